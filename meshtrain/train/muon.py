"""Muon: momentum SGD whose update for a weight matrix is orthogonalised by a Newton-Schulz iteration.

Only hidden 2-D weights (attention and feed-forward projections) suit Muon; the token embedding,
the output head and the 1-D norm scales keep AdamW. ``HybridOptimizer`` holds both kinds of
param group in one ``torch.optim.Optimizer``, so the trainer's schedule (``set_lr``), gradient
zeroing and checkpoint code (``optimizer.state``, ``optimizer.defaults``) treat it like any other.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim.adamw import adamw as adamw_functional

from meshtrain.config import TrainConfig
from meshtrain.parallel.pieces import OptimParam

# Quintic Newton-Schulz coefficients: chosen to push every singular value in (0, 1] towards ~1 as fast
# as possible in few steps, at the price of leaving them in roughly [0.7, 1.2] instead of exactly 1.
NS_COEFFS = (3.4445, -4.7750, 2.0315)

# Parameters that stay on AdamW although they are 2-D: their rows are looked up (embedding) or each
# row scores one token (output head), so orthogonalising the whole matrix has no good reason.
ADAMW_MATRICES = ("tok_embeddings", "output")

ZERO_LAYOUT_MESSAGE = (
    "train.optimizer=muon orthogonalises whole matrices: use parallel.zero_layout=per_tensor (or zero=0)"
)


def newton_schulz(g: Tensor, steps: int = 5, eps: float = 1e-7) -> Tensor:
    """An approximately orthogonal matrix with the singular vectors of ``g`` (its singular values
    pushed to about 1), by ``steps`` iterations of X <- aX + b(XX^T)X + c(XX^T)^2 X.

    Runs in bf16 on CUDA (the iteration is robust to it and tensor cores make it cheap) and in fp32
    elsewhere; returns ``g``'s dtype.
    """
    if g.ndim != 2:
        raise ValueError(f"newton_schulz needs a 2-D matrix, got shape {tuple(g.shape)}")
    a, b, c = NS_COEFFS
    # Normalise in fp32: the Frobenius norm bounds the spectral norm, so every singular value is <= 1,
    # which the iteration needs to converge.
    x = g.float()
    x = x / (x.norm() + eps)
    x = x.to(torch.bfloat16 if g.is_cuda else torch.float32)
    # Work on the smaller Gram matrix: X X^T is min(rows, cols) square.
    transposed = x.size(0) > x.size(1)
    if transposed:
        x = x.mT
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b*A + c*A@A
        x = torch.addmm(x, poly, x, beta=a)  # a*X + (b*A + c*A@A) @ X
    if transposed:
        x = x.mT
    return x.to(g.dtype)


def _check_matrices(params: Iterable[Tensor], who: str) -> None:
    for p in params:
        if p.ndim != 2:
            raise ValueError(f"{who}: Muon updates 2-D weight matrices only, got a parameter of shape "
                             f"{tuple(p.shape)}; give vectors, embeddings and the output head to AdamW "
                             f"(see HybridOptimizer)")


def _group_params(group: dict[str, Any]) -> list[Tensor]:
    params = group["params"]
    return [params] if isinstance(params, Tensor) else list(params)


@torch.no_grad()
def _muon_group_step(group: dict[str, Any], state: dict[Tensor, dict[str, Any]], grad_scale: Tensor | None = None,
                     found_inf: Tensor | None = None) -> None:
    """One Muon update of every parameter with a gradient in ``group``, each gradient divided by ``grad_scale``;
    none where ``found_inf`` is 1 (read on the host: the per-matrix Newton-Schulz loop is driven from there)."""
    if found_inf is not None and bool(found_inf):
        return
    lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
    for p in group["params"]:
        if p.grad is None:
            continue
        grad = p.grad if grad_scale is None else p.grad / grad_scale
        st = state[p]
        if "momentum_buffer" not in st:
            st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buf = st["momentum_buffer"]
        buf.mul_(momentum).add_(grad)
        update = grad.add(buf, alpha=momentum) if group["nesterov"] else buf
        ortho = newton_schulz(update, steps=group["ns_steps"])
        # An orthogonalised m x n update has RMS 1/sqrt(max(m, n)); scaling by 0.2 * sqrt(max(m, n))
        # gives it RMS 0.2, about that of an AdamW update, so Muon works in AdamW's lr range
        # (Liu et al. 2025, "Muon is Scalable for LLM Training").
        scale = 0.2 * math.sqrt(max(p.shape))
        if wd != 0:
            p.mul_(1 - lr * wd)  # decoupled decay, as in AdamW
        p.add_(ortho, alpha=-lr * scale)


class HybridOptimizer(torch.optim.Optimizer):
    """Muon for some param groups, AdamW for the others, as one optimizer.

    Each group has ``kind`` ``"muon"`` or ``"adamw"`` (default ``"adamw"``) and may override any
    hyper-parameter (``lr``, ``weight_decay``, ...). AdamW groups run torch's own AdamW kernels
    (fused, or foreach with ``fused=False``), so they match ``torch.optim.AdamW`` exactly and keep its
    state (``step``, ``exp_avg``, ``exp_avg_sq``); Muon groups keep ``momentum_buffer``.

    Like ``torch.optim.AdamW`` it takes the clip and the non-finite skip as ``grad_scale`` and ``found_inf``
    (``train.optim.optimizer_step``); the fused AdamW groups apply them on the device.
    """

    _step_supports_amp_scaling = True

    def __init__(self, params: Iterable[dict[str, Any]], lr: float = 3e-3, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, fused: bool = False) -> None:
        defaults = {
            "kind": "adamw", "lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
            "momentum": momentum, "nesterov": nesterov, "ns_steps": ns_steps,
            # Read by the checkpoint code: a fused AdamW keeps its step counter on the parameter's device.
            "fused": fused, "foreach": not fused,
        }
        super().__init__(list(params), defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group, checking its ``kind`` and that Muon groups hold matrices only."""
        params = _group_params(param_group)
        kind = param_group.get("kind", self.defaults["kind"])
        if kind not in ("muon", "adamw"):
            raise ValueError(f"HybridOptimizer: param group kind must be 'muon' or 'adamw', got {kind!r}")
        if kind == "muon":
            _check_matrices(params, "HybridOptimizer")
        super().add_param_group({**param_group, "params": params})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every parameter that has a gradient; ``closure`` re-evaluates the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        for group in self.param_groups:
            if group["kind"] == "muon":
                _muon_group_step(group, self.state, grad_scale, found_inf)
            else:
                self._adamw_group_step(group, grad_scale, found_inf)
        return loss

    def _adamw_group_step(self, group: dict[str, Any], grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        """Torch's functional AdamW on one group, with state laid out as ``torch.optim.AdamW`` does."""
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        fused = bool(group["fused"])
        if not fused and (grad_scale is not None or found_inf is not None):
            raise ValueError("HybridOptimizer: grad_scale and found_inf need fused=True (torch's foreach AdamW "
                             "takes neither)")
        for p in group["params"]:
            if p.grad is None:
                continue
            st = self.state[p]
            if len(st) == 0:
                # Like torch.optim.AdamW: the step counter lives on the CPU unless the kernel is fused.
                device = p.device if fused else "cpu"
                st["step"] = torch.zeros((), dtype=torch.float32, device=device)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(st["exp_avg"])
            exp_avg_sqs.append(st["exp_avg_sq"])
            steps.append(st["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw_functional(
            params, grads, exp_avgs, exp_avg_sqs, [], steps,
            foreach=group["foreach"] and not fused, fused=fused, grad_scale=grad_scale, found_inf=found_inf,
            amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group["eps"], maximize=False,
        )


class Muon(HybridOptimizer):
    """Muon over 2-D parameters only: momentum (Nesterov by default), then Newton-Schulz
    orthogonalisation of the update, scaled to AdamW's update RMS, plus decoupled weight decay.

    A ``HybridOptimizer`` whose every group is a Muon group. State per parameter:
    ``momentum_buffer`` (a tensor shaped like the parameter).
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float = 0.02,
                 momentum: float = 0.95, nesterov: bool = True, weight_decay: float = 0.0,
                 ns_steps: int = 5) -> None:
        if lr < 0 or not 0 <= momentum < 1 or weight_decay < 0 or ns_steps < 1:
            raise ValueError(f"Muon: invalid hyper-parameters lr={lr} momentum={momentum} "
                             f"weight_decay={weight_decay} ns_steps={ns_steps}")
        items = list(params)
        groups = items if items and isinstance(items[0], dict) else [{"params": items}]
        super().__init__([{**g, "kind": "muon"} for g in groups], lr=lr, weight_decay=weight_decay,
                         momentum=momentum, nesterov=nesterov, ns_steps=ns_steps)
        self.defaults["kind"] = "muon"  # groups added later are Muon groups too


def is_muon_param(p: OptimParam) -> bool:
    """Whether Muon updates this parameter: a logical matrix that is not the embedding or output head.
    Judged by the last two name components so that wrapper prefixes (``module.``) do not matter."""
    parts = p.name.split(".")
    return len(p.shape) == 2 and not (len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in ADAMW_MATRICES)


def build_muon(params: list[OptimParam], cfg: TrainConfig) -> torch.optim.Optimizer:
    """The ``train.optimizer=muon`` optimizer: Muon (lr ``muon_lr``, momentum ``muon_momentum``) for the
    hidden matrices, AdamW (decay on matrices, none on vectors) for the rest.

    Muon groups carry ``lr_scale = muon_lr / lr`` so that ``set_lr`` drives both with one schedule.
    Raises ValueError when a matrix for Muon is only a piece (flat ZeRO layout) or ``train.lr`` is not positive.
    """
    muon = [p for p in params if is_muon_param(p)]
    if any(not p.is_whole for p in muon):
        raise ValueError(ZERO_LAYOUT_MESSAGE)
    if cfg.lr <= 0:
        raise ValueError(f"train.lr must be > 0 for train.optimizer=muon (got {cfg.lr}): Muon's lr is "
                         f"train.muon_lr scaled by the same schedule")
    rest = [p for p in params if not is_muon_param(p)]
    muon_lr = cfg.muon_lr or cfg.lr  # 0 means "the AdamW lr": the update scaling makes one lr fit both
    groups: list[dict[str, Any]] = [
        {"params": [p.tensor for p in muon], "kind": "muon", "lr": muon_lr, "lr_scale": muon_lr / cfg.lr,
         "momentum": cfg.muon_momentum, "weight_decay": cfg.weight_decay},
        {"params": [p.tensor for p in rest if len(p.shape) >= 2], "kind": "adamw", "weight_decay": cfg.weight_decay},
        {"params": [p.tensor for p in rest if len(p.shape) < 2], "kind": "adamw", "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ValueError("build_muon: no parameters to optimise")
    return HybridOptimizer(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                           weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum, fused=True)
