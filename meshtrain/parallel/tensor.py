"""Tensor parallelism (Megatron) with sequence parallelism and a vocab-parallel loss.

Within a block the first matmul is split by output columns (each rank computes some heads, or some
of the MLP's hidden units) and the second by input rows (each rank holds the matching slice), so a
block needs one collective in forward and its conjugate in backward (seeds 001, 002, 004):

- without SP: ``copy_to_tp`` (identity forward, all-reduce backward) before the column-parallel
  matmuls, ``reduce_from_tp`` (all-reduce forward, identity backward) after the row-parallel one;
- with SP (``parallel.sp``): the all-reduce splits into its two halves around the block, so the
  norms and residuals hold 1/tp of the sequence: ``gather_seq`` (all-gather forward,
  reduce-scatter backward) before the column-parallel matmuls, ``scatter_seq`` (reduce-scatter
  forward, all-gather backward) after the row-parallel one. Same bytes, 1/tp of the activations.

The embedding is split by vocabulary rows (each rank looks up its own ids, then one all-reduce or
reduce-scatter adds the parts); the LM head is column-parallel over the vocabulary and the loss is
computed from the vocabulary shards with three small all-reduces (max, sum of exp, target logit),
so no rank ever holds the full logits. The vocabulary is padded to a multiple of tp; padded
logits are masked out of the loss.

Mixture-of-experts blocks keep their router and experts whole (expert-tensor-parallel size 1: TP for
attention, EP for experts, as in DeepSeek-style layouts): the MoE block runs on the tokens the tp rank
holds (its sequence shard under SP; without SP every tp rank holds the same tokens and computes the
same thing), so its weights are replicated over tp like the norm weights, and their gradients are added
(SP) or averaged over tp the same way.

``parallelize(model, mesh, sp)`` takes each rank's slice of the single-device weights, so the same
seed gives the same model on any tp. Parameter names do not change; each local parameter carries
its place in the logical tensor (``p._logical``) for checkpoints and the gradient norm.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain import comm
from meshtrain.config import ModelConfig
from meshtrain.mesh import AxisGroup, Mesh
from meshtrain.model.llama import Attention, Block, FeedForward, apply_rope
from meshtrain.model.moe import MoEFeedForward
from meshtrain.train.optim import TPSlice

# ----------------------------------------------------------------------------- the f / g operators


class _CopyToTP(torch.autograd.Function):
    """f: identity forward; all-reduce backward (each rank's input gradient is a partial sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        g = g.contiguous().clone()
        comm.all_reduce(g, ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (add the row-parallel partial sums); identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        x = x.contiguous().clone()
        comm.all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None


def _all_gather_seq(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    # Collectives work on dim 0; the sequence is dim 1 of [B, T, D].
    xt = x.transpose(0, 1).contiguous()
    out = xt.new_empty((xt.shape[0] * group.size, *xt.shape[1:]))
    comm.all_gather(out, xt, group)
    return out.transpose(0, 1)


def _reduce_scatter_seq(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    xt = x.transpose(0, 1).contiguous()
    if xt.shape[0] % group.size:
        raise ValueError(f"sequence length {xt.shape[0]} is not divisible by tp={group.size} (parallel.sp)")
    out = xt.new_empty((xt.shape[0] // group.size, *xt.shape[1:]))
    comm.reduce_scatter(out, xt, group)
    return out.transpose(0, 1)


class _GatherSeq(torch.autograd.Function):
    """SP entry: all-gather the sequence forward; reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _reduce_scatter_seq(g, ctx.group), None


class _ScatterSeq(torch.autograd.Function):
    """SP exit: reduce-scatter partial sums to sequence shards forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _all_gather_seq(g, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    return x if group.size == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    return x if group.size == 1 else _ReduceFromTP.apply(x, group)


def gather_seq(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    return x if group.size == 1 else _GatherSeq.apply(x, group)


def scatter_seq(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    return x if group.size == 1 else _ScatterSeq.apply(x, group)


# ----------------------------------------------------------------------------- sharded layers


def _place(p: nn.Parameter, shape: tuple[int, ...], tp: TPSlice | None, replicas: int) -> nn.Parameter:
    p._logical = (tuple(shape), tp, replicas)
    return p


class ColumnParallelLinear(nn.Module):
    """y[..., out/tp] = enter(x) @ W[rows of this rank]^T. ``enter`` is f (or the SP all-gather)."""

    def __init__(self, weight: torch.Tensor, group: AxisGroup, sp: bool, row_start: int, rows_logical: int,
                 logical_shape: tuple[int, int]) -> None:
        super().__init__()
        self.group, self.sp = group, sp
        self.weight = _place(nn.Parameter(weight), logical_shape, TPSlice(0, row_start, rows_logical), 1)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return gather_seq(x, self.group) if self.sp else copy_to_tp(x, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.enter(x), self.weight)


class RowParallelLinear(nn.Module):
    """y = exit(x[..., in/tp] @ W[:, columns of this rank]^T). ``exit`` is g (or the SP reduce-scatter)."""

    def __init__(self, weight: torch.Tensor, group: AxisGroup, sp: bool, col_start: int,
                 logical_shape: tuple[int, int]) -> None:
        super().__init__()
        self.group, self.sp = group, sp
        self.weight = _place(nn.Parameter(weight), logical_shape, TPSlice(1, col_start, weight.shape[1]), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return scatter_seq(y, self.group) if self.sp else reduce_from_tp(y, self.group)


def _rows(w: torch.Tensor, start: int, n: int) -> torch.Tensor:
    return w.detach()[start: start + n].clone()


def _cols(w: torch.Tensor, start: int, n: int) -> torch.Tensor:
    return w.detach()[:, start: start + n].clone()


class ParallelAttention(nn.Module):
    """GQA attention on this rank's heads: fused QKV (one matmul over the concatenated column shards
    of wq, wk, wv, one entry collective), RoPE, causal SDPA, row-parallel output projection."""

    # The plain model's method, not a bound one (that would keep the unsliced Attention alive);
    # context parallelism replaces it per instance.
    attend = Attention.attend

    def __init__(self, attn: Attention, group: AxisGroup, sp: bool) -> None:
        super().__init__()
        tp, r = group.size, group.index(torch.distributed.get_rank()) if group.size > 1 else 0
        hd = attn.head_dim
        self.head_dim = hd
        self.q_heads, self.kv_heads = attn.n_heads // tp, attn.n_kv_heads // tp
        q_rows, kv_rows = self.q_heads * hd, self.kv_heads * hd

        def col(lin: nn.Linear, rows: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(_rows(lin.weight, r * rows, rows), group, sp, r * rows, rows,
                                        tuple(lin.weight.shape))

        self.wq, self.wk, self.wv = col(attn.wq, q_rows), col(attn.wk, kv_rows), col(attn.wv, kv_rows)
        self.wo = RowParallelLinear(_cols(attn.wo.weight, r * q_rows, q_rows), group, sp, r * q_rows,
                                    tuple(attn.wo.weight.shape))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = self.wq.enter(x)  # one collective serves q, k and v
        qkv = F.linear(x, torch.cat([self.wq.weight, self.wk.weight, self.wv.weight]))
        b, t, _ = qkv.shape
        q, k, v = qkv.split([self.q_heads * self.head_dim, self.kv_heads * self.head_dim,
                             self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, t, -1, self.head_dim).transpose(1, 2)
        k = k.view(b, t, -1, self.head_dim).transpose(1, 2)
        v = v.view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = self.attend(q, k, v)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class ParallelFeedForward(nn.Module):
    """SwiGLU with fused gate/up (one matmul over the column shards of w1 and w3) and a row-parallel w2."""

    def __init__(self, ff: FeedForward, group: AxisGroup, sp: bool) -> None:
        super().__init__()
        tp, r = group.size, group.index(torch.distributed.get_rank()) if group.size > 1 else 0
        hidden = ff.w1.weight.shape[0] // tp
        self.hidden = hidden

        def col(lin: nn.Linear) -> ColumnParallelLinear:
            return ColumnParallelLinear(_rows(lin.weight, r * hidden, hidden), group, sp, r * hidden, hidden,
                                        tuple(lin.weight.shape))

        self.w1, self.w3 = col(ff.w1), col(ff.w3)
        self.w2 = RowParallelLinear(_cols(ff.w2.weight, r * hidden, hidden), group, sp, r * hidden,
                                    tuple(ff.w2.weight.shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.w1.enter(x)
        gate, up = F.linear(x, torch.cat([self.w1.weight, self.w3.weight])).split(self.hidden, dim=-1)
        return self.w2(F.silu(gate) * up)


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + V/tp) of the (padded) embedding; other ids contribute zeros, and the parts
    are added by an all-reduce (or a reduce-scatter to sequence shards with SP)."""

    def __init__(self, emb: nn.Embedding, group: AxisGroup, sp: bool, vocab: int) -> None:
        super().__init__()
        tp, r = group.size, group.index(torch.distributed.get_rank()) if group.size > 1 else 0
        self.group, self.sp = group, sp
        per = math.ceil(vocab / tp)
        self.start, self.end = r * per, min((r + 1) * per, vocab)
        weight = torch.zeros(per, emb.weight.shape[1], dtype=emb.weight.dtype, device=emb.weight.device)
        weight[: self.end - self.start] = emb.weight.detach()[self.start: self.end]
        self.weight = _place(nn.Parameter(weight), tuple(emb.weight.shape),
                             TPSlice(0, self.start, self.end - self.start), 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mine = (tokens >= self.start) & (tokens < self.end)
        local = torch.where(mine, tokens - self.start, torch.zeros_like(tokens))
        h = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return scatter_seq(h, self.group) if self.sp else reduce_from_tp(h, self.group)


class VocabParallelHead(ColumnParallelLinear):
    """LM head over this rank's vocabulary rows; returns local logits [B, T, V/tp]."""

    def __init__(self, out: nn.Linear, group: AxisGroup, sp: bool, vocab: int,
                 shared: VocabParallelEmbedding | None = None) -> None:
        nn.Module.__init__(self)
        self.group, self.sp = group, sp
        tp, r = group.size, group.index(torch.distributed.get_rank()) if group.size > 1 else 0
        per = math.ceil(vocab / tp)
        self.start, self.end = r * per, min((r + 1) * per, vocab)
        if shared is not None:  # tied embeddings: the same vocabulary rows, the same parameter
            self.weight = shared.weight
        else:
            weight = torch.zeros(per, out.weight.shape[1], dtype=out.weight.dtype, device=out.weight.device)
            weight[: self.end - self.start] = out.weight.detach()[self.start: self.end]
            self.weight = _place(nn.Parameter(weight), tuple(out.weight.shape),
                                 TPSlice(0, self.start, self.end - self.start), 1)


class _VocabParallelCE(torch.autograd.Function):
    """Sum over tokens of cross-entropy from vocabulary-sharded logits (fp32), never gathering them."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, start: int, valid: int,
                group: AxisGroup) -> torch.Tensor:
        x = logits.float()
        if valid < x.shape[-1]:  # padding rows of the vocabulary are not real classes
            x = x.clone()
            x[..., valid:] = float("-inf")
        m = x.max(dim=-1).values
        comm.all_reduce(m, group, op="max")
        e = torch.exp(x - m.unsqueeze(-1))
        s = e.sum(-1)
        comm.all_reduce(s, group)
        t = targets - start
        mine = (t >= 0) & (t < valid) & (targets != -100)
        picked = torch.where(mine, x.gather(-1, t.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1),
                             torch.zeros_like(m))
        comm.all_reduce(picked, group)
        keep = targets != -100
        loss = ((torch.log(s) + m - picked) * keep).sum()
        ctx.save_for_backward(e, s, t, mine, keep)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        e, s, t, mine, keep = ctx.saved_tensors
        grad = e / s.unsqueeze(-1)  # softmax over the whole vocabulary, this rank's columns
        idx = t.clamp(0, grad.shape[-1] - 1).unsqueeze(-1)
        grad.scatter_add_(-1, idx, -mine.unsqueeze(-1).to(grad.dtype))
        grad = grad * (keep.unsqueeze(-1) * g)
        return grad.to(ctx.in_dtype), None, None, None, None


def gather_vocab(logits: torch.Tensor, head: VocabParallelHead) -> torch.Tensor:
    """Full logits from the vocabulary shards (generation only: a few positions, not a batch)."""
    group = head.group
    if group.size == 1:
        return logits[..., : head.end - head.start]
    lt = logits.movedim(-1, 0).contiguous()
    out = lt.new_empty((lt.shape[0] * group.size, *lt.shape[1:]))
    comm.all_gather(out, lt, group)
    vocab = head.weight._logical[0][0]
    return out.movedim(0, -1)[..., :vocab]


class VocabParallelLoss:
    """``loss(local_logits, targets)`` -> sum of token losses, the same on every tp rank."""

    def __init__(self, head: VocabParallelHead) -> None:
        self.head = head

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.head
        return _VocabParallelCE.apply(logits, targets, h.start, h.end - h.start, h.group)


# ----------------------------------------------------------------------------- the transformation


class TensorParallel:
    """What ``parallelize`` returns: the loss to use and the replicated-gradient sync."""

    def __init__(self, group: AxisGroup, sp: bool, loss_fn, replicated: list[nn.Parameter]) -> None:
        self.group, self.sp, self.loss_fn, self.replicated = group, sp, loss_fn, replicated

    def sync_replicated_grads(self, grads: list[torch.Tensor]) -> None:
        """Norm weights are replicated over tp. With SP each rank saw a different part of the
        sequence, so their gradients are partial sums and must be added. Without SP they are equal
        in exact arithmetic; averaging them anyway keeps the replicas bit-identical, since
        nondeterministic kernels would otherwise let them drift apart (seed 001)."""
        if self.group.size == 1 or not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, self.group, op="sum" if self.sp else "avg")
        off = 0
        for g in grads:
            g.copy_(flat[off: off + g.numel()].view_as(g))
            off += g.numel()


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """The shapes tensor parallelism needs; a clear error otherwise."""
    if cfg.n_heads % tp:
        raise ValueError(f"parallel.tp={tp} must divide model.n_heads={cfg.n_heads} (attention is split by heads).")
    if cfg.kv_heads % tp:
        raise ValueError(
            f"parallel.tp={tp} must divide model.n_kv_heads={cfg.kv_heads}: each rank keeps whole key/value heads "
            f"for its query heads. Replicating kv heads across ranks would need a second gradient reduction "
            f"inside tp; use tp <= n_kv_heads or more kv heads.")
    if cfg.hidden_dim % tp:
        raise ValueError(f"parallel.tp={tp} must divide the MLP hidden size {cfg.hidden_dim} (model.ffn_hidden).")


def parallelize(model: nn.Module, mesh: Mesh, sp: bool = False) -> TensorParallel:
    """Swap the plain model's layers for tensor-parallel twins holding this rank's slices (in place)."""
    group = mesh.group("tp")
    cfg: ModelConfig = model.cfg
    check_tp(cfg, group.size)
    replicated = []
    for block in model.layers.values():
        block: Block
        block.attention = ParallelAttention(block.attention, group, sp)
        if isinstance(block.feed_forward, MoEFeedForward):  # experts are not split by tp: replicated
            for name, p in block.feed_forward.named_parameters():
                _place(p, tuple(p.shape), None, group.size)
                if not name.startswith("experts."):  # routed experts may be pruned by EP: hold no reference
                    replicated.append(p)
        else:
            block.feed_forward = ParallelFeedForward(block.feed_forward, group, sp)
        for norm in (block.attention_norm, block.ffn_norm):
            replicated.append(_place(norm.weight, tuple(norm.weight.shape), None, group.size))
    if sp:
        model.seq_shards = group.size
    emb = VocabParallelEmbedding(model.tok_embeddings, group, sp, cfg.vocab_size)
    tied = cfg.tie_embeddings
    model.tok_embeddings = emb
    head = VocabParallelHead(model.output, group, sp, cfg.vocab_size, shared=emb if tied else None)
    model.output = head
    replicated.append(_place(model.norm.weight, tuple(model.norm.weight.shape), None, group.size))
    return TensorParallel(group, sp, VocabParallelLoss(head), replicated)
