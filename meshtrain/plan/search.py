"""Layout search: enumerate the layouts the runtime's shape rules allow, estimate each one
(``plan/steptime.py``), keep those that fit and rank them by step time; and a layout out as a run config."""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

from meshtrain.config import Config, ConfigError, load_config
from meshtrain.plan.problem import Estimate, Layout, Problem
from meshtrain.plan.schedules import DEFAULT_VIRTUAL
from meshtrain.plan.steptime import evaluate
from meshtrain.plan.validate import validate_layout

PARALLEL_AXES = ("dp", "tp", "pp", "cp", "ep")
DEFAULT_SCHEDULES = ("1f1b", "interleaved", "zb-h1", "dualpipev")  # not afab: 1F1B, same bubble, fewer activations


def _pow2_divisors(n: int, lo: int = 1, hi: int | None = None) -> list[int]:
    hi = n if hi is None else hi
    return [x for x in (2**k for k in range(0, 31)) if lo <= x <= hi and n % x == 0]


def _divisors(n: int) -> list[int]:
    return [x for x in range(1, n + 1) if n % x == 0]


@dataclass
class SearchOptions:
    """Which values the search tries (the defaults cover what the runtime runs)."""

    tps: tuple[int, ...] | None = None  # default: powers of two up to hw.tp_max that divide heads/kv/hidden
    pps: tuple[int, ...] | None = None  # default: 1, 2, 4, ... up to min(max_pp, layers)
    cps: tuple[int, ...] = (1, 2, 4)
    # parallel.cp_attention values tried for cp > 1; allgather only on request (--cp-attention): it moves what the
    # ring does, exposed, so the model never ranks it first, and it would add a third of the search
    cp_attentions: tuple[str, ...] = ("ring", "ulysses")
    zeros: tuple[int, ...] = (0, 1, 2, 3)
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    recomputes: tuple[str, ...] = ("none", "selective", "full")
    max_pp: int = 16
    hsdp: bool = True


@dataclass
class SearchResult:
    """Every layout that fits, fastest first; how many were tried; the fastest of all if it did not fit, and the
    one needing the least memory (how far the slice is from fitting, when nothing does)."""

    ranked: list[Estimate]
    tried: int
    fastest_any: Estimate | None
    rejected: tuple[str, ...] = ()  # why sizes asked for gave no layout (each rule once), for "no layout" answers
    leanest: Estimate | None = None

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None


def runtime_supports(axis: str) -> bool:
    """Does the runtime run ``parallel.<axis> > 1`` today? Every axis the search tries does (dp, tp, pp, cp, ep);
    a name that is not one of them is an error."""
    if axis not in PARALLEL_AXES:
        raise ValueError(f"{axis!r} is not a parallel axis: one of {', '.join(PARALLEL_AXES)}")
    return True


def candidate_layouts(problem: Problem, opts: SearchOptions | None = None,
                      rejected: dict[str, None] | None = None) -> list[Layout]:
    """Every layout the runtime's shape rules allow for this problem (see ``config.validate``): tp divides
    heads and the MLP hidden size, divides the kv heads or is a multiple of them (kv heads replicated), and stays
    on the fast fabric; SP needs tp > 1 and seq_len % tp;
    pp needs ZeRO 0/1, microbatches dividing each dp rank's rows (multiples of pp for interleaved) and enough
    layers; the global batch splits evenly over dp x accumulation. ``rejected`` collects, once each, the rules
    that turned sizes away (what a search that finds nothing tells the user)."""
    opts = opts or SearchOptions()

    def reject(reason: str) -> None:
        if rejected is not None:
            rejected.setdefault(reason)

    cfg, hw, n, T = problem.model, problem.hw, problem.devices, problem.seq_len
    tps = opts.tps or tuple(x for x in _pow2_divisors(n, 1, hw.tp_max)
                            if cfg.n_heads % x == 0 and (cfg.kv_heads % x == 0 or x % cfg.kv_heads == 0)
                            and cfg.hidden_dim % x == 0)
    pps = opts.pps or tuple(x for x in _pow2_divisors(n, 1, opts.max_pp) if cfg.n_layers >= x)
    out: list[Layout] = []
    for tp in tps:
        for cp in opts.cps:
            if T % (2 * cp) and cp > 1:
                reject(f"cp {cp} needs a sequence length divisible by 2 x cp = {2 * cp} (its zigzag chunks); "
                       f"it is {T}")
                continue
            for pp in pps:
                if n % (tp * cp * pp):
                    reject(f"tp x pp x cp must divide the {n} devices")
                    continue
                dp = n // (tp * cp * pp)
                if problem.sequences % dp:
                    reject(f"dp (the devices over tp x pp x cp) must divide the {problem.sequences} sequences of "
                           f"the batch")
                    continue
                rows = problem.sequences // dp
                eps = [e for e in _pow2_divisors(dp * cp, 1, cfg.moe_experts) if cfg.moe_experts % e == 0] \
                    if cfg.moe_experts else [1]  # experts are sharded over ranks carved out of dp x cp
                sps = (False, True) if tp > 1 and T % tp == 0 else (False,)
                attns = _cp_attentions(problem, tp, cp, opts, reject)
                for sp, ep, rc, attn in itertools.product(sps, eps, opts.recomputes, attns):
                    if pp == 1:
                        for accum in _divisors(rows):
                            for zero, shard in _zero_options(dp, opts, pp):
                                out.append(Layout(dp, tp, 1, cp, ep, zero, shard, sp, "1f1b", 1, accum, rc, attn))
                        continue
                    for sched in opts.schedules:
                        v = DEFAULT_VIRTUAL[sched]
                        if cfg.tie_embeddings and sched == "dualpipev":  # config.py: its V syncs the tied weight
                            reject("dualpipev does not combine with tied embeddings (model.tie_embeddings)")  # early
                            continue
                        if cfg.n_layers < pp * v:
                            reject(f"pp {pp} needs {pp} layers or more ({2 * pp} for interleaved and dualpipev); the "
                                   f"model has {cfg.n_layers}")
                            continue
                        for m in _divisors(rows):  # m < pp runs too, with its large bubble
                            if sched == "interleaved" and m % pp:
                                reject("interleaved needs microbatches in multiples of pp that divide each dp rank's "
                                       "sequences")
                                continue
                            for zero, shard in _zero_options(dp, opts, pp):
                                out.append(Layout(dp, tp, pp, cp, ep, zero, shard, sp, sched, v, m, rc, attn))
    return out


def _cp_attentions(problem: Problem, tp: int, cp: int, opts: SearchOptions, reject) -> list[str]:
    """The ``opts.cp_attentions`` the runtime runs at this tp and cp ("ring" alone without cp): Ulysses needs each
    tp rank's query and key/value heads to split over cp (``config._check_context_and_experts``)."""
    if cp == 1:
        return ["ring"]
    cfg = problem.model
    hq, hkv = cfg.n_heads // tp, max(cfg.kv_heads // tp, 1)
    out = []
    for attn in opts.cp_attentions:
        if attn == "ulysses" and (hq % cp or hkv % cp):
            reject(f"ulysses needs cp to divide each tp rank's query and key/value heads ({hq} and {hkv} at tp {tp})")
            continue
        out.append(attn)
    return out


def _zero_options(dp: int, opts: SearchOptions, pp: int) -> list[tuple[int, int]]:
    zeros = [z for z in opts.zeros if pp == 1 or z <= 1]  # ZeRO-2/3 do not combine with pp > 1 (config.py)
    if not zeros:  # only ZeRO-2/3 asked for (--zero): no layout at this pp
        return []
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
    rejected: dict[str, None] = {}
    layouts = candidate_layouts(problem, opts, rejected)
    fits: list[Estimate] = []
    fastest_any: Estimate | None = None
    leanest: Estimate | None = None
    for lay in layouts:
        est = evaluate(problem, lay)
        if fastest_any is None or est.step_s < fastest_any.step_s:
            fastest_any = est
        if leanest is None or est.memory_total < leanest.memory_total:
            leanest = est
        if est.fits:
            fits.append(est)
    fits.sort(key=lambda e: (round(e.step_s, 9), e.memory_total))
    return SearchResult(fits, len(layouts), fastest_any, tuple(rejected), leanest)


def to_config(problem: Problem, layout: Layout) -> Config:
    """The run config of a layout: the model, seq_len, global batch (sequences), the compute dtype (bf16 autocast,
    or fp32 where the precision's activations are 4 bytes: a CPU calibrated without native bf16), recompute,
    accumulation, the gradients' reduce dtype (the precision's) and every parallel setting, as
    ``meshtrain train --config`` reads it."""
    cfg = Config()
    cfg.model = copy.deepcopy(problem.model)
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, problem.seq_len)
    t, p = cfg.train, cfg.parallel
    t.seq_len, t.global_batch, t.recompute = problem.seq_len, problem.sequences, layout.recompute
    t.dtype = "fp32" if problem.precision.act == 4 else "bf16"
    p.reduce_dtype = "bf16" if problem.precision.reduce == 2 else "fp32"
    t.grad_accum = layout.microbatches if layout.pp == 1 else 1
    t.attention_mask = "document" if problem.documents else "causal"
    p.dp, p.tp, p.pp, p.cp, p.ep = layout.dp, layout.tp, layout.pp, layout.cp, layout.ep
    p.zero, p.dp_shard, p.sp, p.sp_regather = layout.zero, layout.dp_shard, layout.sp, layout.sp_regather
    if layout.cp > 1:
        p.cp_attention = layout.cp_attention
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
            f"# run on {problem.devices} processes: on each node R of {problem.nodes}, meshtrain train --config "
            f"{path.name} --nproc {problem.hw.devices_per_node} --nnodes {problem.nodes} --node-rank R "
            f"--rdzv-endpoint NODE0:29500 (docs/multi-node.md; examples/slurm/train.sbatch)\n")
    if (Path(problem.model_name) / "config.json").is_file():  # planned from a HuggingFace folder (plan_config)
        head += (f"# the model is {problem.model_name}/config.json's: add train.init_from={problem.model_name} to "
                 f"start from its weights (docs/fine-tuning.md)\n")
    path.write_text(head + yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    load_config(path)
    return path


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
