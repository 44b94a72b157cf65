"""The calibrated step-cost model's terms, and the fit that finds them from measured steps.

``meshtrain plan --calibrate`` (``meshtrain/calibrate.py``) times whole training steps (forward, backward, AdamW) of
a few small single-process models chosen so the terms below vary independently, then fits the seconds of each
step as a non-negative sum of

- ``flops``: matmul and attention FLOPs (forward x 3), at ``1 / bf16_flops`` seconds each: the matmul rate reached
  at these shapes, not a datasheet peak times an assumed efficiency;
- ``scores``: the attention scores (causal T x T / 2 per head), at ``score_s`` each: the softmax work of SDPA,
  which on a CPU computes every score (flash attention keeps none of them, but still exponentiates each);
- ``elems``: the non-matmul work, counted as the activation elements a block touches (``memory.py``'s count for
  ``recompute=none``) plus the logits, at ``elem_s`` seconds each (norms, RoPE, softmax, SiLU, copies, casts);
- ``blocks``: block forward+backward calls, at ``block_s`` each (operator dispatch, Python: what a tiny block costs);
- ``params``: parameters the optimizer step and gradient clipping touch, at ``param_s`` each;
- ``steps``: one per step, ``step_s`` (zeroing gradients, the step's fixed Python).

The planner (``plan/steptime.py``) prices a layout's work with the same features, so a term measured here is the
term used there. The fit is ordinary least squares on relative error, constrained to non-negative coefficients (a
negative per-FLOP cost would be no machine): every subset of the terms is fitted and the best whose coefficients
are all positive is kept (5 terms: 31 subsets, no solver needed).

``fit_gpu_kernels`` is the GPU's counterpart, from a kernel profile rather than whole steps: on a GPU the matmuls
stay a datasheet roofline (they reach ~75% of peak), and what it fits is the rest (``hardware.GPU_KERNELS``),
from ``benchmarks/gpu_single.py --profile`` runs (``benchmarks/gpu_kernels_fit.py``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from meshtrain.config import ModelConfig
from meshtrain.plan.flops import attention_flops_per_token, layer_flops, param_count, stage_part_flops
from meshtrain.plan.memory import activation_elems_per_token

TERMS = ("flops", "elems", "scores", "blocks", "params", "steps")


@dataclass(frozen=True)
class StepCosts:
    """Seconds per unit of each term (``TERMS``); ``flop_rate`` is 1 / the per-FLOP cost (0: none fitted)."""

    flop_rate: float
    elem_s: float
    score_s: float
    block_s: float
    param_s: float
    step_s: float

    @staticmethod
    def from_coefficients(coef: list[float] | np.ndarray) -> StepCosts:
        c = [float(x) for x in coef]
        return StepCosts(1.0 / c[0] if c[0] > 0 else 0.0, *c[1:])

    def seconds(self, features: dict[str, float]) -> float:
        """Predicted seconds of work described by ``features`` (a dict over ``TERMS``; missing terms are 0)."""
        per_flop = 1.0 / self.flop_rate if self.flop_rate > 0 else 0.0
        return (features.get("flops", 0.0) * per_flop + features.get("elems", 0.0) * self.elem_s
                + features.get("scores", 0.0) * self.score_s
                + features.get("blocks", 0.0) * self.block_s + features.get("params", 0.0) * self.param_s
                + features.get("steps", 0.0) * self.step_s)


def block_features(cfg: ModelConfig, tokens: float, seq_len: int, tp: int = 1, sp: bool = False) -> dict[str, float]:
    """Forward + backward work of one block on ``tokens`` tokens of one rank (split ``tp`` ways)."""
    kv_extra = 2 * 2 * cfg.d_model * cfg.head_dim * max(0, tp - cfg.kv_heads) / tp  # replicated kv heads' matmuls
    return {"flops": 3.0 * tokens * (layer_flops(cfg, seq_len) / tp + kv_extra),
            "elems": tokens * activation_elems_per_token(cfg, "none", tp, sp),
            "scores": tokens * seq_len / 2 * cfg.n_heads / tp, "blocks": 1.0}


def head_features(cfg: ModelConfig, tokens: float, seq_len: int, tp: int = 1) -> dict[str, float]:
    """Forward + backward work of the final norm, the output projection and the loss on ``tokens`` tokens."""
    _, _, head = stage_part_flops(cfg, seq_len)
    return {"flops": 3.0 * tokens * head / tp, "elems": tokens * (2.0 * cfg.d_model + cfg.vocab_size / tp)}


def step_features(cfg: ModelConfig, batch: int, seq_len: int) -> dict[str, float]:
    """The features of one whole single-process training step (what ``--calibrate`` measures)."""
    tokens = batch * seq_len
    out = {k: 0.0 for k in TERMS}
    blk = block_features(cfg, tokens, seq_len)
    for k, v in blk.items():
        out[k] += cfg.n_layers * v
    for k, v in head_features(cfg, tokens, seq_len).items():
        out[k] += v
    out["params"] = float(param_count(cfg).total)
    out["steps"] = 1.0
    return out


def fit_nonnegative(rows: list[dict[str, float]], seconds: list[float], terms: tuple[str, ...] = TERMS,
                    scale: list[float] | None = None) -> tuple[np.ndarray, float]:
    """Non-negative coefficients over ``terms`` minimising the squared error of ``rows`` against ``seconds``
    relative to ``scale`` (default: ``seconds`` themselves); returns (coefficients, RMS relative error)."""
    if len(rows) != len(seconds) or not rows:
        raise ValueError("fit_nonnegative needs one measured time per row, and at least one row")
    y = np.asarray(seconds, dtype=float)
    w = np.asarray(scale if scale is not None else seconds, dtype=float)
    if (w <= 0).any():
        raise ValueError("measured times must be positive")
    x = np.array([[r.get(k, 0.0) for k in terms] for r in rows], dtype=float) / w[:, None]  # relative error
    ones = y / w
    best, best_err = np.zeros(len(terms)), float("inf")
    for size in range(1, len(terms) + 1):
        for subset in itertools.combinations(range(len(terms)), size):
            cols = x[:, subset]
            if not cols.any(axis=0).all():
                continue
            coef, *_ = np.linalg.lstsq(cols, ones, rcond=None)
            if (coef <= 0).any():
                continue
            err = float(np.sqrt(np.mean((cols @ coef - ones) ** 2)))
            if err < best_err - 1e-12:
                best_err = err
                best = np.zeros(len(terms))
                best[list(subset)] = coef
    return best, best_err


def fit_step_costs(rows: list[dict[str, float]], seconds: list[float], flop_rate: float) -> tuple[StepCosts, float]:
    """The step costs of measured steps given the matmul rate measured on its own (``flop_rate`` FLOP/s): the
    other terms are fitted to what the matmuls leave; returns (costs, RMS relative error of the whole step)."""
    rest = TERMS[1:]
    left = [s - r.get("flops", 0.0) / flop_rate for r, s in zip(rows, seconds, strict=True)]
    coef, _ = fit_nonnegative(rows, left, rest, scale=seconds)
    costs = StepCosts(flop_rate, *[float(c) for c in coef])
    err = float(np.sqrt(np.mean([(costs.seconds(r) / s - 1.0) ** 2 for r, s in zip(rows, seconds, strict=True)])))
    return costs, err


def fit_latency_bandwidth(samples: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """(latency s, bandwidth B/s, RMS relative error) of collectives from (latency steps, wire bytes, seconds)
    samples: seconds = steps x latency + bytes / bandwidth (``network.collective_time``'s form), non-negative."""
    rows = [{"latency": steps, "bytes": wire} for steps, wire, _ in samples]
    coef, err = fit_nonnegative(rows, [s for *_, s in samples], ("latency", "bytes"))
    return float(coef[0]), (1.0 / coef[1] if coef[1] > 0 else float("inf")), err


def fit_collective_ops(samples: list[tuple[str, float, float, float]]) -> dict[str, tuple[float, float, float]]:
    """Each op's own (latency s per step, bandwidth B/s, RMS relative error) from (op, latency steps, wire bytes,
    seconds) samples, fitted like ``fit_latency_bandwidth`` but op by op: gloo's ops differ by more than one
    latency and one bandwidth describe (on this machine all-reduce, all-gather and send differ ~2x per byte)."""
    out = {}
    for op in sorted({s[0] for s in samples}):
        out[op] = fit_latency_bandwidth([(steps, wire, sec) for o, steps, wire, sec in samples if o == op])
    return out


def fit_axis_work(points: list[tuple[list[float], float]], allowed: tuple[int, ...] | None = None,
                  noise: list[float] | None = None) -> list[float]:
    """Non-negative coefficients of one axis's runtime work from (features, seconds) measurements
    (``calibrate.measure_axis_work``: features = ``steptime.axis_features`` x microbatches, seconds per step): of
    every subset of the ``allowed`` terms (default all), the non-negative least-squares fit with the least squared
    error, each point's residual divided by its ``noise`` scale; the others 0; all 0 when nothing positive fits.

    ``noise``: what each point's figure is measured against, the axis run's step seconds (the figure is a difference
    of two such steps, so its noise is a share of them). Without it, each residual is relative to the figure itself
    and only positive figures count: a figure near zero, a difference lost in the steps' noise, then outweighs every
    other point (one such point of four once set the ring's per-score work to 0 and predicted cp2 30% fast)."""
    if noise is None:
        usable = [(x, y, y) for x, y in points if y > 0]
    else:
        usable = [(x, y, scale) for (x, y), scale in zip(points, noise, strict=True)]
    k = len(points[0][0]) if points else 0
    terms = tuple(range(k)) if allowed is None else allowed
    b = np.array([y / scale for _, y, scale in usable])
    best, best_err = [0.0] * k, float((b ** 2).sum())  # all 0
    if not usable:
        return best
    for n in range(1, len(terms) + 1):
        for cols in itertools.combinations(terms, n):
            a = np.array([[x[c] / scale for c in cols] for x, _, scale in usable])
            sol, *_ = np.linalg.lstsq(a, b, rcond=None)
            if (sol < 0).any():
                continue
            err = float(((a @ sol - b) ** 2).sum())
            if err < best_err - 1e-12 * max(best_err, 1e-30):
                best, best_err = [0.0] * k, err
                for c, v in zip(cols, sol, strict=True):
                    best[c] = float(v)
    return best


def fit_gpu_kernels(cfg: ModelConfig, seq_len: int, runs: list[tuple[int, dict[str, float]]], peak: float,
                    hbm_bw: float, efficiency: float = 0.75) -> dict[str, float]:
    """``hardware.GPU_KERNELS`` from profiled one-device steps of ``cfg`` at ``seq_len``: each run is (sequences
    per step, ms per step by kernel kind as ``train/profiling.kind_of`` names them). Attention's time beyond its
    FLOPs at ``efficiency`` x ``peak`` per causal score, in FLOPs at ``peak``; the element-wise kinds ("compiled",
    "other") split by least squares into bytes at ``hbm_bw`` per kept activation element and per parameter (two
    runs of different batch or more); the optimizer kind in bytes per parameter."""
    n_params = float(param_count(cfg).total)
    rows, elementwise, scores, excess, optim = [], [], [], [], []
    for batch, kinds in runs:
        tokens = batch * seq_len
        blk, head = block_features(cfg, tokens, seq_len), head_features(cfg, tokens, seq_len)
        attn_flops = 3.0 * tokens * attention_flops_per_token(cfg, seq_len)
        scores.append(cfg.n_layers * blk["scores"])
        excess.append(kinds.get("attention", 0.0) * 1e-3 - attn_flops / (peak * efficiency))
        rows.append({"elems": cfg.n_layers * blk["elems"] + head["elems"], "params": n_params})
        elementwise.append((kinds.get("compiled", 0.0) + kinds.get("other", 0.0)) * 1e-3)
        optim.append(kinds.get("optimizer", 0.0) * 1e-3)
    if len({r["elems"] for r in rows}) < 2:
        raise ValueError("fit_gpu_kernels needs runs of at least two batch sizes (elements and parameters apart)")
    (per_elem, per_param), _ = fit_nonnegative(rows, elementwise, ("elems", "params"))
    per_score = float(np.dot(excess, scores) / np.dot(scores, scores))
    return {"elem_bytes": per_elem * hbm_bw, "score_flops": per_score * peak, "cast_bytes": per_param * hbm_bw,
            "optim_bytes": float(np.mean(optim)) / n_params * hbm_bw}
