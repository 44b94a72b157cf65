"""The calibrated step-time model (issue 15, point 3): the fit of the step-cost terms on synthetic measurements,
how a measured profile prices a layout, and the step-time row of ``meshtrain plan --check-run``. No timing is
asserted here: benchmarks/steptime_check.py compares predictions with real runs."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from meshtrain import cli
from meshtrain.calibrate import CALIBRATION_MODELS
from meshtrain.config import Config, ModelConfig, load_config, resolve_dp, save_config
from meshtrain.plan.check import WARMUP_STEPS, layout_of, predict_rank, predict_rank_calls, predict_step_time
from meshtrain.plan.costfit import (
    TERMS,
    StepCosts,
    block_features,
    fit_collective_ops,
    fit_latency_bandwidth,
    fit_nonnegative,
    fit_step_costs,
    head_features,
    step_features,
)
from meshtrain.plan.hardware import Hardware, save_profile
from meshtrain.plan.memory import MESHTRAIN_BF16
from meshtrain.plan.network import Link, wire_factor
from meshtrain.plan.problem import Layout, Problem
from meshtrain.plan.steptime import evaluate, op_time

TRUE = StepCosts(flop_rate=2e11, elem_s=3e-9, score_s=1e-8, block_s=8e-4, param_s=1e-8, step_s=2e-3)


def _rows() -> list[dict[str, float]]:
    return [step_features(ModelConfig(d_model=d, n_layers=L, n_heads=h, n_kv_heads=max(1, h // 2), vocab_size=257,
                                      max_seq_len=T), b, T) for d, L, h, b, T in CALIBRATION_MODELS]


def test_fit_recovers_known_costs():
    """Times made from known costs give those costs back: exactly without noise, within a few % with +-3% noise;
    the calibration models vary every term independently enough for that."""
    rows = _rows()
    exact = [TRUE.seconds(r) for r in rows]
    costs, err = fit_step_costs(rows, exact, TRUE.flop_rate)
    assert err < 1e-9
    for name in ("elem_s", "score_s", "block_s", "param_s", "step_s"):
        assert getattr(costs, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    noise = np.random.default_rng(0).uniform(-0.03, 0.03, len(rows))
    noisy, err = fit_step_costs(rows, [t * (1 + e) for t, e in zip(exact, noise, strict=True)], TRUE.flop_rate)
    assert 0 < err < 0.05
    for name in ("elem_s", "score_s", "param_s"):  # the large terms; block_s and step_s are small parts of a step
        assert getattr(noisy, name) == pytest.approx(getattr(TRUE, name), rel=0.25), name
    # with every term free (the flop rate fitted too), the noise-free fit is exact as well
    coef, err = fit_nonnegative(rows, exact)
    assert err < 1e-6 and StepCosts.from_coefficients(coef).flop_rate == pytest.approx(TRUE.flop_rate, rel=1e-4)


def test_fit_keeps_coefficients_non_negative():
    """A term that would fit negative (time falling as it grows) is dropped, not given a negative cost."""
    rows = [{"flops": float(i), "elems": float((7 * i) % 5 + 1), "steps": 1.0} for i in range(1, 9)]
    seconds = [2.0 * r["flops"] - 0.3 * r["elems"] + 5.0 for r in rows]
    x = np.array([[r[k] for k in ("flops", "elems", "steps")] for r in rows])
    free = np.linalg.lstsq(x / np.array(seconds)[:, None], np.ones(len(rows)), rcond=None)[0]
    assert free[1] < 0  # unconstrained, the elements would get a negative cost
    coef, err = fit_nonnegative(rows, seconds)
    assert (coef >= 0).all() and coef[TERMS.index("elems")] == 0.0 and err < 0.1
    with pytest.raises(ValueError):
        fit_nonnegative(rows, seconds[:-1])


def test_fit_latency_bandwidth():
    lat, bw = 2e-4, 1.5e9
    samples = [(steps, wire, steps * lat + wire / bw) for steps in (1, 2) for wire in (4e3, 1e6, 1.6e7)]
    got_lat, got_bw, err = fit_latency_bandwidth(samples)
    assert got_lat == pytest.approx(lat, rel=1e-6) and got_bw == pytest.approx(bw, rel=1e-6) and err < 1e-9


def _profile(cores: int = 2) -> Hardware:
    return Hardware("cpu-local", "test", TRUE.flop_rate, 8e9, 2e10, 1e9, 1e9, 2, 2, tp_max=2, cores=cores,
                    elem_s=TRUE.elem_s, score_s=TRUE.score_s, block_s=TRUE.block_s, param_s=TRUE.param_s,
                    step_s=TRUE.step_s, source="test")


def test_measured_profile_prices_the_fitted_terms():
    """dp2 on a measured profile: compute is the fitted terms of the rank's blocks and head (no efficiency
    factor), the optimizer row is its parameters and the fixed step cost; 4 processes on 2 cores run each at half
    speed, so dp4 (half the tokens each) costs about what dp2 does."""
    cfg = load_config("configs/small.yaml").model
    cfg = replace(cfg, vocab_size=257)
    T, seqs = 256, 16
    hw = _profile()
    problem = Problem(cfg, T, seqs, hw, 1, precision=MESHTRAIN_BF16, efficiency=0.5)
    est = evaluate(problem, Layout(dp=2))
    t = seqs // 2 * T
    want = sum(cfg.n_layers * block_features(cfg, t, T)[k] + head_features(cfg, t, T).get(k, 0.0)
               for k in ("flops",)) / TRUE.flop_rate
    want += TRUE.seconds({k: cfg.n_layers * block_features(cfg, t, T).get(k, 0.0)
                          + head_features(cfg, t, T).get(k, 0.0) for k in ("elems", "scores", "blocks")})
    assert est.step.compute == pytest.approx(want, rel=1e-9)
    assert est.step.optimizer > TRUE.step_s
    four = evaluate(replace(problem, nodes=2), Layout(dp=4))
    assert four.step.compute == pytest.approx(est.step.compute * (1 - 0.5 * TRUE.block_s * cfg.n_layers
                                                                   / est.step.compute), rel=0.05)
    assert hw.shared_by(4).elem_s == 2 * hw.elem_s and hw.shared_by(2) is hw


def _fake_run(path, cfg: Config, world: int, times: list[float]) -> None:
    """A finished run's folder: its config, comm.json with the bytes and state the cost model predicts (this test
    is about the step-time row), and metrics.jsonl with the given step times."""
    path.mkdir()
    save_config(cfg, path / "config.yaml")
    dp = resolve_dp(cfg, world)
    ranks = []
    for r in range(world):
        coords = {"pp": 0, "dp": r % dp, "cp": 0, "tp": 0, "edp": r % dp, "ep": 0}
        pred, state = predict_rank(cfg, world, coords)
        ranks.append({"rank": r, "coords": coords, "bytes": {f"{a}/{o}": v for (a, o), v in pred.items()},
                      "state": {k: int(v) for k, v in state.items()}})
    (path / "comm.json").write_text(json.dumps({"step": 3, "ranks": ranks}))
    lines = ["meshtrain: a log line"] + [json.dumps({"step": i + 1, "loss": 1.0, "step_time_s": t})
                                         for i, t in enumerate(times)]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_check_run_shows_step_time_row(tmp_path, monkeypatch, capsys):
    """``meshtrain plan --check-run`` prints the step-time row: the planner's prediction on the cpu-local profile
    for the run's layout, and the median step time of its metrics after the warm-up steps."""
    monkeypatch.setenv("MESHTRAIN_CACHE", str(tmp_path / "cache"))
    cfg = load_config("tiny")
    cfg.model.vocab_size = 257
    cfg.parallel.zero = 3
    times = [5.0, 4.0, 0.31, 0.29, 0.35, 0.30, 0.90]
    _fake_run(tmp_path / "run", cfg, 2, times)
    assert cli.main(["plan", "--check-run", str(tmp_path / "run")]) == 0
    row = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    assert len(row) == 1 and "no prediction" in row[0] and "--calibrate" in row[0]  # no profile yet: said so
    save_profile(_profile(), tmp_path / "cache" / "hardware" / "cpu-local.json")
    assert cli.main(["plan", "--check-run", str(tmp_path / "run")]) == 0
    row = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")][0]
    measured = statistics.median(times[WARMUP_STEPS:])
    predicted = predict_step_time(cfg, 2, _profile()).step_s
    assert f"{predicted * 1e3:.1f} ms" in row and f"{measured * 1e3:.1f} ms" in row
    assert f"{predicted / measured - 1:+.0%}" in row and layout_of(cfg, 2).describe() in row
    for bad in ("{bad", "[1]", "{}", '{"step": 3, "ranks": [{"rank": 0}]}'):  # each was a traceback or a bare error
        (tmp_path / "run" / "comm.json").write_text(bad)
        assert cli.main(["plan", "--check-run", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "comm.json is not a meshtrain run's comm.json" in err, err


def test_fit_collective_ops_recovers_each_op():
    """Each op gets its own latency and bandwidth back from samples made with different ones (the form
    ``--calibrate`` fits: seconds = latency steps x latency + wire bytes / bandwidth), where one pair for all
    ops cannot fit them."""
    true = {"all_reduce": (9e-4, 2e9), "all_gather": (2e-4, 1e9), "reduce_scatter": (3e-4, 5e8),
            "all_to_all": (2e-4, 2e9), "send": (1e-4, 5e9)}
    samples = []
    for op, (lat, bw) in true.items():
        steps = 1.0 if op == "send" else (2.0 if op == "all_reduce" else 1.0)
        for payload in (4e3, 64e3, 1e6, 4e6, 16e6):
            wire = payload * wire_factor(op, 2)
            samples.append((op, steps, wire, steps * lat + wire / bw))
    fits = fit_collective_ops(samples)
    assert set(fits) == set(true)
    for op, (lat, bw) in true.items():
        assert fits[op][0] == pytest.approx(lat, rel=1e-6) and fits[op][1] == pytest.approx(bw, rel=1e-6), op
        assert fits[op][2] < 1e-9
    *_, joint_err = fit_latency_bandwidth([(st, w, sec) for _, st, w, sec in samples])
    assert joint_err > 0.1  # one pair for all ops fits them badly: why each op has its own


def test_op_time_prices_op_fit_and_calls():
    """A profile's own fit of an op replaces its common latency and bandwidth, and every call the meter counts
    adds ``call_s``; 4 processes on 2 cores double both (``shared_by``)."""
    hw = replace(_profile(), collective_fits={"reduce_scatter": [3e-4, 5e8], "send": [1e-4, 4e9]}, call_s=5e-5)
    link = Link(2, 2, hw.intra_bw, hw.inter_bw, hw.intra_latency, hw.inter_latency)
    payload = 2e6
    want = 3 * (3e-4 + payload / 3 * wire_factor("reduce_scatter", 2) / 5e8) + 3 * 5e-5
    assert op_time(hw, "reduce_scatter", payload, link, calls=3) == pytest.approx(want, rel=1e-12)
    # a ring hop: one transfer, a send and a receive counted; recv is priced as send
    assert op_time(hw, "recv", 1e6, link, calls=1, metered=2) == pytest.approx(1e-4 + 1e6 / 4e9 + 2 * 5e-5)
    # an op without its own fit keeps the profile's common latency (per tree level, twice) and bandwidth
    common = 2 * hw.intra_latency + 1e6 / hw.intra_bw + 5e-5
    assert op_time(hw, "all_reduce", 1e6, link) == pytest.approx(common, rel=1e-12)
    assert op_time(hw, "all_reduce", 0, link) == 0.0
    four = hw.shared_by(4)
    assert four.call_s == 2 * hw.call_s and four.collective_fits["send"] == [2e-4, 2e9]


def test_predicted_calls_equal_counted_calls():
    """``predict_rank_calls`` gives, rank by rank, the collective calls per (axis, op) that the comm meter counted
    in real runs (``comm.json``'s ``calls``) for 16 layouts on 2 and 4 processes: every DP/ZeRO stage with
    accumulation and HSDP, TP with and without SP and recompute, three pipeline schedules, ring CP with
    recompute, MoE with EP (and TP+SP). The counts were recorded from the runs the fixture names."""
    doc = json.loads((Path(__file__).parent / "fixtures" / "comm_calls.json").read_text())
    assert len(doc["runs"]) >= 16
    for run in doc["runs"]:
        cfg = load_config("configs/small.yaml", run["overrides"])
        for rank in run["ranks"]:
            pred = {f"{a}/{o}": v for (a, o), v in predict_rank_calls(cfg, run["nproc"], rank["coords"]).items()}
            assert pred == rank["calls"], (run["name"], rank["coords"])


@pytest.mark.slow
def test_predicted_calls_equal_counted_calls_live(tmp_path):
    """The same on runs made now, through the CLI: tp2+sp with full recompute and tp2 without SP with selective
    recompute, both in bf16 (which also checks the predicted bytes: every tp activation and gradient travels in
    bf16, the residual stream's dtype), and ring cp2 with grad accumulation."""
    import subprocess
    import sys

    from meshtrain.plan.check import check_run

    base = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "train.seq_len=32",
            "model.max_seq_len=32", "train.global_batch=4", "train.steps=3", "train.eval_every=0",
            "train.sample_tokens=0", "train.progress=false", "train.tensorboard=false", "train.ckpt_every=0",
            "data.source=synthetic"]
    for name, over in (("tp", ["parallel.tp=2", "parallel.sp=true", "train.recompute=full", "train.dtype=bf16"]),
                       ("tp nosp", ["parallel.tp=2", "train.recompute=selective", "train.dtype=bf16"]),
                       ("cp", ["parallel.cp=2", "train.grad_accum=2"])):
        out = tmp_path / name
        subprocess.run([sys.executable, "-m", "meshtrain", "train", "--nproc", "2", "--config", "configs/small.yaml",
                        "--out", str(out), *base, *over], check=True, capture_output=True)
        cfg = load_config("configs/small.yaml", base + over)
        for rank in json.loads((out / "comm.json").read_text())["ranks"]:
            pred = {f"{a}/{o}": v for (a, o), v in predict_rank_calls(cfg, 2, rank["coords"]).items()}
            assert pred == rank["calls"], (name, rank["coords"])
        text, exact, _ = check_run(out, hardware="h100")
        assert exact, text


def test_axis_work_is_priced_per_block_of_the_axes_used():
    """The runtime's own work per axis (``axis_block_s``, measured by ``--calibrate`` through parallelize) adds its
    seconds to a layout that uses the axis, and nothing to one that does not: a part per block call, one per
    activation element (the rank's tokens per microbatch x d_model), one per microbatch, one per parameter of a
    block (the rank's tp share); an older profile's single number is per block call. Selective recompute's policy
    (a Python dispatch mode over every op of a block's forward and its rerun) is priced the same way; full
    recompute, which has no policy, is not."""
    from meshtrain.plan.units import block_params

    cfg = replace(load_config("configs/small.yaml").model, vocab_size=257)
    work = {"tp": [1e-3, 2e-9, 5e-3], "cp": 2e-3, "zero3": [4e-3, 0.0, 0.0, 3e-9], "selective": [6e-3, 7e-9]}
    plain = Problem(cfg, 256, 16, _profile(), 1, precision=MESHTRAIN_BF16)
    priced = replace(plain, hw=replace(_profile(), axis_block_s=work))
    elems = 16 * 256 * cfg.d_model  # the rank's tokens x d_model with dp = 1, one microbatch
    L, P = cfg.n_layers, block_params(cfg)
    for lay, want in ((Layout(dp=2), 0.0), (Layout(dp=1, tp=2, sp=True), L * (1e-3 + 2e-9 * elems) + 5e-3),
                      (Layout(dp=1, cp=2), L * 2e-3), (Layout(dp=2, zero=3), L * (4e-3 + 3e-9 * P)),
                      (Layout(dp=1, tp=2, sp=True, microbatches=2), L * (2 * 1e-3 + 2e-9 * elems) + 2 * 5e-3),
                      (Layout(dp=2, recompute="selective"), L * (6e-3 + 7e-9 * elems / 2)),
                      (Layout(dp=2, recompute="full"), 0.0)):
        extra = evaluate(priced, lay).step.compute - evaluate(plain, lay).step.compute
        assert extra == pytest.approx(want, rel=1e-9, abs=1e-12), lay.describe()


def test_axis_work_fit_separates_its_terms():
    """Four sizes of the calibration model (more tokens, more blocks, wider blocks) give the per-call, per-element,
    per-microbatch and per-parameter parts back exactly; none goes negative (work that shrinks with more tokens is
    not per element; none measured is none)."""
    from meshtrain.plan.costfit import fit_axis_work

    a, b, c, d = 1e-3, 2e-9, 4e-3, 5e-9
    sizes = [(2, 1e5, 2e5), (2, 4e5, 2e5), (4, 1e5, 2e5), (2, 2e5, 8e5)]  # (blocks, elements, parameters per block)
    points = [([L, L * e, 1.0, L * n], L * (a + b * e + d * n) + c) for L, e, n in sizes]
    assert fit_axis_work(points) == pytest.approx([a, b, c, d])
    shrinking = [([2, 2e5, 1.0, 0.0], 6e-3), ([2, 8e5, 1.0, 0.0], 2e-3), ([4, 4e5, 1.0, 0.0], 5e-3)]
    assert all(v >= 0 for v in fit_axis_work(shrinking)) and fit_axis_work(shrinking)[1] == 0.0
    assert fit_axis_work([([2, 2e5, 1.0, 1.0], -3e-3), ([4, 4e5, 1.0, 1.0], -1e-3)]) == [0.0] * 4
    assert fit_axis_work(points, noise=[0.05] * 4) == pytest.approx([a, b, c, d])  # exact data: any weighting


def test_axis_work_fit_weighs_each_figure_by_the_steps_it_is_measured_against():
    """A figure is a difference of two measured steps, so its noise is a share of those steps, not of itself. The
    ring's four figures of a real calibration (2026-11-28 00:35 UTC, this machine; verbatim): the deep size's +0.63
    ms, half the small size's though it runs twice the blocks, is a difference lost in its 63 ms steps. Weighed by
    each figure itself (the old fit) it decides the fit, and the per-score work comes out 0 (cp2 was then predicted
    30% fast); weighed by the steps, the per-score term is kept, near the 14.8 ns/score of the previous calibration."""
    from meshtrain.calibrate import _axis_configs
    from meshtrain.config import load_config
    from meshtrain.plan.check import layout_of
    from meshtrain.plan.costfit import fit_axis_work
    from meshtrain.plan.steptime import axis_features, tokens_per_microbatch

    measured = {"small": (2.53, 36.4), "large": (25.57, 102.9), "deep": (0.63, 63.2), "wide": (4.45, 58.6)}  # ms
    points, steps = [], []
    for size, (extra, step) in measured.items():
        cfg = load_config(None, _axis_configs()[(size, "cp")])
        lay = layout_of(cfg, 2)
        t = tokens_per_microbatch(cfg.train.global_batch, cfg.train.seq_len, lay)
        points.append((axis_features(cfg.model, lay, t, cfg.train.seq_len), extra * 1e-3))
        steps.append(step * 1e-3)
    assert fit_axis_work(points, (0, 1, 4))[4] == 0.0
    weighed = fit_axis_work(points, (0, 1, 4), noise=steps)
    assert 8e-9 < weighed[4] < 15e-9, weighed


def test_axis_calibration_times_each_size_in_fresh_processes_and_tp_at_five(monkeypatch):
    """``calibrate.measure_axis_work`` spawns one process group per size with that size's runs only: in one process a
    size timed after the others ran slower than timed first. TP is also measured at a fifth size (d_model 256
    x 4K tokens, the demo model's tp2 block) that the other axes skip, and its figure joins TP's fit: planted work
    (2 ms per block call + 20 ns per activation element + 5 ms per microbatch) on top of the predicted steps comes
    back from the five sizes."""
    import meshtrain.calibrate as calibrate
    from meshtrain.calibrate import AXIS_RUNS, AXIS_SIZES, _axis_configs, measure_axis_work
    from meshtrain.plan.steptime import axis_features, tokens_per_microbatch

    hw = _profile()
    planted = [2e-3, 20e-9, 5e-3, 0.0, 0.0]
    groups: list[list[tuple[str, str]]] = []

    def fake_spawn(fn, world_size, args, timeout):
        runs = args[0]
        groups.append(list(runs))
        out = {}
        for key, over in runs.items():
            cfg = load_config(None, over)
            secs = predict_step_time(cfg, 2, hw).step_s
            if key[1] == "tp":
                lay = layout_of(cfg, 2)
                t = tokens_per_microbatch(cfg.train.global_batch, cfg.train.seq_len, lay)
                features = axis_features(cfg.model, lay, t, cfg.train.seq_len)
                secs += sum(w * f for w, f in zip(planted, features, strict=True))
            out[key] = secs
        return [out, out]

    monkeypatch.setattr(calibrate, "spawn", fake_spawn)
    work, lines = measure_axis_work(hw)
    assert [{size for size, _ in g} for g in groups] == [{size} for size in AXIS_SIZES]
    assert sorted(key for g in groups for key in g) == sorted(_axis_configs())
    assert {name for size, name in _axis_configs() if size == "wide-large"} == {"base", "tp"}
    assert len(_axis_configs()) == (len(AXIS_SIZES) - 1) * len(AXIS_RUNS) + 2
    assert sum(" tp " in line and "measured" in line for line in lines) == len(AXIS_SIZES)
    assert work["tp"] == pytest.approx(planted, rel=1e-6, abs=1e-15)
    assert all(v == 0.0 for name, terms in work.items() if name != "tp" for v in terms)


def test_check_run_compares_calls(tmp_path):
    """``--check-run`` lists the predicted against the counted calls where comm.json has them, and marks a count
    that differs (shown, not judged: the check's verdict stays the bytes')."""
    from meshtrain.plan.check import check_run

    cfg = load_config("tiny")
    cfg.model.vocab_size = 257
    cfg.parallel.zero = 3
    _fake_run(tmp_path / "run", cfg, 2, [0.3] * 4)
    comm_json = tmp_path / "run" / "comm.json"
    doc = json.loads(comm_json.read_text())
    for r in doc["ranks"]:
        r["calls"] = {f"{a}/{o}": v for (a, o), v in predict_rank_calls(cfg, 2, r["coords"]).items()}
    comm_json.write_text(json.dumps(doc))
    text, exact, _ = check_run(tmp_path / "run", hardware="h100")
    assert exact and "calls dp_shard_cp/all_gather" in text
    doc["ranks"][1]["calls"]["dp_shard_cp/all_gather"] += 1
    comm_json.write_text(json.dumps(doc))
    text, exact, _ = check_run(tmp_path / "run", hardware="h100")
    assert exact and any(ln.startswith("   1  calls dp_shard_cp/all_gather") and ln.endswith("NO")
                             for ln in text.splitlines())
