"""Layout search: which (dp, ZeRO, HSDP, tp, sp, pp + schedule + microbatches, cp, recompute) to train with.

For a model, a global batch (tokens) and a cluster, ``search`` enumerates the layouts the runtime's shape rules
allow, predicts each one's memory per device and step time with the shared cost model
(``meshtrain/plan/costs.py``), keeps those that fit and ranks them by step time. ``explain`` says why the
best one wins: its sharding in the book's notation (seed 000), the collectives of one layer with bytes, time
and whether they sit on the critical path, and what bounds the step.

The step-time model, per optimizer step on the critical rank:

- each pipeline stage action costs its matmul time (roofline of FLOPs at ``efficiency`` x peak and HBM
  traffic) plus its tensor-parallel collectives (on the critical path) plus the ring-attention transfers not
  hidden behind attention; backward is twice forward, plus a forward for full recompute;
- the pipeline is run by the simulator (``parallel/pipeline/simulator.py``) with those costs and the p2p
  time of one activation: its makespan holds the bubble and the p2p waits; without pp it is microbatches x
  (F + B);
- data-parallel / ZeRO collectives overlap the compute they can (gradient reduction with the last
  backward, ZeRO-3 gathers with forward and backward), what does not fit and the last bucket are exposed;
  ZeRO-1/2's all-gather of updated parameters after the optimizer step is exposed (the runtime does it then);
- the optimizer step reads and writes the local parameters, gradients and moments at HBM bandwidth.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from meshtrain.config import Config, ConfigError, ModelConfig, load_config
from meshtrain.plan import costs
from meshtrain.plan.costs import (
    DEFAULT_REVISION,
    MESHTRAIN_BF16,
    Link,
    Precision,
    StepTime,
    activation_bytes,
    activation_elems_per_token,
    block_params,
    collective_time,
    cp_ring_bytes,
    dp_family_bytes,
    ep_all_to_all_bytes,
    exposed,
    flops_per_token,
    layer_compute_time,
    param_count,
    pp_p2p_bytes,
    stage_part_flops,
    state_bytes,
    tp_layer_collectives,
)
from meshtrain.plan.hardware import Hardware
from meshtrain.plan.schedules import DEFAULT_VIRTUAL
from meshtrain.plan.validate import validate_layout

PARALLEL_AXES = ("dp", "tp", "pp", "cp", "ep")
DEFAULT_SCHEDULES = ("1f1b", "interleaved", "zb-h1", "dualpipev")


# ----------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Problem:
    """What to plan for: a model, a global batch and a cluster, plus the modelling assumptions.

    ``efficiency`` is the fraction of the datasheet peak a large bf16 matmul reaches (the roofline's compute
    ceiling; MFU can only be lower). ``memory_fraction`` of HBM is usable (the rest: CUDA context, allocator
    fragmentation, communication buffers).
    """

    model: ModelConfig
    seq_len: int
    sequences: int  # global batch in sequences
    hw: Hardware
    nodes: int
    model_name: str = "model"
    precision: Precision = MESHTRAIN_BF16
    efficiency: float = 0.75
    memory_fraction: float = 0.9
    revision: str = DEFAULT_REVISION
    train_tokens: float = 0.0  # a token budget to report days for (0: none)

    @property
    def devices(self) -> int:
        return self.nodes * self.hw.devices_per_node

    @property
    def batch_tokens(self) -> int:
        return self.sequences * self.seq_len

    @property
    def memory_budget(self) -> float:
        return self.memory_fraction * self.hw.hbm_bytes


@dataclass(frozen=True)
class Layout:
    """One way to lay the job on the cluster. ``microbatches`` are the pipeline microbatches when pp > 1,
    else the gradient-accumulation steps; ``dp_shard`` 0 shards ZeRO over all of dp (else HSDP groups)."""

    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    dp_shard: int = 0
    sp: bool = False
    schedule: str = "1f1b"
    virtual: int = 1
    microbatches: int = 1
    recompute: str = "none"

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def shard(self) -> int:
        """ZeRO shard group over dp (HSDP: dp_shard), before cp joins it."""
        return self.dp_shard or self.dp

    def describe(self) -> str:
        """A one-line summary, e.g. ``dp32 zero1 tp8 sp pp4 interleaved(v2) m16 recompute=selective``."""
        parts = [f"dp{self.dp}"]
        if self.dp > 1:
            parts.append(f"zero{self.zero}" + (f"/hsdp{self.dp_shard}" if self.dp_shard else ""))
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("+sp" if self.sp else ""))
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.pp > 1:
            sched = self.schedule + (f"(v{self.virtual})" if self.virtual > 1 else "")
            parts.append(f"pp{self.pp} {sched} m{self.microbatches}")
        elif self.microbatches > 1:
            parts.append(f"accum{self.microbatches}")
        parts.append(f"rc={self.recompute}")
        return " ".join(parts)


# ----------------------------------------------------------------------------- outputs


@dataclass
class Collective:
    """One collective of the explained layout: bytes and seconds per call, calls per step, and where it sits."""

    axis: str
    op: str
    what: str
    group: int
    bytes: float
    seconds: float
    calls: int
    critical: str  # "yes", "overlapped", "partly", "exposed"


@dataclass
class Estimate:
    """The prediction for one layout."""

    layout: Layout
    step: StepTime
    memory: dict[str, float]
    budget: float
    model_flops: float  # per step, all devices, no recomputation
    n_devices: int
    peak_flops: float
    tokens: int
    collectives: list[Collective] = field(default_factory=list)
    runnable: bool | None = None
    not_runnable_reason: str = ""

    @property
    def step_s(self) -> float:
        return self.step.total

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())

    @property
    def fits(self) -> bool:
        return self.memory_total <= self.budget

    @property
    def mfu(self) -> float:
        return costs.step_mfu(self.model_flops, self.n_devices, self.peak_flops, self.step_s)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s if self.step_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        return {
            "layout": asdict(self.layout), "describe": self.layout.describe(), "step_s": self.step_s,
            "step": {**asdict(self.step), "total": self.step.total, "bound": self.step.bound()},
            "memory_bytes": {**self.memory, "total": self.memory_total}, "memory_budget_bytes": self.budget,
            "fits": self.fits, "mfu": self.mfu, "tokens_per_s": self.tokens_per_s, "runnable": self.runnable,
            "not_runnable_reason": self.not_runnable_reason,
        }


# ----------------------------------------------------------------------------- links: where each group sits


def _link(hw: Hardware, n: int, stride: int, axes: int = 1) -> Link:
    """The fabric of a group of ``n`` ranks ``stride`` apart in rank order (consecutive ranks share a node):
    members sharing a fast domain talk at intra_bw (x ``axes`` torus axes), the rest at inter_bw."""
    local = max(1, min(n, hw.domain // stride)) if stride <= hw.domain else 1
    intra = hw.intra_bw * (max(1, axes) if hw.torus else 1)
    return Link(n, local, intra, hw.inter_bw, hw.intra_latency, hw.inter_latency)


def _dp_axes(hw: Hardware, layout: Layout) -> int:
    """Torus axes left to the data-parallel group once tp, cp and pp took one each (the book: '3 axes')."""
    if not hw.torus:
        return 1
    used = sum(1 for x in (layout.tp, layout.cp, layout.pp) if x > 1)
    return max(1, len(hw.mesh_axes) - used)


# ----------------------------------------------------------------------------- evaluation

_PARTITIONS: dict[tuple, tuple[list[int], list[float]]] = {}
_SIMS: dict[tuple, tuple[float, float, list[int]]] = {}


def _partition(cfg: ModelConfig, seq_len: int, n_stages: int) -> tuple[list[int], list[float]]:
    """(blocks per stage, forward FLOPs per token per stage) of the runtime's cost-balanced partition."""
    key = (cfg.d_model, cfg.n_layers, cfg.hidden_dim, cfg.vocab_size, cfg.n_heads, cfg.kv_heads, seq_len, n_stages)
    if key not in _PARTITIONS:
        from meshtrain.plan.partition import partition_model

        part = partition_model(cfg, seq_len, n_stages)
        _PARTITIONS[key] = ([len(x) for x in part.layers], list(part.costs))
    return _PARTITIONS[key]


def _snap(x: float, step: float) -> float:
    """``x`` rounded to the nearest power of ``step`` (relative error at most half a step)."""
    return step ** round(math.log(x) / math.log(step))


def _sim(schedule: str, pp: int, m: int, v: int, f: float, b: float, p2p: float) -> tuple[float, float, list[int]]:
    """``costs.pipeline_sim`` on costs normalised to f = 1 and snapped to a geometric grid (b/f in 5% steps,
    p2p/f in 20% steps), cached: the search asks for nearly the same shapes thousands of times.

    Long schedules are simulated at two microbatch counts m1 < m2 in their steady state and extended
    linearly: past the warm-up every further microbatch adds the same time (v (F + B), plus the p2p round
    trips 1F1B cannot hide) and the in-flight peaks stop growing (1F1B and ZB-H1 hold at most pp,
    interleaved its warm-up of at most 3pp chunks, DualPipeV 2pp). The list-scheduled orders (zb-h1,
    dualpipev) are costly to build, so they use (pp, 2pp), the others (2pp, 3pp); tests check the
    extension against full simulations."""
    rb = _snap(b / f, 1.05)
    rp = _snap(p2p / f, 1.2) if p2p > 0 else 0.0
    m1, m2 = (pp, 2 * pp) if schedule in ("zb-h1", "dualpipev") else (2 * pp, 3 * pp)

    def run(mm: int) -> tuple[float, float, list[int]]:
        key = (schedule, pp, mm, v, rb, rp)
        if key not in _SIMS:
            _SIMS[key] = costs.pipeline_sim(schedule, pp, mm, v, 1.0, rb, rp)
        return _SIMS[key]

    if m <= m2:
        makespan, idle, peaks = run(m)
    else:
        s1, i1, _ = run(m1)
        s2, i2, peaks = run(m2)
        makespan = s2 + (s2 - s1) / (m2 - m1) * (m - m2)
        idle = i2 + (i2 - i1) / (m2 - m1) * (m - m2)
    return makespan * f, idle * f, peaks


def _calls_time(op: str, total_bytes: float, calls: int, link: Link) -> float:
    """Seconds for ``calls`` equal collectives that move ``total_bytes`` between them."""
    return calls * collective_time(op, total_bytes / calls, link) if total_bytes > 0 else 0.0


def _rank_units(cfg: ModelConfig, tp: int, blocks: int, first: bool, last: bool, ep: int = 1) -> list[int]:
    """Parameters per sharding unit on one rank: its blocks split tp ways (norms replicated), the embedding
    and the head + final norm (vocabulary split tp ways) when this rank holds the first / last stage.
    Mixture-of-experts blocks keep their router and experts whole (not split by tp); under expert
    parallelism the routed experts belong to no unit (``_rank_experts``)."""
    d = cfg.d_model
    block = (block_params(cfg) - 2 * d) // tp + 2 * d
    if cfg.moe_experts:
        pc = param_count(cfg)
        moe = pc.mlp // cfg.n_layers
        block = pc.attention // cfg.n_layers // tp + 2 * d + moe - (_expert_numel(cfg) * cfg.moe_experts
                                                                   if ep > 1 else 0)
    emb = -(-cfg.vocab_size // tp) * d
    units = [block] * blocks
    if cfg.tie_embeddings and first and last:
        return units + [emb + d]
    return ([emb] if first else []) + units + ([emb + d] if last else [])


def _expert_numel(cfg: ModelConfig) -> int:
    return 3 * cfg.d_model * cfg.expert_hidden


def _rank_experts(cfg: ModelConfig, ep: int, blocks: int) -> int:
    """Routed-expert parameters one rank holds under expert parallelism (E/ep per MoE block), else 0."""
    return blocks * cfg.moe_experts // ep * _expert_numel(cfg) if cfg.moe_experts and ep > 1 else 0


def evaluate(problem: Problem, layout: Layout, with_collectives: bool = False) -> Estimate:
    """Predict step time and per-device memory of ``layout`` (see the module docstring for the model)."""
    cfg, hw, prec, lay = problem.model, problem.hw, problem.precision, layout
    T, tp, pp, cp, v = problem.seq_len, lay.tp, lay.pp, lay.cp, lay.virtual
    C, eff = hw.bf16_flops, problem.efficiency
    rows = problem.sequences // lay.dp
    mc = lay.microbatches
    t = rows // mc * T // cp  # tokens per rank per microbatch
    d = cfg.d_model

    # --- compute of one stage action (the slowest stage; interleaved ranks run v chunks of it)
    n_stages = pp * v
    blocks, stage_flops = _partition(cfg, T, n_stages) if n_stages > 1 else ([cfg.n_layers], [0.0])
    _, _, head_flops = stage_part_flops(cfg, T)
    t_layer = layer_compute_time(cfg, t, T, C, hw.hbm_bw, tp, eff, prec.act, prec.act)
    t_head = t * head_flops / tp / (C * eff)
    stage_f = [blocks[s] * t_layer + (t_head if s == n_stages - 1 else 0.0) for s in range(n_stages)]
    f_c = max(stage_f)
    layers_max = max(blocks)
    b_c = 2 * f_c
    if lay.recompute == "full":
        b_c += f_c
    elif lay.recompute == "selective":  # element-wise ops rerun: HBM-bound
        redo = activation_elems_per_token(cfg, "none", tp, lay.sp) - activation_elems_per_token(
            cfg, "selective", tp, lay.sp)
        b_c += layers_max * 2 * max(redo, 0.0) * t * prec.act / hw.hbm_bw

    # --- tensor parallelism: every collective on the critical path
    tp_link = _link(hw, tp, 1)
    tp_f = tp_b = 0.0
    tp_calls = tp_layer_collectives(t, d, tp, lay.sp, prec.act)
    for _, op, nbytes, phase in tp_calls:
        dt = collective_time(op, nbytes, tp_link) * layers_max
        if phase == "fwd":
            tp_f += dt
        else:
            tp_b += dt
    if tp > 1:  # embedding output / head input gradient: one more activation each way
        tp_f += collective_time("all_reduce", t * d * prec.act, tp_link)
        tp_b += collective_time("all_reduce", t * d * prec.act, tp_link)
    if lay.recompute == "full":
        tp_b += tp_f  # the recomputed forward repeats its collectives

    if cfg.moe_experts and tp > 1 and not lay.sp:
        # MoE blocks are not split by tp: without SP every tp rank runs them on the same tokens.
        t_layer += t * 2.0 * param_count(cfg).active_mlp / cfg.n_layers * (1 - 1 / tp) / (C * eff)
        stage_f = [blocks[s] * t_layer + (t_head if s == n_stages - 1 else 0.0) for s in range(n_stages)]
        f_c = max(stage_f)
        b_c = 2 * f_c + (f_c if lay.recompute == "full" else 0.0)

    # --- expert parallelism: dispatch and combine all-to-alls on the critical path, per MoE block
    ep_link = _link(hw, lay.ep, tp, 1)
    a2a = ep_all_to_all_bytes(t // (tp if lay.sp else 1), d, cfg.moe_top_k, lay.ep, prec.act) \
        if cfg.moe_experts else {"fwd": 0, "bwd": 0}
    ep_f = layers_max * collective_time("all_to_all", a2a["fwd"], ep_link) if a2a["fwd"] else 0.0
    ep_b = layers_max * collective_time("all_to_all", a2a["bwd"], ep_link) if a2a["bwd"] else 0.0
    if lay.recompute == "full":
        ep_b += ep_f

    # --- context parallelism: ring transfers hidden behind attention where they fit
    cp_link = _link(hw, cp, tp, 1)
    ring = cp_ring_bytes(t, cfg, cp, tp, prec.act)
    attn_f = t * costs.attention_flops_per_token(cfg, T) / cfg.n_layers / tp / (C * eff)
    cp_f = layers_max * max(0.0, collective_time("send", ring["fwd"], cp_link) - attn_f) if cp > 1 else 0.0
    cp_b = layers_max * max(0.0, collective_time("send", ring["bwd"], cp_link) - 2 * attn_f) if cp > 1 else 0.0

    # One stage action (one chunk of layers, one microbatch); a rank runs v chunks per microbatch.
    F = f_c + tp_f + cp_f + ep_f
    B = b_c + tp_b + cp_b + ep_b
    step = StepTime()
    p2p_t = 0.0
    peaks = [1] * pp
    if pp > 1:
        world = problem.devices
        p2p_link = _link(hw, 2, world // pp)
        p2p_t = collective_time("send", pp_p2p_bytes(t, d, tp, lay.sp, prec.hidden), p2p_link)
        span0, idle0, peaks = _sim(lay.schedule, pp, mc, v, F, B, 0.0)
        span, _, _ = _sim(lay.schedule, pp, mc, v, F, B, p2p_t)
        busy = span0 - idle0
        step.bubble = max(0.0, idle0)
        step.p2p = max(0.0, span - span0)
        scale = busy / (mc * v * (F + B)) if F + B > 0 else 1.0  # 1 up to the simulator's rounding
    else:
        scale = 1.0
    step.compute = mc * v * (f_c + b_c) * scale
    step.tp = mc * v * (tp_f + tp_b) * scale
    step.cp = mc * v * (cp_f + cp_b) * scale
    step.ep = mc * v * (ep_f + ep_b) * scale

    # --- data-parallel family over dp x cp (the runtime's dp_cp / dp_shard_cp / dp_replicate groups)
    first_units = _rank_units(cfg, tp, blocks[0] if pp > 1 else cfg.n_layers, True, pp == 1, lay.ep)
    last_units = _rank_units(cfg, tp, blocks[-1], False, True, lay.ep) if pp > 1 else first_units
    if pp > 1 and v > 1:  # interleaved / V: a rank holds v chunks; count the heaviest rank's blocks
        first_units = _rank_units(cfg, tp, layers_max * v, True, lay.schedule == "dualpipev", lay.ep)
        last_units = _rank_units(cfg, tp, layers_max * v, lay.schedule == "dualpipev", True, lay.ep)
    units = max(first_units, last_units, key=sum)
    psi = sum(units)
    ndp = lay.dp * cp
    shard = lay.shard * cp
    accum = mc if pp == 1 else 1
    dp_bytes = dp_family_bytes(units, lay.zero, ndp, accum, shard if lay.dp_shard else 0, prec.grad, prec.param,
                               prec.gather)
    axes = _dp_axes(hw, lay)
    dp_link = _link(hw, ndp, tp, axes)
    shard_link = _link(hw, shard, tp, axes)
    rep_link = _link(hw, lay.dp // lay.shard, tp * shard, axes)
    # One call per unit and repetition (ZeRO-0: per 25 MB bucket), so per-call latency counts too.
    nu = len(units)
    reps_rs = accum if lay.zero >= 2 else 1
    reps_ag = 2 * accum if lay.zero == 3 else 1
    t_rs = _calls_time("reduce_scatter", dp_bytes.get(("dp_shard_cp", "reduce_scatter"), 0), nu * reps_rs, shard_link)
    t_ag = _calls_time("all_gather", dp_bytes.get(("dp_shard_cp", "all_gather"), 0), nu * reps_ag, shard_link)
    ar_bytes = dp_bytes.get(("dp_cp", "all_reduce"), 0)
    t_ar = _calls_time("all_reduce", ar_bytes, max(1, math.ceil(ar_bytes / 25e6)), dp_link)
    t_rep = _calls_time("all_reduce", dp_bytes.get(("dp_replicate", "all_reduce"), 0), nu, rep_link)
    last_frac = units[0] / psi  # the embedding's bucket is reduced last: nothing left to hide it
    if lay.zero == 0:
        step.dp = exposed(t_ar, B, t_ar * last_frac)
    elif lay.zero in (1, 2):
        rs_window = B * (accum if lay.zero == 2 else 1)
        step.dp = exposed(t_rs + t_rep, rs_window, (t_rs + t_rep) * last_frac) + t_ag
    else:
        # Per microbatch: half the gathers prefetched under forward, the other half (the runtime reshards
        # after forward) and the reduce-scatter under backward; the replicas' all-reduce joins the last one.
        ag_mb, rs_mb = t_ag / accum, t_rs / accum
        fwd = exposed(ag_mb / 2, F, ag_mb / 2 * units[0] / psi)
        bwd = ag_mb / 2 + rs_mb
        step.dp = accum * fwd + (accum - 1) * exposed(bwd, B, rs_mb * last_frac) \
            + exposed(bwd + t_rep, B, (rs_mb + t_rep) * last_frac)
    # Expert parallelism: the rank's experts' gradients are all-reduced (ZeRO-0) or reduce-scattered and their
    # parameters re-gathered (ZeRO-1/2) over edp = dp x cp / ep once per step, under the last backward.
    experts = _rank_experts(cfg, lay.ep, layers_max * v)
    edp = ndp // lay.ep
    if experts and edp > 1:
        edp_link = _link(hw, edp, tp * lay.ep, axes)
        step.dp += exposed(collective_time("all_reduce", experts * prec.grad, edp_link), B)
    local = psi / (shard if lay.zero >= 1 else 1) + experts / (edp if lay.zero >= 1 else 1)
    step.optimizer = local * (2 * prec.param + prec.grad + 2 * prec.optim) / hw.hbm_bw

    # --- memory of the heaviest rank
    st = state_bytes(psi, lay.zero, shard, prec.param, prec.grad, prec.optim)
    mem = dict(st)
    if experts:  # ZeRO-1/2 shard the experts' optimizer state (and gradients) over edp, as the runtime does
        ez = min(lay.zero, 2) if edp > 1 else 0
        mem["experts"] = experts * (prec.param + prec.grad / (edp if ez >= 2 else 1)
                                    + prec.optim / (edp if ez >= 1 else 1))
    if lay.zero == 3:
        mem["zero3_gathered"] = max(units) * (2 * prec.gather + prec.grad)  # current + prefetched unit, its grad
    inflight = max(peaks) if pp > 1 else 1  # (mb, stage chunk) pairs held at once, from the simulator
    mem["activations"] = activation_bytes(cfg, t, layers_max, lay.recompute, tp, lay.sp, prec.act, inflight) \
        + t * d * prec.hidden * inflight  # each stage's input hidden state
    mem["logits"] = t * -(-cfg.vocab_size // tp) * 12  # fp32 logits, softmax and their gradient on the last stage

    est = Estimate(lay, step, mem, problem.memory_budget, flops_per_token(cfg, T) * problem.batch_tokens,
                   problem.devices, C, problem.batch_tokens)
    if with_collectives:
        est.collectives = _collectives(problem, lay, t, layers_max, tp_link, cp_link, dp_bytes, units,
                                       shard_link, dp_link, rep_link, p2p_t, ring, attn_f)
    return est


def _collectives(problem: Problem, lay: Layout, t: int, layers: int, tp_link: Link, cp_link: Link,
                 dp_bytes: dict, units: list[int], shard_link: Link, dp_link: Link, rep_link: Link,
                 p2p_t: float, ring: dict[str, int], attn_f: float) -> list[Collective]:
    """The collectives of one block (and the per-microbatch pipeline sends), for ``explain``."""
    cfg, prec = problem.model, problem.precision
    mc = lay.microbatches
    out: list[Collective] = []
    per_step = mc * layers * lay.virtual  # block-level calls per step on this rank
    for what, op, nbytes, phase in tp_layer_collectives(t, cfg.d_model, lay.tp, lay.sp, prec.act):
        calls = per_step * (2 if (lay.recompute == "full" and phase == "fwd") else 1)
        out.append(Collective("tp", op, f"{phase}: {what}", lay.tp, nbytes, collective_time(op, nbytes, tp_link),
                              calls, "yes"))
    if lay.cp > 1:
        for phase, factor in (("fwd", 1.0), ("bwd", 2.0)):
            sec = collective_time("send", ring[phase], cp_link)
            hidden = sec <= factor * attn_f
            out.append(Collective("cp", "send", f"{phase}: ring K/V ({lay.cp - 1} hops)", lay.cp, ring[phase], sec,
                                  per_step, "overlapped" if hidden else "partly"))
    if lay.ep > 1 and cfg.moe_experts:
        rows = t // (lay.tp if lay.sp else 1) * cfg.moe_top_k * cfg.d_model * prec.act
        link = _link(problem.hw, lay.ep, lay.tp, 1)
        for phase in ("fwd", "bwd"):
            for what in ("dispatch", "combine"):
                calls = per_step * (2 if (lay.recompute == "full" and phase == "fwd") else 1)
                out.append(Collective("ep", "all_to_all", f"{phase}: {what} (tokens x top_k rows)", lay.ep, rows,
                                      collective_time("all_to_all", rows, link), calls, "yes"))
    if lay.pp > 1:
        nbytes = pp_p2p_bytes(t, cfg.d_model, lay.tp, lay.sp, prec.hidden)
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
        out.append(Collective(group, op, what, n, per_unit, collective_time(op, per_unit, link), calls, crit))
    return out


# ----------------------------------------------------------------------------- search


def _pow2_divisors(n: int, lo: int = 1, hi: int | None = None) -> list[int]:
    hi = n if hi is None else hi
    return [x for x in (2**k for k in range(0, 31)) if lo <= x <= hi and n % x == 0]


def _divisors(n: int) -> list[int]:
    return [x for x in range(1, n + 1) if n % x == 0]


@dataclass
class SearchOptions:
    """Which values the search tries (defaults cover what the runtime can run, plus cp)."""

    tps: tuple[int, ...] | None = None  # default: powers of two up to hw.tp_max that divide heads/kv/hidden
    pps: tuple[int, ...] | None = None  # default: 1, 2, 4, ... up to min(max_pp, layers)
    cps: tuple[int, ...] = (1, 2, 4)
    zeros: tuple[int, ...] = (0, 1, 2, 3)
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    recomputes: tuple[str, ...] = ("none", "selective", "full")
    max_pp: int = 16
    hsdp: bool = True


@dataclass
class SearchResult:
    """Every layout that fits, fastest first; how many were tried; the fastest of all if it did not fit."""

    ranked: list[Estimate]
    tried: int
    fastest_any: Estimate | None

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None


def runtime_supports(axis: str) -> bool:
    """Does the runtime run ``parallel.<axis> > 1`` today? Every axis the search tries does (dp, tp, pp, cp, ep);
    a name that is not one of them is an error."""
    if axis not in PARALLEL_AXES:
        raise ValueError(f"{axis!r} is not a parallel axis: one of {', '.join(PARALLEL_AXES)}")
    return True


def candidate_layouts(problem: Problem, opts: SearchOptions | None = None) -> list[Layout]:
    """Every layout the runtime's shape rules allow for this problem (see ``config.validate``): tp divides
    heads, kv heads and the MLP hidden size and stays on the fast fabric; SP needs tp > 1 and seq_len % tp;
    pp needs ZeRO 0/1, microbatches dividing each dp rank's rows (multiples of pp for interleaved) and enough
    layers; the global batch splits evenly over dp x accumulation."""
    opts = opts or SearchOptions()
    cfg, hw, n, T = problem.model, problem.hw, problem.devices, problem.seq_len
    tps = opts.tps or tuple(x for x in _pow2_divisors(n, 1, hw.tp_max)
                            if cfg.n_heads % x == 0 and cfg.kv_heads % x == 0 and cfg.hidden_dim % x == 0)
    pps = opts.pps or tuple(x for x in _pow2_divisors(n, 1, opts.max_pp) if cfg.n_layers >= x)
    if cfg.tie_embeddings:  # the runtime refuses pp > 1 with a weight shared by the first and last stage
        pps = tuple(x for x in pps if x == 1)
    out: list[Layout] = []
    for tp in tps:
        for cp in opts.cps:
            if T % (2 * cp) and cp > 1:
                continue
            for pp in pps:
                if n % (tp * cp * pp):
                    continue
                dp = n // (tp * cp * pp)
                if problem.sequences % dp:
                    continue
                rows = problem.sequences // dp
                eps = [e for e in _pow2_divisors(dp * cp, 1, cfg.moe_experts) if cfg.moe_experts % e == 0] \
                    if cfg.moe_experts else [1]  # experts are sharded over ranks carved out of dp x cp
                sps = (False, True) if tp > 1 and T % tp == 0 else (False,)
                for sp, ep, rc in itertools.product(sps, eps, opts.recomputes):
                    if pp == 1:
                        for accum in _divisors(rows):
                            for zero, shard in _zero_options(dp, opts, pp):
                                out.append(Layout(dp, tp, 1, cp, ep, zero, shard, sp, "1f1b", 1, accum, rc))
                        continue
                    for sched in opts.schedules:
                        v = DEFAULT_VIRTUAL[sched]
                        if cfg.n_layers < pp * v:
                            continue
                        for m in _divisors(rows):  # m < pp runs too, with its large bubble
                            if sched == "interleaved" and m % pp:
                                continue
                            for zero, shard in _zero_options(dp, opts, pp):
                                out.append(Layout(dp, tp, pp, cp, ep, zero, shard, sp, sched, v, m, rc))
    return out


def _zero_options(dp: int, opts: SearchOptions, pp: int) -> list[tuple[int, int]]:
    zeros = [z for z in opts.zeros if pp == 1 or z <= 1]
    if dp == 1:
        return [(0, 0)] if 0 in zeros else [(zeros[0], 0)]
    out = []
    for z in zeros:
        out.append((z, 0))
        if z >= 1 and opts.hsdp:
            out += [(z, s) for s in _pow2_divisors(dp, 2, dp // 2)]
    return out


def search(problem: Problem, opts: SearchOptions | None = None) -> SearchResult:
    """Evaluate every candidate layout; keep those that fit memory; rank by predicted step time (then by
    memory). ``fastest_any`` is the fastest layout regardless of memory (to say when memory is what binds)."""
    layouts = candidate_layouts(problem, opts)
    fits: list[Estimate] = []
    fastest_any: Estimate | None = None
    for lay in layouts:
        est = evaluate(problem, lay)
        if fastest_any is None or est.step_s < fastest_any.step_s:
            fastest_any = est
        if est.fits:
            fits.append(est)
    fits.sort(key=lambda e: (round(e.step_s, 9), e.memory_total))
    return SearchResult(fits, len(layouts), fastest_any)


# ----------------------------------------------------------------------------- config out


def to_config(problem: Problem, layout: Layout) -> Config:
    """The run config of a layout: the model, seq_len, global batch (sequences), bf16 autocast, recompute,
    accumulation and every parallel setting, as ``meshtrain train --config`` reads it."""
    cfg = Config()
    cfg.model = copy.deepcopy(problem.model)
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, problem.seq_len)
    t, p = cfg.train, cfg.parallel
    t.seq_len, t.global_batch, t.dtype, t.recompute = problem.seq_len, problem.sequences, "bf16", layout.recompute
    t.grad_accum = layout.microbatches if layout.pp == 1 else 1
    p.dp, p.tp, p.pp, p.cp, p.ep = layout.dp, layout.tp, layout.pp, layout.cp, layout.ep
    p.zero, p.dp_shard, p.sp = layout.zero, layout.dp_shard, layout.sp
    if layout.pp > 1:
        p.schedule, p.microbatches, p.virtual_stages = layout.schedule, layout.microbatches, layout.virtual
    return cfg


def check_runnable(problem: Problem, est: Estimate) -> Estimate:
    """Fill ``est.runnable``: does the runtime accept this layout today (``config.validate`` at this world size)?"""
    try:
        validate_layout(to_config(problem, est.layout), problem.devices)
        est.runnable, est.not_runnable_reason = True, ""
    except ConfigError as e:
        est.runnable, est.not_runnable_reason = False, str(e)
    return est


def emit_yaml(problem: Problem, est: Estimate, path: str | Path) -> Path:
    """Write the layout's config as YAML (with the prediction as a comment) and check it loads back through
    ``load_config``; raises ``ConfigError`` for a layout the runtime refuses."""
    import yaml

    cfg = to_config(problem, est.layout)
    validate_layout(cfg, problem.devices)
    path = Path(path)
    head = (f"# meshtrain plan: {problem.model_name} on {problem.nodes} x {problem.hw.devices_per_node} "
            f"{problem.hw.name}, {problem.batch_tokens:,} tokens per step\n"
            f"# layout {est.layout.describe()}: predicted {est.step_s:.3f} s/step, MFU {est.mfu:.1%}, "
            f"{est.memory_total / 1e9:.1f} GB per device\n"
            f"# run on {problem.devices} processes, e.g. torchrun --nnodes {problem.nodes} --nproc-per-node "
            f"{problem.hw.devices_per_node} -m meshtrain.cli train --config {path.name}\n")
    path.write_text(head + yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    load_config(path)
    return path


# ----------------------------------------------------------------------------- explanation


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB"


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f} ms" if x < 1 else f"{x:.3f} s"


def _bytes(x: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x:.0f} B"


def sharding(layout: Layout, model: ModelConfig, seq_len: int) -> list[str]:
    """Per-tensor sharding in the book's notation (seed 000): mesh axes X = data/FSDP (dp), Y = tensor (tp),
    Z = pipeline (pp), S = context (cp); a subscript shards that dimension over the axis; {U_X} marks an
    unreduced partial sum."""
    x = "X" if layout.dp > 1 else ""
    zx = "_X" if (layout.zero == 3 and layout.dp > 1) else ""
    y = "_Y" if layout.tp > 1 else ""
    lz = "L_Z, " if layout.pp > 1 else "L, "
    seq = [a for a, on in (("S", layout.cp > 1), ("Y", layout.sp and layout.tp > 1)) if on]
    tsub = f"_{''.join(seq)}" if seq else ""
    bsub = f"_{x}" if x else ""
    opt = "_X" if (layout.zero >= 1 and layout.dp > 1) else ""
    grad = "_X" if (layout.zero >= 2 and layout.dp > 1) else ""
    hsdp = (f" (HSDP: X = shard groups of {layout.dp_shard}, replicated over the other "
            f"{layout.dp // layout.dp_shard})") if layout.dp_shard else ""
    lines = [
        f"axes: X = dp {layout.dp}{hsdp}, Y = tp {layout.tp}, Z = pp {layout.pp}, S = cp {layout.cp}",
        f"activations between blocks  In[B{bsub}, T{tsub}, D]   (B = sequences, T = {seq_len} tokens)",
        f"attention                   Wq[{lz}D{zx}, N{y}, H]  Wk,Wv[{lz}D{zx}, K{y}, H]  Wo[{lz}N{y}, H, D{zx}]",
        f"gated MLP                   Win,Wgate[{lz}D{zx}, F{y}]  Wout[{lz}F{y}, D{zx}]",
        f"inside the MLP              Tmp[B{bsub}, T{'_S' if layout.cp > 1 else ''}, F{y}]",
        f"embedding / head            E[V{y}, D{zx}]  Head[D{zx}, V{y}]",
        f"gradients                   dW[{lz}D{grad}, F{y}]" + (" {U_X} until reduced" if not grad and x else ""),
        f"optimizer state (AdamW)     m,v[{lz}D{opt}, F{y}]",
    ]
    if layout.cp > 1:
        lines.append("ring attention              K,V[B_X, T_S, K_Y, H] passed round S")
    if model.moe_experts:  # experts are whole per rank (not split by tp), sharded over ep inside dp x cp
        e = "E_EP" if layout.ep > 1 else "E"
        lines[3] = (f"MoE experts                 Win,Wgate[{lz}{e}, D, F]  Wout[{lz}{e}, F, D]  "
                    f"router[{lz}D, E]  (E = {model.moe_experts}, top-{model.moe_top_k}"
                    + (f"; EP = ep {layout.ep}, inside X x S" if layout.ep > 1 else "") + ")")
        lines[4] = "inside an expert            Tmp[rows routed to it, F]  (tokens x top_k / E rows on average)"
        if layout.ep > 1:
            lines.append(f"dispatch / combine          rows[B{bsub} x T{tsub} x top_k, D] all-to-all over EP")
    return lines


def explain(problem: Problem, result: SearchResult, top: int = 3) -> str:
    """The best layout, why: sharding, collectives of one layer, what bounds the step, memory; then the
    book's analysis for this model and cluster."""
    best = result.best
    if result.tried == 0:
        return (f"No layout splits {problem.sequences} sequences of {problem.seq_len} tokens over {problem.devices} "
                f"devices: dp must divide the sequence count and tp x pp x cp the rest (tp <= {problem.hw.tp_max}, "
                f"powers of two). Use a batch of more (or a power of two) sequences, or widen --max-pp / --cp.")
    if best is None:
        f = result.fastest_any
        need = f"; the fastest layout needs {_gb(f.memory_total)} per device" if f else ""
        return (f"No layout fits in {_gb(problem.memory_budget)} per device{need}. Add nodes, lower the batch "
                f"or raise --memory-fraction.")
    est = evaluate(problem, best.layout, with_collectives=True)
    est.runnable, est.not_runnable_reason = best.runnable, best.not_runnable_reason
    lay, st = est.layout, est.step
    out = [f"Best layout: {lay.describe()}  ({problem.devices} devices = dp {lay.dp} x tp {lay.tp} x "
           f"pp {lay.pp} x cp {lay.cp})"]
    if est.runnable is False:
        out.append(f"  (not runnable by meshtrain today: {est.not_runnable_reason})")
    out.append("")
    out.append("Sharding (book notation, seed 000):")
    out += ["  " + s for s in sharding(lay, problem.model, problem.seq_len)]
    out.append("")
    t = problem.sequences // lay.dp // lay.microbatches * problem.seq_len // lay.cp
    out.append(f"Collectives ({t:,} tokens per microbatch per rank; per-layer ones are one block's):")
    out.append(f"  {'axis':<13}{'op':<15}{'what':<46}{'bytes/call':>11}{'time/call':>11}{'calls/step':>11}"
               f"  critical path")
    for c in est.collectives:
        out.append(f"  {c.axis:<13}{c.op:<15}{c.what[:45]:<46}{_bytes(c.bytes):>11}{_ms(c.seconds):>11}"
                   f"{c.calls:>11}  {c.critical}")
    out.append("")
    total = st.total
    parts = [("compute (matmuls, attention, recompute)", st.compute), ("TP/SP collectives", st.tp),
             ("CP ring (not hidden)", st.cp), ("pipeline p2p waits", st.p2p), ("pipeline bubble", st.bubble),
             ("DP/ZeRO comm (exposed)", st.dp), ("optimizer step", st.optimizer)]
    days = (f"; {problem.train_tokens:.3g} tokens in "
            f"{costs.days_for_tokens(problem.train_tokens, problem.batch_tokens, total):.1f} days"
            if problem.train_tokens else "")
    out.append(f"Step: {_ms(total)} predicted, MFU {est.mfu:.1%}, {est.tokens_per_s:,.0f} tokens/s{days}")
    for name, val in parts:
        if val > 0:
            out.append(f"  {name:<42}{_ms(val):>11}  {val / total:6.1%}")
    out.append(f"Bound by: {_bound_text(problem, est, result)}")
    out.append("")
    out.append(f"Memory per device: {_gb(est.memory_total)} of {_gb(problem.memory_budget)} usable "
               f"({problem.memory_fraction:.0%} of {_gb(problem.hw.hbm_bytes)})")
    out.append("  " + ", ".join(f"{k} {_gb(v)}" for k, v in est.memory.items()))
    out.append("")
    out.append("The book's analysis for this model and cluster:")
    out += ["  " + s for s in book_summary(problem)]
    return "\n".join(out)


def _bound_text(problem: Problem, est: Estimate, result: SearchResult) -> str:
    st = est.step
    kind = st.bound()
    share = {"compute": st.compute, "communication": st.communication, "bubble": st.bubble}[kind] / st.total
    text = f"{kind} ({share:.0%} of the step)"
    if kind == "compute":
        text += (f"; communication {st.communication / st.total:.0%} exposed, bubble {st.bubble / st.total:.0%}")
    fast = result.fastest_any
    if fast is not None and not fast.fits and fast.step_s < est.step_s * 0.999:
        text += (f". Memory binds too: the fastest layout overall ({fast.layout.describe()}, {_ms(fast.step_s)}) "
                 f"needs {_gb(fast.memory_total)} > {_gb(problem.memory_budget)}")
    elif est.memory_total > 0.9 * problem.memory_budget:
        text += f". Memory is nearly full ({est.memory_total / problem.memory_budget:.0%} of the budget)"
    return text


def book_summary(problem: Problem) -> list[str]:
    """The book's closed-form limits (seed 000 / 003) evaluated for this problem's model and hardware."""
    hw, cfg, n = problem.hw, problem.model, problem.devices
    c = hw.bf16_flops
    f = cfg.hidden_dim
    batch = problem.batch_tokens
    dp_link = _link(hw, n, 1, len(hw.mesh_axes) or 1)
    w_dp = _effective_bw(dp_link)
    w_tp = hw.intra_bw
    lines = [
        f"DP/FSDP critical batch per device C/W = {costs.critical_batch_per_device(c, w_dp):,.0f} tokens "
        f"(W = {w_dp / 1e9:.1f} GB/s effective over all {n}); this batch gives {batch / n:,.0f} per device",
        f"TP limit F*W/C = {costs.tp_limit(f, c, w_tp):.1f}-way on the fast fabric (F = {f}, "
        f"W = {w_tp / 1e9:.0f} GB/s)",
    ]
    for rev in costs.MIXED_REVISIONS:
        tag = " (default)" if rev == problem.revision else ""
        lines.append(f"mixed FSDP+TP bound, revision {rev}{tag}: B/N > "
                     f"{costs.mixed_min_batch_per_device(f, c, w_dp, rev):,.0f} tokens per device")
    x, y = costs.split_fsdp_tp(batch, n, f, hw.tp_max)
    lines.append(f"optimal split X = sqrt(2BN/F) = {costs.optimal_fsdp(batch, n, f):,.0f} -> X (FSDP) {x} x "
                 f"Y (TP) {y}")
    if n > hw.domain and hw.torus:
        per_pod = batch / (n / hw.domain)
        lines.append(f"cross-pod DCN limit C/W_dcn = {costs.dcn_min_batch_per_pod(c, hw.inter_bw):,.0f} tokens per "
                     f"pod; this batch gives {per_pod:,.0f}")
    return lines


def _effective_bw(link: Link) -> float:
    """Per-device bandwidth a large all-gather over ``link`` achieves: (n-1)/n x bytes / time."""
    big = 1e12
    t = collective_time("all_gather", big, replace(link, intra_latency=0.0, inter_latency=0.0))
    return (link.n - 1) / link.n * big / t if t > 0 else link.intra_bw


# ----------------------------------------------------------------------------- tables and the figure


def format_table(problem: Problem, estimates: list[Estimate]) -> str:
    """The top layouts as a text table."""
    head = (f"{'#':>2}  {'layout':<52}{'step':>10}{'MFU':>7}{'mem/dev':>10}{'compute':>9}{'comm':>8}"
            f"{'bubble':>8}  runs")
    rows = [head]
    for i, e in enumerate(estimates, 1):
        st = e.step
        runs = {True: "yes", False: "no", None: "?"}[e.runnable]
        rows.append(f"{i:>2}  {e.layout.describe():<52}{_ms(e.step_s):>10}{e.mfu:>7.1%}"
                    f"{e.memory_total / 1e9:>8.1f}GB{st.compute / e.step_s:>9.0%}"
                    f"{st.communication / e.step_s:>8.0%}{st.bubble / e.step_s:>8.0%}  {runs}")
    return "\n".join(rows)


def plot_comm_vs_compute(problem: Problem, path: str | Path, batches: list[float] | None = None) -> Path:
    """The book's figure (seed 000, 'comms-flops-time'): one layer's matmul time and each strategy's
    communication time as the global batch varies, on this cluster. A strategy is compute-bound where its
    curve is under the matmul line. Bandwidths: DP/FSDP over all devices (effective, hierarchical), TP on
    the fast fabric; mixed FSDP+TP at the optimal X (2 <= Y <= the fast fabric's TP limit), both revisions.
    Compute is at the datasheet peak, as in the book."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    hw, cfg, n = problem.hw, problem.model, problem.devices
    d, f, c = cfg.d_model, cfg.hidden_dim, hw.bf16_flops  # the book's roofline: peak FLOP/s
    axes = len(hw.mesh_axes) or 1
    w_fsdp = _effective_bw(_link(hw, n, 1, axes))
    w_mixed_x = _effective_bw(_link(hw, n // min(hw.tp_max, n), min(hw.tp_max, n), max(1, axes - 1)))
    w_tp = hw.intra_bw
    batches = batches or [10 ** (3 + k / 8) for k in range(0, 8 * 6 + 1)]
    compute, fsdp, tp_curve, mixed = [], [], [], {r: [] for r in costs.MIXED_REVISIONS}
    for b in batches:
        tm, tc = costs.book_layer_times("fsdp", b, n, d, f, c, w_fsdp)
        compute.append(tm)
        fsdp.append(tc)
        tp_curve.append(costs.book_layer_times("tp", b, n, d, f, c, w_fsdp, w_tp)[1])
        # TP between 2-way and the fast fabric's limit (Y = 1 would be the FSDP curve)
        x = min(max(costs.optimal_fsdp(b, n, f), n / min(hw.tp_max, n)), n / 2)
        for r in costs.MIXED_REVISIONS:
            mixed[r].append(costs.book_layer_times("fsdp+tp", b, n, d, f, c, w_mixed_x, w_tp, x, r)[1])
    fig = Figure(figsize=(9, 5.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.loglog(batches, compute, "k--", lw=2, label="matmul time (compute)")
    ax.loglog(batches, fsdp, label=f"DP / FSDP over {n} (W {w_fsdp / 1e9:.0f} GB/s)")
    ax.loglog(batches, tp_curve, label=f"TP over all {n} (W {w_tp / 1e9:.0f} GB/s)")
    for r in costs.MIXED_REVISIONS:
        style = "-" if r == problem.revision else ":"
        ax.loglog(batches, mixed[r], style, label=f"FSDP + TP, optimal X (revision {r}"
                                                   f"{', default' if r == problem.revision else ''})")
    crit = n * costs.critical_batch_per_device(c, w_fsdp)
    ax.axvline(crit, color="grey", lw=0.8)
    ax.text(crit, ax.get_ylim()[0] * 2, f" FSDP critical batch\n {crit:,.0f}", fontsize=8, color="grey")
    ax.set_xlabel("global batch (tokens)")
    ax.set_ylabel("seconds per layer (forward)")
    ax.set_title(f"{problem.model_name} on {n} x {hw.name}: communication vs compute per layer")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)


def parse_tokens(text: str) -> int:
    """``4M`` = 4 x 2^20 tokens (binary suffixes K, M, G, as batch sizes are usually powers of two); plain
    numbers such as ``4e6`` or ``4000000`` are taken as written."""
    s = str(text).strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(s[-1:], 1)
    num = s[:-1] if scale > 1 else s
    try:
        value = float(num) * scale
    except ValueError:
        raise ValueError(f"--batch-tokens {text!r}: give a number of tokens such as 4M, 4194304 or 4e6") from None
    if value < 1 or not math.isfinite(value):
        raise ValueError(f"--batch-tokens must be positive, got {text!r}")
    return int(value)
