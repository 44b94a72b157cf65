"""Ulysses attention (``parallel.cp_attention=ulysses``; DeepSpeed-Ulysses, Megatron's ``a2a`` context parallelism):
context parallelism that trades the sequence for the heads around attention.

Each cp rank holds its chunks of every sequence for all of its heads. One all-to-all sends head group j of q, k
and v (packed: one call) to cp rank j, which then holds every position of the sequence for 1/cp of the heads and runs
the plain attention core on it, masks and all (causal, documents, sliding window: ``CausalAttention``); a second
all-to-all sends each head group's output back to the ranks that hold its positions. Backward runs the same two
exchanges in reverse. The positions arrive in the cp ranks' chunk order (zigzag: each rank's two chunks), so they
are put in sequence order before the core and back after it.

Against ring attention it moves 4 activations of this rank's tokens per block per direction (q, k, v, output)
instead of K/V cp - 1 times, in two collectives instead of cp - 1 steps, and its core is the single-device one
(no online-softmax merge); it needs each rank's heads, query and key/value, to split over cp
(``config._check_context_and_experts``).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from meshtrain import comm
from meshtrain.mesh import AxisGroup
from meshtrain.model.layers import CausalAttention, Documents


def _all_to_all(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Slice i of dim 0 (of cp) to rank i of ``group``; returns the slices received, slice j from rank j."""
    x = x.contiguous()
    out = torch.empty_like(x)
    comm.all_to_all(out, x, group)
    return out


class _SeqToHeads(torch.autograd.Function):
    """[B, H, t, D] with heads in cp groups -> [B, H/cp, cp * t, D]: this rank's head group, every rank's tokens."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _heads_to_seq(g, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    """The inverse of ``_SeqToHeads``: [B, H/cp, cp * t, D] -> [B, H, t, D]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _seq_to_heads(g, ctx.group), None


def _seq_to_heads(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    cp = group.size
    b, h, t, d = x.shape
    parts = x.unflatten(1, (cp, h // cp)).transpose(0, 1)  # [cp, B, H/cp, t, D]: head group j for rank j (a view)
    got = _all_to_all(parts, group)  # [cp, B, H/cp, t, D]: rank j's tokens of this rank's head group
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * t, d)


def _heads_to_seq(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """[B, H/cp, cp * t, D] -> [B, H, t, D] laid out as [B, t, H, D] in memory, as SDPA lays out its output: the
    attention's transpose back and reshape for ``wo`` are then views, and ``wo`` keeps no copy of its input."""
    cp = group.size
    b, hg, tt, d = x.shape
    parts = x.view(b, hg, cp, tt // cp, d).permute(2, 0, 1, 3, 4)  # [cp, B, H/cp, t, D]: rank j's tokens
    got = _all_to_all(parts, group)  # [cp, B, H/cp, t, D]: head group j of this rank's tokens
    return got.permute(1, 3, 0, 2, 4).reshape(b, tt // cp, cp * hg, d).transpose(1, 2)


class WholeSequenceMasks:
    """The whole-sequence attention mask of one forward's documents, built by the first block that asks and handed
    to the others, as the single-device model builds it once per forward (``layers.Documents``): every block
    building its own would keep one [B, 1, T, T] mask per layer for backward. Held by weak reference, keyed on the
    forward's ``Documents``: it lives as long as autograd keeps it (to that forward's backward) and no longer; a
    forward without grad, or under full recompute, keeps none and each block builds it again."""

    def __init__(self) -> None:
        self._key: tuple[weakref.ref, int] | None = None  # (the forward's Documents, the window)
        self._bias: weakref.ref | None = None

    def of(self, docs: Documents, dtype: torch.dtype, window: int) -> Documents:
        """``docs`` (this rank's view of the forward's documents) with the whole sequence's mask in ``dtype``, each
        token attending within ``window`` too (0: no window)."""
        same = self._key is not None and self._key[0]() is docs and self._key[1] == window
        bias = self._bias() if same and self._bias is not None else None
        if bias is not None and bias.dtype == dtype:
            return Documents(docs.ids, bias)
        whole = Documents.of(docs.ids, docs.ids.shape[1], dtype, window)
        self._key, self._bias = (weakref.ref(docs), window), weakref.ref(whole.bias)
        return whole


class UlyssesAttention(nn.Module):
    """The attention core under ``cp_attention=ulysses`` (swapped in for ``CausalAttention``).

    ``order`` [T]: the sequence position of each token as the all-to-all lines them up (cp rank 0's tokens in its
    local order, then rank 1's, ...); ``core``: the plain core, over whole sequences; ``masks``: the mask of the
    documents, shared by every layer's core (one ``WholeSequenceMasks`` per model)."""

    def __init__(self, group: AxisGroup, order: torch.Tensor, core: CausalAttention,
                 masks: WholeSequenceMasks) -> None:
        super().__init__()
        self.group, self.core, self.window, self.masks = group, core, core.window, masks
        natural = bool(torch.equal(order, torch.arange(order.numel())))
        # None when the chunks already arrive in sequence order (the contiguous layout); buffers, not state: layout
        # constants like the RoPE tables
        self.register_buffer("to_sequence", None if natural else torch.argsort(order), persistent=False)
        self.register_buffer("to_gathered", None if natural else order.clone(), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                docs: Documents | None = None) -> torch.Tensor:
        cp, hq, hkv = self.group.size, q.shape[1], k.shape[1]
        if hq % cp or hkv % cp:
            raise ValueError(f"ulysses attention splits each rank's {hq} query and {hkv} key/value heads over "
                             f"cp={cp}: both must divide.")
        b, _, t, d = q.shape
        # q, k and v in one exchange: each rank's head group of each, side by side
        packed = torch.cat([x.view(b, cp, x.shape[1] // cp, t, d) for x in (q, k, v)], dim=2)
        full = _SeqToHeads.apply(packed.view(b, -1, t, d), self.group)
        if self.to_sequence is not None:
            full = full.index_select(2, self.to_sequence.to(full.device))
        qh, kh, vh = full.split([hq // cp, hkv // cp, hkv // cp], dim=1)
        whole = self.masks.of(docs, qh.dtype, self.window) if docs is not None else None
        y = self.core(qh, kh, vh, docs=whole)
        if self.to_gathered is not None:
            y = y.index_select(2, self.to_gathered.to(y.device))
        return _HeadsToSeq.apply(y, self.group)
