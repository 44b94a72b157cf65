"""Context parallelism: each of the cp ranks holds a slice of every sequence, and attention is the
one place where the slices meet.

``apply_context_parallel(model, mesh, seq_len, layout, attention)`` changes the plain (or
tensor-parallel) model in place and returns a ``ContextParallel``:

- **Sharding.** The sequence is cut into equal chunks. ``zigzag``: 2·cp chunks, cp rank i holds
  chunks i and 2cp-1-i (in that order), so under the causal mask every rank has the same amount
  of attention work. ``contiguous``: cp chunks, rank i holds chunk i (the last rank then does
  ~2cp-1 times the useful work of the first). ``ContextParallel.shard(x)`` takes this rank's
  chunks out of dim 1; ``positions`` are their real token positions.
- **RoPE.** The model's ``rope_cos``/``rope_sin`` tables are replaced by their rows at this rank's
  positions. ``Llama.forward`` takes the first t rows with t the local length, so every token is
  rotated by its real position without any change to the forward (also under sequence
  parallelism, where t = local hidden length × tp, and in the pipeline stages, which copy the
  tables when they are split off after this).
- **Attention.** Every attention module's core (``CausalAttention``, a module without parameters) is
  swapped for ``ContextParallelAttention``:
  ``ring`` passes the key/value block round the cp ranks with point-to-point transfers (the next
  transfer posted before the current block is computed), merging partial outputs with the
  online-softmax rule; backward passes the key/value blocks round again together with their
  gradient accumulators, which arrive home after the last step. ``allgather`` (Llama 3's variant)
  all-gathers the key/value blocks once, keeps them for backward, and reduce-scatters their
  gradients. Both compute only the (query chunk, key chunk) pairs the causal mask does not fully
  hide, in fp32 (or the input dtype if wider), with key/value heads unexpanded (GQA query heads
  are grouped onto their kv head instead). ``ulysses`` trades tokens for heads by all-to-all and runs the
  plain core on whole sequences (``ulysses.py``).

All communication goes through ``comm`` on the mesh's ``cp`` group, so the meter counts it under
``cp``: ring ``send``/``recv``, allgather ``all_gather``/``reduce_scatter``, ulysses ``all_to_all``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from meshtrain import comm
from meshtrain.config import CP_ATTENTIONS as ATTENTIONS
from meshtrain.config import CP_LAYOUTS as LAYOUTS
from meshtrain.mesh import AxisGroup, Mesh
from meshtrain.model.layers import Documents
from meshtrain.parallel.ulysses import UlyssesAttention, WholeSequenceMasks

_TAG_KV, _TAG_DKV = 71, 72  # the two ring streams between the same pair of ranks must not be confused


# ----------------------------------------------------------------------------- the chunk geometry


def n_chunks(cp: int, layout: str) -> int:
    """How many equal chunks the sequence is cut into."""
    if layout not in LAYOUTS:
        raise ValueError(f"parallel.cp_layout must be one of {', '.join(LAYOUTS)}; got {layout!r}.")
    return 2 * cp if layout == "zigzag" else cp


def chunk_ids(index: int, cp: int, layout: str) -> list[int]:
    """The global chunk numbers cp rank ``index`` holds, in local order (zigzag: i and 2cp-1-i)."""
    n_chunks(cp, layout)
    return [index, 2 * cp - 1 - index] if layout == "zigzag" else [index]


def rank_positions(index: int, cp: int, seq_len: int, layout: str) -> torch.Tensor:
    """Real token positions (int64) of cp rank ``index``'s tokens, in local order."""
    c = seq_len // n_chunks(cp, layout)
    return torch.cat([torch.arange(a * c, (a + 1) * c) for a in chunk_ids(index, cp, layout)])


@dataclass(frozen=True)
class _Block:
    """Local query chunks that attend to the same local key chunks of one source rank."""

    q: tuple[int, ...]  # local chunk indices of this rank's queries
    kv: tuple[int, ...]  # local chunk indices of the source rank's keys/values
    masked: bool  # a (q, kv) pair is the same chunk: needs the causal mask inside


def _narrow(x: torch.Tensor, idx: tuple[int, ...], c: int, dim: int) -> torch.Tensor:
    """Rows of chunks ``idx`` (length ``c`` each) along ``dim``: a view when they are consecutive."""
    if all(b == a + 1 for a, b in zip(idx, idx[1:], strict=False)):
        return x.narrow(dim, idx[0] * c, len(idx) * c)
    return torch.cat([x.narrow(dim, a * c, c) for a in idx], dim)


@dataclass
class AttentionFlops:
    """Attention FLOPs this rank actually computed (masked-out entries of a computed block count:
    the matmul did them); ``useful`` counts only entries the causal mask keeps."""

    forward: int = 0
    backward: int = 0
    useful: int = 0

    def reset(self) -> None:
        self.forward = self.backward = self.useful = 0


@dataclass
class BlockPlan:
    """For one cp rank: which of its query chunks meet which key chunks of every source rank, and
    the per-block math (forward with log-sum-exp and merge, backward from the final lse).

    Pure local compute, no communication, so the ring, the all-gather variant and single-process
    tests all run the same code. Tensors are grouped by kv head: queries ``[B, Hkv, rep, T, D]``,
    keys/values stacked ``[2, B, Hkv, T, D]``.
    """

    index: int
    cp: int
    seq_len: int
    layout: str
    window: int = 0  # model.sliding_window: a query sees keys fewer than this many positions back (0: all)
    chunk_len: int = field(init=False)
    positions: torch.Tensor = field(init=False)  # this rank's real token positions, in local order
    blocks: list[list[_Block]] = field(init=False)  # blocks[j]: against source rank j's keys
    _masks: dict = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.chunk_len = self.seq_len // n_chunks(self.cp, self.layout)
        mine = chunk_ids(self.index, self.cp, self.layout)
        self.positions = rank_positions(self.index, self.cp, self.seq_len, self.layout)
        self.blocks = []
        c, w = self.chunk_len, self.window or self.seq_len
        for j in range(self.cp):
            theirs = chunk_ids(j, self.cp, self.layout)
            # Key chunk b entirely after query chunk a, or (a sliding window) entirely before its reach: skipped;
            # entirely visible: unmasked; else (the same chunk, or one the window cuts): masked.
            need: dict[tuple[int, ...], list[int]] = {}
            for qa, a in enumerate(mine):
                kv = tuple(kb for kb, b in enumerate(theirs) if b <= a and (a - b - 1) * c + 1 < w)
                if kv:
                    need.setdefault(kv, []).append(qa)
            self.blocks.append([
                _Block(tuple(qs), kv, any(theirs[kb] == mine[qa] or (mine[qa] - theirs[kb] + 1) * c - 1 >= w
                                          for qa in qs for kb in kv))
                for kv, qs in need.items()
            ])

    @property
    def local_len(self) -> int:
        return len(chunk_ids(self.index, self.cp, self.layout)) * self.chunk_len

    def mask(self, j: int, b: _Block, device: torch.device) -> tuple[torch.Tensor, int]:
        """[tq, tk] bool, True where query position >= key position (and, with a sliding window, less than
        ``window`` after it), and its count of True (cached per block, so counting FLOPs never waits for the
        device)."""
        key = (j, b, device)
        if key not in self._masks:
            theirs = rank_positions(j, self.cp, self.seq_len, self.layout)
            pq = _narrow(self.positions, b.q, self.chunk_len, 0)
            pk = _narrow(theirs, b.kv, self.chunk_len, 0)
            m = pq[:, None] >= pk[None, :]
            if self.window:
                m &= pq[:, None] - pk[None, :] < self.window
            self._masks[key] = (m.to(device), int(m.sum()))
        return self._masks[key]

    def document_mask(self, j: int, b: _Block, docs: torch.Tensor) -> torch.Tensor:
        """[B, tq, tk] bool, True where the query and key tokens are in the same document (``docs``: the whole
        sequence's document ids [B, T], ``train.attention_mask=document``)."""
        theirs = rank_positions(j, self.cp, self.seq_len, self.layout).to(docs.device)
        pq = _narrow(self.positions.to(docs.device), b.q, self.chunk_len, 0)
        pk = _narrow(theirs, b.kv, self.chunk_len, 0)
        return docs[:, pq][:, :, None] == docs[:, pk][:, None, :]

    def _operands(self, j: int, b: _Block, q: torch.Tensor, kv: torch.Tensor, dtype: torch.dtype,
                  docs: torch.Tensor | None):
        c = self.chunk_len
        bsz, hkv, rep, _, d = q.shape
        tq = len(b.q) * c
        # Query heads of one kv head stacked along the rows: one matmul per kv head, kv never expanded.
        qb = _narrow(q, b.q, c, 3).reshape(bsz, hkv, rep * tq, d)
        kvb = _narrow(kv, b.kv, c, 3).to(dtype)
        mask, kept = self.mask(j, b, q.device) if b.masked else (None, tq * kvb.shape[-2])
        if docs is not None:  # [B, tq, tk]; ``kept`` stays the causal count (the block is computed whole)
            same = self.document_mask(j, b, docs)
            mask = same if mask is None else same & mask
        return qb, kvb[0], kvb[1], mask, tq, kept

    @staticmethod
    def _scores(qb, kb, mask, rep, scale):
        # Out of place: selective recompute caches matmul outputs, and an in-place scale or mask would
        # change the cached tensor, so the recomputed forward would scale it twice.
        s = torch.matmul(qb, kb.transpose(-1, -2)) * scale
        if mask is not None:  # [tq, tk] causal, or [B, tq, tk] with documents; rows of qb are (rep, tq)
            keep = mask.repeat(rep, 1) if mask.dim() == 2 else mask.repeat(1, rep, 1).unsqueeze(1)
            s = s.masked_fill(~keep, float("-inf"))
        return s

    @staticmethod
    def _count(flops: AttentionFlops | None, q: torch.Tensor, tq: int, tk: int, kept: int, fwd: bool) -> None:
        if flops is None:
            return
        bsz, hkv, rep, _, d = q.shape
        per_entry = bsz * hkv * rep * d
        if fwd:
            flops.forward += 4 * per_entry * tq * tk  # q k^T and p v
            flops.useful += 4 * per_entry * kept
        else:
            flops.backward += 10 * per_entry * tq * tk  # q k^T again, dv, dp, dq, dk

    def forward_block(self, j: int, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      flops: AttentionFlops | None = None, docs: torch.Tensor | None = None) -> None:
        """Attend this rank's queries to source rank ``j``'s keys/values; merge into ``out`` [B, Hkv, rep,
        T, D] and ``lse`` [B, Hkv, rep, T] in place with the online-softmax rule. ``docs``: also within
        documents only (a query may then see no key of a block: its lse there is -inf, its output 0)."""
        c, scale = self.chunk_len, 1.0 / math.sqrt(q.shape[-1])
        bsz, hkv, rep, _, d = q.shape
        for b in self.blocks[j]:
            qb, kb, vb, mask, tq, kept = self._operands(j, b, q, kv, q.dtype, docs)
            s = self._scores(qb, kb, mask, rep, scale)
            lse_b = torch.logsumexp(s, dim=-1)
            ob = torch.matmul(torch.exp(s - _finite(lse_b).unsqueeze(-1)), vb).view(bsz, hkv, rep, tq, d)
            lse_b = lse_b.view(bsz, hkv, rep, tq)
            for n, a in enumerate(b.q):
                rows, part = slice(a * c, (a + 1) * c), slice(n * c, (n + 1) * c)
                old, new_b = lse[..., rows], lse_b[..., part]
                # Finite: the first block (the rank's own, s = 0) has each query's own key.
                new = torch.logaddexp(old, new_b)
                out[..., rows, :] = (out[..., rows, :] * torch.exp(old - new).unsqueeze(-1)
                                     + ob[..., part, :] * torch.exp(new_b - new).unsqueeze(-1))
                lse[..., rows] = new
            self._count(flops, q, tq, kb.shape[-2], kept, fwd=True)

    def backward_block(self, j: int, q: torch.Tensor, kv: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
                       delta: torch.Tensor, dq: torch.Tensor, flops: AttentionFlops | None = None,
                       docs: torch.Tensor | None = None) -> torch.Tensor:
        """Gradients of the blocks against source rank ``j``: adds into ``dq`` in place and returns this
        rank's contribution to rank j's key/value gradients, [2, B, Hkv, T, D] (zeros where it has none).

        ``lse`` is the final log-sum-exp of forward and ``delta`` = rowsum(dO * O), so each block's
        probabilities are exact without the other blocks."""
        c, scale = self.chunk_len, 1.0 / math.sqrt(q.shape[-1])
        bsz, hkv, rep, _, d = q.shape
        dkv = torch.zeros(kv.shape, dtype=q.dtype, device=q.device)
        for b in self.blocks[j]:
            qb, kb, vb, mask, tq, kept = self._operands(j, b, q, kv, q.dtype, docs)
            dob = _narrow(do, b.q, c, 3).reshape(bsz, hkv, rep * tq, d)
            lse_b = _narrow(lse, b.q, c, 3).reshape(bsz, hkv, rep * tq, 1)
            delta_b = _narrow(delta, b.q, c, 3).reshape(bsz, hkv, rep * tq, 1)
            p = torch.exp(self._scores(qb, kb, mask, rep, scale) - lse_b)  # masked entries: exp(-inf) = 0
            dv = torch.matmul(p.transpose(-1, -2), dob)
            ds = p * (torch.matmul(dob, vb.transpose(-1, -2)) - delta_b)
            dqb = torch.matmul(ds, kb).mul_(scale).view(bsz, hkv, rep, tq, d)
            dk = torch.matmul(ds.transpose(-1, -2), qb).mul_(scale)
            for n, a in enumerate(b.q):
                dq[..., a * c:(a + 1) * c, :] += dqb[..., n * c:(n + 1) * c, :]
            for n, a in enumerate(b.kv):
                dkv[0, ..., a * c:(a + 1) * c, :] += dk[..., n * c:(n + 1) * c, :]
                dkv[1, ..., a * c:(a + 1) * c, :] += dv[..., n * c:(n + 1) * c, :]
            self._count(flops, q, tq, kb.shape[-2], kept, fwd=False)
        return dkv


# ----------------------------------------------------------------------------- the attention functions


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """A block's ``lse`` with -inf (a query that sees no key of it: documents) as 0, for subtracting: exp(-inf - 0)
    = 0 where -inf - -inf is nan. Equal to ``lse`` wherever it is finite, so the causal path is unchanged."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _grouped(x: torch.Tensor, hkv: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, Hq, T, D] -> [B, Hkv, Hq/Hkv, T, D] in ``dtype``: query head h uses kv head h // rep, as
    ``repeat_interleave`` of the keys does in the single-device attention."""
    bsz, hq, t, d = x.shape
    return x.to(dtype).reshape(bsz, hkv, hq // hkv, t, d)


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    # Softmax and the merge in fp32 even under bf16 autocast (float64 stays float64: gradcheck).
    return torch.promote_types(q.dtype, torch.float32)


class _RingAttention(torch.autograd.Function):
    """Ring attention: K/V blocks travel round the cp ranks; dK/dV accumulators follow them home."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel,
                docs: torch.Tensor | None) -> torch.Tensor:
        dtype, n, me = _compute_dtype(q), cp.group.size, cp.index
        with torch.autocast(q.device.type, enabled=False):
            qg = _grouped(q, k.shape[1], dtype)
            kv = torch.stack((k, v))  # sent in the model's compute dtype, unexpanded
            out = torch.zeros_like(qg)
            lse = torch.full(qg.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
            for s in range(n):
                # Post the next block's transfer first; it runs while this block is computed.
                nxt, handles = cp._exchange(kv, _TAG_KV) if s < n - 1 else (None, [])
                cp.plan.forward_block((me - s) % n, qg, kv, out, lse, cp.flops, docs)
                for h in handles:
                    h.wait()
                kv = nxt if nxt is not None else kv
        y = out.view(q.shape).to(q.dtype)
        ctx.save_for_backward(q, k, v, y, lse)
        ctx.cp, ctx.docs = cp, docs
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        q, k, v, y, lse = ctx.saved_tensors
        cp: ContextParallel = ctx.cp
        dtype, n, me, hkv = _compute_dtype(q), cp.group.size, cp.index, k.shape[1]
        with torch.autocast(q.device.type, enabled=False):
            qg, do = _grouped(q, hkv, dtype), _grouped(dy, hkv, dtype)
            delta = (do * _grouped(y, hkv, dtype)).sum(-1)
            dq = torch.zeros_like(qg)
            kv = torch.stack((k, v))
            home = None  # this rank's own block's gradient: stays here, the others' come back round
            acc_in, acc_handles, sending = None, [], None
            for s in range(n):
                nxt, kv_handles = cp._exchange(kv, _TAG_KV) if s < n - 1 else (None, [])
                dkv = cp.plan.backward_block((me - s) % n, qg, kv, do, lse, delta, dq, cp.flops, ctx.docs)
                if s == 0:
                    home = dkv
                else:
                    # The accumulator of this block arrived from the previous rank (none at s=1: its
                    # owner keeps its own part); add ours and pass it on towards the owner.
                    for h in acc_handles:
                        h.wait()
                    if acc_in is not None:
                        dkv += acc_in
                    sending = dkv
                    acc_in, acc_handles = cp._exchange(sending, _TAG_DKV)
                for h in kv_handles:
                    h.wait()
                kv = nxt if nxt is not None else kv
            for h in acc_handles:
                h.wait()
            if acc_in is not None:
                home += acc_in
            del sending
        dq = dq.view(q.shape).to(q.dtype)
        return dq, home[0].to(k.dtype), home[1].to(v.dtype), None, None


class _AllGatherAttention(torch.autograd.Function):
    """Llama 3's variant: all-gather K/V once (kept for backward), reduce-scatter dK/dV."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel,
                docs: torch.Tensor | None) -> torch.Tensor:
        dtype, n, me = _compute_dtype(q), cp.group.size, cp.index
        with torch.autocast(q.device.type, enabled=False):
            qg = _grouped(q, k.shape[1], dtype)
            kv = torch.stack((k, v))
            full = kv.new_empty((2 * n, *kv.shape[1:]))  # rank j's k, v at rows 2j, 2j+1
            comm.all_gather(full, kv, cp.group)
            out = torch.zeros_like(qg)
            lse = torch.full(qg.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
            for s in range(n):  # the ring's order, so both variants compute the same forward bit for bit
                j = (me - s) % n
                cp.plan.forward_block(j, qg, full[2 * j: 2 * j + 2], out, lse, cp.flops, docs)
        y = out.view(q.shape).to(q.dtype)
        ctx.save_for_backward(q, full, y, lse)
        ctx.cp, ctx.kv_dtype, ctx.docs = cp, k.dtype, docs
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        q, full, y, lse = ctx.saved_tensors
        cp: ContextParallel = ctx.cp
        dtype, n, me, hkv = _compute_dtype(q), cp.group.size, cp.index, full.shape[2]
        with torch.autocast(q.device.type, enabled=False):
            qg, do = _grouped(q, hkv, dtype), _grouped(dy, hkv, dtype)
            delta = (do * _grouped(y, hkv, dtype)).sum(-1)
            dq = torch.zeros_like(qg)
            dfull = torch.empty(full.shape, dtype=dtype, device=q.device)
            for s in range(n):
                j = (me - s) % n
                dfull[2 * j: 2 * j + 2] = cp.plan.backward_block(j, qg, full[2 * j: 2 * j + 2], do, lse, delta, dq,
                                                                 cp.flops, ctx.docs)
            dkv = dfull.new_empty((2, *dfull.shape[1:]))
            comm.reduce_scatter(dkv, dfull, cp.group)  # every rank's part of our dK/dV, added
        return dq.view(q.shape).to(q.dtype), dkv[0].to(ctx.kv_dtype), dkv[1].to(ctx.kv_dtype), None, None


# ----------------------------------------------------------------------------- the transformation


class ContextParallel:
    """What ``apply_context_parallel`` returns: the batch sharding, this rank's positions, the
    installed attention (``attend``) and its FLOP counter."""

    def __init__(self, group: AxisGroup, index: int, seq_len: int, layout: str = "zigzag",
                 attention: str = "ring", window: int = 0) -> None:
        if attention not in ATTENTIONS:
            raise ValueError(f"parallel.cp_attention must be one of {', '.join(ATTENTIONS)}; got {attention!r}.")
        chunks = n_chunks(group.size, layout)
        if seq_len % chunks:
            raise ValueError(f"context parallelism cp={group.size} with cp_layout={layout} cuts the sequence into "
                             f"{chunks} equal chunks: seq_len={seq_len} is not divisible by {chunks}.")
        self.group, self.index, self.seq_len = group, index, seq_len
        self.layout, self.attention = layout, attention
        self.plan = BlockPlan(index, group.size, seq_len, layout, window)
        self.positions = self.plan.positions  # LongTensor: this rank's real token positions, in local order
        self.chunks = chunk_ids(index, group.size, layout)
        self.flops = AttentionFlops()
        self.next_rank = group.ranks[(index + 1) % group.size]
        self.prev_rank = group.ranks[(index - 1) % group.size]

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's chunks of dim 1 (the sequence), in local order: [B, T, ...] -> [B, T/cp, ...] (contiguous)."""
        if x.shape[1] != self.seq_len:
            raise ValueError(f"context parallelism was set up for seq_len={self.seq_len}; got a batch of "
                             f"{x.shape[1]} tokens per sequence.")
        return _narrow(x, tuple(self.chunks), self.plan.chunk_len, 1).contiguous()

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               docs: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of this rank's queries over the whole sequence's keys/values.

        q [B, Hq, T/cp, D], k and v [B, Hkv, T/cp, D] (after RoPE); Hkv must divide Hq. ``docs``: the whole
        sequence's document ids [B, T] (not sharded: every rank reads those of the keys it is sent), attention
        then also within documents only."""
        self._check(q, k, v)
        if docs is not None and docs.shape != (q.shape[0], self.seq_len):
            raise ValueError(f"context parallelism takes the whole sequence's document ids [B, T] = "
                             f"{(q.shape[0], self.seq_len)}; got {tuple(docs.shape)}.")
        fn = _RingAttention if self.attention == "ring" else _AllGatherAttention
        return fn.apply(q, k.contiguous(), v.contiguous(), self, docs)

    def _check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
            raise ValueError(f"context-parallel attention takes q [B, Hq, T, D] and k, v [B, Hkv, T, D]; got "
                             f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}.")
        if (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
            raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} differ in batch, length or head_dim.")
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"{k.shape[1]} key/value heads must divide {q.shape[1]} query heads (GQA).")
        if q.shape[2] != self.plan.local_len:
            raise ValueError(f"context parallelism cp={self.group.size} was set up for seq_len={self.seq_len}, "
                             f"i.e. {self.plan.local_len} tokens per rank; attention got {q.shape[2]}.")

    def _exchange(self, t: torch.Tensor, tag: int) -> tuple[torch.Tensor, list[comm.Handle]]:
        """Send ``t`` to the next rank of the ring and receive the previous rank's into a new buffer."""
        nxt = torch.empty_like(t)
        return nxt, comm.batch_p2p([comm.P2P("send", t, self.next_rank, tag),
                                    comm.P2P("recv", nxt, self.prev_rank, tag)], self.group)


class ContextParallelAttention(nn.Module):
    """The attention core under context parallelism (swapped in for ``CausalAttention``): this rank's
    queries against the whole sequence's keys and values, by ring or all-gather."""

    def __init__(self, cp: ContextParallel) -> None:
        super().__init__()
        self.cp = cp

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                docs: Documents | None = None) -> torch.Tensor:
        return self.cp.attend(q, k, v, docs.ids if docs is not None else None)


def apply_context_parallel(model: nn.Module, mesh: Mesh, seq_len: int, layout: str = "zigzag",
                           attention: str = "ring") -> ContextParallel:
    """Make ``model`` (plain or tensor-parallel) run on this rank's chunks of each sequence, in place.

    Replaces the RoPE tables by their rows at this rank's positions and every attention module's core
    by ``ContextParallelAttention`` over ``mesh.group("cp")``. Apply after tensor parallelism and before
    the pipeline split. The caller feeds ``ContextParallel.shard(tokens)``; gradients must be summed
    over ("dp", "cp") and the loss divided by the global token count.
    """
    group = mesh.group("cp")
    cfg = getattr(model, "cfg", None)
    cp = ContextParallel(group, mesh.coord("cp"), seq_len, layout, attention, cfg.sliding_window if cfg else 0)
    if cfg is not None and cfg.n_heads % cfg.kv_heads:
        raise ValueError(f"model.n_kv_heads={cfg.kv_heads} must divide model.n_heads={cfg.n_heads} (GQA).")
    if seq_len > model.rope_cos.shape[0]:
        raise ValueError(f"seq_len={seq_len} exceeds the RoPE tables' {model.rope_cos.shape[0]} positions "
                         f"(model.max_seq_len).")
    pos = cp.positions.to(model.rope_cos.device)
    # Llama.forward takes rows [:t] of these: this rank's real positions, whatever its local length.
    model.rope_cos = model.rope_cos[pos]
    model.rope_sin = model.rope_sin[pos]
    # ulysses: the order the all-to-all lines the sequence up in, every cp rank's tokens in turn
    order = torch.cat([rank_positions(r, group.size, seq_len, layout) for r in range(group.size)])
    masks = WholeSequenceMasks()  # one per model: a forward builds its documents' mask once
    for block in model.layers.values():
        attn = block.attention
        if isinstance(attn.core, ContextParallelAttention | UlyssesAttention):
            raise ValueError("context parallelism is already applied to this model.")
        attn.core = UlyssesAttention(group, order, attn.core, masks) if attention == "ulysses" \
            else ContextParallelAttention(cp)
    return cp


__all__ = ["ATTENTIONS", "LAYOUTS", "AttentionFlops", "BlockPlan", "ContextParallel", "ContextParallelAttention",
           "apply_context_parallel",
           "chunk_ids", "n_chunks", "rank_positions"]
