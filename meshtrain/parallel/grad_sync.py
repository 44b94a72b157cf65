"""The contract every member of the data-parallel family keeps (plain DP, ZeRO-1/2, ZeRO-3/HSDP, and the
experts' sync beside them), so ``Parallel`` drives any of them the same way.

A member owns the gradients' communication over its group and the pieces the optimizer updates; it
also knows where those pieces are sharded, so it adds its own part of the global gradient norm
(``grad_norm_sq``): tensor and pipeline parallelism add theirs in ``Parallel.grad_norm``.
"""

from __future__ import annotations

import abc
import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch

from meshtrain import comm
from meshtrain.mesh import AxisGroup
from meshtrain.parallel.pieces import OptimParam


def weak_grad_hook(method: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """``method`` (a bound method of a family member) as a post-accumulate-grad hook that does not keep its object
    alive. A parameter holds its hooks where Python's collector cannot follow them (autograd's graph holds the
    parameter too), so a hook holding the member would keep member, model and buckets alive for good after the
    trainer is gone: a process building trainer after trainer (the calibration, a sweep, a notebook) kept every
    one's memory (``tests/test_data_parallel.py``)."""
    ref = weakref.WeakMethod(method)

    def hook(p: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(p)

    return hook


class GradSync(abc.ABC):
    """What ``Parallel`` needs from any data-parallel strategy (plain DP, ZeRO-1/2/3, HSDP)."""

    norm_group: AxisGroup | None = None  # where this member's pieces are sharded: partial norms add there
    ep_group: AxisGroup | None = None  # expert parallelism: where expert tensors differ (norms, gathers add)
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

    def grad_norm_sq(self, device: torch.device) -> torch.Tensor:
        """This member's part of the squared global gradient norm, summed over its shard group; pieces
        replicated over tensor parallelism count 1/replicas here (``Parallel`` then sums over tp)."""
        return replica_weighted_norm_sq(self.optim_params(), [self.norm_group], device)

    def state_tensors(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes per rank of parameters, gradients and optimizer state, each storage counted once."""
        return tensor_bytes(self.param_tensors(), self.grad_tensors(), optimizer)

    @abc.abstractmethod
    def param_tensors(self) -> list[torch.Tensor]:
        """The parameter storage this rank keeps (for memory accounting)."""

    def grad_tensors(self) -> list[torch.Tensor]:
        return self.grads()


def reduce_as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What a gradient collective sends for the fp32 gradient ``t`` under ``parallel.reduce_dtype``: ``t`` itself
    (fp32, reduced in place) or a ``dtype`` copy (bf16: half the bytes), whose result the caller writes back."""
    return t if t.dtype == dtype else t.to(dtype)


def all_reduce_as(t: torch.Tensor, group: AxisGroup, dtype: torch.dtype) -> None:
    """Sum the fp32 gradient ``t`` over ``group`` in place, sent as ``dtype`` (``reduce_as``)."""
    send = reduce_as(t, dtype)
    comm.all_reduce(send, group)
    if send is not t:
        t.copy_(send)


def replica_weighted_norm_sq(ops: list[OptimParam], groups: list[AxisGroup | None],
                             device: torch.device) -> torch.Tensor:
    """Sum of squared gradient entries of ``ops`` (a piece held by r tensor-parallel ranks counts 1/r, so
    the later sum over tp counts it once), added over ``groups``: an fp64 scalar on ``device``, not read
    here (the trainer reads it once, with the loss)."""
    with_grad = [op for op in ops if op.tensor.grad is not None]
    norm_sq = torch.zeros((), dtype=torch.float64, device=device)
    for r in sorted({op.replicas for op in with_grad}):
        norm_sq += grad_norm_squared([op.tensor.grad for op in with_grad if op.replicas == r]).double() / r
    for group in groups:
        if group is not None:
            comm.all_reduce_metrics(norm_sq, group)
    return norm_sq


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


@torch.no_grad()
def grad_norm_squared(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squared gradient entries, in fp32. Sharded layouts add the sums of their shards
    (one all-reduce) before the square root, so the norm is that of the whole model."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    norms = torch._foreach_norm([g.float() for g in grads], 2.0)
    return torch.stack(norms).pow(2).sum()
