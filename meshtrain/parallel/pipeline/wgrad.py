"""Deferred weight gradients for zero-bubble schedules: the backward pass split into I and W.

A linear layer's backward does two matmuls: the input gradient (needed at once by the previous
stage) and the weight gradient (needed only by the optimizer). ``defer_weight_grads(stage, store)``
makes the stage's linear layers, while the store is armed, compute only the input gradient
in backward and stash (input, output gradient) instead; the W action then does the weight matmuls
and hands each gradient to autograd's accumulation (``weight.backward(grad)``), so gradient hooks
(data-parallel bucket sync) fire as usual. Every other parameter (norms, embedding, biases) is cheap and
gets its gradient in I.

Which layers: the plain model's bias-free ``nn.Linear`` (swapped for ``DeferredLinear``) and, under tensor
parallelism, its column- and row-parallel twins, which are ``Deferrable`` (``defer_weight_grads`` sets their
``wgrad``). A fused weight (QKV, gate/up: several parameters concatenated along the output rows) is stashed as
its parts; W computes the concatenation's gradient in one matmul and hands each part its rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.comm import eager


class WeightGradStore:
    """Stashed (weights, input, output-gradient) triples per (microbatch, stage): ``weights`` the parameters one
    matmul read, concatenated along the output rows (one for a plain layer)."""

    def __init__(self) -> None:
        self.key: tuple[int, int] | None = None  # armed during an I action
        self.stash: dict[tuple[int, int], list[tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]]] = {}
        self.applied = 0  # weight gradients W has computed (this process, all steps): what shows W did work

    def put(self, weights: tuple[torch.Tensor, ...], x: torch.Tensor, g: torch.Tensor) -> None:
        self.stash.setdefault(self.key, []).append((weights, x, g))

    def armed(self) -> bool:
        """Inside an I action: a deferring layer stashes its weight gradient's inputs instead of computing it."""
        return self.key is not None

    @torch.no_grad()
    def apply(self, key: tuple[int, int]) -> None:
        """The W action: every stashed weight gradient of ``key``, accumulated through autograd."""
        grads: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
        for weights, x, g in self.stash.pop(key, []):
            for w, gw in zip(weights, split_rows(weight_grad(x, g, weights[0]), weights), strict=True):
                grads[id(w)] = (w, grads[id(w)][1] + gw) if id(w) in grads else (w, gw)
        with torch.enable_grad():
            for w, gw in grads.values():
                w.backward(gw)
        self.applied += len(grads)


def weight_grad(x: torch.Tensor, g: torch.Tensor, weight: nn.Parameter) -> torch.Tensor:
    """dL/dW = g^T x in the dtype the forward's matmul ran in (the output gradient's: bf16 under autocast, as
    autocast's own linear backward computes it; an fp32 matmul is ~4x slower on a bf16-capable CPU, and slower
    still against a GPU's bf16 tensor cores), returned in the weight's dtype for its fp32 accumulation."""
    gw = g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]).to(g.dtype)
    return gw.to(weight.dtype)


def split_rows(grad: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A fused weight's gradient cut into its parts' (``weights``, concatenated along the output rows)."""
    return (grad,) if len(weights) == 1 else grad.split([w.shape[0] for w in weights])


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, store: WeightGradStore) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        # The Parameter itself, for W: a saved tensor unpacks as another tensor object, which under activation
        # checkpointing is a leaf alias whose gradient need not reach the Parameter (W's gradient was lost).
        ctx.param = weight
        ctx.store = store
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = g @ weight.to(g.dtype)
        if ctx.store.armed():
            ctx.store.put((ctx.param,), x, g)
            return grad_x, None, None
        return grad_x, weight_grad(x, g, weight), None


# Eager under torch.compile (a clean graph break, like the collectives): the backward reads whether the store is
# armed and stashes into it, which a traced backward would fix at compile time (never deferring).
@eager
def deferred_linear(x: torch.Tensor, weight: torch.Tensor, store: WeightGradStore) -> torch.Tensor:
    """``F.linear(x, weight)`` (bias-free) whose weight gradient, while ``store`` is armed, W computes."""
    return _DeferredLinear.apply(x, weight, store)


class Deferrable:
    """A layer that can leave its weight gradient to W: ``defer_weight_grads`` sets ``wgrad``, and the layer then
    runs its matmul through ``deferred_linear`` (or its own Function's equivalent). The tensor-parallel linears."""

    wgrad: WeightGradStore | None = None


class DeferredLinear(nn.Linear, Deferrable):
    """A bias-free linear layer whose weight gradient the W action computes (when the store is armed)."""

    def __init__(self, lin: nn.Linear, store: WeightGradStore) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight = lin.weight  # the same parameter object
        self.bias = None
        self.wgrad = store

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return deferred_linear(x, self.weight, self.wgrad)


def defer_weight_grads(module: nn.Module, store: WeightGradStore) -> None:
    """Swap every bias-free ``nn.Linear`` in ``module`` for a ``DeferredLinear`` and hand every ``Deferrable``
    layer (tensor-parallel linears) the store (in place)."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.bias is None:
                setattr(parent, name, DeferredLinear(child, store))
            elif isinstance(child, Deferrable):
                child.wgrad = store


def _defers(m: nn.Module) -> bool:
    return isinstance(m, Deferrable) and m.wgrad is not None


def immediate_params(module: nn.Module) -> list[nn.Parameter]:
    """The parameters whose gradients the I action computes: all but the weights of deferring layers (a deferring
    layer's bias, ``model.qkv_bias``, is a sum over tokens of the output gradient I already has)."""
    params = {id(p): p for m in module.modules() for name, p in m.named_parameters(recurse=False)
              if p.requires_grad and not (_defers(m) and name == "weight")}
    return list(params.values())
