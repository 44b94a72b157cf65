"""ZeRO-3 / FSDP (and HSDP): parameters, gradients and optimizer state are all sharded.

Each sharding unit (``units.py``: a block, the embedding, the head) keeps only its flat fp32
shard (1/N of the unit, padded). Just before the unit runs, its shard is all-gathered (in the
compute dtype) into a full flat buffer and the modules' weights become views of it; the next
unit's gather is started at the same time (prefetch), so it travels under this unit's compute.
After forward the buffer's storage is freed (``reshard_after_forward``) and gathered again when
backward reaches the unit. When all of the unit's gradients are in, they are reduce-scattered
(in ``parallel.reduce_dtype``: fp32, or bf16 for half the bytes) and added into the shard's fp32
gradient, and the buffer is freed again. Master shard, gradient and optimizer state stay fp32.

Two mechanisms make the free-and-regather work with autograd:

- the gathered buffer enters the graph through ``_Gathered``, an autograd function whose
  backward is the reduce-scatter, so gradients of every view flow back into one flat gradient;
- a saved-tensors hook stores a *reference* (unit, offset, stride) instead of any tensor that
  lives in a gathered buffer, and rebuilds the view when backward unpacks it (after the
  re-gather), so autograd never pins the full weights between forward and backward.

With HSDP the shard group is dp_shard x cp; the shard gradients are then all-reduced over
dp_replicate (in the reduce dtype too).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections import deque
from collections.abc import Iterator

import torch
from torch import nn

from meshtrain import comm, host_memory
from meshtrain.mesh import AxisGroup, Mesh
from meshtrain.parallel.grad_sync import GradSync, all_reduce_as
from meshtrain.parallel.pieces import OptimParam, Placements, optim_param
from meshtrain.parallel.units import Unit, model_units

# The embedding's input (token ids) needs no gradient, so its backward pre-hook fires on the output
# gradient alone, which is all we use: torch's warning about that is noise here.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect")


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _Gathered(torch.autograd.Function):
    """Puts the unit's gathered buffer into the graph as one view per parameter; in backward, packs their
    gradients into one flat buffer for the unit's reduce-scatter.

    One output per parameter, rather than one flat output sliced afterwards: the backward of a slice is a
    zero-filled tensor of the whole unit, so a block of nine weights would allocate nine block-sized
    gradients and add them up (measured by benchmarks/checkpoint.py). The outputs alias the buffer's storage
    without being autograd views of it (views of one base returned together may not see their base written in
    place, and the re-gather in backward writes it). The buffer is taken from the unit rather than passed in
    for the same reason.
    """

    @staticmethod
    def forward(ctx, shard: torch.Tensor, unit: _ShardedUnit) -> tuple[torch.Tensor, ...]:
        # Weakly: the views are module attributes until the next microbatch, and their graph node is held where
        # Python's collector cannot follow, so a strong unit here would keep units, model and FSDP alive for good.
        ctx.unit = weakref.ref(unit)
        ctx.set_materialize_grads(False)  # an unused weight's gradient stays None, not a zero tensor
        buf = unit.incoming
        unit.incoming = None
        unit.full = buf
        return tuple(_alias(buf, off, shape) for _, off, shape in unit.offsets)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[None, None]:
        ctx.unit().reduce_grad(grads)
        return None, None


class _ShardedUnit:
    def __init__(self, unit: Unit, model: nn.Module, group: AxisGroup, rank: int, dtype: torch.dtype,
                 reshard_after_forward: bool, device: torch.device, inflight: deque[_ShardedUnit],
                 reduce_dtype: torch.dtype = torch.float32) -> None:
        self.unit, self.group, self.dtype, self.reduce_dtype = unit, group, dtype, reduce_dtype
        self.inflight = inflight  # every unit's reduce-scatters in launch order (shared by the units)
        self.reshard_after_forward = reshard_after_forward
        n = group.size
        numel = unit.numel
        self.shard_numel = -(-numel // n)
        self.padded = self.shard_numel * n
        self.lo, self.hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        # This rank's fp32 master shard and its gradient: all that persists between steps. Only the shard is
        # ever allocated: parameters built on the meta device (sharded construction) are filled later, a box
        # at a time (``state.load_state``); real ones are copied in now.
        self.shard = torch.zeros(self.shard_numel, dtype=torch.float32, device=device)
        offsets, index, off = {}, {}, 0
        for i, (_, p) in enumerate(unit.params):
            offsets[id(p)], index[id(p)] = off, i
            a, b = max(off, self.lo), min(off + p.numel(), self.hi)
            if a < b and not p.is_meta:
                self.shard[a - self.lo: b - self.lo] = p.detach().reshape(-1)[a - off: b - off]
            off += p.numel()
        self.offsets = [(name, offsets[id(p)], tuple(p.shape)) for name, p in unit.params]
        self.shard.requires_grad_(True)
        self.grad = torch.zeros(self.shard_numel, dtype=torch.float32, device=device)
        # Every (module, attribute) that held one of the unit's parameters (tied weights twice).
        mine = {id(p) for _, p in unit.params}
        self.slots = []
        for m in model.modules():
            for attr, p in list(m._parameters.items()):
                if p is not None and id(p) in mine:
                    self.slots.append((m, attr, index[id(p)]))  # which of _Gathered's outputs it is
        for m, attr, _ in self.slots:
            m._parameters.pop(attr, None)
        self.full: torch.Tensor | None = None  # the gathered buffer of the current microbatch
        self.incoming: torch.Tensor | None = None
        self.fresh = True  # the next forward starts a new microbatch: a new graph node
        self.materialized = False
        self.fetch: comm.Handle | None = None
        self.fetch_buf: torch.Tensor | None = None
        self.pending: list[tuple[comm.Handle, torch.Tensor]] = []
        self.landed: list[comm.Handle] = []

    # ------------------------------------------------------------------ gather / free

    def _gather_into(self, buf: torch.Tensor, async_op: bool) -> comm.Handle | None:
        return comm.all_gather(buf, self.shard.detach().to(self.dtype), self.group, async_op=async_op)

    def prefetch(self) -> None:
        """Start this unit's all-gather without waiting for it."""
        if self.fetch is not None:
            return
        if self.fresh:  # a new forward: a new buffer (an earlier forward's is no longer needed)
            self.reshard()
            self.fetch_buf = torch.empty(self.padded, dtype=self.dtype, device=self.shard.device)
        else:  # re-gather into the same storage, so the views and saved references stay valid
            if self.materialized:
                return
            self.full.untyped_storage().resize_(self.padded * self.full.element_size())
            self.fetch_buf = self.full.detach()
        self.fetch = self._gather_into(self.fetch_buf, async_op=True)

    def _wait_fetch(self) -> torch.Tensor:
        if self.fetch is None:
            self.prefetch()
        self.fetch.wait()
        buf, self.fetch, self.fetch_buf = self.fetch_buf, None, None
        return buf

    def materialize(self) -> None:
        """Make the modules' weights valid: a new graph node at a microbatch's first use, else a re-gather."""
        if self.fresh:
            self.incoming = self._wait_fetch()
            views = _Gathered.apply(self.shard, self)  # sets self.full to the buffer
            self.fresh = False
            for m, attr, i in self.slots:
                setattr(m, attr, views[i])
        elif not self.materialized:
            self._wait_fetch()
        self.materialized = True

    def reshard(self) -> None:
        """Free the gathered storage (the views stay, pointing at nothing until the next gather)."""
        if self.full is not None and self.materialized:
            self.full.untyped_storage().resize_(0)
        self.materialized = False

    # ------------------------------------------------------------------ gradients

    def reduce_grad(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        """Pack the parameters' gradients into one flat buffer of the reduce dtype and start its reduce-scatter."""
        flat = torch.empty(self.padded, dtype=self.reduce_dtype, device=self.shard.device)
        end = 0
        for (_, off, shape), g in zip(self.offsets, grads, strict=True):
            piece = flat[off: off + _numel(shape)]
            if g is None:
                piece.zero_()
            else:
                piece.view(shape).copy_(g)
            end = off + _numel(shape)
        flat[end:].zero_()
        out = torch.empty(self.shard_numel, dtype=self.reduce_dtype, device=flat.device)
        h = comm.reduce_scatter(out, flat, self.group, async_op=True)
        self.pending.append((h, out))
        self.inflight.append(self)
        # A reduce-scatter holds its unit's full gradient until it is waited for. Left to finish_grads, every
        # unit's would be alive at the end of backward (the whole model's gradients on every rank, measured by
        # benchmarks/checkpoint.py); landing the previous one as this one starts keeps at most two.
        while len(self.inflight) > 1:
            self.inflight.popleft().land()
        self.reshard()  # backward through this unit is over: nothing needs the full weights now

    def land(self) -> None:
        """Wait for this unit's oldest reduce-scatter and add it to the shard's gradient (in launch order, so
        accumulated microbatches add up in the same order as ever), in fp32 whatever the reduce dtype."""
        h, out = self.pending.pop(0)
        h.wait()
        self.grad += out
        self.landed.append(h)

    def drain(self) -> list[comm.Handle]:
        """Land what is still in flight; every handle of this step's reduce-scatters."""
        while self.pending:
            self.land()
        done, self.landed = self.landed, []
        return done


def _alias(buf: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``shape`` on ``buf``'s storage at ``offset``: shares the memory (and its frees and re-gathers)
    but is not an autograd view, so writes into ``buf`` do not touch its version counter."""
    t = torch.empty(0, dtype=buf.dtype, device=buf.device)
    return t.set_(buf.untyped_storage(), buf.storage_offset() + offset, shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class FullyShardedDataParallel(GradSync):
    """ZeRO-3 over dp x cp (HSDP: sharded over dp_shard x cp, replicated over dp_replicate)."""

    def __init__(self, model: nn.Module, mesh: Mesh, placements: Placements, reshard_after_forward: bool = True,
                 compute_dtype: torch.dtype = torch.float32, exclude: frozenset[int] = frozenset(),
                 reduce_dtype: torch.dtype = torch.float32) -> None:
        self.model = model
        self.reduce_dtype = reduce_dtype
        self.group = mesh.group("dp_shard", "cp")
        self.replicas = mesh.group("dp_replicate")
        self.norm_group = self.group
        self.handles = []
        self.always_sync = True  # gradients are reduce-scattered as each unit's backward ends
        me = self.group.index(mesh.rank)
        self._inflight: deque[_ShardedUnit] = deque()
        self.units = [_ShardedUnit(u, model, self.group, me, compute_dtype, reshard_after_forward, mesh.device,
                                   self._inflight, reduce_dtype) for u in model_units(model, exclude)]
        # Unit buffers are freed and remade every unit: have the host allocator return them (host_memory.py).
        itemsize = torch.empty(0, dtype=compute_dtype).element_size()
        host_memory.map_unit_buffers([su.padded * itemsize for su in self.units], mesh.device)
        self._by_storage: dict[int, _ShardedUnit] = {}
        for i, su in enumerate(self.units):
            nxt = self.units[i + 1] if i + 1 < len(self.units) else None
            prev = self.units[i - 1] if i > 0 else None
            # Eager even inside a compiled block (train.compile): gathers, frees and storage bookkeeping.
            for m in su.unit.modules:
                m.register_forward_pre_hook(comm.eager(self._pre_forward(su, nxt)))
            su.unit.modules[-1].register_forward_hook(comm.eager(self._post_forward(su)))
            su.unit.modules[-1].register_full_backward_pre_hook(self._pre_backward(su, prev))
        self._pieces = []
        for su in self.units:
            for name, off, shape in su.offsets:
                a, b = max(off, su.lo), min(off + _numel(shape), su.hi)
                if a < b:
                    piece = su.shard.detach()[a - su.lo: b - su.lo]
                    piece.grad = su.grad[a - su.lo: b - su.lo]
                    self._pieces.append(optim_param(name, piece, placements, piece, a - off, shape))

    # ------------------------------------------------------------------ hooks

    def _pre_forward(self, su: _ShardedUnit, nxt: _ShardedUnit | None):
        def hook(module, args):
            su.materialize()
            if su.fresh is False and self._by_storage.get(_ptr(su.full)) is not su:
                self._by_storage[_ptr(su.full)] = su
            if nxt is not None and not _in_backward():
                nxt.prefetch()  # the next unit's gather travels under this unit's compute
        return hook

    def _post_forward(self, su: _ShardedUnit):
        def hook(module, args, output):
            # Not during a recomputation in backward: the weights are needed right after.
            if su.reshard_after_forward and not _in_backward():
                su.reshard()
        return hook

    def _pre_backward(self, su: _ShardedUnit, prev: _ShardedUnit | None):
        def hook(module, grad_output):
            su.materialize()
            if prev is not None:
                prev.prefetch()
        return hook

    def _pack(self, t: torch.Tensor):
        su = self._by_storage.get(_ptr(t))
        if su is None or su.full is None or not su.materialized or _ptr(su.full) != _ptr(t):
            return t
        return (su, t.storage_offset(), tuple(t.shape), t.stride())

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        su, offset, shape, stride = packed
        su.materialize()
        return su.full.detach().as_strided(shape, stride, offset)

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """Wrap each microbatch's forward: new graph nodes per unit, and weights saved by reference."""
        for su in self.units:
            su.fresh = True
        self._by_storage.clear()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    # ------------------------------------------------------------------ step

    def finish_grads(self) -> None:
        for su in self.units:
            self.handles.extend(su.drain())
            su.reshard()
        self._inflight.clear()  # all landed
        if self.replicas.size > 1:
            for su in self.units:
                all_reduce_as(su.grad, self.replicas, self.reduce_dtype)

    def zero_grad(self) -> None:
        self.handles = []
        for su in self.units:
            su.grad.zero_()

    def optim_params(self) -> list[OptimParam]:
        return self._pieces

    def grads(self) -> list[torch.Tensor]:
        return [su.grad for su in self.units]

    def param_tensors(self) -> list[torch.Tensor]:
        live = [su.shard for su in self.units]
        live += [su.full for su in self.units if su.full is not None and su.materialized]
        return live

    def grad_tensors(self) -> list[torch.Tensor]:
        return self.grads()


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()
