"""Bytes each device holds: parameters, gradients and optimizer state by ZeRO stage, and activations."""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.config import ModelConfig
from meshtrain.plan.units import expert_numel, padded_numel, unit_numels


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of state, so one memory/byte model covers several recipes.

    ``optim`` counts every optimizer byte per parameter (AdamW: two fp32 moments = 8; with 16-bit
    parameters an fp32 master copy joins them: K = 12 in the ZeRO paper). ``act`` is the compute dtype: of
    what is saved for backward, of the residual stream (what pipeline stages send) and of what TP/SP/CP/EP
    move; ``gather`` what ZeRO-3 all-gathers (the compute dtype); ``reduce`` what the gradient
    collectives of the DP family send (``parallel.reduce_dtype``); ZeRO-1/2 all-gather updated parameters in
    ``param``.
    """

    param: int = 4
    grad: int = 4
    optim: int = 8
    act: int = 2
    gather: int = 2
    reduce: int = 4


# meshtrain itself: fp32 parameters, gradients and AdamW moments, bf16 autocast with a bf16 residual stream
# (model/layers.py; docs/ARCHITECTURE.md).
MESHTRAIN_BF16 = Precision(param=4, grad=4, optim=8, act=2, gather=2, reduce=4)


# The ZeRO paper's / Megatron's mixed precision: 16-bit params and grads, fp32 master + Adam (K = 12).
MIXED_16BIT = Precision(param=2, grad=2, optim=12, act=2, gather=2, reduce=2)


PRECISIONS = {"meshtrain": MESHTRAIN_BF16, "mixed": MIXED_16BIT}
# train.dtype, parallel.reduce_dtype. A run resolves train.dtype=auto before its config.yaml is written
# (train/trainer.py resolve_dtype); a config planned as written prices auto as bf16, which every accelerator preset
# computes natively (``meshtrain demo`` resolves it for the CPU it calibrates first).
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "auto": 2}


# The training loss works through the logits in chunks of rows this large in fp32 (parallel/cross_entropy.py).
LOSS_CHUNK_BYTES = 64 * 2**20


def logits_bytes(tokens: float, vocab_local: int, act_bytes: float) -> float:
    """Peak bytes of the loss on the last stage: the [tokens, vocab_local] logits (in the activation dtype, kept
    for backward) and their gradient, plus two chunks' fp32 temporaries (``parallel/cross_entropy.py``; inductor's
    compiled loss holds the same or less). ``F.cross_entropy`` would hold ~12 bytes per logit more."""
    return tokens * vocab_local * 2 * act_bytes + 2 * LOSS_CHUNK_BYTES


def run_precision(dtype: str = "bf16", reduce_dtype: str = "fp32") -> Precision:
    """meshtrain's precision for a run's ``train.dtype`` (what activations, the residual stream, TP/CP/EP and
    pipeline traffic and ZeRO-3's gathers use) and ``parallel.reduce_dtype`` (what the DP family's gradient
    collectives send); parameters, gradients and AdamW moments stay fp32."""
    b = DTYPE_BYTES[dtype]
    return Precision(param=4, grad=4, optim=8, act=b, gather=b, reduce=DTYPE_BYTES[reduce_dtype])


def state_bytes(n_params: float, zero: int, n_shard: int, param_bytes: float = 4, grad_bytes: float = 4,
                optim_bytes: float = 8) -> dict[str, float]:
    """Per-device parameters, gradients and optimizer state for ZeRO stage ``zero`` over ``n_shard`` ranks
    (the ZeRO paper, Rajbhandari et al. 2020, Figure 1): stage 1 shards the optimizer state, stage 2 also
    the gradients, stage 3 also the parameters. The paper's example, 7.5B parameters on 64 ranks with
    2 + 2 + K=12 bytes: 120 / 31.4 / 16.6 / 1.9 GB. ``dp_state_bytes`` is the same with the runtime's
    padding and 4 + 4 + 8 bytes."""
    n = max(1, n_shard) if zero > 0 else 1
    return {"params": param_bytes * n_params / (n if zero >= 3 else 1),
            "grads": grad_bytes * n_params / (n if zero >= 2 else 1),
            "optim": optim_bytes * n_params / (n if zero >= 1 else 1)}


def dp_state_bytes(cfg: ModelConfig, zero: int, dp: int, dp_shard: int = 0, optim_bytes_per_param: int = 8,
                   units: list[int] | None = None) -> dict[str, float]:
    """Per-rank bytes of fp32 parameters, fp32 gradients and optimizer state (AdamW: two fp32
    moments, K = 8 bytes per parameter) for each ZeRO stage: the ZeRO paper's 2+2+K, 2+2+K/N,
    2+(2+K)/N and (4+K)/N with our dtypes (4-byte parameters and gradients, no separate master).
    ``units``: the rank's own units (tensor-parallel shards, pipeline stages), as in dp_comm_bytes."""
    units = unit_numels(cfg) if units is None else units
    psi = sum(units)
    n = (dp_shard or dp) if zero > 0 else 1
    padded = sum(padded_numel(u, n) for u in units) if zero > 0 else psi
    return {
        "params": 4.0 * (padded / n if zero == 3 else padded),
        "grads": 4.0 * (padded / n if zero >= 2 else padded),
        "optim": optim_bytes_per_param * (padded / n if zero >= 1 else psi),
    }


def activation_elems_per_token(cfg: ModelConfig, recompute: str = "none", tp: int = 1, sp: bool = False,
                               sp_regather: bool = True, masked: bool = False) -> float:
    """Elements one block keeps for backward per token on one rank (activation memory = this x tokens x
    layers x bytes). Counted from meshtrain's block (RMSNorm, fused QKV, SDPA, wo, SwiGLU) with
    D = d_model, F = MLP hidden, H = n_heads, Q = H x head_dim (D unless ``model.head_size`` sets the heads' width
    apart), kv = max(n_kv_heads, tp) x head_dim (a rank holds whole kv heads); below, the attention's D is Q:

    - ``none`` (exact for fp32, ``tests/test_tensor_parallel.py`` measures it): each RMSNorm keeps its input
      and one rsqrt per token (D + 1, twice; model/layers._RMSNormFn); each column-parallel layer (fused QKV,
      fused gate/up) its input, D. With SP the norms' tensors are sequence-sharded (1/tp), and so are the
      column inputs with ``sp_regather`` (backward gathers them again, parallel.sp_regather); without it they
      are the gathered whole sequence. Split tp ways: attention's inputs (the QKV output, which the value view
      keeps alive, D + 2kv, and rotated q and k, D + kv; GQA included: SDPA's ``enable_gqa`` repeats no k or v), its
      output D and log-sum-exp H (wo's input is a view of that output: SDPA's flash kernels lay it out
      [B, T, heads, head_dim], so the transpose back needs no copy), and gate/up 2F, SiLU F, their product F.
      With ``model.qk_norm`` the q and k norms keep their inputs, views of the QKV output, and one rsqrt per head.
      ``masked`` (on whole sequences, ``train.attention_mask=document`` or a ``model.sliding_window`` shorter than
      them: ``masked_attention``): SDPA takes a mask, and with GQA the
      core repeats k and v to the query heads for it (SDPA's mask kernels have no GQA of their own). SDPA then
      keeps the rotated q and those copies, 3Q, and neither the rotated k nor the QKV output (v is no longer a view
      of it) unless the q/k norms keep it. The mask is kept once per forward, not per block
      (``mask_elems``).
    - ``selective`` (meshtrain's policy: keep matmul and attention outputs, recompute norms, RoPE, SiLU and
      products): block input D, QKV D + 2kv, attention output D, wo and w2 outputs (whole partial sums, 2D),
      gate/up 2F. The column inputs are recomputed, so ``sp_regather`` does not change it.
    - ``full``: only the block input D.
    Flash attention keeps no T x T scores, so there is no quadratic term. Under bf16 autocast this is an
    estimate: the norms' rsqrt and RoPE compute in fp32, and the matmuls keep compute-dtype copies of their inputs.
    """
    d, f, q = cfg.d_model, cfg.hidden_dim, cfg.n_heads * cfg.head_dim
    kv = max(cfg.kv_heads, tp) * cfg.head_dim  # kv/tp per rank: whole heads (tp > kv heads: one, replicated)
    seq = tp if sp else 1  # what sequence parallelism divides
    if recompute == "full":
        return d / seq
    if recompute == "selective":
        return d / seq + 2 * d + (q + 2 * kv + q + 2 * f) / tp
    if recompute == "none":
        column = d / seq if sp and sp_regather else d
        # the QKV output (v, a view of it, keeps it alive) and the rotated q and k: SDPA's own GQA repeats no k, v
        attn_in = (q + 2 * kv) + (q + kv)
        if masked and q != kv:  # the masked kernel's k and v repeated to the query heads, and the rotated q
            attn_in = 3 * q + (q + 2 * kv if cfg.qk_norm else 0)
        if cfg.qk_norm:  # q and k heads' norms: their inputs are views of the QKV output; one rsqrt per head
            attn_in += (q + kv) / cfg.head_dim
        return 2 * (d + 1) / seq + 2 * column + (attn_in + q + cfg.n_heads + 4 * f) / tp
    raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")


def masked_attention(cfg: ModelConfig, seq_len: int, documents: bool, cp: int = 1, cp_attention: str = "ring"
                     ) -> bool:
    """Whether attention takes a mask kept for backward: documents (``train.attention_mask=document``) or a sliding
    window shorter than the ``seq_len``-token sequences, on whole sequences: one device, or Ulysses' cores, which
    attend over every position of their heads (ring and all-gather context parallelism, ``cp`` > 1, rebuild their
    blocks' masks from the ids and keep none)."""
    whole = cp == 1 or cp_attention == "ulysses"
    return whole and (documents or 0 < cfg.sliding_window < seq_len)


def mask_elems(tokens: float, seq_len: int, masked: bool) -> float:
    """Elements of the additive mask one forward keeps (``masked_attention``: [rows, 1, T, T] in the compute dtype,
    built once and shared by every block: ``layers.Documents``), i.e. T per token; 0 without one."""
    return tokens * seq_len if masked else 0.0


def autocast_copy_numel(cfg: ModelConfig, layers: int, tp: int = 1, ep: int = 1, last: bool = True) -> int:
    """Parameters whose bf16 cast autocast keeps through a step on a rank holding ``layers`` blocks and (``last``)
    the head, when the parameters are fp32 and ZeRO-3 does not gather them in bf16: one copy of each, shared by the
    step's microbatches (``ForwardLoss.one_cast_per_step``, parallel/microsteps.py). Every linear's weight and bias
    at tp = 1; under tensor parallelism the column-parallel layers (QKV, gate/up, the head) cast inside their own
    autograd function and keep nothing (parallel/tensor.py), leaving wo, the down projection and the MoE's router
    and experts (kept whole on each tp rank; E/ep of them under expert parallelism)."""
    d, hd = cfg.d_model, cfg.head_dim
    q, kv = cfg.n_heads * hd, cfg.kv_heads * hd
    if tp == 1:
        attn = d * (q + 2 * kv) + (q + 2 * kv if cfg.qkv_bias else 0) + q * d
        dense, head = 3 * d * cfg.hidden_dim, cfg.vocab_size * d
    else:
        attn, dense, head = q // tp * d, cfg.hidden_dim // tp * d, 0
    if cfg.moe_experts:
        mlp = cfg.moe_experts * d + (cfg.moe_experts // ep + cfg.moe_shared_experts) * expert_numel(cfg)
    else:
        mlp = dense
    return layers * (attn + mlp) + (head if last else 0)


def tp_forward_saved_bytes(cfg: ModelConfig, tokens: int, tp: int, sp: bool = False, sp_regather: bool = True,
                           act_bytes: int = 4, masked: bool = False, seq_len: int = 0) -> float:
    """Bytes one tensor-parallel rank (tp > 1) keeps for backward after one forward of the whole model
    (embedding, blocks, final norm, head; not the loss) over ``tokens`` tokens, without recompute: the
    blocks per ``activation_elems_per_token``; the vocabulary-parallel embedding's local ids (int64) and
    its mask of the ids this rank holds (one element per token); the final norm (D + 1, sequence-sharded
    with SP) and the head's input (as a column-parallel layer's); with ``masked``, the mask of ``seq_len``-token
    sequences (``mask_elems``). Exact for fp32, which the tests measure. No weights: the fused QKV and gate/up
    matmuls keep their parts, not the concatenation or its cast (parallel/tensor.py); under autocast with fp32
    parameters the row-parallel linears keep one cast weight a step, which this does not count."""
    d = cfg.d_model
    seq = tp if sp else 1
    blocks = activation_elems_per_token(cfg, "none", tp, sp, sp_regather, masked) * tokens * cfg.n_layers
    column = d / seq if sp and sp_regather else d
    outside = (1 + (d + 1) / seq + column) * tokens + mask_elems(tokens, seq_len, masked)
    return 8 * tokens + act_bytes * (blocks + outside)


def activation_bytes(cfg: ModelConfig, tokens: int, layers: int, recompute: str = "none", tp: int = 1,
                     sp: bool = False, act_bytes: int = 2, inflight: int = 1, sp_regather: bool = True,
                     masked: bool = False, seq_len: int = 0) -> float:
    """Activation bytes one rank holds: ``inflight`` microbatches (the simulator's peak_inflight under a
    pipeline schedule; 1 without one) of ``tokens`` tokens each (already 1/cp of the sequence under context
    parallelism) through ``layers`` blocks, per ``activation_elems_per_token``; full recompute adds the one
    block rebuilt during backward; ``masked`` (``masked_attention`` of ``seq_len``-token sequences) adds each
    microbatch's mask."""
    per_token = activation_elems_per_token(cfg, recompute, tp, sp, sp_regather, masked) * layers \
        + mask_elems(1, seq_len, masked)
    out = per_token * tokens * inflight * act_bytes
    if recompute == "full":
        out += activation_elems_per_token(cfg, "none", tp, sp, sp_regather, masked) * tokens * act_bytes
    return out
