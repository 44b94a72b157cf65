"""Activation checkpointing ("recompute") per transformer block, applied to the plain model from outside.

``apply_recompute(model, mode)`` makes every module in ``model.layers`` recompute its activations in
backward instead of keeping them from forward:

* ``"none"``: nothing changes.
* ``"full"``: the block runs under non-reentrant ``torch.utils.checkpoint``; only its inputs are kept.
* ``"selective"``: the outputs of matmuls and attention are kept (expensive to recompute), the cheap
  element-wise ops (norms, RoPE, SiLU, multiplies, adds) are recomputed.

How the block is wrapped, and why:

The block's *instance* ``forward`` attribute is replaced by a small callable; the module tree is not
touched. So parameter and buffer names stay exactly ``layers.N.attention.wq.weight`` etc. (checkpoints
and the deterministic init key on them), and whatever a parallelism has swapped inside the block
(sharded Linears, a swapped attention core) is checkpointed along with it.

Hooks: ``nn.Module.__call__`` runs the block's forward pre/post hooks around ``self.forward``, i.e.
*outside* the checkpointed region. The recomputation in backward re-runs only the original forward
function, not ``__call__``, so hooks registered on the block itself fire exactly once per forward and
do NOT fire again during recomputation. Hooks registered on modules *inside* the block (attention,
the Linears, the norms) are called by the inner forward and therefore DO fire again when backward
recomputes it (as far as the recomputation goes: non-reentrant checkpoint stops early once every
tensor backward needs has been rebuilt, so hooks of the block's last submodules may not re-fire).
A full backward pre-hook on the block (``register_full_backward_pre_hook``) fires before the
recomputation starts, so that is where code that must re-gather a block's sharded parameters for
backward should do it; the block's forward pre/post hooks will not run then.

Under ``train.compile`` a block's checkpoint is normally traced into its compiled graph; where the block breaks
graphs (collectives, MoE routing), ``compile_inside`` compiles the forward the checkpoint runs instead
(``parallel/compile.py``), and "selective" then recomputes that compiled forward whole, as "full" (its policy
cannot see inside compiled kernels).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from meshtrain.config import RECOMPUTE_MODES

# Ops whose outputs selective recompute keeps: matmuls and every attention kernel this torch has
# (which one SDPA picks depends on device, dtype and shapes). Matched by overload packet so that all
# overloads (.default, .out, ...) count.
_SAVED_OP_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable",
)
SELECTIVE_SAVED_OPS: frozenset[Any] = frozenset(
    getattr(torch.ops.aten, name) for name in _SAVED_OP_NAMES if hasattr(torch.ops.aten, name)
)


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective-checkpoint policy: keep matmul/attention outputs, recompute everything else."""
    packet = getattr(op, "overloadpacket", op)
    return CheckpointPolicy.MUST_SAVE if packet in SELECTIVE_SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> tuple[Any, Any]:
    # A fresh pair of contexts per checkpoint call: each holds that call's cache of saved outputs.
    return create_selective_checkpoint_contexts(selective_policy)


class _RecomputedForward:
    """Replacement for a block's ``forward``: runs the original forward under ``checkpoint``.

    Deliberately not an ``nn.Module`` (it would become a child and change the parameter names). It keeps
    a strong reference to the block rather than a bound method, so ``copy.deepcopy`` of a model rebinds
    it to the copy (the memo maps the block to its copy) and pickling does not resolve ``block.forward``
    back to this wrapper.
    """

    def __init__(self, module: nn.Module, inner: Callable[..., Any] | None, mode: str) -> None:
        self.module = module
        # An instance-level forward someone installed before us, or None for the class's forward.
        self.inner = inner
        self.mode = mode
        # ``compile_inside`` sets this: the block's forward compiled on its own, run inside the checkpoint.
        self.compiled: Callable[..., Any] | None = None

    def compile_inside(self, dynamic: bool | None = None) -> None:
        """Compile what the checkpoint runs (``torch.compile`` of the block's forward) instead of the block's
        ``__call__``: the checkpoint then stays eager, outside the graphs, and recomputes the compiled forward
        in backward. For blocks whose forward breaks graphs (collectives, MoE routing), which dynamo cannot trace
        inside a checkpoint (``meshtrain/parallel/compile.py``). Compiles the unbound forward, so the compiled
        function holds no block and a deep copy of the model still runs its own block. ``dynamic``:
        ``torch.compile``'s."""
        self.compiled = torch.compile(self.inner if self.inner is not None else type(self.module).forward,
                                      dynamic=dynamic)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is not None:
            if self.inner is not None:
                return self.compiled(*args, **kwargs)
            return self.compiled(self.module, *args, **kwargs)
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Selective's policy is a dispatch mode that must see every op; compiled kernels hide theirs (and reuse
        # the matmul outputs it would cache), so a forward compiled inside the checkpoint is recomputed whole.
        if self.mode == "selective" and self.compiled is None:
            return checkpoint(self._run, *args, use_reentrant=False, context_fn=_selective_context, **kwargs)
        return checkpoint(self._run, *args, use_reentrant=False, **kwargs)


def _check_mode(mode: str) -> None:
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"train.recompute must be one of {', '.join(RECOMPUTE_MODES)}; got {mode!r}.")


def recompute_mode(block: nn.Module) -> str:
    """The recompute mode ``apply_recompute`` installed on ``block`` ("none" if it installed none)."""
    fwd = recomputed_forward(block)
    return fwd.mode if fwd is not None else "none"


def recomputed_forward(block: nn.Module) -> _RecomputedForward | None:
    """The checkpointing forward ``apply_recompute`` installed on ``block`` (None if it installed none)."""
    fwd = block.__dict__.get("forward")
    return fwd if isinstance(fwd, _RecomputedForward) else None


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """Make every module in ``model.layers`` recompute its activations in backward; in place, returns ``model``.

    ``mode`` is ``train.recompute``: "none" (no change), "full" or "selective" (see the module docstring).
    Parameter names, the module tree and hooks on the blocks are unchanged. Applying again to an already
    wrapped block switches its mode instead of nesting checkpoints; "none" leaves blocks as they are.
    """
    _check_mode(mode)
    if mode == "none":
        return model
    for block in model.layers.values():
        current = block.__dict__.get("forward")
        if isinstance(current, _RecomputedForward):
            current.mode = mode
            continue
        # Setting an instance attribute shadows the class's forward for this block only; nn.Module's
        # __setattr__ stores non-Module, non-Parameter values as plain attributes.
        block.forward = _RecomputedForward(block, current, mode)
    return model


def _storage_key(t: torch.Tensor) -> tuple[int, int, torch.UntypedStorage] | None:
    """(data_ptr, nbytes, storage) of a plain tensor's storage; None for what we cannot measure."""
    if is_traceable_wrapper_subclass(t) or t.device.type == "meta":
        return None  # wrapper subclasses (DTensor, ...) have no storage of their own; their inner ops are seen
    storage = t.untyped_storage()
    if storage.nbytes() == 0 or storage.data_ptr() == 0:
        return None
    return storage.data_ptr(), storage.nbytes(), storage


class _NewStorageRecorder(TorchDispatchMode):
    """Weakly records every storage an op allocates (outputs that do not alias an input), and notes the storages
    a collective (a ``c10d`` op) was handed."""

    def __init__(self, record: Callable[[torch.Tensor], None], touched: Callable[[int], None]) -> None:
        super().__init__()
        self.record = record
        self.touched = touched

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            key[0]
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and (key := _storage_key(t)) is not None
        }
        if getattr(func, "namespace", "") == "c10d":
            for ptr in inputs:
                self.touched(ptr)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and (key := _storage_key(t)) is not None and key[0] not in inputs:
                self.record(t)
        return out


def saved_activation_bytes(fn: Callable[[], Any], exclude: Iterable[torch.Tensor] = (),
                           comm_settle_s: float = 2.0) -> int:
    """Bytes of activation memory that the forward ``fn()`` leaves held for backward; each storage counted once.

    Run ``fn`` (a forward, e.g. ``lambda: loss_fn(model(x))``) with grad enabled and let it return its
    output, so the autograd graph is alive when we measure. Counted, deduplicated by storage data_ptr:

    * every tensor saved for backward through ``torch.autograd.graph.saved_tensors_hooks``, and
    * every storage allocated by an op during ``fn`` that is still alive once ``fn`` returns. This is
      needed because checkpointing hides what it keeps from the hooks above: inside a checkpointed region
      checkpoint's own hooks take precedence, and selective checkpointing caches the outputs it keeps in
      its own storage, not as saved tensors (measured on the tiny test model: with the hooks alone,
      "selective" reads the same as "full").

    Not counted: parameters (tensors that are, or are views of, ``nn.Parameter``), storages of the
    tensors ``fn`` returns unless they are also saved for backward (the caller holds those, not autograd),
    and storages of the tensors in ``exclude`` (e.g. ``model.buffers()``). On CPU this stands in for
    allocator statistics.

    Storages a collective was handed are the one exception to "alive means kept": a backend's worker
    thread (gloo's) drops its reference to a finished collective's tensors a moment *after* the wait
    returns, so such a storage (e.g. a row-parallel output, all-reduced in place and dead after the
    residual add) can read as alive for a while. We wait for those, up to ``comm_settle_s``, before
    counting; only one that is still alive then (kept by a selective cache, say) is counted.
    """
    excluded = {key[0] for t in exclude if (key := _storage_key(t)) is not None}
    tracked: dict[int, tuple[StorageWeakRef, int]] = {}
    saved: set[int] = set()
    touched: set[int] = set()

    def record(t: torch.Tensor) -> int | None:
        key = _storage_key(t)
        if key is None:
            return None
        ptr, nbytes, storage = key
        # A dead storage's address can be reused by a later allocation: the newer entry replaces it.
        tracked[ptr] = (StorageWeakRef(storage), nbytes)
        touched.discard(ptr)
        return ptr

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base
        if not isinstance(base, nn.Parameter) and (ptr := record(t)) is not None:
            saved.add(ptr)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _NewStorageRecorder(record, touched.add):
        out = fn()
    returned = {
        key[0] for t in tree_leaves(out) if isinstance(t, torch.Tensor) and (key := _storage_key(t)) is not None
    }
    settling = [tracked[ptr][0] for ptr in touched if ptr in tracked and ptr not in saved | returned | excluded]
    deadline = time.monotonic() + comm_settle_s
    while any(not ref.expired() for ref in settling) and time.monotonic() < deadline:
        time.sleep(0.001)
    total = 0
    for ptr, (ref, nbytes) in tracked.items():
        if ref.expired() or ptr in excluded or (ptr in returned and ptr not in saved):
            continue
        total += nbytes
    del out
    return total


__all__ = [
    "RECOMPUTE_MODES",
    "SELECTIVE_SAVED_OPS",
    "apply_recompute",
    "recompute_mode",
    "recomputed_forward",
    "saved_activation_bytes",
    "selective_policy",
]
