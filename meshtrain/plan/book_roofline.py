"""The HBM-bandwidth roofline: where a matmul or a decode step is bound by memory, not by the network.

A bf16 matmul In[B, D] x W[D, F] does 2BDF FLOPs and reads 2DF weight bytes (plus 2BD + 2BF of activations,
small while B << D, F), so its arithmetic intensity is about B and it is compute-bound when the tokens per
chip exceed C / W_hbm (the book's Part 1 and 7; seed 000 quotes it as "> 240 tokens" on TPU v5e: 1.97e14 /
8.2e11). Weights of w bytes halve it for int8 (120). A decode step reads every parameter once for the whole
batch, so generation has the same critical batch, plus the KV cache it reads per sequence.
"""

from __future__ import annotations


def hbm_critical_batch(flops: float, hbm_bw: float, weight_bytes: float = 2.0) -> float:
    """Tokens per chip above which a matmul with ``weight_bytes``-byte weights is compute-bound: its
    intensity is 2B / weight_bytes, so B > weight_bytes x C / (2 W_hbm) (bf16: C / W_hbm, TPU v5e 240;
    int8 weights 120)."""
    return weight_bytes * flops / (2.0 * hbm_bw)


def matmul_roofline(batch: float, d_in: int, d_out: int, flops: float, hbm_bw: float, bytes_per: float = 2.0
                    ) -> dict[str, float | str]:
    """One matmul [B, d_in] x [d_in, d_out] on one chip: FLOP time, HBM time (inputs, weights and output
    read or written once), its arithmetic intensity and which bound wins."""
    t_math = 2.0 * batch * d_in * d_out / flops
    moved = bytes_per * (batch * d_in + d_in * d_out + batch * d_out)
    t_hbm = moved / hbm_bw
    return {"flops_s": t_math, "hbm_s": t_hbm, "intensity": 2.0 * batch * d_in * d_out / moved,
            "bound": "compute" if t_math >= t_hbm else "memory", "seconds": max(t_math, t_hbm)}


def decode_roofline(n_params: float, batch: int, kv_bytes_per_seq: float, flops: float, hbm_bw: float,
                    weight_bytes: float = 2.0) -> dict[str, float | str]:
    """One generation step of ``batch`` sequences: 2 P B FLOPs against reading the weights once and every
    sequence's KV cache (``kv_bytes_per_seq``); memory-bound below the HBM critical batch even without
    a cache, and always once the cache outweighs the weights."""
    t_math = 2.0 * n_params * batch / flops
    t_hbm = (weight_bytes * n_params + batch * kv_bytes_per_seq) / hbm_bw
    return {"flops_s": t_math, "hbm_s": t_hbm, "bound": "compute" if t_math >= t_hbm else "memory",
            "seconds": max(t_math, t_hbm), "tokens_per_s": batch / max(t_math, t_hbm)}
