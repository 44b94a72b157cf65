"""The one FLOP/parameter model: the trainer's MFU, the planner and the tests all read it.

Notation follows the scaling book (seed 000): D = d_model, F = MLP hidden, L = layers,
V = vocabulary, T = sequence length. Training FLOPs per token are 6 x (matmul parameters)
plus the attention score/value term, 6 x 2 x L x T x D for causal attention (half of the
full T x T square, forward 2 matmuls x 2 FLOPs, backward twice forward).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.config import ModelConfig


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts by part; ``total`` counts a tied embedding once."""

    embedding: int
    attention: int  # per model, all layers
    mlp: int
    norms: int
    head: int

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.mlp + self.norms + self.head

    @property
    def matmul(self) -> int:
        """Parameters that take part in a matmul for every token (the head, not the embedding lookup)."""
        return self.attention + self.mlp + self.head


def param_count(cfg: ModelConfig) -> ParamCount:
    """Exact parameter counts of ``meshtrain.model.Llama`` for this config."""
    d, hd, layers = cfg.d_model, cfg.head_dim, cfg.n_layers
    attn = d * cfg.n_heads * hd * 2 + d * cfg.kv_heads * hd * 2  # wq, wo; wk, wv
    mlp = 3 * d * cfg.hidden_dim
    embedding = cfg.vocab_size * d
    head = cfg.vocab_size * d
    return ParamCount(
        embedding=embedding,
        attention=layers * attn,
        mlp=layers * mlp,
        norms=(2 * layers + 1) * d,
        head=0 if cfg.tie_embeddings else head,
    )


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters used in a matmul per token; with tied embeddings the head still multiplies."""
    pc = param_count(cfg)
    return pc.attention + pc.mlp + cfg.vocab_size * cfg.d_model


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Forward FLOPs of QK^T and AV per token: 2 matmuls x 2 FLOPs x T x (n_heads x head_dim) per layer."""
    full = 4.0 * seq_len * cfg.n_heads * cfg.head_dim * cfg.n_layers
    return full / 2 if causal else full


def flops_per_token(cfg: ModelConfig, seq_len: int, training: bool = True) -> float:
    """Model FLOPs per token: forward 2N + attention; training x3 (backward is twice forward).

    Recomputation is not counted: MFU measures useful model FLOPs, not hardware FLOPs.
    """
    fwd = 2.0 * matmul_params(cfg) + attention_flops_per_token(cfg, seq_len)
    return 3.0 * fwd if training else fwd


def mfu(tokens_per_s: float, cfg: ModelConfig, seq_len: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' peak."""
    if peak_flops <= 0:
        return 0.0
    return tokens_per_s * flops_per_token(cfg, seq_len) / peak_flops
