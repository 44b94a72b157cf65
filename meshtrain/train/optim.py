"""Optimizer, learning-rate schedule and gradient clipping."""

from __future__ import annotations

import math

import torch
from torch import nn

from meshtrain.config import TrainConfig
from meshtrain.parallel.pieces import OptimParam, Placements, optim_param


def model_params(model: nn.Module, placements: Placements | None = None) -> list[OptimParam]:
    """Every trainable parameter of a model whose parameters are whole on this rank, tied ones once
    (``placements``: where tensor parallelism put each local parameter, if it was applied)."""
    return [optim_param(n, p, placements or {}) for n, p in model.named_parameters() if p.requires_grad]


def adamw_groups(params: list[OptimParam], weight_decay: float) -> list[dict]:
    """Decay matrices (linear and embedding weights), not vectors (norm scales): the usual LLM recipe.
    The logical shape decides, so a 1-D ZeRO piece of a matrix still decays."""
    decay = [p.tensor for p in params if len(p.shape) >= 2]
    no_decay = [p.tensor for p in params if len(p.shape) < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_adamw(params: list[OptimParam], cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over fp32 tensors with torch's fused kernel (CUDA and CPU have one): one pass over each tensor, and
    the only AdamW that applies the clip and the non-finite skip on the device (``optimizer_step``)."""
    return torch.optim.AdamW(
        adamw_groups(params, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True,
    )


def clip_divisor(norm: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """What the gradients are divided by so their global ``norm`` is at most ``max_norm``: ``norm / max_norm``
    where that exceeds 1, else 1 (None: no clipping, ``max_norm`` 0). A device scalar, never read on the host."""
    if max_norm <= 0:
        return None
    return torch.clamp((norm.float() + 1e-6) / max_norm, min=1.0)


def non_finite(*values: torch.Tensor) -> torch.Tensor:
    """1.0 where any of the device scalars ``values`` is NaN or infinite, else 0.0 (``optimizer_step``'s flag)."""
    return (~torch.isfinite(torch.stack([v.float() for v in values])).all()).float()


def optimizer_step(optimizer: torch.optim.Optimizer, divisor: torch.Tensor | None, found_inf: torch.Tensor) -> None:
    """One optimizer step on the gradients divided by ``divisor`` (the clip), changing nothing (parameters,
    moments, step counters) where ``found_inf`` is 1: both decided on the device, in the fused kernel, so the
    host queues the step without reading anything and the gradients are read once, by the optimizer.

    This is torch's own protocol for AMP's loss scaling (``GradScaler`` sets the same two attributes on an
    optimizer that declares ``_step_supports_amp_scaling`` and removes them after the step)."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        raise TypeError(f"{type(optimizer).__name__} cannot apply the clip and the non-finite skip in its step")
    optimizer.grad_scale, optimizer.found_inf = divisor, found_inf
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf


def build_optimizer(params: list[OptimParam], cfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer named by ``train.optimizer`` over ``params`` (see ``model_params``)."""
    if cfg.optimizer == "muon":
        from meshtrain.train.muon import build_muon

        return build_muon(params, cfg)
    return build_adamw(params, cfg)


def set_lr(optimizer: torch.optim.Optimizer, step: int, cfg: TrainConfig) -> float:
    """Apply the schedule to every param group; a group's ``lr_scale`` (e.g. Muon's muon_lr / lr)
    multiplies it, so one schedule drives both optimizers of a hybrid."""
    lr = lr_at(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    return lr


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based).

    Linear warmup to ``lr`` over ``warmup_steps``, then by ``lr_schedule``, with ``floor = lr * min_lr_ratio``:
    ``cosine`` and ``linear`` fall from lr towards the floor, reached at ``steps``; ``constant`` holds lr;
    ``wsd`` holds lr, then its last ``wsd_decay_steps()`` steps fall by ``decay_shape`` and the final step is at the
    floor. wsd's lr before its decay does not depend on ``steps``, so a run can be extended from such a checkpoint.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if cfg.lr_schedule == "wsd":
        decay = cfg.wsd_decay_steps()
        done = step - (cfg.steps - decay) + 1  # decay steps taken, this one included: 1..decay
        if done <= 0:
            return cfg.lr
        return floor + (cfg.lr - floor) * _decayed(min(done / decay, 1.0), cfg.decay_shape)
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return floor + (cfg.lr - floor) * _decayed(progress, cfg.lr_schedule)


def _decayed(progress: float, shape: str) -> float:
    """The share of (lr - floor) left after ``progress`` (0..1) of a decay of this shape."""
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if shape == "sqrt":
        return 1.0 - math.sqrt(progress)
    return 1.0 - progress  # linear
