"""The scaling book's closed-form analyses (seeds 000 and 003), by name.

Notation of "How to Parallelize a Transformer for Training" (seed 000; seed 003 is a later revision):
B tokens in the global batch, N chips, D = d_model, F = MLP hidden, C = FLOP/s per chip,
W = bandwidth per chip of one mesh axis (the book's bidirectional W_ici, e.g. 2 x 9e10 on v5p).
A layer is approximated as two matmuls In[B, D] x Win[D, F] x Wout[F, D] in bf16: 4BDF forward FLOPs.

``explain``'s closing summary and ``--plot`` evaluate some of these for a problem; the rest reproduce the book's
published figures in ``tests/test_planner.py``. The general critical batches (ring factor, MoE, DCN,
pipelining) are in ``book_batch``, memory (checkpoints, fewest devices, largest model) in ``book_memory``, the
HBM roofline in ``book_roofline``; ``queries`` evaluates them all for ``meshtrain plan <query>``.
"""

from __future__ import annotations

import math

MIXED_REVISIONS = ("000", "003")
# Default: seed 003's later revision, where the FSDP (X) and TP (Y) collectives overlap each other. They
# run on different links (different torus axes; NVLink for TP against InfiniBand for FSDP on GPU
# clusters), which is what the planner's own link model assumes too. Seed 000's sum is the stricter bound.
DEFAULT_REVISION = "003"


def book_param_count(n_layers: int, d_model: int, ffw: int, n_heads: int, head_dim: int, vocab: int
                     ) -> dict[str, float]:
    """Seed 000, Question 1: FFW 3LDF (gated: two up-projections and one down), attention 4DNHL
    (Q, K, V, O with K = N heads), vocabulary 2VD (untied embedding and head); norms ignored."""
    parts = {"ffw": 3.0 * n_layers * d_model * ffw, "attention": 4.0 * d_model * n_heads * head_dim * n_layers,
             "vocab": 2.0 * vocab * d_model}
    parts["total"] = sum(parts.values())
    return parts


def training_flops(n_params: float, tokens: float) -> float:
    """6 x parameters x tokens (seed 000: LLaMA-3 70B on 15e12 tokens = 15e12 x 70e9 x 6 = 6.3e24)."""
    return 6.0 * n_params * tokens


def critical_batch_per_device(flops: float, bandwidth: float, n_axes: int = 1) -> float:
    """Seed 000: pure DP and FSDP stay compute-bound while the per-device batch (tokens) exceeds C / W,
    the arithmetic intensity of the network; using ``n_axes`` mesh axes multiplies W. On TPU v5p
    4.59e14 / 1.8e11 = 2550 per chip, and 850 with all three axes."""
    return flops / (bandwidth * n_axes)


def tp_limit(ffw: float, flops: float, bandwidth: float, n_axes: int = 1) -> float:
    """Seed 000: tensor (model) parallelism of degree Y is compute-bound while F > Y x C / W, so the largest
    useful degree is Y = F W / C (F = 50k for Gemma 7B on v5p: about 19-way). Independent of the batch."""
    return ffw * bandwidth * n_axes / flops


def tp_min_ffw(tp: int, flops: float, bandwidth: float, n_axes: int = 1) -> float:
    """The MLP width that ``tp``-way model parallelism needs to stay compute-bound: Y x C / W (8-way on v5p
    needs about 20k, seed 000)."""
    return tp * flops / (bandwidth * n_axes)


def mixed_min_batch_per_device(ffw: float, flops: float, bandwidth: float, revision: str = DEFAULT_REVISION,
                               fsdp_bw: float | None = None, tp_bw: float | None = None) -> float:
    """The per-chip batch (B / N) above which mixed FSDP + TP at the optimal split is compute-bound.

    ``bandwidth`` is W of ONE mesh axis: the book puts FSDP on two axes (W_X = 2W) and TP on one (W_Y = W),
    which is where its factors 2 and 1/2 come from. Pass ``fsdp_bw`` and ``tp_bw`` (each the whole bandwidth
    of that group) for another layout; the general form is k C^2 / (F W_X W_Y), k = 4 summed, 1 overlapped.

    - ``"000"`` (seed 000, the two axes' comm times add up): B / N > 2 (C/W)^2 / F (LLaMA-3 70B, F = 30k:
      2 x 2550^2 / 30000 = 432; LLaMA-2 13B: 940).
    - ``"003"`` (seed 003, the two axes overlap): B / N > (C/W)^2 / (2F), four times lower (LLaMA-2 13B: 235).
    """
    if revision not in MIXED_REVISIONS:
        raise ValueError(f"revision must be one of {MIXED_REVISIONS}, got {revision!r}")
    w_x = 2.0 * bandwidth if fsdp_bw is None else fsdp_bw
    w_y = bandwidth if tp_bw is None else tp_bw
    k = 4.0 if revision == "000" else 1.0
    return k * flops**2 / (ffw * w_x * w_y)


def optimal_fsdp(batch: float, n_chips: float, ffw: float, fsdp_bw: float = 2.0, tp_bw: float = 1.0) -> float:
    """Seed 000/003: the FSDP degree X that minimises mixed FSDP + TP communication, X = sqrt(2 B N / F)
    (FSDP on two mesh axes, TP on one); Y = N / X. In general X = sqrt(B N W_X / (F W_Y)) (only the ratio of
    the two bandwidths matters). Both revisions share it (the sum and the max of a/X and bX are both
    smallest where a/X = bX)."""
    return math.sqrt(batch * n_chips * fsdp_bw / (ffw * tp_bw))


def split_fsdp_tp(batch: float, n_chips: int, ffw: float, max_tp: int | None = None) -> tuple[int, int]:
    """``optimal_fsdp`` rounded to a power-of-two X dividing N (nearest in log scale), Y = N / X, with Y capped
    at ``max_tp``. Seed 003, Question 3: B = 3e6, N = 4096, F = 13824 gives X = 1333, so 1024 x 4."""
    x = optimal_fsdp(batch, n_chips, ffw)
    best = min((d for d in range(1, n_chips + 1) if n_chips % d == 0 and d & (d - 1) == 0),
               key=lambda d: abs(math.log(d / x)))
    y = n_chips // best
    if max_tp is not None and y > max_tp:
        y = max_tp
        best = n_chips // y
    return best, y


def dcn_min_batch_per_pod(flops: float, dcn_bandwidth: float) -> float:
    """Seed 003: pure DP across pods (FSDP inside each) is DCN-bound unless every pod's batch exceeds
    C / W_dcn tokens, W_dcn per chip: 4.46e14 / 6.25e9 = 71,360 on v5p (seed 000 rounds it to ~75,000)."""
    return flops / dcn_bandwidth


def chips_for_batch(batch: float, batch_per_chip: float) -> float:
    """How many chips a batch of ``batch`` tokens keeps compute-bound (seed 000: 16e6 / (2550 / 3) = 18,823)."""
    return batch / batch_per_chip


def days_to_train(total_flops: float, chips: float, flops: float, mfu: float) -> float:
    """Wall-clock days at a given MFU (seed 000: 6.3e24 FLOPs on 18,823 v5p chips at 50% is about 17 days)."""
    return total_flops / (chips * flops * mfu) / 86400.0


def book_step_time(n_params: float, batch: float, chips: float, flops: float, mfu: float) -> float:
    """Roofline seconds per step, 6 N B / (chips C MFU) (seed 003, Question 3: 300 ms)."""
    return 6.0 * n_params * batch / (chips * flops * mfu)


def book_checkpoint_bytes(n_layers: int, batch: float, d_model: int, ffw: int, bytes_per: int = 2) -> float:
    """Seed 000, Question 2: activations checkpointed after the three big matmuls of every layer,
    bytes x L x B x (D + 2F) (LLaMA-2 13B at 16M tokens: about 4.2e13 = 42 TB)."""
    return float(bytes_per) * n_layers * batch * (d_model + 2 * ffw)


def book_layer_comm(strategy: str, batch: float, n_chips: int, d_model: int, ffw: int, flops: float,
                    bw_x: float, bw_y: float | None = None, x: float | None = None) -> dict[str, float]:
    """One layer's forward matmul seconds and the communication seconds of EACH mesh axis on its own, per
    the book's per-strategy algebra (seed 000); the backward pass has the same ratios. ``bw_x`` is the
    bandwidth of the FSDP/DP axes, ``bw_y`` of the TP axis. Keys: ``math``, ``x`` (the FSDP/DP axes: weights
    move) and ``y`` (the TP axis: activations move); an axis the strategy does not use is 0.

    - ``dp`` / ``fsdp``: all-gather (or all-reduce in backward) of Win and Wout: 2 x 2DF bytes / W_x.
    - ``tp`` (all N chips on Y): all-gather + reduce-scatter of In/Out [B, D]: 2 x 2BD bytes / W_y.
    - ``fsdp+tp``: X = ``x`` (default ``optimal_fsdp``) and Y = N / X: 4DF / (Y W_x) and 4BD / (X W_y).
    """
    t_math = 4.0 * batch * d_model * ffw / (n_chips * flops)
    bw_y = bw_x if bw_y is None else bw_y
    if strategy in ("dp", "fsdp"):
        return {"math": t_math, "x": 4.0 * d_model * ffw / bw_x, "y": 0.0}
    if strategy == "tp":
        return {"math": t_math, "x": 0.0, "y": 4.0 * batch * d_model / bw_y}
    if strategy == "fsdp+tp":
        x = optimal_fsdp(batch, n_chips, ffw) if x is None else x
        x = min(max(x, 1.0), float(n_chips))
        y = n_chips / x
        return {"math": t_math, "x": 4.0 * d_model * ffw / (y * bw_x), "y": 4.0 * batch * d_model / (x * bw_y)}
    raise ValueError(f"strategy must be dp, fsdp, tp or fsdp+tp, got {strategy!r}")


def book_layer_times(strategy: str, batch: float, n_chips: int, d_model: int, ffw: int, flops: float,
                     bw_x: float, bw_y: float | None = None, x: float | None = None,
                     revision: str = DEFAULT_REVISION) -> tuple[float, float]:
    """(matmul seconds, communication seconds) of one layer's forward pass: ``book_layer_comm``'s two axes
    summed (revision 000) or overlapped (003: their max); a one-axis strategy has only one."""
    if revision not in MIXED_REVISIONS:
        raise ValueError(f"revision must be one of {MIXED_REVISIONS}, got {revision!r}")
    t = book_layer_comm(strategy, batch, n_chips, d_model, ffw, flops, bw_x, bw_y, x)
    return t["math"], (t["x"] + t["y"] if revision == "000" else max(t["x"], t["y"]))
