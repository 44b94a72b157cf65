"""The step-time and memory estimate of one layout, per optimizer step on the critical rank:

- each pipeline stage action costs its matmul time (roofline of FLOPs at ``efficiency`` x peak and HBM
  traffic) plus its tensor-parallel collectives (on the critical path, less what backward runs beside its
  column layers' matmuls where the hardware overlaps: ``tp_hidden_backward``) plus the ring-attention transfers not
  hidden behind attention; backward is twice forward, plus under full recompute each block's forward again up to
  a dense block's MLP exit (``full_recompute_time``), and under recompute (full or selective) the block
  collectives the rerun forward issues again (``tp_recomputed``, EP's all-to-alls, CP's exchanges: exposed under
  selective, which keeps attention's outputs and so has no attention to hide them);
- the pipeline is run by the simulator (``plan/simulator.py``) with those costs and the p2p
  time of one activation: its makespan holds the bubble and the p2p waits; without pp it is microbatches x
  (F + B);
- data-parallel / ZeRO collectives overlap the compute they can (gradient reduction with the last
  backward, ZeRO-3 gathers with forward and backward), what does not fit and the last bucket are exposed;
  ZeRO-1/2's all-gather of updated parameters after the optimizer step is exposed (the runtime does it then);
- the optimizer step reads and writes the local parameters, gradients and moments at HBM bandwidth.

On the GPU presets (``hw.gpu_kernels``) the roofline is completed by what a GPU measurably spends beside its
matmuls (``hardware.GPU_KERNELS``, from an H100's kernel profile): the element-wise kernels at HBM bandwidth in
proportion to the activations a block keeps, attention's cost per score beyond its FLOPs, each weight's cast and
gradient copy per microbatch, and the clip and AdamW per parameter. They add rather than overlap the matmuls:
a GPU runs one kernel at a time within a step. The TPU presets keep the book's roofline.

A calibrated profile (``meshtrain plan --calibrate``: ``hw.measured_steps``) replaces the roofline by the measured
step costs of ``plan/costfit.py`` (matmul FLOPs at the measured rate, non-matmul elements, attention scores, block
calls; parameters and a fixed cost for the optimizer step), divides each process's share of the machine when more
processes than cores run (``Hardware.shared_by``), and hides no communication behind compute when every core is busy
computing (``overlaps``). There every collective costs its op's own measured latency and bandwidth plus the host
work of each call the comm meter counts (``op_time``; the calls per step are ``comm_bytes.py``'s ``*_calls``), and
each block of a layout using tp, cp, MoE+ep, ZeRO-3, a zero-bubble schedule or selective recompute the runtime's
own work that axis adds (``axis_block_time``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from meshtrain.config import ModelConfig
from meshtrain.plan.comm_bytes import (
    TP_BESIDE_MATMUL,
    cp_block_elems,
    cp_ring_bytes,
    dp_family_bytes,
    ep_all_to_all_bytes,
    pp_p2p_bytes,
    tp_layer_collectives,
)
from meshtrain.plan.costfit import StepCosts, block_features, head_features
from meshtrain.plan.flops import attention_flops_per_token, flops_per_token, layer_flops, param_count, stage_part_flops
from meshtrain.plan.hardware import Hardware
from meshtrain.plan.memory import (
    MESHTRAIN_BF16,
    Precision,
    activation_bytes,
    activation_elems_per_token,
    autocast_copy_numel,
    logits_bytes,
    masked_attention,
    state_bytes,
)
from meshtrain.plan.network import Link, collective_time, dp_axes, exposed, group_link
from meshtrain.plan.pipeline_cost import pipeline_sim_fast, stage_partition
from meshtrain.plan.problem import Collective, Estimate, Layout, Problem, StepTime
from meshtrain.plan.units import block_params, expert_params_per_rank, unit_numels


def layer_compute_time(cfg: ModelConfig, tokens: int, seq_len: int, flops: float, hbm_bw: float = 0.0,
                       tp: int = 1, efficiency: float = 1.0, weight_bytes: int = 2, act_bytes: int = 2) -> float:
    """Forward seconds of one block on one device for ``tokens`` tokens: the roofline max of its FLOPs
    (split tp ways) at ``efficiency`` x peak and of its HBM traffic (weights read once, activations written
    and read once) when ``hbm_bw`` is given. Small microbatches on wide tensor parallelism turn HBM-bound.
    With fewer kv heads than tp, each rank also projects its (replicated) kv head: the k and v matmuls
    cost max(kv heads, tp) / tp heads per rank, not kv heads / tp."""
    kv_extra = 2 * 2 * cfg.d_model * cfg.head_dim * max(0, tp - cfg.kv_heads) / tp  # forward FLOPs per token
    t_flops = tokens * (layer_flops(cfg, seq_len) / tp + kv_extra) / (flops * efficiency)
    if hbm_bw <= 0:
        return t_flops
    traffic = block_params(cfg) / tp * weight_bytes + 2 * tokens * activation_elems_per_token(cfg, "none", tp) \
        * act_bytes
    return max(t_flops, traffic / hbm_bw)


def overlaps(hw: Hardware, devices: int) -> bool:
    """Whether communication can run beside compute: on GPUs (the copy engines, NCCL's own SMs) it can; processes
    sharing CPU cores (a calibrated profile with at least one process per core) have no idle core for gloo's
    work, so a collective waits for, and is waited for by, the compute beside it."""
    return not (hw.cores and devices >= hw.cores)


def op_time(hw: Hardware, op: str, payload: float, link: Link, calls: int = 1, metered: int | None = None) -> float:
    """Seconds of ``calls`` equal ``op`` collectives moving ``payload`` bytes between them over ``link``: each call
    ``network.collective_time`` at the op's own measured latency and bandwidth where the profile has them
    (``hw.collective_fits``, ``--calibrate``), plus ``hw.call_s`` of host work per call the comm meter counts
    (``metered``, default ``calls``: a ring hop is a send and a receive, two counted calls, one transfer)."""
    if payload <= 0 or link.n <= 1:
        return 0.0
    op = "send" if op in ("recv", "p2p") else op  # a receive is the other end of a send
    fit = hw.collective_fits.get(op)
    if fit:
        lat, bw = fit
        link = replace(link, intra_latency=lat, inter_latency=lat, intra_bw=bw, inter_bw=bw)
    return calls * collective_time(op, payload / calls, link) + (calls if metered is None else metered) * hw.call_s


def tokens_per_microbatch(sequences: int, seq_len: int, lay: Layout) -> int:
    """Tokens one rank runs through a block per microbatch: its data-parallel share of the ``sequences``, its
    microbatch of them, its context-parallel part of each."""
    return sequences // lay.dp // lay.microbatches * seq_len // lay.cp


AXIS_TERM_COUNT = 5  # per block call, activation element, microbatch, block parameter, attention score


def _axis_terms(work: float | list[float]) -> tuple[float, ...]:
    """An ``axis_block_s`` entry as (s per block call, s per activation element, s per microbatch, s per parameter of
    a block, s per attention score); older profiles hold a number (per block call) or the first terms."""
    if isinstance(work, (int, float)):
        work = [work]
    return tuple([*map(float, work), *[0.0] * AXIS_TERM_COUNT][:AXIS_TERM_COUNT])


def axis_features(cfg: ModelConfig, lay: Layout, t: float, seq_len: int) -> list[float]:
    """What one microbatch of ``t`` tokens per rank (of ``seq_len``-token sequences) exposes to each term of an axis's
    runtime work on a rank running ``blocks`` blocks: [block calls, activation elements of them (t x d_model each),
    1, the parameters of them (this rank's tp share), the causal attention scores they compute (t x seq_len / 2 per
    head of the rank's)]. ``calibrate.measure_axis_work`` fits the terms on these, ``axis_block_time`` prices
    them."""
    blocks = cfg.n_layers / lay.pp
    elems, params, scores = _block_sizes(cfg, lay, t, seq_len)
    return [blocks, blocks * elems, 1.0, blocks * params, blocks * scores]


def _block_sizes(cfg: ModelConfig, lay: Layout, t: float, seq_len: int) -> tuple[float, float, float]:
    """One block's (activation elements, parameters of the rank's tp share, causal attention scores of the rank's
    heads) for ``t`` tokens per rank: what ``axis_features`` counts per block."""
    return t * cfg.d_model, block_params(cfg) / lay.tp, t * seq_len / 2 * cfg.n_heads / lay.tp


def _axes_used(lay: Layout, cfg: ModelConfig) -> list[str]:
    cp_axis = "cp" if lay.cp_attention == "ring" else f"cp_{lay.cp_attention}"  # each CP attention's own work
    return [axis for axis, on in (("tp", lay.tp > 1), (cp_axis, lay.cp > 1),
                                  ("moe", bool(cfg.moe_experts) and lay.ep > 1),
                                  ("zero3", lay.zero == 3 and lay.dp * lay.cp > 1),
                                  ("zb", lay.pp > 1 and lay.schedule in ("zb-h1", "dualpipev")),
                                  ("selective", lay.recompute == "selective")) if on]


def _axis_work(hw: Hardware, lay: Layout, cfg: ModelConfig) -> list[tuple[float, ...]]:
    """The measured terms of each axis ``lay`` uses (``_axis_terms``). All-gather attention is priced as the ring's
    (``cp``: the same per-chunk attention and merges; ``calibrate.AXIS_TERMS``), and so is Ulysses by a profile
    calibrated before it had a run of its own."""
    out = []
    for axis in _axes_used(lay, cfg):
        if axis not in hw.axis_block_s and axis.startswith("cp_"):
            axis = "cp"
        if axis in hw.axis_block_s:
            out.append(_axis_terms(hw.axis_block_s[axis]))
    return out


def axis_block_time(hw: Hardware, lay: Layout, cfg: ModelConfig, t: float, seq_len: int) -> float:
    """Seconds per block forward + backward of the parallel runtime's own work for ``lay``'s axes on ``t`` tokens per
    rank and microbatch, as ``--calibrate`` measured it through ``parallelize()`` (``hw.axis_block_s``; empty for the
    datasheet presets): TP's autograd functions, ring attention's per-chunk attention and merges, MoE routing and
    the expert exchange's bookkeeping, ZeRO-3's flat-buffer gathers and reshards, a zero-bubble schedule's split
    backward (input gradients first, weight gradients deferred), selective recompute's policy (a Python dispatch
    mode over every op of the forward and its rerun); context parallelism's by its attention (``cp``
    for the ring, ``cp_allgather``, ``cp_ulysses``: the per-chunk attention and merges grow with the scores). Per
    axis: a part per block call, one per activation element (``t x d_model``), one per parameter of the block (the
    rank's tp share) and one per attention score (``axis_features``); the part per microbatch is
    ``axis_microbatch_time``."""
    per_elem, per_param, per_score = _block_sizes(cfg, lay, t, seq_len)
    total = 0.0
    for call, elem, _, param, score in _axis_work(hw, lay, cfg):
        total += call + elem * per_elem + param * per_param + score * per_score
    return total


def axis_microbatch_time(hw: Hardware, lay: Layout, cfg: ModelConfig) -> float:
    """Seconds per microbatch forward + backward of the runtime work of ``lay``'s axes outside the blocks (TP's
    vocab-parallel embedding, head and loss, ...): the third term of ``hw.axis_block_s``, charged to the stage
    holding the head."""
    return sum(terms[2] for terms in _axis_work(hw, lay, cfg))


def gpu_kernel_time(hw: Hardware, features: dict[str, float], params: float) -> float:
    """Forward + backward seconds a GPU spends beside the matmuls on work of ``features`` (``block_features`` or
    ``head_features``) whose weights hold ``params`` parameters: the element-wise kernels at HBM bandwidth, attention
    beyond its FLOPs, and each weight's cast and gradient copy (``hardware.GPU_KERNELS``, measured on an H100)."""
    return (features.get("elems", 0.0) * hw.elem_bytes / hw.hbm_bw
            + features.get("scores", 0.0) * hw.score_flops / hw.bf16_flops + params * hw.cast_bytes / hw.hbm_bw)


def gpu_optimizer_bytes(hw: Hardware, prec: Precision) -> float:
    """HBM bytes per local parameter of the clip and the optimizer step on a GPU preset: ``hw.optim_bytes``,
    measured with meshtrain's fp32 state, in proportion for another precision to what the kernels move by hand
    (AdamW reads parameter, gradient and moments and writes parameter and moments; the clip reads the gradient
    for its norm, then reads and writes it to scale it)."""
    def by_hand(p: Precision) -> int:
        return 2 * p.param + p.grad + 2 * p.optim + 3 * p.grad

    return hw.optim_bytes * by_hand(prec) / by_hand(MESHTRAIN_BF16)


def step_costs(hw: Hardware) -> StepCosts:
    """The measured step-cost terms a calibrated profile carries (``plan/costfit.py``)."""
    return StepCosts(hw.bf16_flops, hw.elem_s, hw.score_s, hw.block_s, hw.param_s, hw.step_s)


@dataclass
class StageAction:
    """Seconds of one pipeline stage action (one chunk of layers of the slowest stage, one microbatch) by cause,
    forward (``*_f``) and backward (``*_b``); a rank runs ``virtual`` such chunks per microbatch. The links, ring
    bytes and attention time are kept for ``explain``'s table of collectives."""

    blocks: list[int]  # blocks per stage (the runtime's partition)
    compute_f: float
    compute_b: float
    tp_f: float
    tp_b: float
    ep_f: float
    ep_b: float
    cp_f: float
    cp_b: float
    tp_link: Link
    cp_link: Link
    ring: dict[str, int]
    attn_f: float

    @property
    def layers(self) -> int:
        return max(self.blocks)

    @property
    def forward(self) -> float:
        return self.compute_f + self.tp_f + self.cp_f + self.ep_f

    @property
    def backward(self) -> float:
        return self.compute_b + self.tp_b + self.cp_b + self.ep_b


def stage_action(problem: Problem, lay: Layout, t: int) -> StageAction:
    """The slowest stage's forward and backward for ``t`` tokens per rank: matmuls (roofline), recomputation,
    and the collectives on the critical path (TP/SP, EP all-to-alls, CP's exchanges: ``cp_block_time``)."""
    cfg, hw, prec = problem.model, problem.hw, problem.precision
    T, tp, cp = problem.seq_len, lay.tp, lay.cp
    C = hw.bf16_flops
    eff = matmul_rate(problem) / C  # a calibrated profile's measured rate is reached as it is
    d = cfg.d_model

    # --- compute of one stage action (the slowest stage; interleaved ranks run v chunks of it)
    n_stages = lay.pp * lay.virtual
    blocks, _ = stage_partition(cfg, T, n_stages) if n_stages > 1 else ([cfg.n_layers], [0.0])
    _, _, head_flops = stage_part_flops(cfg, T)
    redo = activation_elems_per_token(cfg, "none", tp, lay.sp) - activation_elems_per_token(
        cfg, "selective", tp, lay.sp)  # element-wise work selective recompute reruns, per token and block
    if hw.measured_steps:  # measured costs (--calibrate): the features costfit.py fitted, forward = 1/3
        costs = step_costs(hw)
        t_layer = costs.seconds(block_features(cfg, t, T, tp, lay.sp)) / 3
        t_head = costs.seconds(head_features(cfg, t, T, tp)) / 3
        redo_s = max(redo, 0.0) * t * costs.elem_s / 3
    elif hw.gpu_kernels:  # the matmuls' roofline plus what a GPU measurably spends beside them
        weights = block_params(cfg) / tp * prec.act / hw.hbm_bw  # a small microbatch's matmuls read their weights
        t_layer = max(layer_compute_time(cfg, t, T, C, 0.0, tp, eff), weights) \
            + gpu_kernel_time(hw, block_features(cfg, t, T, tp, lay.sp), block_params(cfg) / tp) / 3
        t_head = t * head_flops / tp / (C * eff) \
            + gpu_kernel_time(hw, head_features(cfg, t, T, tp), cfg.vocab_size * cfg.d_model / tp) / 3
        redo_s = max(redo, 0.0) * t * hw.elem_bytes / hw.hbm_bw / 3  # the forward's share of the element work
    else:
        t_layer = layer_compute_time(cfg, t, T, C, hw.hbm_bw, tp, eff, prec.act, prec.act)
        t_head = t * head_flops / tp / (C * eff)
        redo_s = 2 * max(redo, 0.0) * t * prec.act / hw.hbm_bw  # HBM-bound
    t_layer += axis_block_time(hw, lay, cfg, t, T) / 3  # the parallel runtime's own work, a third of it forward
    t_head += axis_microbatch_time(hw, lay, cfg) / 3
    if cfg.moe_experts and tp > 1 and not lay.sp:
        # MoE blocks are not split by tp: without SP every tp rank runs them on the same tokens.
        t_layer += t * 2.0 * param_count(cfg).active_mlp / cfg.n_layers * (1 - 1 / tp) / (C * eff)
    stage_f = [blocks[s] * t_layer + (t_head if s == n_stages - 1 else 0.0) for s in range(n_stages)]
    f_c = max(stage_f)
    layers_max = max(blocks)
    b_c = 2 * f_c
    if lay.recompute == "full":  # each block's forward again, not the head's (``full_recompute_time``)
        b_c += layers_max * full_recompute_time(cfg, t, tp, C * eff, t_layer)
    elif lay.recompute == "selective":  # element-wise ops rerun
        b_c += layers_max * redo_s

    # --- tensor parallelism: every collective on the critical path
    tp_link = group_link(hw, tp, 1)
    tp_f = tp_b = 0.0
    for what, op, nbytes, phase in tp_layer_collectives(t, d, tp, lay.sp, prec.act, lay.sp_regather,
                                                        mlp_tp=not cfg.moe_experts):
        dt = op_time(hw, op, nbytes, tp_link) * layers_max
        if phase == "fwd":
            tp_f += dt
            if tp_recomputed(lay, what, phase):
                tp_b += dt
        else:
            tp_b += dt
    if tp > 1:  # embedding output / head input gradient: one more activation each way (under SP a reduce-scatter
        # and an all-gather, and the head's input re-gathered in backward), and the loss's three small all-reduces
        tp_f += op_time(hw, "all_reduce", t * d * prec.act, tp_link, metered=2 if lay.sp else 1) \
            + op_time(hw, "all_reduce", 3 * 4 * t, tp_link, calls=3)
        tp_b += op_time(hw, "all_reduce", t * d * prec.act, tp_link,
                        metered=(3 if lay.sp_regather else 2) if lay.sp else 1)
    if overlaps(hw, problem.devices):
        tp_b -= layers_max * sum(tp_hidden_backward(problem, lay, t, tp_link, matmul_rate(problem)).values())

    # --- expert parallelism: dispatch and combine all-to-alls on the critical path, per MoE block
    ep_link = group_link(hw, lay.ep, tp, 1)
    a2a = ep_all_to_all_bytes(t // (tp if lay.sp else 1), d, cfg.moe_top_k, lay.ep, prec.act) \
        if cfg.moe_experts else {"fwd": 0, "bwd": 0}
    # forward: the per-expert counts, dispatch and combine (3 calls); backward: the two row exchanges reversed
    ep_f = layers_max * op_time(hw, "all_to_all", a2a["fwd"], ep_link, calls=2, metered=3)
    ep_b = layers_max * op_time(hw, "all_to_all", a2a["bwd"], ep_link, calls=2)
    if lay.recompute != "none":  # the block's forward runs again in backward, its exchanges with it
        ep_b += ep_f

    # --- context parallelism: the ring's transfers hidden behind attention where they fit, the others exposed
    cp_link = group_link(hw, cp, tp, 1)
    ring = cp_ring_bytes(t, cfg, cp, tp, prec.act)
    attn_f = t * attention_flops_per_token(cfg, T) / cfg.n_layers / tp / (C * eff)
    cp_f, cp_b = (layers_max * x for x in cp_block_time(problem, lay, t, cp_link, attn_f))
    if lay.recompute == "full":
        cp_b += cp_f  # the recomputed forward exchanges again, beside its attention again
    elif lay.recompute == "selective":  # exchanges again, but attention's outputs are kept: nothing to hide behind
        cp_b += layers_max * cp_block_time(problem, lay, t, cp_link, 0.0)[0]
    return StageAction(blocks, f_c, b_c, tp_f, tp_b, ep_f, ep_b, cp_f, cp_b, tp_link, cp_link, ring, attn_f)


def full_recompute_time(cfg: ModelConfig, t: int, tp: int, rate: float, t_layer: float) -> float:
    """Seconds full recompute adds to one block's backward, whose forward takes ``t_layer`` for ``t`` tokens per rank:
    its forward again, less a dense block's MLP exit matmul. Non-reentrant checkpointing stops the rerun once every
    tensor backward needs is rebuilt; the exit's output is needed by nothing (its input is what backward keeps), so
    the rerun ends before it, and before its collective (``tp_recomputed``). A MoE block reruns whole: its combine's
    output is kept for the router weights' gradient, so the experts' down projections run again."""
    if cfg.moe_experts:
        return t_layer
    return max(0.0, t_layer - t * 2 * cfg.d_model * cfg.hidden_dim / tp / rate)


def tp_recomputed(lay: Layout, what: str, phase: str) -> bool:
    """Whether recompute (full or selective) runs block collective ``what`` of ``tp_layer_collectives`` again in
    backward. The block's forward is rerun up to the last activation backward needs, the input of its final matmul
    (``comm_bytes.tp_comm_bytes``, which the comm meter checks): every forward collective but the MLP's exit."""
    return lay.recompute != "none" and phase == "fwd" and what != "mlp out"


def matmul_rate(problem: Problem) -> float:
    """FLOP/s the step time's matmuls run at: the peak at the problem's efficiency, or a calibrated profile's
    measured rate as it is."""
    hw = problem.hw
    return hw.bf16_flops * (1.0 if hw.measured_steps else problem.efficiency)


def tp_column_matmul_time(cfg: ModelConfig, t: int, tp: int, rate: float) -> dict[str, float]:
    """Seconds of one forward matmul of each column-parallel layer of a block ({"attention": fused QKV, "mlp": fused
    gate/up}) on ``t`` tokens at ``rate`` FLOP/s: this rank's output columns (its query heads and kv heads, one
    replicated kv head where tp > kv heads; its share of the hidden units) by d_model. Its input-gradient and
    weight-gradient matmuls in backward cost the same FLOPs each."""
    qkv = (cfg.n_heads // tp + 2 * max(cfg.kv_heads // tp, 1)) * cfg.head_dim
    return {"attention": 2.0 * t * cfg.d_model * qkv / rate,
            "mlp": 2.0 * t * cfg.d_model * 2 * cfg.hidden_dim / tp / rate}


def tp_hidden_backward(problem: Problem, lay: Layout, t: int, link: Link, rate: float) -> dict[str, float]:
    """Seconds of one block's TP backward collectives hidden behind a matmul where the hardware runs both at once
    (``overlaps``), by ``tp_layer_collectives``' name (``comm_bytes.TP_BESIDE_MATMUL``): with SP a column layer's
    re-gather under its input-gradient matmul and its input gradient's reduce-scatter under its weight-gradient
    matmul; without SP its input gradient's all-reduce under its weight-gradient matmul. Each is hidden up to that
    matmul's time (``tp_column_matmul_time`` at ``rate``)."""
    cfg, prec = problem.model, problem.precision
    if lay.tp <= 1:
        return {}
    matmul = tp_column_matmul_time(cfg, t, lay.tp, rate)
    out = {}
    for what, op, nbytes, phase in tp_layer_collectives(t, cfg.d_model, lay.tp, lay.sp, prec.act, lay.sp_regather,
                                                        mlp_tp=not cfg.moe_experts):
        if phase == "bwd" and what in TP_BESIDE_MATMUL:
            out[what] = min(op_time(problem.hw, op, nbytes, link), matmul[TP_BESIDE_MATMUL[what]])
    return out


def cp_block_time(problem: Problem, lay: Layout, t: int, link: Link, attn_f: float) -> tuple[float, float]:
    """Seconds of one block's context-parallel exchanges on the critical path for ``t`` tokens per rank (forward,
    backward), by ``lay.cp_attention`` (the bytes and calls are ``comm_bytes.cp_comm_bytes`` / ``cp_calls``'):

    - ring: K/V round the ring in cp - 1 hops (a send and a receive each), and in backward again with the dK/dV
      accumulators, each hop beside the attention on the chunk already held: only what attention (``attn_f``
      forward, twice that backward) cannot hide is exposed;
    - allgather: one all-gather of K/V before attention forward, one reduce-scatter of the fp32 dK/dV after it
      backward, both exposed (attention waits for the whole K/V);
    - ulysses: two all-to-alls forward (q, k and v packed; the output back) and the same two reversed backward,
      exposed: the core needs every position of its heads, and the block its output."""
    cfg, hw, prec, cp, tp = problem.model, problem.hw, problem.precision, lay.cp, lay.tp
    if cp <= 1:
        return 0.0, 0.0
    q, kv = cp_block_elems(cfg, t, tp)
    if lay.cp_attention == "ulysses":
        qkv_out = (2 * q + kv) * prec.act  # q, k, v one way, the output back
        one_way = op_time(hw, "all_to_all", qkv_out, link, calls=2)
        return one_way, one_way
    if lay.cp_attention == "allgather":
        return (op_time(hw, "all_gather", cp * kv * prec.act, link),
                op_time(hw, "reduce_scatter", cp * kv * 4, link))
    ring = cp_ring_bytes(t, cfg, cp, tp, prec.act)
    hide = attn_f if overlaps(hw, problem.devices) else 0.0  # what attention can hide of the ring
    hops = cp - 1  # each hop a send and a receive (two counted calls); backward passes K/V and dK/dV
    return (max(0.0, op_time(hw, "send", ring["fwd"], link, hops, 2 * hops) - hide),
            max(0.0, op_time(hw, "send", ring["bwd"], link, 2 * hops, 4 * hops) - 2 * hide))


def pipeline_time(problem: Problem, lay: Layout, t: int, act: StageAction, step: StepTime) -> tuple[float, list[int]]:
    """Fill ``step``'s compute, TP, CP, EP, bubble and p2p parts: the simulated schedule under pipeline
    parallelism, else microbatches x (F + B). Returns the p2p time of one activation and the in-flight peaks."""
    hw, prec, pp, mc, v = problem.hw, problem.precision, lay.pp, lay.microbatches, lay.virtual
    F, B = act.forward, act.backward
    p2p_t = 0.0
    peaks = [1] * pp
    if pp > 1:
        world = problem.devices
        p2p_link = group_link(hw, 2, world // pp)
        p2p_t = op_time(hw, "send", pp_p2p_bytes(t, problem.model.d_model, lay.tp, lay.sp, prec.act), p2p_link)
        span0, idle0, peaks = pipeline_sim_fast(lay.schedule, pp, mc, v, F, B, 0.0)
        span, _, _ = pipeline_sim_fast(lay.schedule, pp, mc, v, F, B, p2p_t)
        busy = span0 - idle0
        step.bubble = max(0.0, idle0)
        step.p2p = max(0.0, span - span0)
        scale = busy / (mc * v * (F + B)) if F + B > 0 else 1.0  # 1 up to the simulator's rounding
    else:
        scale = 1.0
    step.compute = mc * v * (act.compute_f + act.compute_b) * scale
    step.tp = mc * v * (act.tp_f + act.tp_b) * scale
    step.cp = mc * v * (act.cp_f + act.cp_b) * scale
    step.ep = mc * v * (act.ep_f + act.ep_b) * scale
    return p2p_t, peaks


@dataclass
class DataParallel:
    """The data-parallel family of the heaviest rank: its units, their bytes per (group, op) and the groups' links."""

    units: list[int]
    bytes: dict[tuple[str, str], int]
    dp_link: Link
    shard_link: Link
    rep_link: Link


def data_parallel_time(problem: Problem, lay: Layout, act: StageAction) -> tuple[float, DataParallel]:
    """Seconds of data-parallel / ZeRO communication left exposed, over dp x cp (the runtime's dp_cp /
    dp_shard_cp / dp_replicate groups), by how much each collective overlaps the compute it can."""
    cfg, hw, prec = problem.model, problem.hw, problem.precision
    tp, pp, cp, v, mc = lay.tp, lay.pp, lay.cp, lay.virtual, lay.microbatches
    blocks, layers_max = act.blocks, act.layers
    F, B = act.forward, act.backward
    if not overlaps(hw, problem.devices):  # no idle core to run gloo on: every collective is on the critical path
        F = B = 0.0
    first_units = unit_numels(cfg, tp, range(blocks[0] if pp > 1 else cfg.n_layers), True, pp == 1, lay.ep)
    last_units = unit_numels(cfg, tp, range(blocks[-1]), False, True, lay.ep) if pp > 1 else first_units
    if pp > 1 and v > 1:  # interleaved / V: a rank holds v chunks; count the heaviest rank's blocks
        first_units = unit_numels(cfg, tp, range(layers_max * v), True, lay.schedule == "dualpipev", lay.ep)
        last_units = unit_numels(cfg, tp, range(layers_max * v), lay.schedule == "dualpipev", True, lay.ep)
    units = max(first_units, last_units, key=sum)
    psi = sum(units)
    ndp = lay.dp * cp
    shard = lay.shard * cp
    accum = mc if pp == 1 else 1
    dp_bytes = dp_family_bytes(units, lay.zero, ndp, accum, shard if lay.dp_shard else 0, prec.reduce, prec.param,
                               prec.gather)
    axes = dp_axes(hw, lay.tp, lay.cp, lay.pp)
    dp_link = group_link(hw, ndp, tp, axes)
    shard_link = group_link(hw, shard, tp, axes)
    rep_link = group_link(hw, lay.dp // lay.shard, tp * shard, axes)
    # One call per unit and repetition (ZeRO-0: per 25 MB bucket), so per-call latency counts too.
    nu = len(units)
    reps_rs = accum if lay.zero >= 2 else 1
    reps_ag = 2 * accum if lay.zero == 3 else 1
    t_rs = op_time(hw, "reduce_scatter", dp_bytes.get(("dp_shard_cp", "reduce_scatter"), 0), shard_link, nu * reps_rs)
    t_ag = op_time(hw, "all_gather", dp_bytes.get(("dp_shard_cp", "all_gather"), 0), shard_link, nu * reps_ag)
    ar_bytes = dp_bytes.get(("dp_cp", "all_reduce"), 0)
    t_ar = op_time(hw, "all_reduce", ar_bytes, dp_link, max(1, math.ceil(ar_bytes / 25e6)))
    t_rep = op_time(hw, "all_reduce", dp_bytes.get(("dp_replicate", "all_reduce"), 0), rep_link, nu)
    last_frac = units[0] / psi  # the embedding's bucket is reduced last: nothing left to hide it
    if lay.zero == 0:
        dp_time = exposed(t_ar, B, t_ar * last_frac)
    elif lay.zero in (1, 2):
        rs_window = B * (accum if lay.zero == 2 else 1)
        dp_time = exposed(t_rs + t_rep, rs_window, (t_rs + t_rep) * last_frac) + t_ag
    else:
        # Per microbatch: half the gathers prefetched under forward, the other half (the runtime reshards
        # after forward) and the reduce-scatter under backward; the replicas' all-reduce joins the last one.
        ag_mb, rs_mb = t_ag / accum, t_rs / accum
        fwd = exposed(ag_mb / 2, F, ag_mb / 2 * units[0] / psi)
        bwd = ag_mb / 2 + rs_mb
        dp_time = accum * fwd + (accum - 1) * exposed(bwd, B, rs_mb * last_frac) \
            + exposed(bwd + t_rep, B, (rs_mb + t_rep) * last_frac)
    # Expert parallelism: the rank's experts' gradients are all-reduced (ZeRO-0) or reduce-scattered and their
    # parameters re-gathered (ZeRO-1/2) over edp = dp x cp / ep once per step, under the last backward.
    experts = expert_params_per_rank(cfg, lay.ep, layers_max * v)
    edp = ndp // lay.ep
    if experts and edp > 1:
        edp_link = group_link(hw, edp, tp * lay.ep, axes)
        dp_time += exposed(op_time(hw, "all_reduce", experts * prec.reduce, edp_link), B)
    if cfg.tie_embeddings and pp > 1 and lay.schedule != "dualpipev":
        # The tied weight's gradient added between the first and the last stage after the sync (parallel/tied.py):
        # its tp slice, or ZeRO-1 shard; exposed. The two ranks are (pp - 1) x dp x cp x tp apart.
        tied = math.ceil(cfg.vocab_size / tp) * cfg.d_model / (shard if lay.zero >= 1 else 1)
        ends = group_link(hw, 2, (pp - 1) * problem.devices // pp)
        dp_time += op_time(hw, "all_reduce", tied * prec.reduce, ends)
    return dp_time, DataParallel(units, dp_bytes, dp_link, shard_link, rep_link)


def kv_grad_elems(problem: Problem, lay: Layout, layers: int) -> float:
    """Gradient elements of shared kv heads one rank all-reduces per step (0 unless kv heads < tp): its wk and
    wv (one head each) in every block it holds (``layers`` per stage chunk), the shard it owns under ZeRO."""
    cfg = problem.model
    if cfg.kv_heads >= lay.tp:
        return 0.0
    elems = 2.0 * cfg.head_dim * cfg.d_model * layers * lay.virtual
    return elems / (lay.shard * lay.cp) if lay.zero >= 1 else elems


def kv_grad_time(problem: Problem, lay: Layout, act: StageAction) -> float:
    """Seconds of the shared kv heads' gradient all-reduce over the tp / n_kv_heads consecutive tp ranks that
    share each head ("tp_kv"), once per step after the last backward: exposed, like the runtime's."""
    elems = kv_grad_elems(problem, lay, act.layers)
    if not elems:
        return 0.0
    return op_time(problem.hw, "all_reduce", elems * problem.precision.grad, _kv_link(problem, lay))


def _kv_link(problem: Problem, lay: Layout) -> Link:
    return group_link(problem.hw, lay.tp // problem.model.kv_heads, 1)


def memory(problem: Problem, lay: Layout, t: int, act: StageAction, units: list[int], inflight: int
           ) -> dict[str, float]:
    """Bytes of the heaviest rank by kind: parameters, gradients and optimizer state (ZeRO-sharded), its experts,
    ZeRO-3's gathered units, autocast's bf16 copies of fp32 weights, activations of ``inflight`` microbatches, and
    the logits."""
    cfg, prec, tp = problem.model, problem.precision, lay.tp
    psi = sum(units)
    shard = lay.shard * lay.cp
    experts = expert_params_per_rank(cfg, lay.ep, act.layers * lay.virtual)
    edp = lay.dp * lay.cp // lay.ep
    mem = dict(state_bytes(psi, lay.zero, shard, prec.param, prec.grad, prec.optim))
    if experts:  # ZeRO-1/2 shard the experts' optimizer state (and gradients) over edp, as the runtime does
        ez = min(lay.zero, 2) if edp > 1 else 0
        mem["experts"] = experts * (prec.param + prec.grad / (edp if ez >= 2 else 1)
                                    + prec.optim / (edp if ez >= 1 else 1))
    if lay.zero == 3:
        # current + prefetched unit, and its gradient packed for the reduce-scatter
        mem["zero3_gathered"] = max(units) * (2 * prec.gather + prec.reduce)
    # autocast's bf16 copies of fp32 weights, one a step; ZeRO-3 gathers its units in bf16 (not ep's experts)
    cast = experts if lay.zero == 3 else autocast_copy_numel(cfg, act.layers * lay.virtual, tp, lay.ep)
    if prec.act < prec.param and cast:
        mem["weight_casts"] = prec.act * cast
    masked = masked_attention(cfg, problem.seq_len, problem.documents, lay.cp, lay.cp_attention)
    # the mask covers whole rows: T per token on one device, cp x T per local token under Ulysses
    mask_len = problem.seq_len * (lay.cp if lay.cp_attention == "ulysses" else 1)
    mem["activations"] = activation_bytes(cfg, t, act.layers, lay.recompute, tp, lay.sp, prec.act, inflight,
                                          sp_regather=lay.sp_regather, masked=masked, seq_len=mask_len) \
        + t * cfg.d_model * prec.act * inflight  # each stage's input hidden state
    if lay.cp > 1 and lay.cp_attention == "ulysses" and lay.recompute == "none":
        # Ulysses keeps its attention output twice: in head order for SDPA's backward, in sequence order for wo's
        # (tests/test_context_parallel.py measures it)
        mem["activations"] += t * act.layers * cfg.n_heads * cfg.head_dim / tp * prec.act * inflight
    mem["logits"] = logits_bytes(t, -(-cfg.vocab_size // tp), prec.act)  # on the last stage
    return mem


def evaluate(problem: Problem, layout: Layout, with_collectives: bool = False) -> Estimate:
    """Predict step time and per-device memory of ``layout`` (see the module docstring for the model)."""
    peak = problem.hw.bf16_flops  # the MFU denominator: one device's (one core's) rate, not its shared slice
    shared = problem.hw.oversubscription(problem.devices)
    if shared > 1:  # processes sharing the cores: each runs on a slice
        problem = replace(problem, hw=problem.hw.shared_by(problem.devices))
    cfg, hw, prec, lay = problem.model, problem.hw, problem.precision, layout
    t = tokens_per_microbatch(problem.sequences, problem.seq_len, lay)
    act = stage_action(problem, lay, t)
    step = StepTime()
    p2p_t, peaks = pipeline_time(problem, lay, t, act, step)
    if shared > 1:
        # In the pipeline's fill and drain about half the stages wait, and a waiting process frees its core: the
        # busy ones then share the cores among fewer, so the bubble passes max(1, shared / 2) / shared as fast.
        step.bubble *= max(1.0, shared / 2) / shared
    step.dp, dp = data_parallel_time(problem, lay, act)
    step.tp += kv_grad_time(problem, lay, act)
    psi = sum(dp.units)
    shard, edp = lay.shard * lay.cp, lay.dp * lay.cp // lay.ep
    experts = expert_params_per_rank(cfg, lay.ep, act.layers * lay.virtual)
    local = psi / (shard if lay.zero >= 1 else 1) + experts / (edp if lay.zero >= 1 else 1)
    if hw.measured_steps:  # measured: gradient clipping + AdamW per parameter, and the step's fixed cost
        step.optimizer = local * hw.param_s + hw.step_s
    elif hw.gpu_kernels:
        step.optimizer = local * gpu_optimizer_bytes(hw, prec) / hw.hbm_bw
    else:
        step.optimizer = local * (2 * prec.param + prec.grad + 2 * prec.optim) / hw.hbm_bw
    inflight = max(peaks) if lay.pp > 1 else 1  # (mb, stage chunk) pairs held at once, from the simulator
    mem = memory(problem, lay, t, act, dp.units, inflight)
    est = Estimate(lay, step, mem, problem.memory_budget, flops_per_token(cfg, problem.seq_len) * problem.batch_tokens,
                   problem.devices, peak, problem.batch_tokens)
    if with_collectives:
        est.collectives = _collectives(problem, lay, t, act.layers, act.tp_link, act.cp_link, dp.bytes, dp.units,
                                       dp.shard_link, dp.dp_link, dp.rep_link, p2p_t, act.ring, act.attn_f)
    return est


def _collectives(problem: Problem, lay: Layout, t: int, layers: int, tp_link: Link, cp_link: Link,
                 dp_bytes: dict, units: list[int], shard_link: Link, dp_link: Link, rep_link: Link,
                 p2p_t: float, ring: dict[str, int], attn_f: float) -> list[Collective]:
    """The collectives of one block (and the per-microbatch pipeline sends), for ``explain``."""
    cfg, prec = problem.model, problem.precision
    mc = lay.microbatches
    out: list[Collective] = []
    per_step = mc * layers * lay.virtual  # block-level calls per step on this rank
    hidden = tp_hidden_backward(problem, lay, t, tp_link, matmul_rate(problem)) \
        if overlaps(problem.hw, problem.devices) else {}
    for what, op, nbytes, phase in tp_layer_collectives(t, cfg.d_model, lay.tp, lay.sp, prec.act, lay.sp_regather,
                                                        mlp_tp=not cfg.moe_experts):
        calls = per_step * (2 if tp_recomputed(lay, what, phase) else 1)
        sec = op_time(problem.hw, op, nbytes, tp_link)
        where = "yes" if what not in hidden else "overlapped" if hidden[what] >= sec else "partly"
        out.append(Collective("tp", op, f"{phase}: {what}", lay.tp, nbytes, sec, calls, where))
    out += _cp_collectives(problem, lay, t, cp_link, ring, attn_f, per_step)
    if kv := kv_grad_elems(problem, lay, layers):
        nbytes = kv * prec.grad
        out.append(Collective("tp_kv", "all_reduce", "step end: shared kv heads' gradients", lay.tp // cfg.kv_heads,
                              nbytes, op_time(problem.hw, "all_reduce", nbytes, _kv_link(problem, lay)), 1, "exposed"))
    if lay.ep > 1 and cfg.moe_experts:
        rows = t // (lay.tp if lay.sp else 1) * cfg.moe_top_k * cfg.d_model * prec.act
        link = group_link(problem.hw, lay.ep, lay.tp, 1)
        for phase in ("fwd", "bwd"):
            for what in ("dispatch", "combine"):
                calls = per_step * (2 if (lay.recompute != "none" and phase == "fwd") else 1)
                out.append(Collective("ep", "all_to_all", f"{phase}: {what} (tokens x top_k rows)", lay.ep, rows,
                                      op_time(problem.hw, "all_to_all", rows, link), calls, "yes"))
    if lay.pp > 1:
        nbytes = pp_p2p_bytes(t, cfg.d_model, lay.tp, lay.sp, prec.act)
        out.append(Collective("pp", "send", "activation to next stage / its gradient back", 2, nbytes, p2p_t,
                              2 * mc, "partly (pipeline fill and drain)"))
    block = max(units[1:-1] or units)
    psi = sum(units)
    for (group, op), nbytes in dp_bytes.items():
        per_unit = nbytes * block / psi
        link = {"dp_cp": dp_link, "dp_shard_cp": shard_link, "dp_replicate": rep_link}[group]
        n = link.n
        if op == "all_gather" and lay.zero in (1, 2):
            crit, calls, what = "exposed (after the optimizer step)", 1, "updated parameters"
        elif op == "all_gather":
            gathers = 2
            calls = (mc if lay.pp == 1 else 1) * gathers
            per_unit /= calls
            crit, what = "overlapped (prefetched)", "parameters, forward and backward"
        else:
            calls = mc if (lay.zero >= 2 and lay.pp == 1) else 1
            per_unit /= calls
            crit = "overlapped (backward), last bucket exposed"
            what = "gradients" if group != "dp_replicate" else "gradient shards across replicas"
        out.append(Collective(group, op, what, n, per_unit, op_time(problem.hw, op, per_unit, link), calls, crit))
    return out


def _cp_collectives(problem: Problem, lay: Layout, t: int, link: Link, ring: dict[str, int], attn_f: float,
                    per_step: int) -> list[Collective]:
    """Context parallelism's rows of ``_collectives``, by ``lay.cp_attention`` (``cp_block_time``)."""
    if lay.cp <= 1:
        return []
    cfg, hw, prec, cp, tp = problem.model, problem.hw, problem.precision, lay.cp, lay.tp
    again = 2 if lay.recompute != "none" else 1  # forward exchanges rerun by the recomputed forward
    q_elems, kv = cp_block_elems(cfg, t, tp)
    if lay.cp_attention == "ulysses":
        q, qkv = q_elems * prec.act, (q_elems + kv) * prec.act
        rows = [("fwd", "q, k, v: heads for positions", qkv, again), ("fwd", "output: positions for heads", q, again),
                ("bwd", "output's gradient", q, 1), ("bwd", "q, k, v gradients", qkv, 1)]
        return [Collective("cp", "all_to_all", f"{phase}: {what}", cp, nbytes,
                           op_time(hw, "all_to_all", nbytes, link), per_step * n, "yes")
                for phase, what, nbytes, n in rows]
    if lay.cp_attention == "allgather":
        return [Collective("cp", "all_gather", "fwd: K/V of the whole sequence", cp, cp * kv * prec.act,
                           op_time(hw, "all_gather", cp * kv * prec.act, link), per_step * again, "yes"),
                Collective("cp", "reduce_scatter", "bwd: dK/dV (fp32)", cp, cp * kv * 4,
                           op_time(hw, "reduce_scatter", cp * kv * 4, link), per_step, "yes")]
    out = []
    full = 2 if lay.recompute == "full" else 1  # full's rerun has its attention again to hide behind
    for phase, factor in (("fwd", 1.0), ("bwd", 2.0)):
        hops = int(factor) * (cp - 1)
        sec = op_time(hw, "send", ring[phase], link, hops, 2 * hops)
        hidden = sec <= factor * attn_f
        out.append(Collective("cp", "send", f"{phase}: ring K/V ({cp - 1} hops)", cp, ring[phase], sec,
                              per_step * (full if phase == "fwd" else 1), "overlapped" if hidden else "partly"))
    if lay.recompute == "selective":  # attention's outputs are kept: its rerun exchanges have nothing beside them
        out.append(Collective("cp", "send", f"bwd: ring K/V again, selective recompute ({cp - 1} hops)", cp,
                              ring["fwd"], out[0].seconds, per_step, "yes"))
    return out
