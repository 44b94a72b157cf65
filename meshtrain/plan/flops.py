"""FLOPs and parameters: the one FLOP/parameter model the trainer's MFU, the planner and the tests all read.

Notation follows the scaling book (seed 000): D = d_model, F = MLP hidden, L = layers,
V = vocabulary, T = sequence length. Training FLOPs per token are 6 x (matmul parameters)
plus the attention score/value term, 6 x 2 x L x T x D for causal attention (half of the
full T x T square, forward 2 matmuls x 2 FLOPs, backward twice forward).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshtrain.config import ModelConfig


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts by part; ``total`` counts a tied embedding once.

    With a mixture of experts ``mlp`` counts the router and every expert (memory) and ``mlp_active`` the
    router and the experts one token runs through, top_k routed + the shared ones (FLOPs); for a dense
    model the two are equal.
    """

    embedding: int
    attention: int  # per model, all layers
    mlp: int
    norms: int
    head: int
    mlp_active: int = -1  # -1: the same as mlp (dense)
    biases: int = 0  # model.qkv_bias: added per token, in no matmul

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.mlp + self.norms + self.head + self.biases

    @property
    def active_mlp(self) -> int:
        return self.mlp if self.mlp_active < 0 else self.mlp_active

    @property
    def matmul(self) -> int:
        """Parameters that take part in a matmul for every token (the head, not the embedding lookup)."""
        return self.attention + self.active_mlp + self.head


def param_count(cfg: ModelConfig) -> ParamCount:
    """Exact parameter counts of ``meshtrain.model.Llama`` for this config (MoE blocks included)."""
    d, hd, layers = cfg.d_model, cfg.head_dim, cfg.n_layers
    attn = d * cfg.n_heads * hd * 2 + d * cfg.kv_heads * hd * 2  # wq, wo; wk, wv
    mlp = active = 3 * d * cfg.hidden_dim
    if cfg.moe_experts:  # router d x E, then SwiGLU experts: routed ones and the shared ones
        expert = 3 * d * cfg.expert_hidden
        mlp = d * cfg.moe_experts + (cfg.moe_experts + cfg.moe_shared_experts) * expert
        active = d * cfg.moe_experts + (cfg.moe_top_k + cfg.moe_shared_experts) * expert
    embedding = cfg.vocab_size * d
    head = cfg.vocab_size * d
    return ParamCount(
        embedding=embedding,
        attention=layers * attn,
        mlp=layers * mlp,
        norms=(2 * layers + 1) * d + (2 * layers * hd if cfg.qk_norm else 0),
        head=0 if cfg.tie_embeddings else head,
        mlp_active=layers * active,
        biases=layers * (cfg.n_heads + 2 * cfg.kv_heads) * hd if cfg.qkv_bias else 0,
    )


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters used in a matmul per token (MoE: the active ones); with tied embeddings the head still
    multiplies."""
    pc = param_count(cfg)
    return pc.attention + pc.active_mlp + cfg.vocab_size * cfg.d_model


def keys_per_query(seq_len: int, causal: bool = True, window: int = 0) -> float:
    """Keys a query attends to, on average over a ``seq_len``-token sequence: T for full attention, T/2 causal (the
    book's, as a continuous average), and with a sliding ``window`` w < T (each token sees itself and the w - 1
    before it) w - w^2 / (2T): the first w queries see their prefix, the rest w keys each."""
    if not causal:
        return float(seq_len)
    if 0 < window < seq_len:
        return window - window * window / (2.0 * seq_len)
    return seq_len / 2.0


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True, window: int = 0) -> float:
    """Forward FLOPs of QK^T and AV per token: 2 matmuls x 2 FLOPs x (n_heads x head_dim) per layer for each key a
    query attends to (``keys_per_query``)."""
    return 4.0 * keys_per_query(seq_len, causal, window) * cfg.n_heads * cfg.head_dim * cfg.n_layers


def flops_per_token(cfg: ModelConfig, seq_len: int, training: bool = True, causal: bool = True) -> float:
    """Model FLOPs per token: forward 2N + attention; training x3 (backward is twice forward).

    Recomputation is not counted: MFU measures useful model FLOPs, not hardware FLOPs. A ``model.sliding_window``
    shorter than the sequence counts the keys in the window only: the scores outside it are no model work, whatever
    a kernel computes and masks. ``causal=False`` counts the whole T x T square, as torchtitan and the PaLM formula
    do: only for comparing with their MFU. The planner's step-time model prices what the kernels run
    (``layer_flops``: causal attention, window or not).
    """
    fwd = 2.0 * matmul_params(cfg) + attention_flops_per_token(cfg, seq_len, causal, cfg.sliding_window)
    return 3.0 * fwd if training else fwd


def mfu(tokens_per_s: float, cfg: ModelConfig, seq_len: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' peak."""
    if peak_flops <= 0:
        return 0.0
    return tokens_per_s * flops_per_token(cfg, seq_len) / peak_flops


def stage_part_flops(cfg: ModelConfig, seq_len: int) -> tuple[float, float, float]:
    """Forward FLOPs per token of (the embedding, one block, the final norm + head + loss).

    The embedding is a lookup (no matmul); the head is a d x V matmul plus a softmax over V.
    """
    pc = param_count(cfg)
    block = 2.0 * (pc.attention + pc.active_mlp) / cfg.n_layers + attention_flops_per_token(cfg, seq_len) \
        / cfg.n_layers
    head = 2.0 * cfg.vocab_size * cfg.d_model + 5.0 * cfg.vocab_size
    return 0.0, block, head


def layer_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one block (matmuls + causal attention), from ``stage_part_flops``."""
    return stage_part_flops(cfg, seq_len)[1]


def moe_param_count(cfg: ModelConfig, n_experts: int, top_k: int, n_shared: int = 0, expert_hidden: int = 0,
                    moe_every: int = 1) -> tuple[int, int]:
    """(total, active) parameters when every ``moe_every``-th block's gated MLP becomes ``n_experts``
    routed experts (each of hidden size ``expert_hidden``, default the dense hidden) plus ``n_shared``
    always-on experts and a d x E router. Active counts the experts a token runs through (top_k + shared).

    The counts are passed explicitly (the planner explores them); ``cfg``'s own MoE fields are ignored. With
    ``n_experts=1, top_k=1`` this is the dense ``param_count(cfg).total`` plus the router; with the config's
    own fields it equals ``param_count`` of the MoE config (``tests/test_moe.py``) when ``moe_every=1``.
    """
    if n_experts < 1 or not 1 <= top_k <= n_experts:
        raise ValueError(f"need n_experts >= 1 and 1 <= top_k <= n_experts, got {n_experts}, {top_k}")
    fe = expert_hidden or cfg.hidden_dim
    cfg = dataclasses.replace(cfg, moe_experts=0)
    pc = param_count(cfg)
    expert = 3 * cfg.d_model * fe
    dense_mlp = pc.mlp // cfg.n_layers
    moe_layers = cfg.n_layers // moe_every
    router = cfg.d_model * n_experts
    base = pc.total - moe_layers * dense_mlp
    total = base + moe_layers * (router + (n_experts + n_shared) * expert)
    active = base + moe_layers * (router + (top_k + n_shared) * expert)
    return total, active


def step_mfu(model_flops_per_step: float, n_devices: int, peak_flops: float, step_s: float) -> float:
    """MFU of a predicted step: model FLOPs (no recomputation) over the devices' peak for ``step_s`` seconds."""
    return model_flops_per_step / (n_devices * peak_flops * step_s) if step_s > 0 else 0.0


def days_for_tokens(token_budget: float, tokens_per_step: float, step_s: float) -> float:
    """Days to train ``token_budget`` tokens at ``tokens_per_step`` per ``step_s`` seconds."""
    return token_budget / tokens_per_step * step_s / 86400.0
