"""Building blocks shared by the dense model and the mixture of experts: the embedding, RMSNorm, RoPE, the
SwiGLU MLP and the causal attention core. No distributed code lives here.

Under bf16 autocast the residual stream is bf16, as Megatron-LM and torchtitan (FSDP2's ``param_dtype``) run it:
the embedding's output is cast to the compute dtype as a matmul's would be, and each RMSNorm computes in fp32 but
returns its input's dtype with its weight rounded to it. Autocast alone would keep the residual fp32 (the
embedding and the adds are not autocast ops), which costs twice the bytes in every elementwise kernel, every
pipeline hand-over and tensor-parallel entry; and it makes one device differ from ZeRO-3, whose bf16 gather
already gives every weight, the embedding and norms included, the compute dtype. With the cast, both run the
same program."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.config import ModelConfig


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the model computes in for ``x``: autocast's where it is on for x's device, else x's own."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose output is in the compute dtype: a lookup is a matmul with one-hot rows, so under
    autocast it returns what a matmul would (the module docstring says why)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = super().forward(tokens)
        return h.to(compute_dtype(h))


class _RMSNormFn(torch.autograd.Function):
    """``(x / rms(x)) * w`` in fp32, returned in x's dtype, with the scale rounded to x's dtype first. Keeps for
    backward x and one rsqrt per row, and rebuilds the normalised rows there: autograd through the plain ops would
    keep fp32 copies of x and of x / rms(x) (under bf16, 8 bytes per element where x is 2), as fused norms
    (Megatron's, Transformer Engine's) also avoid. The gradients are the plain ops' (the weight's rounded to x's
    dtype, as through the cast)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        y = xf * rstd * weight.to(x.dtype).float()
        # Cast only when it is one: torch 2.11's compile of a Function whose output is a no-op .to() of an
        # intermediate returns zero gradients (seen with the GPU image's torch; tests/test_compile.py holds it).
        return y if y.dtype == x.dtype else y.to(x.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        xn, gf = x.float() * rstd, g.float()
        gn = gf * weight.to(x.dtype).float()  # dL/d(x / rms(x))
        gx = rstd * (gn - xn * (gn * xn).mean(-1, keepdim=True))
        gw = (gf * xn).reshape(-1, xn.shape[-1]).sum(0)
        return gx.to(x.dtype), gw.to(x.dtype).to(weight.dtype), None


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale, computed in fp32 for stability; the output and the scale
    are in the input's dtype (bf16 under autocast, as with 16-bit weights: the module docstring). What backward
    keeps is the input and one value per row (``_RMSNormFn``)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, self.weight, self.eps)


def rope_frequencies(head_dim: int, theta: float, cfg: ModelConfig | None = None) -> torch.Tensor:
    """RoPE's angular frequency of each pair, [head_dim // 2] in float64: theta^(-2i/head_dim), then, when
    ``cfg.rope_scaling`` is llama3 (Llama 3.1+, Meta's ``apply_scaling``, HF's ``rope_type: llama3``), frequencies
    of wavelength beyond ``original / low_freq_factor`` divided by ``rope_factor``, those under ``original /
    high_freq_factor`` kept, and those between blended linearly in ``original / wavelength``."""
    freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if cfg is None or cfg.rope_scaling == "none":
        return freq
    original, low, high = cfg.rope_original_max_len, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelength = 2 * math.pi / freq
    smooth = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: long waves, 1: short ones
    return (1 - smooth) * freq / cfg.rope_factor + smooth * freq


def rope_tables(head_dim: int, max_len: int, theta: float,
                cfg: ModelConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, shape [max_len, head_dim // 2], in fp32 (``cfg``: its RoPE scaling,
    ``rope_frequencies``)."""
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), rope_frequencies(head_dim, theta, cfg))
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x [B, T, H, D] by position-dependent angles (cos/sin [T, D/2], or
    [B, T, D/2] when each row has its own positions: left-padded generation, ``kv_cache.py``), in fp32.

    x is a projection's output viewed as heads, in its own memory order (the attention transposes afterwards): a
    pass over contiguous memory. Rotating the transposed [B, H, T, D] view instead made the real form, which
    compiled blocks run, write [B, H, T, D] copies of q and k: transposing kernels, slower than a copy on a GPU."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # the same angles for every head
    if torch.compiler.is_compiling():  # inductor fuses the real form into one kernel; it has no complex codegen
        return rope_real(x, cos, sin)
    return _ComplexRope.apply(x, cos, sin)


def rope_real(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE's textbook form (``apply_rope`` under ``torch.compile``): rotate the pairs (x[2i], x[2i+1]) with four
    products and two sums, in fp32; cos/sin already broadcast against x."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).type_as(x)


def _as_complex(t: torch.Tensor) -> torch.Tensor:
    """fp32 [..., D] as complex [..., D/2]: pair i is t[2i] + i t[2i+1] (a view where the strides allow)."""
    t = t.float()
    if t.stride(-1) != 1 or t.storage_offset() % 2 or any(s % 2 for s in t.stride()[:-1]):
        t = t.contiguous()
    return torch.view_as_complex(t.unflatten(-1, (-1, 2)))


class _ComplexRope(torch.autograd.Function):
    """Eager RoPE: the rotation is one complex multiply by cos + i sin, and its backward one by cos - i sin: a
    kernel each way where the real form takes nine (four products, two sums, a stack), and RoPE is memory-bound,
    so on a GPU its kernel count is its cost. A Function so that backward keeps only cos and sin (views of the
    model's tables) rather than the complex table autograd would save, a new tensor per layer."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.dtype = x.dtype
        return torch.view_as_real(_as_complex(x) * torch.complex(cos, sin)).flatten(-2).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return torch.view_as_real(_as_complex(grad) * torch.complex(cos, -sin)).flatten(-2).to(ctx.dtype), None, None


def gated(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """The gated MLP's hidden units: ``act(gate) * up``, act SiLU (SwiGLU) or tanh-approximated GELU (GeGLU,
    Gemma's ``gelu_pytorch_tanh``), by ``model.mlp_activation``."""
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    return F.silu(gate) * up


class FeedForward(nn.Module):
    """SwiGLU (or GeGLU): w2(act(w1 x) * w3 x). ``hidden`` defaults to the dense rule (an expert passes its own)."""

    def __init__(self, cfg: ModelConfig, hidden: int | None = None) -> None:
        super().__init__()
        hidden = hidden or cfg.hidden_dim
        self.w1 = nn.Linear(cfg.d_model, hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.d_model, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, cfg.d_model, bias=False)  # down
        self.activation = cfg.mlp_activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(gated(self.w1(x), self.w3(x), self.activation))


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Which document each token of a row [B, T] belongs to, int32, counted from the row's first (0): a document
    ends with its eos id (which belongs to it) and the next starts after it (``train.attention_mask=document``)."""
    ends = (tokens == eos_id).to(torch.int32)
    return torch.cumsum(ends, dim=1, dtype=torch.int32) - ends


def causal_mask(t: int, window: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """[t, t] bool, True where a query may attend to a key: the key is not after it and, with a sliding ``window``
    (``model.sliding_window``), fewer than ``window`` positions before it (a token sees itself and the window - 1
    before it)."""
    keep = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    return keep if not window else keep.triu(1 - window)


def document_mask(docs: torch.Tensor, window: int = 0) -> torch.Tensor:
    """[B, 1, T, T] bool for ``document_ids`` [B, T]: True where a query may attend to a key, i.e. the key is
    not after it, in the same document and (``window``) within the sliding window."""
    keep = causal_mask(docs.shape[1], window, docs.device)
    return (keep & (docs[:, :, None] == docs[:, None, :])).unsqueeze(1)


def additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as SDPA's additive one in ``dtype``: 0 where kept, -inf elsewhere."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, -math.inf)


@dataclass(frozen=True)
class Documents:
    """One forward's documents (``train.attention_mask=document``), as every attention core gets them.

    ``ids``: ``document_ids`` of the whole sequence [B, T] (context parallelism reads those of each rank's
    keys; all 0 for a sliding window alone). ``bias``: the additive mask of whole-sequence attention, [B, 1, T, T] in
    the compute dtype (0 where ``document_mask`` keeps, with the model's sliding window, -inf elsewhere), built once
    per forward and shared by every layer, so autograd keeps one copy for backward (a boolean mask would be
    converted, and kept, by every layer's SDPA); None where the cores hold only part of the sequence (context
    parallelism)."""

    ids: torch.Tensor
    bias: torch.Tensor | None

    @staticmethod
    def of(ids: torch.Tensor, t: int, dtype: torch.dtype, window: int = 0) -> Documents:
        """For cores that attend over ``t`` tokens a row: the bias too when that is the whole sequence."""
        if t != ids.shape[1]:
            return Documents(ids, None)
        return Documents(ids, additive(document_mask(ids, window), dtype))


class CausalAttention(nn.Module):
    """The attention core: causal softmax attention over [B, H, T, D] after RoPE, key/value heads shared by
    groups of query heads (GQA). A module without parameters, so context parallelism can swap it for its
    ring or all-gather version (``parallel/context.py``) the way tensor parallelism swaps Linears.

    ``docs`` (``Documents``): each token attends only within its own document as well, by its ``bias`` (SDPA then
    runs a kernel that takes a mask, not the causal flash kernel). ``window`` (``model.sliding_window``): each token
    attends to itself and the ``window`` - 1 before it; without ``docs`` (whose bias has it) the core builds that
    mask itself when the sequence is longer than the window.

    ``mask`` [B, 1, Tq, Tk] (True: may attend) replaces the plain causal mask when decoding from a KV cache,
    where the queries are the last Tq of Tk positions and rows may start with padding (``kv_cache.py``)."""

    def __init__(self, window: int = 0) -> None:
        super().__init__()
        self.window = window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None, docs: Documents | None = None) -> torch.Tensor:
        if docs is None and mask is None and self.window and q.shape[2] > self.window:
            mask = causal_mask(q.shape[2], self.window, q.device)
        if docs is not None:
            if mask is not None or docs.bias is None or docs.bias.shape[-1] != q.shape[2]:
                raise ValueError(f"documents of {docs.ids.shape[1]} tokens a row must come with their mask over "
                                 f"the {q.shape[2]} queries, and not with a KV cache's mask.")
            mask = docs.bias
        if mask is None:
            # SDPA's own GQA: query head h reads kv head h // (Hq / Hkv) without the repeated K/V copies
            # (Hq/Hkv times the K/V bytes, 8 at Llama-3 70B, and saved for backward too).
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        if k.shape[1] != q.shape[1]:  # with a mask SDPA runs its math kernel, which repeats them itself anyway
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
