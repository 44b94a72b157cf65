"""Pipeline schedules as data: structure, the simulator's bubble and memory numbers, charts and the CLI."""

import random
from collections import Counter

import pytest

from meshtrain.config import SCHEDULES
from meshtrain.plan.schedules import Action, PipelineSchedule, build_schedule, dependencies, done_key
from meshtrain.plan.simulator import (
    SimResult,
    bubble_of_timelines,
    check_schedule,
    compile_schedule,
    inflight_peaks,
    png_chart,
    simulate,
    text_chart,
)

VIRTUAL = {"afab": 1, "1f1b": 1, "interleaved": 2, "zb-h1": 1, "dualpipev": 2}
M = 8


def sched(name: str, pp: int, m: int = M, **kw) -> PipelineSchedule:
    return build_schedule(name, pp, m, VIRTUAL[name], **kw)


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_is_complete_and_runs(name, pp):
    s = sched(name, pp)
    check_schedule(s)
    assert s.n_stages == pp * s.virtual == len(s.placement)
    kinds = Counter(a.kind for acts in s.actions for a in acts)
    per = M * s.n_stages
    assert kinds == (Counter(F=per, I=per, W=per) if s.split_backward else Counter(F=per, B=per))
    for r in range(pp):
        assert {a.stage for a in s.actions[r]} == set(s.stages_of(r))
    assert str(Action("F", 3, 1)) == "F3@1"


def test_placements():
    assert sched("interleaved", 4).placement == [0, 1, 2, 3, 0, 1, 2, 3]
    v = sched("dualpipev", 4)
    assert v.placement == [0, 1, 2, 3, 3, 2, 1, 0] and v.virtual == 2
    assert v.stages_of(0) == [0, 7] and v.stages_of(3) == [3, 4]  # embedding and loss both on rank 0
    assert build_schedule("dualpipev", 4, 8, 1).virtual == 2  # forced


@pytest.mark.parametrize("name", ["afab", "1f1b"])
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("f, b", [(1.0, 1.0), (1.0, 2.0)])
def test_afab_and_1f1b_bubble_is_exact(name, pp, f, b):
    # Uniform costs, no p2p: makespan (m + p - 1)(f + b), so the bubble is (p-1)/(m+p-1) for any f, b.
    r = simulate(sched(name, pp), f, b)
    assert r.makespan == pytest.approx((M + pp - 1) * (f + b), abs=1e-9)
    assert r.bubble == pytest.approx((pp - 1) / (M + pp - 1), abs=1e-9)
    assert r.idle_time == pytest.approx((pp - 1) * (f + b), abs=1e-9)


def test_afab_with_p2p_adds_two_latencies_per_hop():
    r = simulate(sched("afab", 4), 1.0, 2.0, p2p=0.25)
    assert r.makespan == pytest.approx((M + 3) * 3 + 2 * 3 * 0.25, abs=1e-9)


@pytest.mark.parametrize("pp", [2, 4])
def test_interleaved_bubble_is_1f1b_over_virtual(pp):
    # Same model, v chunks per rank: each chunk action costs 1/v of a 1F1B stage action. Then the idle time per rank
    # is exactly (p-1)(f+b)/v (Megatron's formula), 1/v of 1F1B's, and the fraction is (p-1)/(m v + p - 1).
    v, f, b = 2, 1.0, 2.0
    one = simulate(sched("1f1b", pp), f, b)
    il = simulate(sched("interleaved", pp), f / v, b / v)
    assert il.idle_time == pytest.approx((pp - 1) * (f + b) / v, abs=1e-9)
    assert il.idle_time == pytest.approx(one.idle_time / v, abs=1e-9)
    assert il.bubble == pytest.approx((pp - 1) / (M * v + pp - 1), abs=1e-9)
    assert il.bubble < one.bubble
    assert simulate(sched("interleaved", pp), f, b).bubble == pytest.approx(il.bubble, abs=1e-12)  # scale-free


def test_interleaved_needs_multiple_of_pp_and_v3_works():
    s = build_schedule("interleaved", 2, 4, 3)
    check_schedule(s)
    r = simulate(s, 1.0, 2.0)
    assert r.bubble == pytest.approx(1 / (4 * 3 + 1), abs=1e-9)


def test_zb_h1_bubble_is_a_third_of_1f1b_at_equal_f_i_w():
    # f = i = w = 1 (b = 2, w = 1). ZB-H1's published bubble is (p-1)(f + i - w) against 1F1B's (p-1)(f + b):
    # a third in time. As a fraction of the (equal-work) step it is (p-1)/(3m+p-1) against (p-1)/(m+p-1).
    pp = 4
    one = simulate(sched("1f1b", pp), 1.0, 2.0)
    zb = simulate(sched("zb-h1", pp), 1.0, 2.0, 1.0)
    msg = (f"1f1b idle {one.idle_time} bubble {one.bubble:.4f}; zb-h1 idle {zb.idle_time} bubble {zb.bubble:.4f}; "
           f"ratio (time) {zb.idle_time / one.idle_time:.3f}, ratio (fraction) {zb.bubble / one.bubble:.3f}")
    assert zb.idle_time <= one.idle_time / 3 + 1e-9, msg
    assert zb.idle_time == pytest.approx(pp - 1, abs=1e-9), msg
    assert zb.bubble == pytest.approx((pp - 1) / (3 * M + pp - 1), abs=1e-9), msg
    assert zb.bubble <= 0.41 * one.bubble, msg


def test_zb_h1_and_dualpipev_beat_1f1b_with_their_generation_costs():
    # The generated orders are built for gen_costs; with the matching costs they beat 1F1B's idle time.
    for f, b, w in [(1.0, 1.0, 0.5), (1.0, 2.0, 0.5), (1.0, 2.0, 1.5)]:
        one = simulate(sched("1f1b", 4), f, b)
        zb = simulate(sched("zb-h1", 4, gen_costs=(f, b, w)), f, b, w)
        if b - w >= w:  # the published ZB-H1 bubble (p-1)(f + i - w)
            assert zb.idle_time == pytest.approx(3 * (f + (b - w) - w), abs=1e-9)
        # dualpipev stages are half a rank's layers: halve the costs to compare at equal model size
        dv = simulate(sched("dualpipev", 4, gen_costs=(f, b, w)), f / 2, b / 2, w / 2)
        assert dv.idle_time < one.idle_time and zb.idle_time < one.idle_time, (f, b, w, one, zb.idle_time)


@pytest.mark.parametrize("pp", [2, 4])
def test_peak_inflight(pp):
    assert simulate(sched("afab", pp)).peak_inflight == [M] * pp
    assert simulate(sched("1f1b", pp)).peak_inflight == [pp - r for r in range(pp)]
    # interleaved: Megatron's warm-up (p - r - 1) * 2 + (v - 1) * p forwards, plus the first steady-state one
    assert simulate(sched("interleaved", pp)).peak_inflight == [(pp - r - 1) * 2 + pp + 1 for r in range(pp)]
    zb = simulate(sched("zb-h1", pp), 1.0, 2.0, 1.0)
    assert zb.peak_before_input == [pp - r for r in range(pp)]  # full activations: 1F1B's bound on every rank
    assert max(zb.peak_inflight) <= pp  # with pending W's: never above 1F1B's rank-0 peak
    dv = simulate(sched("dualpipev", pp), 1.0, 2.0, 1.0)
    assert max(dv.peak_inflight) <= 2 * pp  # half-size stages: 2pp of them weigh pp 1F1B stages


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_action_starts_when_its_rank_and_inputs_are_ready(name):
    # The rule of the module docstring checked on the timelines, with uneven costs per stage and a p2p latency:
    # an action starts exactly at the later of its rank's previous end and each dependency's end (+ p2p across
    # ranks). A schedule compiled once gives the same run, and the in-flight peaks it counts without costs are
    # the ones the timelines show.
    rng = random.Random(7)
    s = sched(name, 4, 8)
    compiled = compile_schedule(s)
    for _ in range(3):
        costs = {"F": [rng.uniform(0.0, 2.0) for _ in range(s.n_stages)],
                 "B": [rng.uniform(1.0, 4.0) for _ in range(s.n_stages)]}
        p2p = rng.uniform(0.0, 0.5)
        res = simulate(s, p2p=p2p, costs=costs)
        again = simulate(compiled, p2p=p2p, costs=costs)
        assert again.timelines == res.timelines and again.peak_inflight == res.peak_inflight
        assert (res.peak_inflight, res.peak_before_input) == inflight_peaks(res.timelines)
        ends = {done_key(a): (en, r) for r, tl in enumerate(res.timelines) for _, en, a in tl}
        for r, tl in enumerate(res.timelines):
            assert [a for _, _, a in tl] == s.actions[r]
            free = 0.0
            for st, en, a in tl:
                ready = [ends[k][0] + (p2p if ends[k][1] != r else 0.0) for k in dependencies(a, s.n_stages)]
                assert st == max([free, *ready]), (name, r, a)
                free = en


def test_small_layouts_all_check():
    for name in SCHEDULES:
        for pp in range(1, 5):
            for m in range(1, 9):
                if name == "interleaved" and m % pp:
                    continue
                check_schedule(sched(name, pp, m))


def test_generated_orders_are_deterministic():
    assert sched("zb-h1", 4).actions == sched("zb-h1", 4).actions
    assert sched("dualpipev", 4).actions == sched("dualpipev", 4).actions


def _deadlocked() -> PipelineSchedule:
    # Rank 0 runs B0 before sending F1; rank 1 waits for F1 before it runs B0's stage-1 half: a cycle.
    acts = [[Action("F", 0, 0), Action("B", 0, 0), Action("F", 1, 0), Action("B", 1, 0)],
            [Action("F", 1, 1), Action("F", 0, 1), Action("B", 0, 1), Action("B", 1, 1)]]
    return PipelineSchedule("hand", 2, 2, 1, [0, 1], acts, False)


def test_deadlock_is_rejected():
    with pytest.raises(RuntimeError, match=r"deadlock.*rank 0 at B0@0 waiting for B/I0@1.*rank 1 at F1@1"):
        simulate(_deadlocked())
    with pytest.raises(ValueError, match="deadlock"):
        check_schedule(_deadlocked())


@pytest.mark.parametrize("mutate, message", [
    (lambda a: a[0].pop(), "needs either B1@0"),
    (lambda a: a[0].append(Action("F", 0, 0)), "appears twice"),
    (lambda a: a[0].insert(0, a[1].pop(0)), "placed on rank 1"),
    (lambda a: a[0].insert(0, a[0].pop(3)), "backward of .* before its forward"),
    (lambda a: a[0].append(Action("I", 0, 0)), "split backward but split_backward is False"),
])
def test_malformed_schedules_are_rejected(mutate, message):
    s = sched("1f1b", 2, 2)
    mutate(s.actions)
    with pytest.raises(ValueError, match=message):
        check_schedule(s)


@pytest.mark.parametrize("args, option", [
    (("gpipe", 4, 8, 1), "parallel.schedule"),
    (("1f1b", 0, 8, 1), "parallel.pp"),
    (("1f1b", 4, 0, 1), "parallel.microbatches"),
    (("1f1b", 4, 8, 2), "parallel.virtual_stages=1"),
    (("afab", 4, 8, 2), "parallel.virtual_stages=1"),
    (("zb-h1", 4, 8, 2), "parallel.virtual_stages=1"),
    (("interleaved", 4, 8, 1), "parallel.virtual_stages=2"),
    (("interleaved", 4, 6, 2), "parallel.microbatches=4 or 8"),
    (("interleaved", 4, 2, 2), "parallel.microbatches=4"),
    (("dualpipev", 4, 8, 3), "parallel.virtual_stages must be 2"),
])
def test_bad_names_and_sizes(args, option):
    with pytest.raises(ValueError, match=option):
        build_schedule(*args)


def test_per_stage_costs():
    s = sched("1f1b", 4)
    assert simulate(s, costs={"F": [1.0] * 4, "B": [2.0] * 4}).makespan == simulate(s, 1.0, 2.0).makespan
    slow = simulate(s, costs={"F": [1, 1, 2, 1], "B": [2, 2, 4, 2]})
    assert slow.busy == [24.0, 24.0, 48.0, 24.0]
    # the slow stage's own work, plus the forwards before it and the backwards after it
    assert slow.makespan >= 48 + 2 * 1 + 2 * 2 - 1e-9
    z = sched("zb-h1", 4)
    assert simulate(z, costs={"F": 1.0, "B": 2.0, "W": 0.5}).makespan == simulate(z, 1.0, 2.0, 0.5).makespan
    assert simulate(z, costs={"F": 1, "I": 1.5, "W": 0.5}).makespan == simulate(z, 1.0, 2.0, 0.5).makespan
    with pytest.raises(ValueError, match="one cost per stage"):
        simulate(s, costs={"F": [1.0, 1.0]})
    with pytest.raises(ValueError, match="unknown kinds"):
        simulate(s, costs={"X": 1.0})


def test_bubble_of_measured_timelines():
    r = simulate(sched("1f1b", 4), 1.0, 2.0)
    shifted = [[(1000.0 + st, 1000.0 + en, a) for st, en, a in tl] for tl in r.timelines]  # wall-clock times
    makespan, bubble = bubble_of_timelines(shifted)
    assert makespan == pytest.approx(r.makespan) and bubble == pytest.approx(r.bubble)
    assert bubble_of_timelines([[], []]) == (0.0, 0.0)
    assert bubble_of_timelines([[(0.0, 2.0, Action("F", 0, 0))], []]) == (2.0, 0.5)  # an idle rank counts


def test_text_chart():
    r = simulate(sched("1f1b", 2, 4), 1.0, 2.0)
    chart = text_chart(r, width=40)
    lines = chart.splitlines()
    assert len(lines) == 3 and "bubble" in lines[-1] and "20.00%" in lines[-1]
    assert all(len(line.split("|")[1]) == 40 for line in lines[:2])
    assert lines[1].split("|")[1].startswith("...")  # rank 1 waits for the first forward
    assert set(lines[0].split("|")[1]) <= set("FfBb.") and "f" in lines[0] and "b" in lines[0]
    assert text_chart(r.timelines, width=40) == chart  # plain (measured) timelines work too


def test_png_chart(tmp_path):
    r = simulate(sched("dualpipev", 2, 4), 1.0, 2.0, 1.0)
    path = tmp_path / "dv.png"
    png_chart(r.timelines, path, "dualpipev")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert isinstance(r, SimResult)


def test_cli_prints_chart_and_bubble(capsys):
    from meshtrain.cli import main

    assert main(["schedule", "--pp", "2", "--microbatches", "4", "--schedule", "1f1b"]) == 0
    out = capsys.readouterr().out
    assert "bubble" in out and "0.2000" in out
    assert "peak in-flight per rank" in out and "rank 0: 2, rank 1: 1" in out


def test_cli_writes_png(tmp_path, capsys):
    from meshtrain.cli import main

    path = tmp_path / "zb.png"
    argv = ["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "zb-h1", "--f", "1", "--b", "2", "--w", "1",
            "--png", str(path)]
    assert main(argv) == 0
    assert path.read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "bubble 0.1111" in out and "peak awaiting I" in out


def test_cli_reports_bad_options(capsys):
    from meshtrain.cli import main

    # each error names the option typed, not the training config's key behind it
    for argv, said in [(["--schedule", "interleaved", "--microbatches", "6"], "--microbatches"),
                       (["--pp", "0"], "--pp must be an integer >= 1, got 0: set --pp to"),
                       (["--schedule", "bogus"], "--schedule 'bogus' is not a pipeline schedule"),
                       (["--schedule", "1f1b", "--virtual", "3"], "so --virtual must be 1 (got 3): set --virtual 1"),
                       (["--schedule", "1f1b", "--w", "0.3"], "--w is the weight half of a split backward")]:
        assert main(["schedule", *argv]) == 2
        err = capsys.readouterr().err
        assert said in err and "parallel." not in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert main(["schedule", "--pp", "2", "--microbatches", "4", "--schedule", "zb-h1", "--w", "0.3"]) == 0
    assert "W=0.3" in capsys.readouterr().out
