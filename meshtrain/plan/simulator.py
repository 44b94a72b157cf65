"""Run a pipeline schedule on a clock: timelines, makespan, bubble, in-flight activations, and charts.

Each rank executes its action list strictly in order; an action starts when its rank is free and its dependencies
(``schedules.dependencies``) have finished, plus ``p2p`` when a dependency ran on another rank. Costs are per stage
action: ``F`` forward, ``B`` full backward, and for split backwards ``I = B - W`` and ``W``.

``bubble_of_timelines``, ``text_chart`` and ``png_chart`` only read ``(start, end, Action)`` timelines, so they work on
measured timelines recorded by the engine as well as on simulated ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from meshtrain.plan.schedules import KINDS, Action, Key, PipelineSchedule, dependencies, done_key

Timeline = list[tuple[float, float, Action]]


@dataclass
class SimResult:
    """A simulated (or measured) run.

    ``bubble`` is the idle fraction ``1 - busy / (pp * makespan)``. ``peak_inflight[r]`` is the most (mb, stage) on
    rank r whose F is done and whose B (or W, for split backwards) is not; ``peak_before_input[r]`` counts only those
    whose B or I is not done yet (the full activations; equal to ``peak_inflight`` without split backwards).
    """

    timelines: list[Timeline]
    makespan: float
    bubble: float
    peak_inflight: list[int]
    peak_before_input: list[int] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)

    @property
    def idle_time(self) -> float:
        """Mean idle time per rank: ``makespan - mean(busy)``; the bubble in time units rather than as a fraction."""
        return self.makespan - sum(self.busy) / len(self.busy) if self.busy else 0.0


def _per_stage(v: float | Sequence[float], n: int, what: str) -> list[float]:
    if isinstance(v, int | float):
        return [float(v)] * n
    out = [float(x) for x in v]
    if len(out) != n:
        raise ValueError(f"costs[{what!r}] must give one cost per stage ({n}), got {len(out)}")
    return out


def _cost_table(s: PipelineSchedule, f: float, b: float, w: float | None,
                costs: Mapping[str, float | Sequence[float]] | None) -> dict[str, list[float]]:
    n = s.n_stages
    if costs is not None:
        unknown = set(costs) - {"F", "B", "I", "W"}
        if unknown:
            raise ValueError(f"costs has unknown kinds {sorted(unknown)}: use F, B, W (and optionally I)")
        f, b = costs.get("F", f), costs.get("B", b)
        w = costs.get("W", w)
    tf, tb = _per_stage(f, n, "F"), _per_stage(b, n, "B")
    tw = [x / 2 for x in tb] if w is None else _per_stage(w, n, "W")
    if costs is not None and "I" in costs:
        ti = _per_stage(costs["I"], n, "I")
    else:
        ti = [x - y for x, y in zip(tb, tw, strict=True)]
    if any(x < 0 for x in tf + tb + tw + ti):
        raise ValueError("action costs must be >= 0 (and w <= b, since I costs b - w)")
    return {"F": tf, "B": tb, "I": ti, "W": tw}


def inflight_peaks(timelines: Sequence[Timeline]) -> tuple[list[int], list[int]]:
    """Per rank: (peak F-done-and-B-or-W-pending, peak F-done-and-B-or-I-pending), in each rank's execution order."""
    peaks, peaks_full = [], []
    for tl in timelines:
        held = full = peak = peak_full = 0
        for _, _, a in sorted(tl, key=lambda e: e[0]):  # stable: ties keep the recorded order
            if a.kind == "F":
                held, full = held + 1, full + 1
            elif a.kind == "B":
                held, full = held - 1, full - 1
            elif a.kind == "I":
                full -= 1
            else:
                held -= 1
            peak, peak_full = max(peak, held), max(peak_full, full)
        peaks.append(peak)
        peaks_full.append(peak_full)
    return peaks, peaks_full


def bubble_of_timelines(timelines: Sequence[Timeline]) -> tuple[float, float]:
    """``(makespan, bubble)`` of per-rank ``(start, end, Action)`` timelines, simulated or measured.

    The makespan runs from the earliest start to the latest end over all ranks; the bubble is the idle fraction
    ``1 - busy / (n_ranks * makespan)`` (a rank with an empty timeline is idle throughout).
    """
    spans = [(st, en) for tl in timelines for st, en, _ in tl]
    if not spans:
        return 0.0, 0.0
    makespan = max(en for _, en in spans) - min(st for st, _ in spans)
    if makespan <= 0:
        return 0.0, 0.0
    busy = sum(en - st for st, en in spans)
    return makespan, 1.0 - busy / (len(timelines) * makespan)


@dataclass(frozen=True)
class CompiledSchedule:
    """A schedule turned into an index graph once, for simulating it many times (the planner's search does).

    ``order`` lists every action so that each one's dependencies and its rank's earlier actions come first;
    ``prev[i]`` is the index in ``order`` of the same rank's previous action (-1 for the first) and ``deps[i]``
    the ``(index, cross_rank)`` pairs action ``i`` waits for. The in-flight peaks do not depend on the costs
    (a rank's start times never decrease along its list), so they are counted here once.
    """

    schedule: PipelineSchedule
    order: list[Action]
    rank: list[int]
    prev: list[int]
    deps: list[tuple[tuple[int, bool], ...]]
    peak_inflight: list[int]
    peak_before_input: list[int]


def compile_schedule(s: PipelineSchedule) -> CompiledSchedule:
    """Order ``s``'s actions as they can run and link each to what it waits for.

    Raises ``RuntimeError("deadlock ...")`` naming each rank's stuck action when no rank can progress: whether a
    schedule deadlocks does not depend on the costs.
    """
    n = s.n_stages
    index: dict[Key, int] = {}  # done key -> position in order
    order: list[Action] = []
    rank: list[int] = []
    prev: list[int] = []
    deps: list[tuple[tuple[int, bool], ...]] = []
    ptr, last = [0] * s.pp, [-1] * s.pp
    while True:
        progressed = False
        for r, acts in enumerate(s.actions):
            while ptr[r] < len(acts):
                a = acts[ptr[r]]
                keys = dependencies(a, n)
                if any(k not in index for k in keys):
                    break
                deps.append(tuple((index[k], rank[index[k]] != r) for k in keys))
                order.append(a)
                rank.append(r)
                prev.append(last[r])
                last[r] = index[done_key(a)] = len(order) - 1
                ptr[r] += 1
                progressed = True
        if all(p == len(acts) for p, acts in zip(ptr, s.actions, strict=True)):
            break
        if not progressed:
            stuck = []
            for r, acts in enumerate(s.actions):
                if ptr[r] < len(acts):
                    a = acts[ptr[r]]
                    missing = [f"{'B/I' if k[0] == 'BI' else k[0]}{k[1]}@{k[2]}" for k in dependencies(a, n)
                               if k not in index]
                    stuck.append(f"rank {r} at {a} waiting for {', '.join(missing)}")
            raise RuntimeError(f"deadlock in schedule {s.name!r}: " + "; ".join(stuck))
    peaks, peaks_full = inflight_peaks([[(0.0, 0.0, a) for a in acts] for acts in s.actions])
    return CompiledSchedule(s, order, rank, prev, deps, peaks, peaks_full)


def _clock(c: CompiledSchedule, cost: Sequence[float], p2p: float) -> tuple[list[float], list[float]]:
    """(start, end) of every action of ``c.order`` given its cost: each starts when its rank is free and its
    dependencies have finished, plus ``p2p`` for one on another rank."""
    start, end = [0.0] * len(cost), [0.0] * len(cost)
    for i, (before, waits) in enumerate(zip(c.prev, c.deps, strict=True)):
        t = end[before] if before >= 0 else 0.0
        for j, cross in waits:
            t = max(t, end[j] + p2p if cross else end[j])
        start[i], end[i] = t, t + cost[i]
    return start, end


def simulate(s: PipelineSchedule | CompiledSchedule, f: float = 1.0, b: float = 2.0, w: float | None = None,
             p2p: float = 0.0, *, costs: Mapping[str, float | Sequence[float]] | None = None,
             action_costs: Mapping[Action, float] | None = None) -> SimResult:
    """Run ``s`` with per-stage action costs and return its timelines, makespan, bubble and in-flight peaks.

    ``f``/``b`` are the forward / full-backward costs; for split schedules ``W`` costs ``w`` (default ``b / 2``) and
    ``I`` costs ``b - w``. ``costs={"F": [...], "B": [...], "W": [...]}`` (per stage; optional ``"I"``, scalars
    allowed) overrides them, e.g. with measured costs; ``action_costs`` gives single actions their own cost (a
    measured run replayed action by action). ``p2p`` is added to every cross-rank dependency. ``s`` may be
    compiled already (``compile_schedule``), which saves its ordering when one schedule is run many times.
    Raises ``RuntimeError("deadlock ...")`` naming each rank's stuck action when no rank can progress.
    """
    c = s if isinstance(s, CompiledSchedule) else compile_schedule(s)
    table = _cost_table(c.schedule, f, b, w, costs)
    cost = [table[a.kind][a.stage] for a in c.order]
    if action_costs is not None:
        cost = [action_costs.get(a, x) for a, x in zip(c.order, cost, strict=True)]
    start, end = _clock(c, cost, p2p)
    timelines: list[Timeline] = [[] for _ in range(c.schedule.pp)]
    for r, a, st, en in zip(c.rank, c.order, start, end, strict=True):
        timelines[r].append((st, en, a))
    makespan, bubble = bubble_of_timelines(timelines)
    busy = [sum(en - st for st, en, _ in tl) for tl in timelines]
    return SimResult(timelines, makespan, bubble, list(c.peak_inflight), list(c.peak_before_input), busy)


def check_schedule(s: PipelineSchedule) -> None:
    """Raise ``ValueError`` unless ``s`` is complete, well ordered and runs to the end without deadlock.

    Every (mb, stage) has exactly one F and either one B or one I and one W (I/W only when ``split_backward``), all
    on ``placement[stage]``'s rank; on that rank F comes before B/I and I before W; and the simulated run finishes.
    """
    n = s.n_stages
    if len(s.placement) != n or any(not 0 <= r < s.pp for r in s.placement):
        raise ValueError(f"{s.name}: placement must map each of the {n} stages to a rank in 0..{s.pp - 1}, "
                         f"got {s.placement}")
    if len(s.actions) != s.pp:
        raise ValueError(f"{s.name}: expected one action list per pp rank ({s.pp}), got {len(s.actions)}")
    where: dict[tuple[str, int, int], tuple[int, int]] = {}  # (kind, mb, stage) -> (rank, position)
    for r, acts in enumerate(s.actions):
        for i, a in enumerate(acts):
            if a.kind not in KINDS:
                raise ValueError(f"{s.name}: rank {r} action {a} has unknown kind {a.kind!r}")
            if not (0 <= a.mb < s.microbatches and 0 <= a.stage < n):
                raise ValueError(f"{s.name}: rank {r} action {a} is outside {s.microbatches} microbatches x {n} stages")
            if s.placement[a.stage] != r:
                raise ValueError(f"{s.name}: {a} is on rank {r} but stage {a.stage} is placed on rank "
                                 f"{s.placement[a.stage]}")
            if a.kind in ("I", "W") and not s.split_backward:
                raise ValueError(f"{s.name}: {a} is a split backward but split_backward is False")
            k = (a.kind, a.mb, a.stage)
            if k in where:
                raise ValueError(f"{s.name}: {a} appears twice")
            where[k] = (r, i)
    for mb in range(s.microbatches):
        for st in range(n):
            f = where.get(("F", mb, st))
            b, i, w = (where.get((k, mb, st)) for k in ("B", "I", "W"))
            name = f"(mb {mb}, stage {st})"
            if f is None:
                raise ValueError(f"{s.name}: {name} has no forward F{mb}@{st}")
            if b is not None and (i is not None or w is not None):
                raise ValueError(f"{s.name}: {name} has both a full backward B and a split one I/W")
            if b is None and (i is None or w is None):
                raise ValueError(f"{s.name}: {name} needs either B{mb}@{st} or both I{mb}@{st} and W{mb}@{st}")
            first_back = b if b is not None else i
            if first_back[1] < f[1]:
                raise ValueError(f"{s.name}: rank {f[0]} runs the backward of {name} before its forward")
            if w is not None and w[1] < i[1]:
                raise ValueError(f"{s.name}: rank {w[0]} runs W{mb}@{st} before I{mb}@{st}")
    try:
        simulate(s, 1.0, 2.0, 1.0)
    except RuntimeError as e:
        raise ValueError(f"{s.name}: {e}") from None


# ------------------------------------------------------------------------------------------------------- charts


def _timelines_of(x: SimResult | Sequence[Timeline]) -> list[Timeline]:
    return list(x.timelines if isinstance(x, SimResult) else x)


def text_chart(result_or_timelines: SimResult | Sequence[Timeline], width: int = 100) -> str:
    """One row per rank, time scaled to ``width`` columns, then a line with the bubble.

    A block shows its kind (F, B, I, W) in upper case for even microbatches and lower case for odd ones, so that
    adjacent blocks stay apart; ``.`` is idle.
    """
    timelines = _timelines_of(result_or_timelines)
    makespan, bubble = bubble_of_timelines(timelines)
    starts = [st for tl in timelines for st, _, _ in tl]
    t0 = min(starts) if starts else 0.0
    scale = width / makespan if makespan > 0 else 0.0
    label = len(str(len(timelines) - 1))
    lines = []
    for r, tl in enumerate(timelines):
        row = ["."] * width
        for st, en, a in tl:
            # Round both ends: neighbouring blocks then share a boundary and real gaps stay visible.
            c0, c1 = round((st - t0) * scale), round((en - t0) * scale)
            ch = a.kind if a.mb % 2 == 0 else a.kind.lower()
            for c in range(c0, min(max(c1, c0 + 1), width)):
                row[c] = ch
        lines.append(f"rank {r:>{label}} |{''.join(row)}|")
    busy = sum(en - st for tl in timelines for st, en, _ in tl)
    capacity = len(timelines) * makespan
    lines.append(f"bubble {bubble:.2%} (makespan {makespan:.4g}, idle {capacity - busy:.4g} of {capacity:.4g} "
                 f"rank-time; upper case = even microbatch, lower case = odd, . = idle)")
    return "\n".join(lines)


_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}
_NAMES = {"F": "forward", "B": "backward", "I": "backward-input", "W": "backward-weight"}


def png_chart(timelines: SimResult | Sequence[Timeline], path: str | Path, title: str) -> None:
    """Write a Gantt chart of the timelines to ``path``: one row per rank, colour by kind, microbatch in each box.

    Stages of a rank's second (and later) model chunks are drawn lighter; the bubble is added to the title.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: plotting is optional
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    tls = _timelines_of(timelines)
    makespan, bubble = bubble_of_timelines(tls)
    starts = [st for tl in tls for st, _, _ in tl]
    t0 = min(starts) if starts else 0.0
    n = len(tls)
    fig = Figure(figsize=(14, 1.2 + 0.55 * n))
    FigureCanvasAgg(fig)  # Agg, without touching pyplot's global backend
    ax = fig.add_subplot()
    inch_per_unit = 12.5 / makespan if makespan > 0 else 0.0
    kinds = set()
    later_chunks = False
    for r, tl in enumerate(tls):
        for st, en, a in tl:
            kinds.add(a.kind)
            chunk = a.stage // max(n, 1)  # chunk index for interleaved and V placements
            later_chunks |= chunk > 0
            ax.broken_barh([(st - t0, en - st)], (r - 0.4, 0.8), facecolors=_COLOURS.get(a.kind, "grey"),
                           edgecolors="black", linewidth=0.4, alpha=1.0 if chunk % 2 == 0 else 0.55)
            text = str(a.mb)
            if (en - st) * inch_per_unit * 72 >= 6 * len(text) + 2:  # only when the number fits in the box
                ax.text(st - t0 + (en - st) / 2, r, text, ha="center", va="center", fontsize=7, color="white")
    ax.set_xlim(0, makespan if makespan > 0 else 1)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
    ax.set_xlabel("time")
    ax.set_title(f"{title} (bubble {bubble:.1%}, makespan {makespan:.4g})")
    handles = [Patch(facecolor=_COLOURS[k], label=_NAMES[k]) for k in "FBIW" if k in kinds]
    if later_chunks:
        handles.append(Patch(facecolor="grey", alpha=0.55, label="lighter: chunk 1, 3, ..."))
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.005, 0.5), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
