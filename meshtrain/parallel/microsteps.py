"""The micro-steps of one optimizer step, and the one forward-and-loss every path uses.

``ForwardLoss`` runs a module (the whole model, or a pipeline stage) on a microbatch under the data-parallel
family's forward context and autocast, and gives the sum of token losses when it is handed targets. The
step, the pipeline engine and evaluation all call it, so they cannot drift apart.

``Accumulation`` is the degenerate schedule: a rank holding every layer runs its microbatches one after
another (``train.grad_accum`` of them), gradients communicated with the last. ``PipelineEngine``
(``pipeline/engine.py``) is the general case; both answer ``run`` (train) and ``forward_only`` (evaluate)
with the same signature, so ``Parallel`` drives either the same way.

Loss scaling: each microbatch's token-loss sum is divided by the token count of the *global* batch, so the
sum over microbatches and ranks is exactly the single-device mean.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from meshtrain.parallel.grad_sync import GradSync


@dataclass
class ForwardLoss:
    """``forward(module, x)`` -> output; ``forward(module, x, targets)`` -> sum of token losses (fp32); ``docs``
    (the rows' document ids, ``train.attention_mask=document``) goes to the module."""

    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    sync: GradSync
    dtype: torch.dtype
    device: torch.device

    def autocast(self, enabled: bool = True) -> contextlib.AbstractContextManager:
        """Autocast in the compute dtype (``enabled=False``: off, nested inside an enabled one); nothing in fp32."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype, enabled=enabled)

    def one_cast_per_step(self) -> contextlib.AbstractContextManager:
        """Around a step's microbatches: each fp32 weight is cast to the compute dtype once for all of them.

        Autocast caches a parameter's cast until its outermost context exits, and each microbatch's matmuls keep
        the cast weight for backward. With a context per forward alone, every microbatch in flight kept a copy of
        its own (2 bytes a parameter each: up to pp of them on a 1F1B stage); inside this one they share one, and
        the casts are done once a step. What runs in it outside a forward, the loss and backward, runs under
        ``autocast(enabled=False)``, as it did outside any context."""
        return self.autocast()

    def __call__(self, module: nn.Module, x: torch.Tensor, targets: torch.Tensor | None = None,
                 docs: torch.Tensor | None = None) -> torch.Tensor:
        with self.sync.forward_context(), self.autocast():
            out = module(x) if docs is None else module(x, docs=docs)
        if targets is None:
            return out
        with self.autocast(enabled=False):
            return self.loss_fn(out, targets)


def chunks(docs: torch.Tensor | None, n: int) -> list[torch.Tensor | None]:
    """The microbatches' document ids (rows cut as ``inputs.chunk(n)`` cuts them), or ``n`` Nones."""
    return [None] * n if docs is None else list(docs.chunk(n))


class Accumulation:
    """Plain gradient accumulation over ``n`` microbatches of a rank that holds the whole model."""

    def __init__(self, model: nn.Module, forward: ForwardLoss, n: int) -> None:
        self.model, self.forward, self.n = model, forward, n

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, n_tokens: int,
            docs: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of every microbatch; returns this rank's loss sum / ``n_tokens`` (an fp64
        scalar on the device, unread: a host read would stall a GPU until the step's work is done)."""
        sync, device = self.forward.sync, self.forward.device
        total = torch.zeros((), dtype=torch.float64, device=device)
        micro = list(zip(inputs.chunk(self.n), targets.chunk(self.n), chunks(docs, self.n), strict=True))
        with self.forward.one_cast_per_step():
            for i, (x, y, d) in enumerate(micro):
                # Gradients are communicated only with the last microbatch (ZeRO-2/3 reduce every one).
                with sync.no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
                    loss = self.forward(self.model, x.to(device), y.to(device), d) / n_tokens
                    with self.forward.autocast(enabled=False):
                        loss.backward()
                total += loss.detach().double()
        return total

    @torch.no_grad()
    def forward_only(self, inputs: torch.Tensor, targets: torch.Tensor,
                     docs: torch.Tensor | None = None) -> tuple[float, int]:
        """Evaluation in the training microbatches: (sum of token losses, token count) on this rank."""
        total, count = 0.0, 0
        for x, y, d in zip(inputs.chunk(self.n), targets.chunk(self.n), chunks(docs, self.n), strict=True):
            y = y.to(self.forward.device)
            total += float(self.forward(self.model, x.to(self.forward.device), y, d))
            count += int((y != -100).sum())
        return total, count
