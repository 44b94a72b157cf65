"""Optimizer, learning-rate schedule and gradient clipping."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from meshtrain.config import TrainConfig


@dataclass(frozen=True)
class TPSlice:
    """Where a tensor-parallel parameter sits in its logical tensor: ``logical.narrow(dim, start,
    length) == local.narrow(dim, 0, length)`` (the local tensor may carry padding rows after that)."""

    dim: int
    start: int
    length: int


@dataclass(frozen=True)
class OptimParam:
    """What the optimizer updates: ``tensor`` is the whole parameter, or the piece of it this rank owns.

    ``name`` and ``shape`` are the logical (single-device) parameter's. ``offset`` is where the piece
    starts in the flattened *local* parameter (ZeRO cuts pieces), whose shape is ``local_shape``;
    ``tp`` places the local parameter in the logical one (tensor parallelism), and ``replicas`` says
    how many tensor-parallel ranks hold the same values (norm weights: tp; sharded weights: 1).
    """

    name: str
    tensor: torch.Tensor
    shape: tuple[int, ...]
    offset: int = 0
    local_shape: tuple[int, ...] | None = None
    tp: TPSlice | None = None
    replicas: int = 1

    @property
    def is_whole(self) -> bool:
        return tuple(self.tensor.shape) == self.shape

    @property
    def local(self) -> tuple[int, ...]:
        return self.local_shape if self.local_shape is not None else self.shape


def describe(name: str, p: torch.Tensor, tensor: torch.Tensor | None = None, offset: int = 0) -> OptimParam:
    """The OptimParam for (a piece of) parameter ``p``, reading the logical placement that tensor
    parallelism attaches to parameters (``p._logical``: (shape, TPSlice | None, replicas))."""
    shape, tp, replicas = getattr(p, "_logical", (tuple(p.shape), None, 1))
    return OptimParam(name, p if tensor is None else tensor, tuple(shape), offset, tuple(p.shape), tp, replicas)


def model_params(model: nn.Module) -> list[OptimParam]:
    """Every trainable parameter of a (non-sharded) model, tied ones once."""
    return [describe(n, p) for n, p in model.named_parameters() if p.requires_grad]


def adamw_groups(params: list[OptimParam], weight_decay: float) -> list[dict]:
    """Decay matrices (linear and embedding weights), not vectors (norm scales): the usual LLM recipe.
    The logical shape decides, so a 1-D ZeRO piece of a matrix still decays."""
    decay = [p.tensor for p in params if len(p.shape) >= 2]
    no_decay = [p.tensor for p in params if len(p.shape) < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_adamw(params: list[OptimParam], cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over fp32 tensors; fused on CUDA, foreach (multi-tensor) elsewhere."""
    on_cuda = params[0].tensor.is_cuda
    return torch.optim.AdamW(
        adamw_groups(params, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
        fused=on_cuda, foreach=not on_cuda,
    )


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
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then cosine to min_lr_ratio x lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def grad_norm_squared(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squared gradient entries, in fp32. Sharded layouts add the sums of their shards
    (one all-reduce) before the square root, so the norm is that of the whole model."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    norms = torch._foreach_norm([g.float() for g in grads], 2.0)
    return torch.stack(norms).pow(2).sum()


@torch.no_grad()
def clip_grads(grads: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale gradients so their global norm is at most ``max_norm`` (0: no clipping)."""
    if max_norm <= 0 or not grads:
        return
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef.to(grads[0].device))
