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
so no rank ever holds the full logits (``cross_entropy.py``). The vocabulary is padded to a multiple of tp; padded
logits are masked out of the loss.

Mixture-of-experts blocks keep their router and experts whole (expert-tensor-parallel size 1: TP for
attention, EP for experts, as in DeepSeek-style layouts): the MoE block runs on the tokens the tp rank
holds (its sequence shard under SP; without SP every tp rank holds the same tokens and computes the
same thing), so its weights are replicated over tp like the norm weights, and their gradients are added
(SP) or averaged over tp the same way.

``apply_tensor_parallel(model, mesh, rules, sp)`` takes each rank's slice of the single-device weights,
so the same seed gives the same model on any tp. What is sliced, along which dimension, and what is
replicated is read from the logical-axis rules table (``meshtrain/rules.py``, ``model/axes.py``): a
weight dimension whose logical axis maps to ``tp`` is sliced; a weight with none is replicated.
Parameter names do not change; the returned ``TensorParallel.placements`` says where each local
parameter sits in its logical tensor, for checkpoints and the gradient norm.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain import comm
from meshtrain.config import ModelConfig
from meshtrain.mesh import AxisGroup, Mesh
from meshtrain.model.axes import param_axes
from meshtrain.model.kv_cache import LayerKV
from meshtrain.model.layers import Documents, compute_dtype, gated
from meshtrain.model.llama import Attention, Block, FeedForward, attend, heads_with_rope
from meshtrain.parallel.cross_entropy import lean_cross_entropy
from meshtrain.parallel.pieces import Placement, Placements, TPSlice
from meshtrain.parallel.pipeline.wgrad import Deferrable, WeightGradStore, deferred_linear, split_rows, weight_grad
from meshtrain.rules import Rules, check_executable, tp_dim

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


# Collectives work on dim 0; the sequence is dim 1 of [B, T, D]. The shards travel as they are ([B, T/tp, D] each,
# stacked to [tp, B, T/tp, D]) and one copy puts the gathered sequence in order (a view when B = 1), so no rank
# transposes its shard to [T/tp, B, D] first; the reduce-scatter's result is this rank's [B, T/tp, D] as it is.


def _all_gather_seq(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((group.size * x.shape[0], *x.shape[1:]))
    comm.all_gather(out, x, group)
    return _in_sequence_order(out, group.size)


def _in_sequence_order(stacked: torch.Tensor, n: int) -> torch.Tensor:
    """[n·B, T/n, ...] (rank r's shard at rows r·B..) -> [B, T, ...]."""
    return stacked.unflatten(0, (n, -1)).transpose(0, 1).flatten(1, 2)


def _reduce_scatter_seq(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    out, handle = _start_reduce_scatter_seq(x, group)
    handle.wait()
    return out


def _start_reduce_scatter_seq(x: torch.Tensor, group: AxisGroup) -> tuple[torch.Tensor, comm.Handle]:
    """(this rank's sequence shard of the sum of ``x`` over ``group``, the handle to wait on before reading it)."""
    n, seq = group.size, x.shape[1]
    if seq % n:
        raise ValueError(f"sequence length {seq} is not divisible by tp={n} (parallel.sp)")
    # [n·B, T/n, ...], rank r's part at rows r·B..
    stacked = x.unflatten(1, (n, seq // n)).transpose(0, 1).flatten(0, 1).contiguous()
    out = x.new_empty((x.shape[0], seq // n, *x.shape[2:]))
    return out, comm.reduce_scatter(out, stacked, group, async_op=True)


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


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast computes matmuls in on ``x``'s device, or None outside autocast."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None


# The column-parallel matmuls read one weight or several concatenated along the output rows (QKV; gate/up): one
# entry collective and one matmul serve them all. What backward keeps is the parts themselves (the parameters, or
# ZeRO-3's gathered compute-dtype views, which its saved-tensor hook keeps by reference), never a copy: backward
# concatenates and casts them again. A kept concatenation is 1/tp of every block's QKV and gate/up weights, held
# from forward to backward whatever the data-parallel sharding (~11 GB a rank for Llama-3 70B at tp=8 in bf16); a
# kept autocast cast of fp32 weights is the same bytes again for each microbatch in flight (up to pp on a 1F1B
# stage), where autocast's own linear shares one cast a step (``ForwardLoss.one_cast_per_step``). Rebuilding costs
# one more cast of those weights per microbatch, in backward.


def _fused_weight(parts: tuple[torch.Tensor, ...], dtype: torch.dtype | None) -> torch.Tensor:
    """The weight one matmul reads: ``parts`` along the output rows, in ``dtype`` (autocast's; None: their own)."""
    ws = [w if dtype is None or w.dtype == dtype else w.to(dtype) for w in parts]
    return ws[0] if len(ws) == 1 else torch.cat(ws)


def _keep_weights(ctx, parts: tuple[torch.Tensor, ...], cast: torch.dtype | None) -> tuple[torch.Tensor, ...]:
    """What backward keeps of the fused weight: ``parts`` themselves; ``_kept_weight`` rebuilds it in ``cast``.
    Sets ``ctx.parts`` (for W: pipeline/wgrad.py) and ``ctx.cast``."""
    ctx.parts, ctx.cast = parts, cast
    return parts


def _kept_weight(ctx, kept: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return _fused_weight(kept, ctx.cast)


def _weight_grads_or_defer(ctx, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """Each part's gradient, the rows of g^T x (``pipeline/wgrad.weight_grad``, as W computes it), or, inside a
    zero-bubble pipeline's I action (``ctx.wgrad`` armed), Nones with (parts, x, g) stashed for W."""
    if ctx.wgrad is not None and ctx.wgrad.armed():
        ctx.wgrad.put(ctx.parts, x, g)
        return (None,) * len(ctx.parts)
    return split_rows(weight_grad(x, g, ctx.parts[0]), ctx.parts)


class _GatherLinear(torch.autograd.Function):
    """SP entry and column-parallel matmul in one, keeping only the sequence shard for backward (Megatron).

    Forward all-gathers the sequence and multiplies, like ``F.linear(gather_seq(x), w)``, but saves the
    [B, T/tp, D] shard instead of the gathered [B, T, D] input the weight gradient needs: backward
    gathers it again, started before the input-gradient matmul so the two overlap, then starts the input
    gradient's reduce-scatter and computes the weight gradient while it runs (Megatron's asynchronous
    tensor-parallel communication: each backward collective has a matmul to hide behind). Under autocast the
    shard is saved (and re-gathered) in the compute dtype, which is all the matmuls read of it. Under a
    zero-bubble pipeline's I action (``wgrad`` armed) the gathered input is stashed for W instead of the weight
    gradient computed. ``parts``: the weights, concatenated along the output rows (above)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup, wgrad: WeightGradStore | None,
                *parts: torch.Tensor) -> torch.Tensor:
        cast = _autocast_dtype(x)
        w = _fused_weight(parts, cast)
        ctx.group, ctx.x_dtype, ctx.wgrad = group, x.dtype, wgrad
        ctx.save_for_backward(x if cast is None else x.to(cast), *_keep_weights(ctx, parts, cast))
        full = _all_gather_seq(x, group)
        return F.linear(full if cast is None else full.to(cast), w)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        shard, *kept = ctx.saved_tensors
        shard = shard.contiguous()
        stacked = shard.new_empty((ctx.group.size * shard.shape[0], *shard.shape[1:]))
        gathering = comm.all_gather(stacked, shard, ctx.group, async_op=True)
        grad_in = g.matmul(_kept_weight(ctx, kept).to(g.dtype))  # under the all-gather
        grad_x, scattering = _start_reduce_scatter_seq(grad_in.to(ctx.x_dtype), ctx.group)
        gathering.wait()
        grads_w = _weight_grads_or_defer(ctx, _in_sequence_order(stacked, ctx.group.size), g)  # under the RS
        scattering.wait()
        return grad_x, None, None, *grads_w


class _CopyLinear(torch.autograd.Function):
    """f and column-parallel matmul in one (no SP): ``F.linear(copy_to_tp(x), w)``, whose backward starts the input
    gradient's all-reduce as soon as that gradient is computed and computes the weight gradient while it runs
    (Megatron's asynchronous tensor-parallel communication), where ``copy_to_tp``'s all-reduce could only start
    after the whole linear backward. Autocast, a zero-bubble pipeline's ``wgrad`` and ``parts`` as
    ``_GatherLinear``; with ``group`` None, no collective (one rank, or SP's entry already gathered)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup | None, wgrad: WeightGradStore | None,
                *parts: torch.Tensor) -> torch.Tensor:
        cast = _autocast_dtype(x)
        w = _fused_weight(parts, cast)
        xc = x if cast is None else x.to(cast)
        ctx.group, ctx.x_dtype, ctx.wgrad = group, x.dtype, wgrad
        ctx.save_for_backward(xc, *_keep_weights(ctx, parts, cast))
        return F.linear(xc, w)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, *kept = ctx.saved_tensors
        grad_x = g.matmul(_kept_weight(ctx, kept).to(g.dtype)).to(ctx.x_dtype)  # a fresh tensor: reduced in place
        reducing = None if ctx.group is None else comm.all_reduce(grad_x, ctx.group, async_op=True)
        grads_w = _weight_grads_or_defer(ctx, x, g)  # under the all-reduce
        if reducing is not None:
            reducing.wait()
        return grad_x, None, None, *grads_w


@comm.eager  # as deferred_linear: the backward reads whether the store is armed
def _deferred(fn: type[torch.autograd.Function], x: torch.Tensor, group: AxisGroup | None,
              wgrad: WeightGradStore, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return fn.apply(x, group, wgrad, *parts)


def copy_to_tp(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    return x if group.size == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    return x if group.size == 1 else _ReduceFromTP.apply(x, group)


def gather_seq(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    return x if group.size == 1 else _GatherSeq.apply(x, group)


def scatter_seq(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    return x if group.size == 1 else _ScatterSeq.apply(x, group)


# ----------------------------------------------------------------------------- sharded layers


class Sharder:
    """Cuts this rank's slice of a logical weight along the dimension the rules give its logical axes, and
    records the slice's ``Placement`` by parameter name."""

    def __init__(self, rules: Rules, group: AxisGroup, index: int) -> None:
        self.rules, self.group, self.index = rules, group, index
        self.placements: Placements = {}

    def shard(self, name: str, w: torch.Tensor, units: int | None = None) -> tuple[torch.Tensor, TPSlice | None]:
        """(this rank's slice of ``w``, padded to ceil(n / tp) along the sliced dimension; its TPSlice), or
        (``w`` itself, None) when no dimension is split over tp. ``units``: the indivisible pieces (heads) along
        that dimension; when there are fewer than tp, each rank takes the one its query heads use, so
        tp / units consecutive ranks hold the same slice (``Placement.replicas``; grads summed over "tp_kv")."""
        shape = tuple(w.shape)
        dim = tp_dim(param_axes(name), self.rules)
        if dim is None:
            self.placements[name] = Placement(shape, None, self.group.size)
            return w, None
        n = shape[dim]
        if units is not None and units < self.group.size:
            if self.group.size % units or n % units:
                raise ValueError(f"{name}: tp={self.group.size} must be a multiple of its {units} heads.")
            share, per = self.group.size // units, n // units
            tp = TPSlice(dim, self.index // share * per, per)
            self.placements[name] = Placement(shape, tp, share)
            return w.detach().narrow(dim, tp.start, per).clone(), tp
        per = math.ceil(n / self.group.size)
        start = self.index * per
        length = max(0, min(n, start + per) - start)
        local = w.new_zeros((*shape[:dim], per, *shape[dim + 1:]))
        local.narrow(dim, 0, length).copy_(w.detach().narrow(dim, start, length))
        tp = TPSlice(dim, start, length)
        self.placements[name] = Placement(shape, tp, 1)
        return local, tp

    def replicate(self, name: str, p: nn.Parameter) -> nn.Parameter:
        """A parameter every tp rank holds whole (norms, MoE router and experts): its rules give it no tp axis."""
        if tp_dim(param_axes(name), self.rules) is not None:
            raise ValueError(f"{name} has a tensor-parallel axis in the rules but no sharded layer executes it.")
        self.placements[name] = Placement(tuple(p.shape), None, self.group.size)
        return p


class ColumnParallelLinear(nn.Module, Deferrable):
    """y[..., out/tp] = enter(x) @ W[rows of this rank]^T. ``enter`` is f (or the SP all-gather). Without SP the
    input gradient's all-reduce runs beside the weight-gradient matmul (``_CopyLinear``); with SP and ``regather``
    (``parallel.sp_regather``) backward gathers the sequence shard again instead of keeping the gathered input,
    each collective beside a matmul (``_GatherLinear``). In a zero-bubble pipeline (``wgrad`` set) W computes the
    weight gradient (a bias's, a sum over tokens, comes with the input gradient). ``bias``: this rank's rows of it,
    or None."""

    def __init__(self, weight: torch.Tensor, group: AxisGroup, sp: bool, regather: bool = False,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.group, self.sp, self.regather = group, sp, sp and regather
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return gather_seq(x, self.group) if self.sp else copy_to_tp(x, self.group)

    def matmul(self, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        """enter(x) @ W^T, W this layer's weight or several concatenated along the output rows (a fused QKV or
        gate/up sharing its entry), in one matmul."""
        fn, group = _CopyLinear, None  # one rank, or SP keeping the gathered input: the entry goes first
        if self.group.size > 1 and (self.regather or not self.sp):
            fn, group = (_GatherLinear if self.sp else _CopyLinear), self.group
        else:
            x = self.enter(x)
        if self.wgrad is not None:
            return _deferred(fn, x, group, self.wgrad, weights)
        return fn.apply(x, group, None, *weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.weight)
        return y if self.bias is None else y + self.bias


class RowParallelLinear(nn.Module, Deferrable):
    """y = exit(x[..., in/tp] @ W[:, columns of this rank]^T). ``exit`` is g (or the SP reduce-scatter). In a
    zero-bubble pipeline (``wgrad`` set) W computes the weight gradient."""

    def __init__(self, weight: torch.Tensor, group: AxisGroup, sp: bool) -> None:
        super().__init__()
        self.group, self.sp = group, sp
        self.weight = nn.Parameter(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight) if self.wgrad is None else deferred_linear(x, self.weight, self.wgrad)
        return scatter_seq(y, self.group) if self.sp else reduce_from_tp(y, self.group)


def _linear(sharder: Sharder, name: str, lin: nn.Linear, sp: bool, units: int | None = None, *,
            regather: bool = False) -> nn.Module:
    """The sharded twin of ``lin`` the rules ask for: column-parallel (dim 0 split) or row-parallel (dim 1);
    ``units`` as in ``Sharder.shard``. A column-parallel layer's bias is split as its weight's rows."""
    local, tp = sharder.shard(name, lin.weight, units)
    if tp is None or tp.dim not in (0, 1):
        raise ValueError(f"{name}: the rules must split a linear weight along dim 0 or 1 over tp.")
    if lin.bias is not None and tp.dim != 0:
        raise ValueError(f"{name}: a row-parallel layer with a bias is not supported (it would be added tp times).")
    if tp.dim == 0:
        bias = None if lin.bias is None else sharder.shard(name.removesuffix("weight") + "bias", lin.bias, units)[0]
        return ColumnParallelLinear(local, sharder.group, sp, regather, bias)
    return RowParallelLinear(local, sharder.group, sp)


class ParallelAttention(nn.Module):
    """GQA attention on this rank's heads: fused QKV (one matmul over the concatenated column shards
    of wq, wk, wv, one entry collective), RoPE, the attention core, row-parallel output projection.
    With fewer kv heads than tp, wk and wv are the one kv head this rank's query heads use (replicated)."""

    def __init__(self, attn: Attention, sharder: Sharder, prefix: str, sp: bool, regather: bool = False) -> None:
        super().__init__()
        self.head_dim = attn.head_dim
        self.wq, self.wk, self.wv, self.wo = (
            _linear(sharder, f"{prefix}.{n}.weight", getattr(attn, n), sp, attn.n_kv_heads if n in ("wk", "wv")
                    else None, regather=regather) for n in ("wq", "wk", "wv", "wo"))
        if not all(isinstance(m, ColumnParallelLinear) for m in (self.wq, self.wk, self.wv)) or \
                not isinstance(self.wo, RowParallelLinear):
            raise ValueError("the rules must split attention by heads (wq, wk, wv by rows, wo by columns).")
        self.q_rows, self.kv_rows = self.wq.weight.shape[0], self.wk.weight.shape[0]
        # model.qk_norm: the scales are whole on every rank, each rank's gradient a partial sum over its heads
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        for n in ("q_norm", "k_norm"):
            if getattr(attn, n) is not None:
                sharder.replicate(f"{prefix}.{n}.weight", getattr(attn, n).weight)
        self.core = attn.core  # causal SDPA, or context parallelism's ring

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerKV | None = None, docs: Documents | None = None) -> torch.Tensor:
        projections = (self.wq, self.wk, self.wv)
        if torch.is_grad_enabled():  # one entry collective and one matmul serve q, k and v
            qkv = self.wq.matmul(x, *(m.weight for m in projections))
            if self.wq.bias is not None:  # model.qkv_bias (Qwen2)
                qkv = qkv + torch.cat([m.bias for m in projections]).to(qkv.dtype)  # as a linear adds its own
            q, k, v = qkv.split([self.q_rows, self.kv_rows, self.kv_rows], dim=-1)
        else:  # evaluation, generation: no fused copy of the weights per call (a decode step's few rows make the
            h = self.wq.enter(x)  # copy cost more than the matmuls); still one entry collective
            q, k, v = (F.linear(h, m.weight, m.bias) for m in projections)
        b, t = q.shape[:2]
        q, k, v = heads_with_rope(q, k, v, self.head_dim, cos, sin, self.q_norm, self.k_norm)
        y = attend(self.core, q, k, v, cache, docs)  # with a cache: this rank's kv heads only (kv_cache.py)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class ParallelFeedForward(nn.Module):
    """SwiGLU (or GeGLU) with fused gate/up (one matmul over the column shards of w1 and w3) and a row-parallel w2."""

    def __init__(self, ff: FeedForward, sharder: Sharder, prefix: str, sp: bool, regather: bool = False) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = (_linear(sharder, f"{prefix}.{n}.weight", getattr(ff, n), sp, regather=regather)
                                     for n in ("w1", "w3", "w2"))
        if not isinstance(self.w1, ColumnParallelLinear) or not isinstance(self.w2, RowParallelLinear):
            raise ValueError("the rules must split the MLP by its hidden units (w1, w3 by rows, w2 by columns).")
        self.hidden = self.w1.weight.shape[0]
        self.activation = ff.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            gate, up = self.w1.matmul(x, self.w1.weight, self.w3.weight).split(self.hidden, dim=-1)
        else:  # as ParallelAttention: no per-call copy of the fused weight without autograd
            h = self.w1.enter(x)
            gate, up = F.linear(h, self.w1.weight), F.linear(h, self.w3.weight)
        return self.w2(gated(gate, up, self.activation))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + V/tp) of the (padded) embedding; other ids contribute zeros, and the parts
    are added by an all-reduce (or a reduce-scatter to sequence shards with SP). The parts are cast to the
    compute dtype first, as the plain ``Embedding``'s output is: exact (one rank's row plus zeros) and half the
    bytes under bf16."""

    def __init__(self, weight: torch.Tensor, tp: TPSlice, group: AxisGroup, sp: bool) -> None:
        super().__init__()
        self.group, self.sp = group, sp
        self.start, self.end = tp.start, tp.start + tp.length
        self.weight = nn.Parameter(weight)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mine = (tokens >= self.start) & (tokens < self.end)
        local = torch.where(mine, tokens - self.start, torch.zeros_like(tokens))
        h = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        h = h.to(compute_dtype(h))
        return scatter_seq(h, self.group) if self.sp else reduce_from_tp(h, self.group)


class VocabParallelHead(ColumnParallelLinear):
    """LM head over this rank's vocabulary rows [start, end) of ``vocab``; returns local logits [B, T, V/tp]."""

    def __init__(self, weight: nn.Parameter, tp: TPSlice, vocab: int, group: AxisGroup, sp: bool,
                 regather: bool = False) -> None:
        nn.Module.__init__(self)
        self.group, self.sp, self.regather, self.vocab = group, sp, sp and regather, vocab
        self.start, self.end = tp.start, tp.start + tp.length
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.bias = None


def gather_vocab(logits: torch.Tensor, head: VocabParallelHead) -> torch.Tensor:
    """Full logits from the vocabulary shards (generation only: a few positions, not a batch)."""
    group = head.group
    if group.size == 1:
        return logits[..., : head.end - head.start]
    lt = logits.movedim(-1, 0).contiguous()
    out = lt.new_empty((lt.shape[0] * group.size, *lt.shape[1:]))
    comm.all_gather(out, lt, group)
    return out.movedim(0, -1)[..., : head.vocab]


class VocabParallelLoss:
    """``loss(local_logits, targets)`` -> sum of token losses, the same on every tp rank."""

    def __init__(self, head: VocabParallelHead) -> None:
        self.head = head

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.head
        return lean_cross_entropy(logits, targets, h.start, h.end - h.start, h.group)


# ----------------------------------------------------------------------------- the transformation


def head_partial(name: str) -> bool:
    """Whether parameter ``name`` is applied to each head apart (its logical axes are ``head_dim`` alone: the
    per-head norms of model.qk_norm): whole on every tp rank, but each rank's gradient covers its heads only."""
    return param_axes(name) == ("head_dim",)


class TensorParallel:
    """What ``apply_tensor_parallel`` returns: the loss to use, where each local parameter sits in its
    logical tensor, and the replicated-gradient sync (``kv_group``: the ranks sharing a kv head, or None)."""

    def __init__(self, group: AxisGroup, sp: bool, loss_fn, placements: Placements, head: VocabParallelHead,
                 kv_group: AxisGroup | None = None) -> None:
        self.group, self.sp, self.loss_fn, self.placements, self.head = group, sp, loss_fn, placements, head
        self.kv_group = kv_group

    def sync_replicated_grads(self, grads: list[torch.Tensor]) -> None:
        """Norm weights are replicated over tp. With SP each rank saw a different part of the
        sequence, so their gradients are partial sums and must be added. Without SP they are equal
        in exact arithmetic; averaging them anyway keeps the replicas bit-identical, since
        nondeterministic kernels would otherwise let them drift apart (seed 001)."""
        if self.group.size > 1 and grads:
            _all_reduce_flat(grads, self.group, "sum" if self.sp else "avg")

    def sync_head_partial_grads(self, grads: list[torch.Tensor]) -> None:
        """The per-head norms' scales (model.qk_norm) are replicated, but each rank applied them to its own heads
        only, so its gradient is its heads' part: summed over tp, with or without SP."""
        if self.group.size > 1 and grads:
            _all_reduce_flat(grads, self.group, "sum")

    def sync_shared_kv_grads(self, grads: list[torch.Tensor]) -> None:
        """A kv head shared by several tp ranks (fewer kv heads than tp) got from each rank only its own query
        heads' part of the gradient: summed over the ranks that share it ("tp_kv"), with or without SP."""
        if self.kv_group is not None and grads:
            _all_reduce_flat(grads, self.kv_group, "sum")

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Every vocabulary column of a few positions' local logits (generation)."""
        return gather_vocab(logits, self.head)


def _all_reduce_flat(grads: list[torch.Tensor], group: AxisGroup, op: str) -> None:
    """One all-reduce of ``grads`` concatenated, copied back in place."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group, op=op)
    off = 0
    for g in grads:
        g.copy_(flat[off: off + g.numel()].view_as(g))
        off += g.numel()


def apply_tensor_parallel(model: nn.Module, mesh: Mesh, rules: Rules, sp: bool = False,
                          sp_regather: bool = True) -> TensorParallel:
    """Swap the plain model's layers for tensor-parallel twins holding this rank's slices (in place), as the
    logical-axis ``rules`` say. With ``sp``, ``sp_regather`` makes the column-parallel layers (fused QKV,
    gate/up, the head) keep their sequence shard for backward and gather it again there. Shape checks (tp
    divides heads and hidden; divides kv heads or is a multiple of them) are the config's
    (``config.validate``), before any process starts."""
    check_executable(rules)
    group = mesh.group("tp")
    sharder = Sharder(rules, group, mesh.coord("tp"))
    cfg: ModelConfig = model.cfg
    kv_group = None
    if cfg.kv_heads < group.size:  # each kv head on tp / kv_heads consecutive ranks: they sum its gradient
        kv_group = mesh.group("tp_kv")
        if kv_group.size * cfg.kv_heads != group.size:
            raise ValueError(f"tp={group.size} with {cfg.kv_heads} kv heads needs the mesh built with "
                             f"kv_share={group.size // cfg.kv_heads}, not {kv_group.size}.")
    for key, block in model.layers.items():
        block: Block
        prefix = f"layers.{key}"
        block.attention = ParallelAttention(block.attention, sharder, f"{prefix}.attention", sp, sp_regather)
        if isinstance(block.feed_forward, FeedForward):
            block.feed_forward = ParallelFeedForward(block.feed_forward, sharder, f"{prefix}.feed_forward", sp,
                                                     sp_regather)
        else:  # a mixture of experts: router and experts are whole on every tp rank (the rules give them no tp axis)
            for name, p in block.feed_forward.named_parameters():
                sharder.replicate(f"{prefix}.feed_forward.{name}", p)
        for norm in ("attention_norm", "ffn_norm"):
            sharder.replicate(f"{prefix}.{norm}.weight", getattr(block, norm).weight)
    if sp:
        model.seq_shards = group.size
    emb_w, emb_tp = sharder.shard("tok_embeddings.weight", model.tok_embeddings.weight)
    if emb_tp is None or emb_tp.dim != 0:
        raise ValueError("the rules must split the embedding by vocabulary rows over tp.")
    emb = VocabParallelEmbedding(emb_w, emb_tp, group, sp)
    model.tok_embeddings = emb
    if cfg.tie_embeddings:  # the same vocabulary rows, the same parameter
        head = VocabParallelHead(emb.weight, emb_tp, cfg.vocab_size, group, sp, sp_regather)
    else:
        head_w, head_tp = sharder.shard("output.weight", model.output.weight)
        head = VocabParallelHead(head_w, head_tp, cfg.vocab_size, group, sp, sp_regather)
    model.output = head
    sharder.replicate("norm.weight", model.norm.weight)
    return TensorParallel(group, sp, VocabParallelLoss(head), sharder.placements, head, kv_group)
