"""Expert parallelism: each rank of the ``ep`` group holds E/ep whole experts of every MoE layer, and
tokens travel to their experts and back by all-to-all (seed 001: dispatch and combine).

``apply_expert_parallel(model, mesh, sp, global_sequences)`` runs after tensor and context parallelism
(it needs to know how they split the tokens) and before the pipeline split. For every MoE block it

- keeps experts [ep_index x E/ep, (ep_index + 1) x E/ep) and deletes the others (names do not change);
- installs ``ExpertDispatch`` as the block's ``dispatch`` hook (only when ep > 1);
- installs ``seq_reduce``: an all-reduce of the per-sequence expert counts over the ranks that split a
  sequence (cp, and tp under sequence parallelism), so the aux loss sees whole sequences;
- tells it the global batch's sequence count (the aux loss is a mean over them).

Dispatch, per MoE layer and microbatch (the rows arrive sorted by global expert, so the rows for
ep rank j are contiguous)::

    rank 0: [e0 e0 e1 | e2 e3 e3]        counts ──all_to_all──> how many rows each peer sends me
    rank 1: [e0 | e2 e2 e3]              rows   ──all_to_all──> my experts' rows, by source rank
                                         regroup by local expert, run the experts, regroup back
                                         outputs ──all_to_all──> back to their tokens' ranks

``_AllToAll`` is an autograd function whose backward is the reverse all-to-all (splits swapped).
The ep group's peers share the tp coordinate (``mesh.group("ep")`` is per (pp, tp, edp)): experts are
not split by tensor parallelism; they are replicated over tp like the norm weights (see
``tensor.parallelize``) and run on the tokens the tp rank holds.

Gradient sync: the experts a rank holds are replicated over ``edp`` (the ranks of dp x cp with the same
ep index) and differ across ``ep``; ``data.wrap`` all-reduces them over edp, separately from the dense
parameters. ``ExpertParallel`` (what this returns) reduces the step's routing statistics over the ranks
that hold different tokens, updates the aux-loss-free bias after each optimizer step, and gathers that
bias for checkpoints.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain import comm
from meshtrain.mesh import AxisGroup, Mesh
from meshtrain.model.moe import MoEFeedForward
from meshtrain.model.source import TensorSource, full_box


class _AllToAll(torch.autograd.Function):
    """Rows to peers: forward sends ``in_splits[i]`` rows to rank i and receives ``out_splits[i]`` from it;
    backward sends the gradients back the same way reversed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        ctx.group, ctx.splits = group, (out_splits, in_splits)
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        comm.all_to_all(out, x.contiguous(), group, out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        out_splits, in_splits = ctx.splits
        grad = g.new_empty((sum(in_splits), *g.shape[1:]))
        comm.all_to_all(grad, g.contiguous(), ctx.group, in_splits, out_splits)
        return grad, None, None, None


class ExpertDispatch:
    """The MoE block's ``dispatch`` hook under expert parallelism: experts ``first .. first + local - 1``
    live here; the others on the peers of ``group``."""

    def __init__(self, group: AxisGroup, first: int, local: int) -> None:
        self.group, self.first, self.local = group, first, local

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, moe: MoEFeedForward) -> torch.Tensor:
        ep, local = self.group.size, self.local
        kind = rows.device.type
        if torch.is_autocast_enabled(kind):  # the experts' matmuls would cast anyway: send half the bytes
            rows = rows.to(torch.get_autocast_dtype(kind))
        # Step 1: how many rows each peer will send me, per local expert (E int64 values).
        recv = torch.empty_like(counts)
        comm.all_to_all(recv, counts, self.group)
        send_splits = counts.view(ep, local).sum(1).tolist()
        recv_counts = recv.view(ep, local).tolist()  # [source rank][local expert]
        recv_splits = [sum(c) for c in recv_counts]
        # Step 2: the rows (dispatch).
        got = _AllToAll.apply(rows, self.group, recv_splits, send_splits)
        # Received in (source, expert) blocks; the experts want (expert, source) blocks.
        starts, off = [], 0
        for c in recv_counts:
            starts.append([])
            for n in c:
                starts[-1].append(off)
                off += n
        perm = torch.cat([torch.arange(starts[i][e], starts[i][e] + recv_counts[i][e]) for e in range(local)
                          for i in range(ep)]).to(rows.device)
        per_expert = [sum(recv_counts[i][e] for i in range(ep)) for e in range(local)]
        chunks = got[perm].split(per_expert)
        ys = torch.cat([moe.experts[str(self.first + e)](chunk) for e, chunk in enumerate(chunks)])
        back = ys.new_zeros(ys.shape).index_copy(0, perm, ys)  # (source, expert) order again
        # Step 3: the outputs go home (combine); they arrive in the order the rows left.
        return _AllToAll.apply(back, self.group, send_splits, recv_splits)


def moe_blocks(model: nn.Module) -> dict[int, MoEFeedForward]:
    """The MoE feed-forward of every block this rank holds, by global layer index."""
    return {int(key): block.feed_forward for key, block in model.layers.items()
            if isinstance(block.feed_forward, MoEFeedForward)}


class ExpertParallel:
    """What ``apply_expert_parallel`` returns: per-step routing metrics, the bias update, bias checkpoints."""

    def __init__(self, model: nn.Module, mesh: Mesh, sp: bool) -> None:
        self.model, self.mesh = model, mesh  # the model is read at each call: a pipeline split prunes it later
        cfg = model.cfg
        self.n_layers, self.n_experts = cfg.n_layers, cfg.moe_experts
        # Ranks that saw different tokens: dp x cp, and tp under SP (without SP tp ranks see the same ones);
        # pp too, so every rank learns every layer's counts (zeros from stages without the layer).
        self.token_group = mesh.group("pp", "dp", "cp", "tp") if sp else mesh.group("pp", "dp", "cp")

    def after_step(self) -> dict[str, object]:
        """After the optimizer step: the step's global expert loads and aux loss, and the bias update.

        Returns ``expert_load`` (per layer, tokens routed to each expert over the global batch, before
        capacity drops), ``moe_imbalance`` (the largest max/mean load over the layers), ``aux_loss`` (the
        aux term added to the objective, summed over layers), with ``model.moe_z_loss_coef`` ``z_loss`` (the
        router z-loss term, summed over layers) and, with a capacity, ``moe_dropped``.
        """
        n, e = self.n_layers, self.n_experts
        vec = torch.zeros(n * e + 3, dtype=torch.float64)
        blocks = moe_blocks(self.model)
        for i, moe in blocks.items():
            if moe.load is not None:
                vec[i * e: (i + 1) * e] = moe.load.double().cpu()
            if moe.aux_sum is not None:
                vec[-3] += float(moe.aux_sum)
            if moe.z_sum is not None:
                vec[-2] += float(moe.z_sum)
            vec[-1] += moe.dropped
        total = torch.tensor(comm.all_reduce_scalars(vec.tolist(), self.token_group, device=self.mesh.device),
                             dtype=torch.float64)
        loads = total[: n * e].view(n, e)
        for i, moe in blocks.items():
            moe.update_bias(loads[i])
            moe.reset_stats()
        mean = loads.mean(1)
        imbalance = float((loads.max(1).values / mean.clamp(min=1e-12)).max()) if float(mean.min()) > 0 else 0.0
        rec: dict[str, object] = {"aux_loss": float(total[-3]), "moe_imbalance": imbalance,
                                  "expert_load": loads.round().long().tolist()}
        if self.model.cfg.moe_z_loss_coef > 0:
            rec["z_loss"] = float(total[-2])
        if any(moe.capacity_factor > 0 for moe in blocks.values()):
            rec["moe_dropped"] = int(total[-1])
        return rec

    def discard_step(self) -> None:
        """Forget a skipped step's routing counts: its loads must not move the bias."""
        for moe in moe_blocks(self.model).values():
            moe.reset_stats()

    def local_bias(self) -> dict[str, torch.Tensor]:
        """The aux-free selection bias of every layer this rank holds, by its buffer name (state to save)."""
        return {f"layers.{i}.feed_forward.expert_bias": moe.expert_bias for i, moe in moe_blocks(self.model).items()}

    @torch.no_grad()
    def load_bias(self, source: TensorSource) -> None:
        """Install saved biases (weights without them, e.g. a fresh init, leave them at zero)."""
        for name, bias in self.local_bias().items():
            if source.shape(name) is not None:
                bias.copy_(source.read(name, full_box(bias.shape)))


def apply_expert_parallel(model: nn.Module, mesh: Mesh, sp: bool = False,
                          global_sequences: int | None = None, global_tokens: int | None = None) -> ExpertParallel:
    """Shard every MoE block's experts over ``mesh.group("ep")`` (in place) and set the token hooks; the optimizer
    step's sequences and tokens normalise the aux and z losses."""
    cfg = model.cfg
    ep = mesh.group("ep")
    local = cfg.moe_experts // ep.size
    first = ep.index(mesh.rank) * local
    split = [a for a in ("cp", "tp") if mesh.size(a) > 1 and (a == "cp" or sp)]  # who cuts each sequence
    seq_group = mesh.group(*split) if split else None
    for moe in moe_blocks(model).values():
        moe.global_sequences, moe.global_tokens = global_sequences, global_tokens
        if seq_group is not None:
            moe.seq_reduce = lambda t, g=seq_group: comm.all_reduce(t, g)
        if ep.size > 1:
            for key in list(moe.experts.keys()):
                if not first <= int(key) < first + local:
                    del moe.experts[key]
            moe.dispatch = ExpertDispatch(ep, first, local)
    return ExpertParallel(model, mesh, sp)
