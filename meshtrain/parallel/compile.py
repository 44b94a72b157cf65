"""``torch.compile`` per transformer block (``train.compile=true``), applied to the model from outside.

``apply_compile(model)`` compiles every module in ``model.layers`` on its own, as torchtitan does, rather than
the whole model: each block is one bounded graph set (the blocks share their code, so after the first block the
others reuse its compiled kernels), and whatever runs between blocks (the DP family's hooks, ZeRO-3's per-block
gather and free, the pipeline engine's sends) stays eager Python. The final norm is compiled the same way: eager,
its fp32 Function is a score of memory-bound kernels over the whole stream (``apply_compile``).

How, and why this way:

* ``nn.Module.compile()`` is torch's own in-place form: the block keeps its class, its children and its
  parameters, so ``named_parameters``/``state_dict`` keep the single-device names (``layers.0.attention.wq.weight``,
  not ``layers.0._orig_mod...`` as ``torch.compile(block)`` would give). Checkpoints, the deterministic init,
  ``Placement`` tables and the HuggingFace export key on those names. ``Module.compile`` stores the compiled
  ``__call__`` on the module (torch's documented mechanism); nothing of ours is patched.
* It runs in ``parallelize`` after recompute and before the DP family (torchtitan: after TP and activation
  checkpointing, before FSDP). After TP, CP and EP because it must see the modules they swapped in; after
  recompute so the checkpoint is traced into the graph (the partitioner then recomputes inside the compiled
  backward; where that is impossible, see the last point); before the DP family, whose hooks on the block
  (ZeRO-3) are then called by the compiled ``__call__``: dynamo runs them as graph breaks, eagerly, in the same
  order as without compile.
* Graph breaks, by design: tensor parallelism's f/g ops and sequence parallelism's gather/scatter are autograd
  Functions that call ``meshtrain.comm``; ring/all-gather attention (CP) and the expert all-to-all (EP) too. Each
  is one break (the code around it is still compiled); ``docs/compile.md`` lists where, from
  ``torch._dynamo.explain``. Zero-bubble pipelines' ``deferred_linear`` is one too (``pipeline/wgrad.py``).
* A recomputed block that breaks graphs -- it calls collectives (tp, cp or ep > 1), or it is an MoE block, whose
  routing reads token counts -- is compiled the other way round:
  ``checkpoint(compiled forward)``, not ``compile(checkpointed block)``. Dynamo cannot break a graph inside a
  checkpoint: it gives up on the whole checkpoint and the block ran eagerly, silently. So the checkpoint stays
  eager and outside, and what it runs -- the block's forward -- is ``torch.compile``d (``recompute.py``,
  ``compile_inside``); non-reentrant checkpoint recomputes the compiled forward in backward. Selective recompute
  is then recomputed whole, as full: its policy is a dispatch mode that cannot see inside compiled kernels.

Compiling is lazy: the first forward of each block shape traces and compiles (tens of seconds on a CPU, less
with inductor's on-disk cache warm). Evaluation and sampling at new sequence lengths recompile once, then dynamo
marks the length dynamic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from meshtrain.model.moe import MoEFeedForward
from meshtrain.parallel.recompute import recomputed_forward


def compile_unavailable(device: torch.device) -> str | None:
    """Why inductor cannot compile for ``device`` on this machine, with the fix (None: it can). CPU kernels are
    C++ built by a host compiler (``$CXX`` or g++); CUDA kernels are Triton."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton (inductor's CUDA kernels) is not installed: pip install triton"
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception:  # noqa: BLE001 - any failure to find one means the same thing to the user
        return "no C++ compiler for inductor's CPU kernels was found: install g++ (or set CXX to one)"
    return None


def compile_loss(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 enabled: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The plain cross-entropy (``model/llama.cross_entropy_sum``) compiled when ``enabled`` (``train.compile``).

    Eager, it writes an fp32 copy of the [tokens, vocab] logits, its log-softmax, and saves that for backward
    (4 bytes per logit; the backward writes two more fp32 tensors of that size). Inductor fuses the upcast, the
    log-softmax and the pick of each target's logit into the reductions, forward and backward, and saves the
    logits as they came (bf16 under autocast: 2 bytes per logit) with one fp32 log-sum-exp per token. The
    vocabulary-parallel loss (tp > 1) is an autograd Function that calls collectives; ``parallelize`` passes
    it here only disabled."""
    return torch.compile(loss_fn) if enabled else loss_fn


def apply_compile(model: nn.Module, enabled: bool, collectives: bool = False) -> nn.Module:
    """Compile every module in ``model.layers`` in place (``enabled`` is ``train.compile``; False: nothing
    changes). Returns ``model``; names, module tree and hooks are unchanged.

    ``collectives``: the blocks call collectives (tp, cp or ep > 1), i.e. their forward breaks graphs; an MoE
    block breaks graphs anyway (its routing reads token counts). Such a block, if recomputed, is compiled inside
    its checkpoint rather than around it (see the module docstring); every other block is compiled whole with
    ``Module.compile()``, and so is the final norm where ``model`` has it."""
    if not enabled:
        return model
    for block in model.layers.values():
        recomputed = recomputed_forward(block)
        routes = any(isinstance(m, MoEFeedForward) for m in block.modules())
        if recomputed is not None and (collectives or routes):
            # An MoE block's shapes follow its routing, so they change every step: dynamic from the first
            # compile. Left automatic, dynamo compiles a static graph first and a dynamic one later that matches
            # the same inputs, and a checkpoint's recomputation could then run another graph than its forward
            # did (it stops: "a different number of tensors was saved", pytorch/pytorch#166926).
            recomputed.compile_inside(dynamic=True if routes else None)
        else:
            # Not fullgraph: the collectives inside TP/CP/EP blocks are graph breaks (see the module docstring).
            block.compile()
    if model.norm is not None:
        # The final norm (on the pipeline's last stage only), between the last block and the head: eager, its fp32
        # Function is some twenty memory-bound kernels over the whole residual stream each step (~5 ms a step at
        # batch 24 on the H100: fp32 casts, broadcast products, a mean, a sum); compiled, a reduction each way.
        # It calls no collective on any layout (under SP it normalises its own rows), so it is one graph.
        model.norm.compile()
    return model


def is_compiled(module: nn.Module) -> bool:
    """Whether ``apply_compile`` compiled ``module``: a block (whole, or inside its checkpoint) or the final norm."""
    recomputed = recomputed_forward(module)
    return (getattr(module, "_compiled_call_impl", None) is not None
            or (recomputed is not None and recomputed.compiled is not None))


__all__ = ["apply_compile", "compile_unavailable", "is_compiled"]
