"""Optimizer, learning-rate schedule and gradient clipping."""

from __future__ import annotations

import math

import torch
from torch import nn

from meshtrain.config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (linear and embedding weights), not vectors (norm scales): the usual LLM recipe."""
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over fp32 parameters; fused on CUDA, foreach (multi-tensor) elsewhere."""
    on_cuda = next(model.parameters()).is_cuda
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
        fused=on_cuda, foreach=not on_cuda,
    )


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then cosine to min_lr_ratio x lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def grad_norm_squared(params: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squared gradient entries, in fp32. Parallel layouts add the sums of their shards
    (one all-reduce) before the square root, so the norm is that of the whole model."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    norms = torch._foreach_norm([g.float() for g in grads], 2.0)
    return torch.stack(norms).pow(2).sum()


@torch.no_grad()
def clip_grads(params: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale gradients so their global norm is at most ``max_norm`` (0: no clipping)."""
    if max_norm <= 0:
        return
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_([p.grad for p in params if p.grad is not None], coef.to(params[0].device))
