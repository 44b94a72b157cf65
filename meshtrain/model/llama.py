"""A Llama-style decoder in plain PyTorch: no distributed code lives here.

Embedding -> n_layers x [RMSNorm -> GQA attention (RoPE, causal SDPA) -> residual,
RMSNorm -> SwiGLU MLP (or a mixture of experts, ``moe.py``) -> residual] -> RMSNorm -> LM head.

Parallelisms are transformations applied to this module from the outside (they swap
Linear/Embedding for sharded twins, drop layers a pipeline stage does not own, ...).
To let them do that, ``forward`` tolerates a missing embedding (the input is then
already hidden states) and a missing head (the output is then hidden states).
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.config import ModelConfig
from meshtrain.model.layers import CausalAttention, FeedForward, RMSNorm, apply_rope, rope_tables
from meshtrain.model.moe import MoEFeedForward

__all__ = ["Attention", "Block", "CausalAttention", "FeedForward", "Llama", "RMSNorm", "apply_rope", "build_model",
           "cross_entropy_sum", "decoder_forward", "init_weights", "rope_tables"]


class Attention(nn.Module):
    """Grouped-query attention: n_heads query heads share n_kv_heads key/value heads."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.d_model, bias=False)
        self.core = CausalAttention()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Head counts come from the weights, so a tensor-parallel shard (fewer heads) runs unchanged.
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = self.core(q, k, v)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """Pre-norm transformer block; the MLP is a mixture of experts when ``cfg.moe_experts > 0``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if cfg.moe_experts:
            self.feed_forward: nn.Module = MoEFeedForward(cfg)
        else:
            self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """The plain single-device model. Layers live in a ModuleDict keyed by their global index,
    so a pipeline stage that keeps a subset still has the same parameter names."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (it is taken from the tokenizer by the trainer).")
        self.cfg = cfg
        self.tok_embeddings: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output: nn.Module | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Sequence parallelism shards the hidden states' sequence between the blocks; RoPE is applied
        # after the gather, so the tables must cover the whole sequence.
        self.seq_shards = 1
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] (or hidden states [B, T, D] when this module has no embedding) -> logits."""
        return decoder_forward(self, tokens, positions)


def decoder_forward(m: nn.Module, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """The decoder's forward over whatever parts ``m`` holds (a ``Llama`` or a pipeline stage of one):
    ``tok_embeddings`` (or None: the input is already hidden states), ``layers``, ``norm`` and ``output`` (or
    None: hidden states out), ``seq_shards`` and the RoPE tables.

    ``positions`` [T] gives each token's position in its sequence; by default 0..T-1 (context parallelism
    instead puts the rows of this rank's positions into the tables, so the default reads them).
    """
    h = m.tok_embeddings(tokens) if m.tok_embeddings is not None else tokens
    t = tokens.shape[1] if tokens.dim() == 2 else h.shape[1] * m.seq_shards
    if positions is None:
        cos, sin = m.rope_cos[:t], m.rope_sin[:t]
    else:
        cos, sin = m.rope_cos[positions], m.rope_sin[positions]
    for layer in m.layers.values():
        h = layer(h, cos, sin)
    if m.norm is not None:
        h = m.norm(h)
    return m.output(h) if m.output is not None else h


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Sum of token losses in fp32; the trainer divides by the token count of the whole global batch,
    so accumulation and data parallelism give exactly the mean over the global batch."""
    return F.cross_entropy(
        logits.float().flatten(0, -2), targets.flatten(), ignore_index=ignore_index, reduction="sum"
    )


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Deterministic init from (seed, parameter name) only, so it does not depend on which
    parameters a rank holds or in which order they are created: any layout gets the same weights.

    Linear and embedding weights ~ N(0, init_std); output projections of each residual branch
    (wo, w2, also every expert's w2) are scaled by 1/sqrt(2 * n_layers) as in GPT-2; norms start at one.
    """
    resid_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:  # tied weights are initialised once
            continue
        seen.add(id(p))
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        std = resid_std if name.endswith(("wo.weight", "w2.weight")) else cfg.init_std
        g = torch.Generator().manual_seed(_param_seed(seed, name))
        p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)


def build_model(cfg: ModelConfig, seed: int, device: torch.device | str = "cpu") -> Llama:
    """The single-device model with its deterministic init, in fp32 on ``device``."""
    model = Llama(cfg)
    init_weights(model, cfg, seed)
    return model.to(device)
