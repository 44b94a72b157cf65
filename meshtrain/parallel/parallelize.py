"""``parallelize(model, mesh, cfg)``: the one place where parallelism is applied, and ``Parallel``, the one
object that owns what is parallel about a training step.

The transformations run in one fixed order, each on what the previous one left:

1. **TP** (``tensor.py``): Linears and the embedding become sharded twins, as the logical-axis rules say
   (``meshtrain/rules.py``); the loss becomes the vocabulary-parallel one.
2. **CP** (``context.py``): the attention core becomes ring (or all-gather) attention and RoPE reads this
   rank's positions. After TP, because it swaps the core inside TP's attention.
3. **EP** (``expert.py``): each MoE block keeps its experts and dispatches tokens by all-to-all. After TP
   and CP, because it must know how they split the tokens.
4. **PP** (``pipeline/``): the model is pruned to this rank's stages; zero-bubble schedules defer weight
   gradients. After the above (they change what a stage holds), before the DP family (which records
   which modules hold each parameter).
5. **Recompute** (``recompute.py``): blocks recompute their activations in backward.
6. **Compile** (``compile.py``, ``train.compile``): each block is ``torch.compile``d in place. After the above,
   so the graph holds the sharded modules and the checkpoint; before the DP family, whose hooks stay eager.
   A recomputed block that breaks graphs (collectives: tp, cp or ep > 1; an MoE block's routing) has its forward
   compiled inside the checkpoint instead (dynamo cannot break a graph inside a checkpoint): same step of the
   order, the nesting turned round.
7. **DP family** (``data.py``, ``zero.py``, ``fsdp.py``): gradients (and with ZeRO, state) synchronised and
   sharded over dp x cp; experts over edp.

``Parallel`` then owns, for the trainer: the rows of the global batch a rank reads (``batch_rows``) and their
sequence chunks (``shard_batch``), the micro-steps
(``forward_backward``: a pipeline schedule, or plain accumulation as its degenerate case) with the loss
reduced to the global mean, the gradient sync (``sync_grads``), the global gradient norm (``grad_norm``, which
the optimizer's step clips by), what follows the optimizer step (``after_optimizer_step``), evaluation, and the logical
state (``local_state`` / ``load_state``, as boxes of the logical tensors: ``state.py``). The trainer's
step therefore has no branch on which axis is on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from meshtrain import comm
from meshtrain.config import Config, ParallelConfig
from meshtrain.mesh import Mesh
from meshtrain.model.llama import Llama, cross_entropy_sum
from meshtrain.model.moe import expert_index
from meshtrain.model.source import TensorSource
from meshtrain.parallel.compile import apply_compile, compile_loss
from meshtrain.parallel.context import ContextParallel, apply_context_parallel
from meshtrain.parallel.cross_entropy import lean_cross_entropy
from meshtrain.parallel.data import DataParallel, WithExperts
from meshtrain.parallel.expert import ExpertParallel, apply_expert_parallel
from meshtrain.parallel.fsdp import FullyShardedDataParallel
from meshtrain.parallel.grad_sync import GradSync
from meshtrain.parallel.microsteps import Accumulation, ForwardLoss
from meshtrain.parallel.pieces import OptimParam, Placements
from meshtrain.parallel.pipeline.engine import PipelineEngine, split
from meshtrain.parallel.pipeline.wgrad import WeightGradStore
from meshtrain.parallel.recompute import apply_recompute, recomputed_forward
from meshtrain.parallel.state import Held, check_shapes, gather_full, load_state, local_state, regions
from meshtrain.parallel.tensor import TensorParallel, apply_tensor_parallel, head_partial
from meshtrain.parallel.tied import TiedEmbedding, tied_across_ranks
from meshtrain.parallel.units import Unit
from meshtrain.parallel.zero import ZeroGradSync
from meshtrain.plan.partition import Partition, partition_model
from meshtrain.plan.schedules import PipelineSchedule, build_schedule
from meshtrain.rules import Rules, check_executable, rules_for

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ORDER = ("tp", "cp", "ep", "pp", "recompute", "compile", "dp")  # the order parallelize applies them in


def batch_rows(rows: int, index: int, count: int) -> slice:
    """The rows of a global batch of ``rows`` owned by data-parallel coordinate ``index`` of ``count``: the
    contiguous block ``[index * r, (index + 1) * r)`` with ``r = rows // count``."""
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"data-parallel index {index} out of range for {count} shards")
    if rows % count:
        raise ValueError(
            f"train.global_batch ({rows} rows) is not divisible by the {count} data-parallel shards; "
            f"choose a multiple of {count}"
        )
    r = rows // count
    return slice(index * r, (index + 1) * r)


def shard_rows(x: torch.Tensor, index: int, count: int) -> torch.Tensor:
    """Rows of the global batch ``x`` owned by data-parallel coordinate ``index`` of ``count`` (a view)."""
    return x[batch_rows(x.shape[0], index, count)]


@torch.no_grad()
def materialize(model: nn.Module, names: list[str], device: torch.device, dtype: torch.dtype | None = None) -> None:
    """Give the meta-device parameters ``names`` (uninitialised) storage on ``device``, in ``dtype`` (default: their
    own), in every module that holds them (a tied weight stays one parameter)."""
    wanted = {id(p) for n, p in model.named_parameters() if n in set(names) and p.is_meta}
    new: dict[int, nn.Parameter] = {}
    for m in model.modules():
        for attr, p in list(m._parameters.items()):
            if p is not None and id(p) in wanted:
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=dtype or p.dtype, device=device),
                                              requires_grad=p.requires_grad)
                m._parameters[attr] = new[id(p)]


def data_parallel(model: nn.Module, mesh: Mesh, cfg: ParallelConfig, placements: Placements,
                  compute_dtype: torch.dtype = torch.float32) -> GradSync:
    """The data-parallel member chosen by ``parallel.zero``, over dp x cp (context-parallel ranks hold the
    same weights too).

    ZeRO-3 gathers parameters in ``compute_dtype``; gradients are reduced in ``cfg.reduce_dtype`` (fp32 or bf16),
    experts' too; parameters, gradients and optimizer state stay fp32. Under expert parallelism
    the experts are synced over edp instead, beside the chosen member (``WithExperts``): all-reduced with
    ZeRO-0, sharded with ZeRO-1/2 (stage 2 also for ZeRO-3: experts are not gathered per forward).
    """
    # Sharded construction: what this rank holds whole gets storage now (ZeRO-3 allocates only its shards).
    # Values come later, a box at a time (``Parallel.load_state``).
    held_whole = [n for n in dict(model.named_parameters()) if cfg.zero < 3 or
                  (mesh.size("ep") > 1 and expert_index(n) is not None)]
    materialize(model, held_whole, mesh.device)
    experts = [(n, p) for n, p in model.named_parameters() if expert_index(n) is not None] \
        if mesh.size("ep") > 1 else []
    skip = frozenset(id(p) for _, p in experts)
    rd = DTYPES[cfg.reduce_dtype]
    if cfg.zero == 0:
        dense: GradSync = DataParallel(model, mesh.group("dp", "cp"), placements, cfg.bucket_mb, exclude=skip,
                                       reduce_dtype=rd)
    elif cfg.zero in (1, 2):
        dense = ZeroGradSync(model, mesh, placements, stage=cfg.zero, layout=cfg.zero_layout, exclude=skip,
                             reduce_dtype=rd)
    else:
        dense = FullyShardedDataParallel(model, mesh, placements, reshard_after_forward=cfg.reshard_after_forward,
                                         compute_dtype=compute_dtype, exclude=skip, reduce_dtype=rd)
    if not experts:
        return dense
    edp = mesh.group("edp")
    if cfg.zero == 0 or edp.size == 1:
        sync: GradSync = DataParallel(model, edp, placements, cfg.bucket_mb, params=experts, reduce_dtype=rd)
    else:  # ZeRO over the ranks holding the same experts: stage 1 or 2 (ZeRO-3 keeps experts at stage 2)
        by_layer: dict[str, list] = {}
        for name, p in experts:
            by_layer.setdefault(name.split(".feed_forward.")[0], []).append((name, p))
        units = [Unit(f"{layer}.experts", [], params) for layer, params in by_layer.items()]
        sync = ZeroGradSync(model, mesh, placements, stage=min(cfg.zero, 2), layout=cfg.zero_layout, units=units,
                            group=edp, reduce_dtype=rd)
    return WithExperts(dense, sync, mesh.group("ep"))


class Parallel:
    """What is parallel about a training step, for one rank (built by ``parallelize``)."""

    def __init__(self, model: nn.Module, mesh: Mesh, cfg: Config, rules: Rules, shapes: dict[str, tuple[int, ...]],
                 sync: GradSync, micro: Accumulation | PipelineEngine, forward: ForwardLoss,
                 tp: TensorParallel | None, cp: ContextParallel | None, moe: ExpertParallel | None,
                 schedule: PipelineSchedule | None, partition: Partition | None,
                 tied: TiedEmbedding | None = None) -> None:
        self.model, self.mesh, self.cfg, self.rules, self.shapes = model, mesh, cfg, rules, shapes
        self.sync, self.micro, self.forward = sync, micro, forward
        self.tp, self.cp, self.moe, self.tied = tp, cp, moe, tied
        self.schedule, self.partition = schedule, partition
        self.device = mesh.device
        # The loss and token counts live on the last stage of each dp x cp coordinate: summed over these.
        self.loss_group = mesh.group("pp", "dp", "cp")

    # ------------------------------------------------------------------ the step

    def batch_rows(self, global_batch: int) -> slice:
        """This rank's rows of a global batch of ``global_batch`` rows (its dp coordinate's): the only rows it
        reads, so what a rank reads falls as 1/dp."""
        return batch_rows(global_batch, self.mesh.coord("dp"), self.mesh.size("dp"))

    def shard_batch(self, inputs: torch.Tensor, targets: torch.Tensor, docs: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This rank's part of its rows (``batch_rows``) of a global batch: under context parallelism its
        sequence chunks. The rows' document ids ``docs`` (or None) keep the whole sequence: attention reads
        those of every key."""
        if self.cp is not None:
            inputs, targets = self.cp.shard(inputs), self.cp.shard(targets)
        return inputs, targets, docs

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, n_tokens: int,
                         docs: torch.Tensor | None = None) -> torch.Tensor:
        """The micro-steps of one optimizer step on this rank's batch (``shard_batch``); ``n_tokens`` is the
        global batch's token count. Returns the step's loss, the mean over every token of the global batch
        (the same on every rank), as an fp64 scalar on the device that nothing here reads: the host need not
        wait for the device until the trainer reads it with the norm. The gradients may still be in flight
        (``sync_grads`` waits). ``docs``: the rows' document ids (``shard_batch``)."""
        return comm.all_reduce_metrics(self.micro.run(inputs, targets, n_tokens, docs), self.loss_group)

    def sync_grads(self) -> None:
        """Wait for the gradient communication; then the pieces' ``.grad`` are the global gradients
        (tensor-parallel replicas added under SP, averaged without; per-head norms and shared kv heads added; a
        weight tied across pipeline stages added over them)."""
        self.sync.finish_grads()
        if self.tied is not None:
            self.tied.sync_grads(self.sync.optim_params())
        if self.tp is not None:
            held = [op for op in self.sync.optim_params() if op.tensor.grad is not None and op.replicas > 1]
            whole = [op for op in held if op.tp is None]
            self.tp.sync_replicated_grads([op.tensor.grad for op in whole if not head_partial(op.name)])
            self.tp.sync_head_partial_grads([op.tensor.grad for op in whole if head_partial(op.name)])
            self.tp.sync_shared_kv_grads([op.tensor.grad for op in held if op.tp is not None])

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm (every logical entry once, whatever holds it), an fp32 scalar on the device
        (not read here, as ``forward_backward``'s loss). The optimizer's step divides by it to clip
        (``train.optim.optimizer_step``): the gradients are not rewritten for that."""
        norm_sq = self.sync.grad_norm_sq(self.device)
        if self.tied is not None:  # held by the first and the last stage: counted once
            norm_sq -= self.tied.counted_twice(self.optim_params(), self.sync.norm_group, self.device)
        for axis in ("tp", "pp"):  # different slices (tp) and different layers (pp) add
            comm.all_reduce_metrics(norm_sq, self.mesh.group(axis))
        return norm_sq.float().sqrt()

    def skip_step(self) -> None:
        """Drop a step's gradients (and MoE routing counts) instead of applying them: nothing changes."""
        self.sync.zero_grad()
        if self.moe is not None:
            self.moe.discard_step()

    def after_optimizer_step(self) -> dict[str, object]:
        """Parameters up to date on every rank, gradients cleared; returns the step's routing metrics (MoE)."""
        self.sync.after_step()
        self.sync.zero_grad()
        return self.moe.after_step() if self.moe is not None else {}

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor,
                 docs: torch.Tensor | None = None) -> tuple[float, int]:
        """(sum of token losses, token count) of a global batch's ``shard_batch`` parts, over every rank."""
        self.model.eval()
        try:
            total, count = self.micro.forward_only(inputs, targets, docs)
        finally:
            self.model.train()
        total, count = comm.all_reduce_scalars([total, count], self.loss_group, device=self.device)
        return total, int(count)

    # ------------------------------------------------------------------ state

    def optim_params(self) -> list[OptimParam]:
        """What the optimizer updates on this rank."""
        return self.sync.optim_params()

    def local_state(self, optimizer: torch.optim.Optimizer | None = None) -> list[Held]:
        """The logical state this rank holds, as boxes: parameters, optimizer state (if ``optimizer``) and the
        MoE selection bias of its layers. What a checkpoint writes."""
        return local_state(self.optim_params(), optimizer, self.moe.local_bias() if self.moe else None)

    def load_state(self, optimizer: torch.optim.Optimizer, source: TensorSource,
                   optim_keys: dict[str, list[str]] | None = None, what: str = "the weights") -> None:
        """Fill this rank's parameters (and the optimizer state ``optim_keys`` names, per parameter) from
        ``source``, reading only the boxes this rank holds; then every rank holding a parameter it does not own
        gets it from its owner. ``what`` names the source in errors."""
        check_shapes(self.optim_params(), source, what)
        load_state(self.optim_params(), source, optimizer if optim_keys is not None else None, optim_keys)
        self.sync.after_step()
        if self.moe is not None:
            self.moe.load_bias(source)

    def logical_tensors(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Whole logical parameters (``grads=True``: their gradients, after ``sync_grads``) on every rank.
        For equivalence tests on tiny models only: it sends every tensor to every rank."""
        if grads:
            held = [Held(op.name, op.shape, op.tensor.grad, regions(op)) for op in self.optim_params()
                    if op.tensor.grad is not None]
        else:
            held = self.local_state()
        return gather_full(held, self.mesh.group("world"))

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Live bytes of parameters, gradients and optimizer state on this rank."""
        return self.sync.state_tensors(optimizer)

    # ------------------------------------------------------------------ reporting and generation

    def log_lines(self) -> str:
        """What a log should say about the layout beyond the mesh (the pipeline's stages; selective recompute run
        as full under compile)."""
        lines = ""
        if any(f is not None and f.mode == "selective" and f.compiled is not None
               for f in map(recomputed_forward, self.model.layers.values())):
            lines += ("train.recompute=selective with train.compile and tp, cp or ep > 1 (or MoE): the compiled "
                      "blocks are recomputed whole, as full (docs/compile.md)\n")
        if self.schedule is None:
            return lines.rstrip("\n")
        s = self.schedule
        return (lines + f"pipeline: {s.name}, {s.n_stages} stages over pp={s.pp}, {s.microbatches} microbatches\n"
                + self.partition.table(s.placement))

    def sampler(self) -> tuple[Callable[[torch.Tensor], torch.Tensor] | None, int] | None:
        """(full-vocabulary logits from the model's output, sequence padding multiple) for sampling on this
        layout, or None where the model is not whole along the sequence on each rank (pipeline, context), or
        where each token's forward would gather every weight (ZeRO-3 over dp > 1: at Llama-3 70B, tp 8, ~18 GB per
        rank a token; ``meshtrain generate`` splits the model over tp and pp instead)."""
        if self.schedule is not None or self.cp is not None:
            return None
        if self.cfg.parallel.zero == 3 and self.mesh.size("dp") > 1:
            return None
        if self.tp is None:
            return None, 1
        return self.tp.full_logits, self.tp.group.size if self.tp.sp else 1


def parallelize(model: Llama, mesh: Mesh, cfg: Config) -> Parallel:
    """Apply TP -> CP -> EP -> PP -> recompute -> compile -> DP family to the plain ``model`` on ``mesh`` (in place), as
    ``cfg.parallel`` and the logical-axis rules say; returns the ``Parallel`` that runs its steps."""
    p, t = cfg.parallel, cfg.train
    shapes = {n: tuple(q.shape) for n, q in model.named_parameters()}
    rules = rules_for(p)
    check_executable(rules)
    dtype = DTYPES[t.dtype]
    tp = apply_tensor_parallel(model, mesh, rules, sp=p.sp, sp_regather=p.sp_regather) \
        if mesh.size("tp") > 1 else None
    cp = apply_context_parallel(model, mesh, t.seq_len, p.cp_layout, p.cp_attention) if mesh.size("cp") > 1 \
        else None
    moe = apply_expert_parallel(model, mesh, sp=p.sp, global_sequences=t.global_batch,
                                global_tokens=t.global_batch * t.seq_len) \
        if cfg.model.moe_experts else None
    schedule = partition = wgrad = stages = tied = None
    if mesh.size("pp") > 1:
        schedule = build_schedule(p.schedule, p.pp, p.microbatches, p.virtual_stages)
        partition = partition_model(cfg.model, t.seq_len, schedule.n_stages)
        wgrad = WeightGradStore() if schedule.split_backward else None
        stages = split(model, mesh, schedule, partition, wgrad)
        if cfg.model.tie_embeddings and tied_across_ranks(schedule):
            tied = TiedEmbedding(mesh, schedule, DTYPES[p.reduce_dtype])
    apply_recompute(model, t.recompute)
    apply_compile(model, t.compile, collectives=max(p.tp, p.cp, p.ep) > 1)
    sync = data_parallel(model, mesh, p, tp.placements if tp else {}, dtype)
    # The loss over the logits: vocab-parallel under tp; else inductor's fusion of the plain cross-entropy when
    # compiling, and otherwise the lean one that tp's uses too (both save the logits, not an fp32 log-softmax).
    if tp is not None:
        loss_fn = tp.loss_fn
    elif t.compile:
        loss_fn = compile_loss(cross_entropy_sum, True)
    else:
        loss_fn = lean_cross_entropy
    forward = ForwardLoss(loss_fn, sync, dtype, mesh.device)
    if schedule is not None:
        rows = t.global_batch // mesh.size("dp") // p.microbatches
        seq = t.seq_len // p.cp // (p.tp if p.sp else 1)
        posting = None if p.p2p_posting == "auto" else p.p2p_posting  # None: by the pp group's backend
        micro: Accumulation | PipelineEngine = PipelineEngine(schedule, stages, mesh, (rows, seq, cfg.model.d_model),
                                                              forward, wgrad, act_dtype=dtype, posting=posting)
    else:
        micro = Accumulation(model, forward, t.grad_accum)
    return Parallel(model, mesh, cfg, rules, shapes, sync, micro, forward, tp, cp, moe, schedule, partition, tied)
