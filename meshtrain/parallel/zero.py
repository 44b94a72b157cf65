"""ZeRO-1 and ZeRO-2: every rank holds all parameters but only a shard of the optimizer state
(stage 1) and, in stage 2, only a shard of the gradients.

An all-reduce is a reduce-scatter followed by an all-gather (seed 001). ZeRO splits the two
around the optimizer step: gradients are reduce-scattered so each rank gets the summed
gradient of the part it owns, it updates that part, and the updated parameters are all-gathered.
Same bytes as DP's all-reduce, 1/N of the optimizer state.

Two shard layouts:

- ``flat``: each sharding unit (``units.py``) is one flat fp32 buffer padded to a multiple of N;
  rank r owns elements [r*s, (r+1)*s). Balanced to the element, and it cuts tensors.
- ``per_tensor``: whole tensors are assigned to ranks (largest first, to the least-loaded rank);
  gradients are reduced to their owner and parameters broadcast from it. Needed by optimizers
  that look at a whole matrix (Muon's orthogonalisation).

Stage 1 keeps the full gradients and communicates once per step (after the last microbatch);
stage 2 reduces every microbatch and drops the full gradient as soon as it has been sent.
With HSDP the shard group is dp_shard x cp, and shards are then all-reduced over dp_replicate.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain import comm
from meshtrain.mesh import AxisGroup, Mesh
from meshtrain.parallel.grad_sync import GradSync, all_reduce_as, reduce_as, weak_grad_hook
from meshtrain.parallel.pieces import OptimParam, Placements, optim_param
from meshtrain.parallel.units import Unit, model_units


def assign_owners(sizes: list[int], n: int) -> list[int]:
    """Whole tensors to ranks: largest first, each to the least-loaded rank (ties: lowest rank)."""
    load = [0] * n
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(n), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


class _FlatUnit:
    """One unit's parameters and gradients as padded flat buffers, with this rank's shard."""

    def __init__(self, unit: Unit, n: int, rank: int, keep_full_grad: bool, placements: Placements) -> None:
        self.unit, self.placements = unit, placements
        self.params = [p for _, p in unit.params]
        numel = unit.numel
        self.shard = -(-numel // n)
        device = self.params[0].device
        self.param_buf = torch.zeros(self.shard * n, dtype=torch.float32, device=device)
        self.lo, self.hi = rank * self.shard, (rank + 1) * self.shard
        self.offsets = []
        off = 0
        for p in self.params:
            view = self.param_buf[off: off + p.numel()].view_as(p)
            view.copy_(p.detach())
            p.data = view  # the model's parameters now live in the unit buffer
            self.offsets.append(off)
            off += p.numel()
        if keep_full_grad:  # stage 1: full gradients accumulate in place; the shard is a view of them
            self.grad_buf = torch.zeros_like(self.param_buf)
            for p, o in zip(self.params, self.offsets, strict=True):
                p.grad = self.grad_buf[o: o + p.numel()].view_as(p)
            self.grad_shard = self.grad_buf[self.lo: self.hi]
        else:  # stage 2: only the shard persists
            self.grad_buf = None
            self.grad_shard = torch.zeros(self.shard, dtype=torch.float32, device=device)

    def pieces(self) -> list[OptimParam]:
        """The parts of each parameter inside this rank's shard, as views the optimizer updates in place."""
        out = []
        for (name, p), o in zip(self.unit.params, self.offsets, strict=True):
            a, b = max(o, self.lo), min(o + p.numel(), self.hi)
            if a >= b:
                continue
            piece = self.param_buf[a:b]
            piece.grad = self.grad_shard[a - self.lo: b - self.lo]
            out.append(optim_param(name, p, self.placements, piece, offset=a - o))
        return out


class ZeroGradSync(GradSync):
    """ZeRO stage 1 or 2 (gradients reduce-scattered to their owners, owners' updates all-gathered) over
    the mesh's dp x cp ranks (sharded over dp_shard x cp for HSDP).

    ``units`` and ``group`` shard something else over another group: expert parallelism passes each
    layer's local experts as a unit and the edp group (the ranks holding the same experts), with no
    replicas. ``reduce_dtype`` is what the gradient collectives send (``parallel.reduce_dtype``): bf16 sends
    bf16 copies and adds the results into the fp32 gradient shards; the parameters' all-gather stays fp32."""

    def __init__(self, model: nn.Module, mesh: Mesh, placements: Placements, stage: int, layout: str = "flat",
                 exclude: frozenset[int] = frozenset(), units: list[Unit] | None = None,
                 group: AxisGroup | None = None, reduce_dtype: torch.dtype = torch.float32) -> None:
        if stage not in (1, 2) or layout not in ("flat", "per_tensor"):
            raise ValueError(f"ZeroGradSync: stage must be 1 or 2 and layout flat or per_tensor, "
                             f"got {stage}, {layout}.")
        self.model, self.stage, self.layout, self.reduce_dtype = model, stage, layout, reduce_dtype
        self.group = group if group is not None else mesh.group("dp_shard", "cp")
        self.replicas = mesh.group("dp_replicate") if group is None else None
        self.norm_group = self.group
        self.handles = []
        self.always_sync = stage == 2  # stage 2 keeps no full gradient, so it sends every microbatch
        n, me = self.group.size, self.group.index(mesh.rank)
        self.units = model_units(model, exclude, merge_tied=mesh.size("pp") == 1) if units is None else units
        self._unit_of = {id(p): i for i, u in enumerate(self.units) for _, p in u.params}
        self._pending = [0] * len(self.units)
        self._inflight: list[list[tuple]] = [[] for _ in self.units]
        if layout == "flat":
            self.flat = [_FlatUnit(u, n, me, stage == 1, placements) for u in self.units]
            self._pieces = [op for f in self.flat for op in f.pieces()]
        else:
            named = [(name, p) for u in self.units for name, p in u.params]
            owners = assign_owners([p.numel() for _, p in named], n)
            self.owner = {id(p): o for (_, p), o in zip(named, owners, strict=True)}
            self._pieces = [optim_param(name, p, placements) for name, p in named if self.owner[id(p)] == me]
            self._acc = {id(op.tensor): torch.zeros_like(op.tensor) for op in self._pieces} if stage == 2 else {}
        self.me = me
        hook = weak_grad_hook(self._on_grad_ready)
        for u in self.units:
            for _, p in u.params:
                p.register_post_accumulate_grad_hook(hook)

    # ------------------------------------------------------------------ backward

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._sync:
            return
        i = self._unit_of[id(p)]
        self._pending[i] += 1
        if self._pending[i] == len(self.units[i].params):
            self._pending[i] = 0
            self._launch(i)

    def _launch(self, i: int) -> None:
        self._drain(i)  # stage 2: the previous microbatch's reduction of this unit must land first
        unit, rd = self.units[i], self.reduce_dtype
        # In flight: (handle, where the result lands, what was sent); _drain adds or copies it into the fp32 grads.
        if self.layout == "flat":
            f = self.flat[i]
            if self.stage == 1:  # fp32: in place into the shard (a view of grad_buf); bf16: a bf16 shard
                out = f.grad_shard if rd == torch.float32 else f.grad_shard.new_empty(f.shard, dtype=rd)
                h = comm.reduce_scatter(out, reduce_as(f.grad_buf, rd), self.group, async_op=True)
                self._inflight[i].append((h, out, None))
            else:
                full = f.param_buf.new_empty(f.param_buf.numel(), dtype=rd)
                for (_, p), o in zip(unit.params, f.offsets, strict=True):
                    piece = full[o: o + p.numel()]
                    if p.grad is None:
                        piece.zero_()
                    else:
                        piece.copy_(p.grad.reshape(-1))
                    p.grad = None  # the full gradient lives only until it has been sent
                full[unit.numel:].zero_()
                out = full.new_empty(f.shard)
                h = comm.reduce_scatter(out, full, self.group, async_op=True)
                self._inflight[i].append((h, out, full))
        else:
            for _, p in unit.params:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                sent = reduce_as(g, rd)
                h = comm.reduce(sent, self.group, self.owner[id(p)], async_op=True)
                if self.stage == 2:
                    p.grad = None
                self._inflight[i].append((h, p, sent))
        self.handles.extend(x[0] for x in self._inflight[i])

    def _drain(self, i: int) -> None:
        for h, a, b in self._inflight[i]:
            h.wait()
            if self.layout == "flat":
                f = self.flat[i]
                if self.stage == 2:
                    f.grad_shard += a
                elif a is not f.grad_shard:  # stage 1 reduced in bf16
                    f.grad_shard.copy_(a)
            elif self.owner[id(a)] == self.me:
                if self.stage == 2:
                    self._acc[id(a)] += b
                elif a.grad is not None and b is not a.grad:  # stage 1 reduced in bf16
                    a.grad.copy_(b)
        self._inflight[i] = []

    def finish_grads(self) -> None:
        for i in range(len(self.units)):
            if not self._inflight[i] and self._sync:
                self._launch(i)  # a unit that received no gradient this step still takes part
            self._drain(i)
        if self.layout == "per_tensor":
            for op in self._pieces:
                if self.stage == 2:
                    op.tensor.grad = self._acc[id(op.tensor)]
        grads = self.grads()
        if self.replicas is not None and self.replicas.size > 1:  # HSDP: shards replicated; sum across replicas
            for g in grads:
                all_reduce_as(g, self.replicas, self.reduce_dtype)

    # ------------------------------------------------------------------ step

    def after_step(self) -> None:
        """Every rank gets the parameters the others updated."""
        hs = []
        if self.layout == "flat":
            for f in self.flat:
                hs.append(comm.all_gather(f.param_buf, f.param_buf[f.lo: f.hi], self.group, async_op=True))
        else:
            for u in self.units:
                for _, p in u.params:
                    hs.append(comm.broadcast(p.data, self.group, self.owner[id(p)], async_op=True))
        for h in hs:
            h.wait()

    def zero_grad(self) -> None:
        self.handles = []
        if self.layout == "flat":
            for f in self.flat:
                (f.grad_buf if f.grad_buf is not None else f.grad_shard).zero_()
        else:
            for u in self.units:
                for _, p in u.params:
                    if self.stage == 1 and p.grad is not None:
                        p.grad.zero_()
            for acc in self._acc.values():
                acc.zero_()
            if self.stage == 2:
                for op in self._pieces:
                    op.tensor.grad = None

    # ------------------------------------------------------------------ views

    def optim_params(self) -> list[OptimParam]:
        return self._pieces

    def grads(self) -> list[torch.Tensor]:
        if self.layout == "flat":
            return [f.grad_shard for f in self.flat]
        return [op.tensor.grad for op in self._pieces if op.tensor.grad is not None]

    def param_tensors(self) -> list[torch.Tensor]:
        return [p for u in self.units for _, p in u.params]

    def grad_tensors(self) -> list[torch.Tensor]:
        if self.layout == "flat":
            return [f.grad_buf if f.grad_buf is not None else f.grad_shard for f in self.flat]
        if self.stage == 1:
            return [p.grad for u in self.units for _, p in u.params if p.grad is not None]
        return list(self._acc.values())
