"""A Llama-style decoder in plain PyTorch: no distributed code lives here.

Embedding -> n_layers x [RMSNorm -> GQA attention (RoPE, causal SDPA) -> residual,
RMSNorm -> SwiGLU MLP (or a mixture of experts, ``moe.py``) -> residual] -> RMSNorm -> LM head.

Parallelisms are transformations applied to this module from the outside (they swap
Linear/Embedding for sharded twins, drop layers a pipeline stage does not own, ...).
To let them do that, ``forward`` tolerates a missing embedding (the input is then
already hidden states) and a missing head (the output is then hidden states).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.config import ModelConfig
from meshtrain.model.init import init_weights
from meshtrain.model.kv_cache import KVCache, LayerKV
from meshtrain.model.layers import (
    CausalAttention,
    Documents,
    Embedding,
    FeedForward,
    RMSNorm,
    apply_rope,
    compute_dtype,
    rope_tables,
)
from meshtrain.model.moe import MoEFeedForward

__all__ = ["Attention", "Block", "CausalAttention", "FeedForward", "KVCache", "Llama", "RMSNorm", "apply_rope",
           "attend", "build_model", "heads_with_rope",
           "cross_entropy_sum", "decoder_forward", "rope_tables"]


class Attention(nn.Module):
    """Grouped-query attention: n_heads query heads share n_kv_heads key/value heads."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.d_model, self.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.d_model, self.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.d_model, bias=False)
        # model.qk_norm (Qwen3): one RMSNorm scale over head_dim for every q head, one for every k head
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.core = CausalAttention(cfg.sliding_window)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerKV | None = None, docs: Documents | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = heads_with_rope(self.wq(x), self.wk(x), self.wv(x), self.head_dim, cos, sin,
                                  self.q_norm, self.k_norm)
        y = attend(self.core, q, k, v, cache, docs)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


def heads_with_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int, cos: torch.Tensor,
                    sin: torch.Tensor, q_norm: nn.Module | None = None,
                    k_norm: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The projections [B, T, H * D] as the attention core's [B, H, T, D], q and k normalised per head (``q_norm``,
    ``k_norm``: model.qk_norm) and rotated (shared by the plain and the tensor-parallel attention). Head counts come
    from the widths, so a tensor-parallel shard (fewer heads) runs unchanged. RoPE rotates q and k in their own
    [B, T, H, D] order and the core gets [B, H, T, D] views of them, as of v: no copy changes the layout on the way
    in (torchtitan's order too)."""
    b, t = q.shape[:2]
    q, k = q.view(b, t, -1, head_dim), k.view(b, t, -1, head_dim)
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    q = apply_rope(q, cos, sin).transpose(1, 2)
    k = apply_rope(k, cos, sin).transpose(1, 2)
    return q, k, v.view(b, t, -1, head_dim).transpose(1, 2)


def attend(core: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           cache: LayerKV | None, docs: Documents | None = None) -> torch.Tensor:
    """The attention core over this step's keys/values, or, with a cache, over every cached position too
    (shared by the plain and the tensor-parallel attention: the cache holds whatever kv heads the module has).
    ``docs`` (``Documents``): attention kept within documents."""
    if cache is None:
        return core(q, k, v) if docs is None else core(q, k, v, docs=docs)
    if docs is not None:
        raise ValueError("a KV cache decodes one text a row: no document ids.")
    k, v = cache.update(k, v)
    return core(q, k, v, cache.mask)


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerKV | None = None, docs: Documents | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, cache, docs)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """The plain single-device model. Layers live in a ModuleDict keyed by their global index,
    so a pipeline stage that keeps a subset still has the same parameter names."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (it is taken from the tokenizer by the trainer).")
        self.cfg = cfg
        self.tok_embeddings: nn.Module | None = Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output: nn.Module | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Sequence parallelism shards the hidden states' sequence between the blocks; RoPE is applied
        # after the gather, so the tables must cover the whole sequence.
        self.seq_shards = 1
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None, last_only: bool = False,
                docs: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] (or hidden states [B, T, D] when this module has no embedding) -> logits. With ``cache``
        the tokens follow the cached positions (``kv_cache.py``); ``last_only``: the last position's only;
        ``docs``: attention within documents (``decoder_forward``)."""
        return decoder_forward(self, tokens, positions, cache, last_only, docs)


def decoder_forward(m: nn.Module, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                    cache: KVCache | None = None, last_only: bool = False,
                    docs: torch.Tensor | None = None) -> torch.Tensor:
    """The decoder's forward over whatever parts ``m`` holds (a ``Llama`` or a pipeline stage of one):
    ``tok_embeddings`` (or None: the input is already hidden states), ``layers``, ``norm`` and ``output`` (or
    None: hidden states out), ``seq_shards`` and the RoPE tables.

    ``positions`` [T] gives each token's position in its sequence; by default 0..T-1 (context parallelism
    instead puts the rows of this rank's positions into the tables, so the default reads them).

    ``cache`` (a ``KVCache``): the tokens come after the cached positions; each row's positions and the attention
    mask come from the cache, each layer appends its keys and values to it, and it advances by T at the end.
    ``last_only``: the output of the last position only, [B, 1, ...] (a prompt's prefill needs no other logits).

    ``docs`` [B, T] (``document_ids`` of the whole sequence, also under sequence or context parallelism): each
    token attends only to tokens of its own document (``train.attention_mask=document``); the layers get them as
    one ``Documents``. RoPE positions are not reset at a document's start: attention scores depend only on
    relative positions, so within a document they are the same.
    """
    h = tokens
    if m.tok_embeddings is not None:
        h = m.tok_embeddings(tokens)
        if m.cfg.embed_scale:  # Gemma: in the embedding's output dtype, as transformers' GemmaScaledWordEmbedding
            h = h * math.sqrt(m.cfg.d_model)
    t = tokens.shape[1] if tokens.dim() == 2 else h.shape[1] * m.seq_shards
    if cache is not None:
        if positions is not None or m.seq_shards != 1:
            raise ValueError("a KV cache decodes whole sequences from position 0: no positions, no sequence shards.")
        positions = cache.begin(t)
    if positions is None:
        cos, sin = m.rope_cos[:t], m.rope_sin[:t]
    else:
        cos, sin = m.rope_cos[positions], m.rope_sin[positions]
    within = Documents.of(docs, t, compute_dtype(h), m.cfg.sliding_window) if docs is not None else None
    for key, layer in m.layers.items():
        if cache is not None:
            h = layer(h, cos, sin, cache.layer(key))
        else:
            h = layer(h, cos, sin) if docs is None else layer(h, cos, sin, docs=within)
    if cache is not None:
        cache.advance(t)
    if last_only:
        h = h[:, -1:]
    if m.norm is not None:
        h = m.norm(h)
    return m.output(h) if m.output is not None else h


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Sum of token losses in fp32; the trainer divides by the token count of the whole global batch,
    so accumulation and data parallelism give exactly the mean over the global batch."""
    return F.cross_entropy(
        logits.float().flatten(0, -2), targets.flatten(), ignore_index=ignore_index, reduction="sum"
    )


def build_model(cfg: ModelConfig, seed: int, device: torch.device | str = "cpu", meta: bool = False) -> Llama:
    """The single-device model with its deterministic init, in fp32 on ``device``.

    ``meta=True``: the parameters are left on the meta device (shapes, no storage), for ``parallelize`` to
    materialise only what each rank holds; the computed buffers (RoPE tables, the MoE selection bias) are
    made on ``device`` all the same, since every rank needs them and they are small.
    """
    if not meta:
        model = Llama(cfg)
        init_weights(model, cfg, seed)
        return model.to(device)
    with torch.device("meta"):
        model = Llama(cfg)
    for module in model.modules():
        for key, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[key] = torch.zeros(b.shape, dtype=b.dtype, device=device)
    cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    return model
