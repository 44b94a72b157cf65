"""Memory analyses of the book: activation checkpoints in its c x [B, D] form, the fewest devices that hold a
training run under each strategy, and the largest model a slice holds.

State follows the book's convention (seed 000, pure-DP section): bf16 parameters and two fp32 Adam moments,
2 + 8 = 10 bytes per parameter (gradients, like the book, not counted; pass ``bytes_per_param`` for another
recipe, e.g. 16 for meshtrain's fp32 parameters, gradients and moments). Checkpoints are bf16, c tensors of
[B, D] per layer, c by policy:

- ``none`` (no rematerialisation): about 20 (the book's Part 4, 'Gradient checkpointing': 4M tokens, L = 64,
  D = 8192 save 2 x 20 x B D L = 84 TB);
- ``big-matmuls`` (save the outputs of the seven big matmuls): about 7 (same section);
- ``ffw`` (seed 000, Question 2: after the three big FFW matmuls): 1 + 2F/D (LLaMA-2 13B at 16M tokens: 42 TB);
- ``block`` (only each layer's input): 1 (4.2 TB in the Part 4 example), at 8ND instead of 6ND FLOPs.
"""

from __future__ import annotations

import math

BOOK_BYTES_PER_PARAM = 10.0  # bf16 parameters + fp32 Adam m and v (seed 000)
REMAT_POLICIES = ("none", "big-matmuls", "ffw", "block")
STRATEGIES = ("dp", "fsdp", "tp", "pp", "fsdp+tp")


def checkpoint_factor(policy: str, d_model: int, ffw: int) -> float:
    """c: how many [B, D]-sized tensors one layer keeps for backward under ``policy``."""
    factors = {"none": 20.0, "big-matmuls": 7.0, "ffw": 1.0 + 2.0 * ffw / d_model, "block": 1.0}
    if policy not in factors:
        raise ValueError(f"remat policy must be one of {', '.join(REMAT_POLICIES)}, got {policy!r}")
    return factors[policy]


def checkpoint_bytes(policy: str, batch: float, d_model: int, ffw: int, n_layers: int, bytes_per: int = 2
                     ) -> float:
    """Bytes of activation checkpoints over the whole batch: bytes x c x B x D x L."""
    return bytes_per * checkpoint_factor(policy, d_model, ffw) * batch * d_model * n_layers


def remat_flops_per_token(n_params: float, policy: str) -> float:
    """Training FLOPs per token: 6N, or 8N when block remat repeats the forward (the book's Part 4); the
    other policies recompute only element-wise work, which the book leaves out."""
    return (8.0 if policy == "block" else 6.0) * n_params


def min_devices(n_params: float, act_bytes: float, hbm: float, bytes_per_param: float = BOOK_BYTES_PER_PARAM,
                tp_max: int = 0, n_layers: int = 0) -> dict[str, int | None]:
    """The fewest devices of ``hbm`` bytes each that hold the state (``n_params`` x ``bytes_per_param``) and
    ``act_bytes`` of checkpoints, by strategy (None: the strategy cannot, however many devices):

    - ``dp``: every device holds the whole state; only the activations split, so the state must fit one device.
    - ``fsdp`` / ``fsdp+tp``: everything shards ("no duplication of model parameters", seed 000).
    - ``tp``: shards everything too (In[B, D_Y]), but only up to ``tp_max`` ways (the fast fabric; 0: no cap).
    - ``pp``: shards by layer, at most ``n_layers`` stages (0: no cap).
    ``any`` is the smallest of them: the fewest devices that can train the model at all.
    """
    state = n_params * bytes_per_param
    total = state + act_bytes
    shard = max(1, math.ceil(total / hbm))
    out: dict[str, int | None] = {
        "dp": None if state >= hbm else max(1, math.ceil(act_bytes / (hbm - state))),
        "fsdp": shard,
        "tp": shard if not tp_max or shard <= tp_max else None,
        "pp": shard if not n_layers or shard <= n_layers else None,
        "fsdp+tp": shard,
    }
    out["any"] = min(v for v in out.values() if v is not None)
    return out


def largest_model(hbm: float, devices: int, act_bytes: float = 0.0,
                  bytes_per_param: float = BOOK_BYTES_PER_PARAM) -> dict[str, float]:
    """The most parameters ``devices`` devices of ``hbm`` bytes hold beside ``act_bytes`` of checkpoints (over
    the whole batch, sharded by batch): pure DP keeps the whole state on every device (seed 000: HBM / 10,
    about 9B on a 96 GB v5p chip); FSDP and FSDP + TP shard it over all of them (the two differ in the batch
    they need to stay compute-bound, not in memory)."""
    dp = max(0.0, hbm - act_bytes / devices) / bytes_per_param
    sharded = max(0.0, devices * hbm - act_bytes) / bytes_per_param
    return {"dp": dp, "fsdp": sharded, "fsdp+tp": sharded}
