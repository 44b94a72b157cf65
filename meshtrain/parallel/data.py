"""Data parallelism: every rank holds the whole model, sees its slice of the global batch, and the
gradients are summed over the data-parallel group.

Gradients live in flat buckets (``parallel.bucket_mb``), filled in the order backward produces
them (last layer first). A post-accumulate-grad hook counts each bucket's parameters; when the
last one is ready the bucket's all-reduce starts asynchronously, so communication runs under the
rest of backward. ``finish_grads`` waits for all of them before the optimizer step. Inside
``no_sync()`` (all microbatches but the last) nothing is sent: gradients just accumulate.

The loss of each rank is already divided by the token count of the *global* batch (see the
trainer), so the SUM over ranks is the single-device gradient: no extra division.

``wrap`` picks the member of the family from ``parallel.zero``: this module (0), ``zero.py``
(1, 2) or ``fsdp.py`` (3). Under expert parallelism (ep > 1) the routed experts are left out of that
member: each rank holds different experts, replicated only over ``edp``, so ``WithExperts`` adds a
plain bucketed all-reduce of their gradients over edp beside it. ZeRO-1/2/3 therefore shard the dense
parameters only; experts keep whole parameters, gradients and optimizer state (they are already
divided ep ways). At ep = 1 the experts are ordinary parameters of the chosen member.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from meshtrain import comm
from meshtrain.config import ParallelConfig
from meshtrain.mesh import AxisGroup, Mesh
from meshtrain.model.moe import expert_index
from meshtrain.train.optim import OptimParam, describe


class GradSync(abc.ABC):
    """What the trainer needs from any data-parallel strategy (plain DP, ZeRO-1/2/3, HSDP)."""

    norm_group: AxisGroup | None = None  # where partial grad-norm sums are added (sharded grads)
    ep_group: AxisGroup | None = None  # where expert tensors differ (expert parallelism): norms and gathers add
    expert_norm_group: AxisGroup | None = None  # where expert pieces are ZeRO-sharded (edp), if they are
    handles: list[comm.Handle]  # the async collectives of the last step, for overlap measurement
    always_sync = False  # True: gradients must be sent every microbatch (they are not kept whole)
    _sync = True  # read by the gradient hooks: send when a bucket / unit is complete

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (every microbatch but the last), unless they cannot be kept."""
        self._sync = self.always_sync
        try:
            yield
        finally:
            self._sync = True

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Entered around each microbatch's forward (ZeRO-3 uses it to manage gathered weights)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def optim_params(self) -> list[OptimParam]:
        """What the optimizer updates on this rank (whole parameters or ZeRO pieces)."""

    def finish_grads(self) -> None:  # noqa: B027 - a no-op unless communication is in flight
        """Wait for gradient communication; afterwards optim_params' ``.grad`` are the global sums."""

    def after_step(self) -> None:  # noqa: B027 - nothing to do when every rank updated everything
        """Bring every rank's parameters up to date after the optimizer step."""

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Clear the accumulated gradients (keeping any buffers they live in)."""

    def grads(self) -> list[torch.Tensor]:
        return [p.tensor.grad for p in self.optim_params() if p.tensor.grad is not None]

    def is_expert(self, op: OptimParam) -> bool:
        """Whether ``op`` is an expert-parallel expert's (sharded over ``ep_group``, not ``norm_group``)."""
        return False

    def state_tensors(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes per rank of parameters, gradients and optimizer state, each storage counted once."""
        return tensor_bytes(self.param_tensors(), self.grad_tensors(), optimizer)

    @abc.abstractmethod
    def param_tensors(self) -> list[torch.Tensor]:
        """The parameter storage this rank keeps (for memory accounting)."""

    def grad_tensors(self) -> list[torch.Tensor]:
        return self.grads()


def tensor_bytes(params: list[torch.Tensor], grads: list[torch.Tensor],
                 optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Sum of live bytes by kind; views of one buffer count the buffer once."""
    def total(tensors: list[torch.Tensor]) -> int:
        seen: dict[int, int] = {}
        for t in tensors:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values())

    state = [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    return {"params": total(params), "grads": total(grads), "optim": total(state)}


class _Bucket:
    def __init__(self, params: list[nn.Parameter], device: torch.device) -> None:
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=device)
        self.pending = len(params)
        self.handle: comm.Handle | None = None
        offset = 0
        for p in params:
            # The gradient is a view into the bucket: backward accumulates straight into what is sent.
            p.grad = self.buffer[offset: offset + p.numel()].view_as(p)
            offset += p.numel()


class DataParallel(GradSync):
    """Plain data parallelism (``parallel.zero=0``) over ``group`` with bucketed, overlapped all-reduce.

    ``params`` (named) restricts it to some of the model's parameters (the experts over edp); ``exclude``
    leaves some out (the experts, for the dense member).
    """

    def __init__(self, model: nn.Module, group: AxisGroup, bucket_mb: float = 25.0,
                 params: list[tuple[str, nn.Parameter]] | None = None, exclude: frozenset[int] = frozenset()) -> None:
        self.model = model
        self.group = group
        self.handles = []
        named = params if params is not None else [(n, p) for n, p in model.named_parameters()
                                                    if p.requires_grad and id(p) not in exclude]
        self._optim = [describe(n, p) for n, p in named]
        params = [p for _, p in named]
        device = params[0].device
        limit = max(int(bucket_mb * 2**20 / 4), 1)
        self.buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        for p in reversed(params):  # backward produces the last layers' gradients first
            current.append(p)
            if sum(q.numel() for q in current) >= limit:
                self.buckets.append(_Bucket(current, device))
                current = []
        if current:
            self.buckets.append(_Bucket(current, device))
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        if group.size > 1:
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._sync:
            return
        bucket = self._bucket_of[id(p)]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        bucket.handle = comm.all_reduce(bucket.buffer, self.group, async_op=True)
        self.handles.append(bucket.handle)

    def finish_grads(self) -> None:
        if self.group.size == 1:
            return
        for b in self.buckets:
            if b.handle is None:  # some parameter got no gradient this step: send the bucket anyway
                self._launch(b)
            b.handle.wait()
            b.handle = None
            b.pending = len(b.params)

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.buffer.zero_()
        self.handles = []

    def optim_params(self) -> list[OptimParam]:
        return self._optim

    def param_tensors(self) -> list[torch.Tensor]:
        return [op.tensor for op in self._optim]

    def grad_tensors(self) -> list[torch.Tensor]:
        return [b.buffer for b in self.buckets]


class WithExperts(GradSync):
    """A dense data-parallel member plus the expert-parallel experts (``experts``): all-reduced over edp
    (ZeRO-0), or ZeRO-1/2-sharded over edp (``experts.norm_group``).

    Expert gradients differ across ``ep_group`` (different experts), so the gradient norm adds their
    squares over the edp shards and then over ep (the dense ones over ``norm_group``), and checkpoints
    rebuild them the same way.
    """

    def __init__(self, dense: GradSync, experts: GradSync, ep_group: AxisGroup) -> None:
        self.dense, self.experts, self.ep_group = dense, experts, ep_group
        self.expert_norm_group = experts.norm_group  # None when every holder keeps them whole
        self.norm_group = dense.norm_group
        self.always_sync = dense.always_sync
        self._expert_ids = {id(op.tensor) for op in experts.optim_params()}

    @property
    def handles(self) -> list[comm.Handle]:
        return self.dense.handles + self.experts.handles

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.dense.no_sync(), self.experts.no_sync():
            yield

    def forward_context(self) -> contextlib.AbstractContextManager:
        return self.dense.forward_context()

    def optim_params(self) -> list[OptimParam]:
        return self.dense.optim_params() + self.experts.optim_params()

    def is_expert(self, op: OptimParam) -> bool:
        return id(op.tensor) in self._expert_ids

    def finish_grads(self) -> None:
        self.dense.finish_grads()
        self.experts.finish_grads()

    def after_step(self) -> None:
        self.dense.after_step()
        self.experts.after_step()  # ZeRO: every holder gets the expert shards the others updated

    def zero_grad(self) -> None:
        self.dense.zero_grad()
        self.experts.zero_grad()

    def grads(self) -> list[torch.Tensor]:
        return self.dense.grads() + self.experts.grads()

    def param_tensors(self) -> list[torch.Tensor]:
        return self.dense.param_tensors() + self.experts.param_tensors()

    def grad_tensors(self) -> list[torch.Tensor]:
        return self.dense.grad_tensors() + self.experts.grad_tensors()


def wrap(model: nn.Module, mesh: Mesh, cfg: ParallelConfig, compute_dtype: torch.dtype = torch.float32) -> GradSync:
    """Apply the data-parallel member chosen by ``parallel.zero`` to ``model`` on ``mesh``.

    Gradients are reduced over dp x cp (context-parallel ranks hold the same weights too).
    ZeRO-3 gathers parameters in ``compute_dtype``; everything else stays fp32. Under expert
    parallelism the experts are synced over edp instead, beside the chosen member (``WithExperts``): all-reduced
    with ZeRO-0, sharded with ZeRO-1/2 (stage 2 also for ZeRO-3: experts are not gathered per forward).
    """
    experts = [(n, p) for n, p in model.named_parameters() if expert_index(n) is not None] \
        if mesh.size("ep") > 1 else []
    skip = frozenset(id(p) for _, p in experts)
    if cfg.zero == 0:
        dense: GradSync = DataParallel(model, mesh.group("dp", "cp"), cfg.bucket_mb, exclude=skip)
    elif cfg.zero in (1, 2):
        from meshtrain.parallel.zero import ZeroOptimizer

        dense = ZeroOptimizer(model, mesh, stage=cfg.zero, layout=cfg.zero_layout, exclude=skip)
    else:
        from meshtrain.parallel.fsdp import FullyShardedDataParallel

        dense = FullyShardedDataParallel(model, mesh, reshard_after_forward=cfg.reshard_after_forward,
                                         compute_dtype=compute_dtype, exclude=skip)
    if not experts:
        return dense
    edp = mesh.group("edp")
    if cfg.zero == 0 or edp.size == 1:
        sync: GradSync = DataParallel(model, edp, cfg.bucket_mb, params=experts)
    else:  # ZeRO over the ranks holding the same experts: stage 1 or 2 (ZeRO-3 keeps experts at stage 2)
        from meshtrain.parallel.units import Unit
        from meshtrain.parallel.zero import ZeroOptimizer

        by_layer: dict[str, list] = {}
        for name, p in experts:
            by_layer.setdefault(name.split(".feed_forward.")[0], []).append((name, p))
        units = [Unit(f"{layer}.experts", [], params) for layer, params in by_layer.items()]
        sync = ZeroOptimizer(model, mesh, stage=min(cfg.zero, 2), layout=cfg.zero_layout, units=units, group=edp)
    return WithExperts(dense, sync, mesh.group("ep"))
