"""Pipeline schedules as data: for each pp rank, the ordered list of actions it executes.

A schedule is built once, checked (``simulator.check_schedule``, which runs it), drawn by the simulator and executed
by the engine (``meshtrain/parallel/pipeline/engine.py``); nothing here knows about tensors or processes. An
:class:`Action` names a kind, a microbatch and a *global* stage: ``S = pp * virtual`` stages, stage 0 holds the
embedding and stage ``S - 1`` the head and the loss, and ``placement[stage]`` is the pp rank that runs it.

Kinds: ``F`` forward, ``B`` full backward, or the split backward ``I`` (gradient w.r.t. the stage input, which the
previous stage is waiting for) followed by ``W`` (gradient w.r.t. the stage's weights, which nobody waits for and
can therefore be deferred into what would otherwise be idle time).

Dependencies (the only rules; the simulator and the engine both obey them):

- ``F(mb, s)`` needs ``F(mb, s-1)`` finished (``s > 0``);
- ``B`` or ``I`` ``(mb, s)`` needs ``F(mb, s)`` finished and the ``B`` or ``I`` of ``(mb, s+1)`` finished (``s < S-1``);
- ``W(mb, s)`` needs ``I(mb, s)`` finished.

A dependency on an action of another rank is a point-to-point transfer and costs the p2p latency in the simulator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshtrain.config import SCHEDULES

KINDS = ("F", "B", "I", "W")
# Model chunks per rank a schedule runs with unless told otherwise (``parallel.virtual_stages``; dualpipev's V is
# always 2): what ``meshtrain schedule`` and the planner's search use.
DEFAULT_VIRTUAL = {"afab": 1, "1f1b": 1, "interleaved": 2, "zb-h1": 1, "dualpipev": 2}

Key = tuple[str, int, int]  # ("F" | "BI" | "W", mb, stage): what a dependency waits for


@dataclass(frozen=True)
class Action:
    """One unit of pipeline work: ``kind`` (F, B, I or W) of microbatch ``mb`` on global stage ``stage``."""

    kind: str
    mb: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}@{self.stage}"


@dataclass
class PipelineSchedule:
    """Per-rank action lists plus the stage placement they were built for.

    ``placement[stage]`` is the pp rank holding that stage; ``actions[rank]`` is that rank's execution order;
    ``split_backward`` is True when backwards are split into I and W.
    """

    name: str
    pp: int
    microbatches: int
    virtual: int
    placement: list[int]
    actions: list[list[Action]]
    split_backward: bool

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual

    def stages_of(self, rank: int) -> list[int]:
        """The global stages held by ``rank``, in increasing order."""
        return [s for s, r in enumerate(self.placement) if r == rank]


def done_key(a: Action) -> Key:
    """What finishing ``a`` provides: a B and an I both provide the input gradient ("BI")."""
    return ("BI" if a.kind in ("B", "I") else a.kind, a.mb, a.stage)


def dependencies(a: Action, n_stages: int) -> list[Key]:
    """The keys ``a`` waits for (see the module docstring)."""
    if a.kind == "F":
        return [("F", a.mb, a.stage - 1)] if a.stage > 0 else []
    if a.kind in ("B", "I"):
        deps: list[Key] = [("F", a.mb, a.stage)]
        if a.stage < n_stages - 1:
            deps.append(("BI", a.mb, a.stage + 1))
        return deps
    if a.kind == "W":
        return [("BI", a.mb, a.stage)]
    raise ValueError(f"unknown action kind {a.kind!r}: expected one of {', '.join(KINDS)}")


# --------------------------------------------------------------------------------------------- hand-written orders


def _afab(pp: int, m: int) -> list[list[Action]]:
    # GPipe: every forward, then every backward (in microbatch order, so rank 0 frees the oldest first).
    return [[Action("F", i, r) for i in range(m)] + [Action("B", i, r) for i in range(m)] for r in range(pp)]


def _1f1b(pp: int, m: int) -> list[list[Action]]:
    out = []
    for r in range(pp):
        warm = min(pp - r - 1, m)  # enough forwards in flight that the first backward arrives just in time
        acts = [Action("F", i, r) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action("F", warm + i, r), Action("B", i, r)]
        acts += [Action("B", i, r) for i in range(m - warm, m)]
        out.append(acts)
    return out


def _interleaved(pp: int, m: int, v: int) -> list[list[Action]]:
    # Megatron's order: the k-th forward of a rank runs chunk (k // pp) % v of microbatch (k // (pp*v)) * pp + k % pp,
    # i.e. pp microbatches go through chunk 0, then the same pp through chunk 1, ...; backwards walk chunks in reverse.
    total = m * v
    out = []
    for r in range(pp):
        def fwd(k: int, r: int = r) -> Action:
            mb = (k // (pp * v)) * pp + k % pp
            return Action("F", mb, ((k // pp) % v) * pp + r)

        def bwd(k: int, r: int = r) -> Action:
            mb = (k // (pp * v)) * pp + k % pp
            return Action("B", mb, (v - 1 - (k // pp) % v) * pp + r)

        warm = min((pp - r - 1) * 2 + (v - 1) * pp, total)
        acts = [fwd(k) for k in range(warm)]
        for k in range(total - warm):
            acts += [fwd(warm + k), bwd(k)]
        acts += [bwd(k) for k in range(total - warm, total)]
        out.append(acts)
    return out


# ------------------------------------------------------------------------------------------ generated (zero bubble)


def _first_ready(kind: str, stages: list[int], m: int, n_stages: int, finish: dict[Key, float],
                 t: float) -> Action | None:
    """The oldest microbatch's ``kind`` action on these stages (in the given stage order) that can start at ``t``."""
    for mb in range(m):
        for s in stages:
            a = Action(kind, mb, s)
            if done_key(a) not in finish and all(finish.get(d, math.inf) <= t for d in dependencies(a, n_stages)):
                return a
    return None


def _list_schedule(pp: int, m: int, placement: list[int], full_limit: list[int], total_limit: list[int],
                   costs: tuple[float, float, float]) -> list[list[Action]]:
    """Record the order in which a greedy event-driven list scheduler runs F, I and W on each rank.

    ``costs = (f, b, w)``: F costs f, I costs b - w, W costs w (the defaults give F = I = W = 1); no p2p latency.
    Whenever a rank is free it starts, in this priority order:

    1. the ready ``F`` of the oldest microbatch (later stage first on a tie), but only while the rank holds fewer
       than ``full_limit[rank]`` (mb, stage) whose F has started and I has not (full activations) and fewer than
       ``total_limit[rank]`` whose W has not (activations W still needs): forwards keep the pipe full, the limits
       keep memory at the level chosen by the schedule;
    2. the ready ``I`` of the oldest microbatch (later stage first): the previous stage waits for it;
    3. the ``W`` of the oldest microbatch whose I is done: nobody waits for it, so it fills what would be idle time.

    Otherwise the rank waits for the next event. The result is plain data, like the hand-written schedules.
    """
    f, b, w = costs
    cost = {"F": f, "I": b - w, "W": w}
    n_stages = len(placement)
    down = [[s for s in reversed(range(n_stages)) if placement[s] == r] for r in range(pp)]
    finish: dict[Key, float] = {}  # set when an action starts, to the time it will finish
    full = [0] * pp  # F started, I not finished
    total = [0] * pp  # F started, W not finished
    free = [0.0] * pp
    order: list[list[Action]] = [[] for _ in range(pp)]
    left = 3 * m * n_stages
    t = 0.0
    while left:
        again = False  # a zero-cost action ran: its rank is free again at t
        for r in range(pp):
            if free[r] > t:
                continue
            pick = None
            if full[r] < full_limit[r] and total[r] < total_limit[r]:
                pick = _first_ready("F", down[r], m, n_stages, finish, t)
            pick = pick or _first_ready("I", down[r], m, n_stages, finish, t)
            pick = pick or _first_ready("W", down[r][::-1], m, n_stages, finish, t)
            if pick is None:
                continue
            finish[done_key(pick)] = free[r] = t + cost[pick.kind]
            order[r].append(pick)
            left -= 1
            again = again or cost[pick.kind] == 0
            full[r] += {"F": 1, "I": -1, "W": 0}[pick.kind]
            total[r] += {"F": 1, "I": 0, "W": -1}[pick.kind]
        if again:  # look again at the same time
            continue
        later = [x for x in free if x > t]
        if left and not later:  # nobody busy and nobody could start: the limits are too tight for this layout
            raise RuntimeError(f"list scheduler stuck at t={t} with {left} actions left (memory limits too tight)")
        t = min(later, default=t)
    return order


def _zb_h1(pp: int, m: int, costs: tuple[float, float, float]) -> list[list[Action]]:
    # Memory rule: rank r keeps at most pp - r full activations (F done, I not done), exactly 1F1B's bound, and at
    # most pp (mb, stage) whose W is still pending, which is 1F1B's peak on rank 0, the pipeline's peak.
    return _list_schedule(pp, m, list(range(pp)), [pp - r for r in range(pp)], [pp] * pp, costs)


def _v_placement(pp: int) -> list[int]:
    # Rank r holds stage r (down the V) and stage 2pp-1-r (back up); the loss is on rank 0.
    return [s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)]


def _dualpipev(pp: int, m: int, costs: tuple[float, float, float]) -> list[list[Action]]:
    # Each stage is half a rank's layers, so 2pp stage activations weigh what pp full-rank activations weigh in
    # 1F1B (its rank-0 peak); every rank may hold that many until their W has run.
    limit = [2 * pp] * pp
    return _list_schedule(pp, m, _v_placement(pp), limit, limit, costs)


# ----------------------------------------------------------------------------------------------------- public API


def build_schedule(name: str, pp: int, microbatches: int, virtual: int = 1, *,
                   gen_costs: tuple[float, float, float] = (1.0, 2.0, 1.0)) -> PipelineSchedule:
    """Build the named schedule for ``pp`` ranks and ``microbatches`` microbatches per step.

    - ``afab``: GPipe, all forwards then all backwards (``virtual`` must be 1).
    - ``1f1b``: PipeDream-Flush; rank r runs ``min(pp - r - 1, m)`` warm-up forwards, then alternates one forward and
      one backward, then the remaining backwards (``virtual`` must be 1).
    - ``interleaved``: Megatron's interleaved 1F1B with ``virtual >= 2`` chunks per rank, stage s on rank ``s % pp``;
      rank r runs ``min((pp - r - 1) * 2 + (virtual - 1) * pp, m * virtual)`` warm-up forwards; needs
      ``microbatches % pp == 0``.
    - ``zb-h1``: 1F1B with each backward split into I then W, the W's deferred into what would be idle time.
      Generated by a list scheduler (``_list_schedule``: priority F-under-memory-limit > I > W) with rank r holding
      at most ``pp - r`` full activations (F done, I not; 1F1B's bound) and at most ``pp`` whose W is pending.
    - ``dualpipev``: DualPipeV's V placement (``virtual`` forced to 2: rank r holds stages r and ``2pp-1-r``), split
      backward, generated by the same list scheduler with at most ``2pp`` stage activations per rank. Unlike DeepSeek's
      DualPipe, a rank here runs one action at a time: it does not overlap a forward chunk with a backward chunk.

    ``gen_costs = (f, b, w)`` are the per-action costs the list scheduler assumes for zb-h1 and dualpipev (F = f,
    I = b - w, W = w; default F = I = W = 1); pass measured costs to generate an order suited to them. The
    hand-written schedules ignore it.

    Raises ``ValueError`` naming the option (``parallel.schedule``, ``parallel.pp``, ``parallel.microbatches``,
    ``parallel.virtual_stages``) and the fix.
    """
    if name not in SCHEDULES:
        raise ValueError(f"parallel.schedule={name!r} is not a pipeline schedule: choose one of "
                         f"{', '.join(SCHEDULES)}.")
    if not isinstance(pp, int) or pp < 1:
        raise ValueError(f"parallel.pp must be an integer >= 1, got {pp!r}: set parallel.pp to the number of "
                         f"pipeline ranks.")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"parallel.microbatches must be an integer >= 1, got {microbatches!r}: set it to the number "
                         f"of microbatches per step (at least parallel.pp={pp} keeps every stage busy).")
    if not isinstance(virtual, int) or virtual < 1:
        raise ValueError(f"parallel.virtual_stages must be an integer >= 1, got {virtual!r}: set "
                         f"parallel.virtual_stages=1 (or 2 for the interleaved schedule).")
    f, b, w = gen_costs
    if not (f > 0 and b > 0 and 0 <= w <= b):
        raise ValueError(f"gen_costs=(f, b, w) needs f > 0, b > 0 and 0 <= w <= b, got {gen_costs}")
    m = microbatches
    if name in ("afab", "1f1b", "zb-h1") and virtual != 1:
        raise ValueError(f"parallel.schedule={name} runs one stage per rank, so parallel.virtual_stages must be 1 "
                         f"(got {virtual}): set parallel.virtual_stages=1, or use parallel.schedule=interleaved.")
    one_each = list(range(pp))
    if name == "afab":
        return PipelineSchedule(name, pp, m, 1, one_each, _afab(pp, m), False)
    if name == "1f1b":
        return PipelineSchedule(name, pp, m, 1, one_each, _1f1b(pp, m), False)
    if name == "zb-h1":
        return PipelineSchedule(name, pp, m, 1, one_each, _zb_h1(pp, m, gen_costs), True)
    if name == "interleaved":
        if virtual < 2:
            raise ValueError(f"parallel.schedule=interleaved needs parallel.virtual_stages >= 2 model chunks per rank "
                             f"(got {virtual}): set parallel.virtual_stages=2, or use parallel.schedule=1f1b.")
        if m % pp:
            fits = sorted({max(pp, m // pp * pp), (m // pp + 1) * pp})
            raise ValueError(f"parallel.schedule=interleaved needs parallel.microbatches to be a multiple of "
                             f"parallel.pp={pp} (got {m}): set parallel.microbatches="
                             f"{' or '.join(map(str, fits))}.")
        placement = [s % pp for s in range(pp * virtual)]
        return PipelineSchedule(name, pp, m, virtual, placement, _interleaved(pp, m, virtual), False)
    # dualpipev
    if virtual not in (1, 2):
        raise ValueError(f"parallel.schedule=dualpipev always holds 2 stages per rank (a V), so "
                         f"parallel.virtual_stages must be 2 (got {virtual}): set parallel.virtual_stages=2.")
    return PipelineSchedule(name, pp, m, 2, _v_placement(pp), _dualpipev(pp, m, gen_costs), True)
