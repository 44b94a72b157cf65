"""The pipeline's time and memory for the planner: schedules run by the simulator (cached), the classic bubble,
and the runtime's cost-balanced partition of layers into stages."""

from __future__ import annotations

import math

from meshtrain.config import ModelConfig
from meshtrain.plan.partition import partition_model
from meshtrain.plan.schedules import build_schedule
from meshtrain.plan.simulator import CompiledSchedule, compile_schedule, simulate


def pipeline_sim(schedule: str, pp: int, microbatches: int, virtual: int = 1, f: float = 1.0, b: float = 2.0,
                 p2p: float = 0.0, w: float | None = None) -> tuple[float, float, list[int]]:
    """(makespan, idle time per rank, peak in-flight (mb, stage) per rank) of a pipeline schedule from the
    simulator (meshtrain/plan/simulator.py), with per-stage action costs ``f``, ``b`` (``w`` the
    deferred weight part of split schedules, default b/2) and ``p2p`` per cross-rank dependency. The order of
    generated schedules is built with the runtime's default costs, as the runtime builds it. The in-flight
    peaks are what activation memory multiplies (each counts one stage's layers for one microbatch)."""
    res = simulate(_compiled_schedule(schedule, pp, microbatches, virtual), f, b, w, p2p)
    return res.makespan, res.idle_time, list(res.peak_inflight)


def bubble_fraction(pp: int, microbatches: int) -> float:
    """The classic pipeline bubble of GPipe / 1F1B, (p - 1) / (m + p - 1) (equal forward/backward split,
    no p2p latency); ``pipeline_sim`` reproduces it for those schedules and computes it for the others."""
    return (pp - 1) / (microbatches + pp - 1)


_SCHEDULES: dict[tuple[str, int, int, int], CompiledSchedule] = {}


def _compiled_schedule(name: str, pp: int, m: int, v: int) -> CompiledSchedule:
    key = (name, pp, m, v)
    if key not in _SCHEDULES:
        _SCHEDULES[key] = compile_schedule(build_schedule(name, pp, m, v))
    return _SCHEDULES[key]


_PARTITIONS: dict[tuple, tuple[list[int], list[float]]] = {}
_SIMS: dict[tuple, tuple[float, float, list[int]]] = {}


def stage_partition(cfg: ModelConfig, seq_len: int, n_stages: int) -> tuple[list[int], list[float]]:
    """(blocks per stage, forward FLOPs per token per stage) of the runtime's cost-balanced partition."""
    key = (cfg.d_model, cfg.n_layers, cfg.hidden_dim, cfg.vocab_size, cfg.n_heads, cfg.kv_heads, seq_len, n_stages)
    if key not in _PARTITIONS:
        part = partition_model(cfg, seq_len, n_stages)
        _PARTITIONS[key] = ([len(x) for x in part.layers], list(part.costs))
    return _PARTITIONS[key]


def _snap(x: float, step: float) -> float:
    """``x`` rounded to the nearest power of ``step`` (relative error at most half a step)."""
    return step ** round(math.log(x) / math.log(step))


def pipeline_sim_fast(schedule: str, pp: int, m: int, v: int, f: float, b: float, p2p: float
                      ) -> tuple[float, float, list[int]]:
    """``pipeline_sim`` on costs normalised to f = 1 and snapped to a geometric grid (b/f in 5% steps,
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
            _SIMS[key] = pipeline_sim(schedule, pp, mm, v, 1.0, rb, rp)
        return _SIMS[key]

    if m <= m2:
        makespan, idle, peaks = run(m)
    else:
        s1, i1, _ = run(m1)
        s2, i2, peaks = run(m2)
        makespan = s2 + (s2 - s1) / (m2 - m1) * (m - m2)
        idle = i2 + (i2 - i1) / (m2 - m1) * (m - m2)
    return makespan * f, idle * f, peaks
