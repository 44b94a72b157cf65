"""The Megatron-LM paper's closed forms (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", Section 5.1 and Appendix), for a GPT model of l layers, hidden size h,
vocabulary V and sequence length s, beside which the planner prints its own counts.

They assume a GPT block (4h MLP without gating, multi-head attention, tied embedding, learned positions), so
for a Llama-style model they differ from ``flops.param_count`` by the gated MLP and grouped kv heads: that
difference is what printing both shows.
"""

from __future__ import annotations

SOURCE = "Megatron-LM (Narayanan et al. 2021)"


def megatron_params(n_layers: int, hidden: int, vocab: int, seq_len: int) -> float:
    """P = 12 l h^2 (1 + 13 / (12 h) + (V + s) / (12 l h)) (Table 1: l = 128, h = 25600 gives 1008.0B)."""
    lh = n_layers * hidden
    return 12.0 * lh * hidden * (1.0 + 13.0 / (12.0 * hidden) + (vocab + seq_len) / (12.0 * lh))


def megatron_flops_per_iteration(batch: int, seq_len: int, n_layers: int, hidden: int, vocab: int,
                                 recompute: bool = True) -> float:
    """Hardware FLOPs of one iteration of ``batch`` sequences. With activation recompute (a second forward)
    F = 96 B s l h^2 (1 + s / (6h) + V / (16 l h)); without, the blocks cost 3/4 of that:
    72 B s l h^2 (1 + s / (6h) + V / (12 l h))."""
    base = batch * seq_len * n_layers * hidden**2
    if recompute:
        return 96.0 * base * (1.0 + seq_len / (6.0 * hidden) + vocab / (16.0 * n_layers * hidden))
    return 72.0 * base * (1.0 + seq_len / (6.0 * hidden) + vocab / (12.0 * n_layers * hidden))


def megatron_training_days(tokens: float, n_params: float, n_gpus: int, flops_per_gpu: float,
                           recompute: bool = True) -> float:
    """End-to-end training time 8 T P / (n X) (6 T P / (n X) without recompute), in days, for T tokens on n
    GPUs each achieving X FLOP/s (GPT-3 175B, 300B tokens, 1024 A100s at 140 TFLOP/s: about 34 days)."""
    per_token = 8.0 if recompute else 6.0
    return per_token * tokens * n_params / (n_gpus * flops_per_gpu) / 86400.0
