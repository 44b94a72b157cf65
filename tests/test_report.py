"""The run report (meshtrain/train/report.py) and ``meshtrain demo`` (meshtrain/demo.py): plan, train on two
processes, check, report; every figure in report.md read from the run's own files."""

import email
import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain.config import load_config, save_config
from meshtrain.plan.check import predict_rank
from meshtrain.plan.hardware import Hardware, save_profile
from meshtrain.train.report import RunFiles, step_time_summary, write_report

SECTIONS = ("## Layout", "## What each axis moved", "## Timings", "## Where time went", "## Memory per rank",
            "## Predicted vs measured", "## Loss")


def _synthetic_run(root: Path) -> Path:
    """A run folder as a 2-rank dp2 ZeRO-1 run writes it, with made-up timings and the planner's bytes."""
    run = root / "run"
    run.mkdir()
    cfg = load_config("tiny", ["parallel.zero=1", "train.steps=8"])
    cfg.model.vocab_size = 257
    save_config(cfg, run / "config.yaml")
    rows = []
    for step in range(1, 9):
        rows.append({"step": step, "loss": 5.0 - 0.2 * step, "step_time_s": 0.1 + 0.01 * step,
                     "comm_wait_s": 0.02 + 0.001 * step, "tokens_per_s": 1000.0 + step, "mfu": 0.01,
                     "peak_mem_bytes": 4e8, **({"unigram_loss": 3.25} if step == 1 else {}),
                     **({"val_loss": 4.9 - 0.2 * step} if step % 4 == 0 else {})})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ranks = []
    for rank in range(2):
        coords = {"pp": 0, "dp": rank, "cp": 0, "tp": 0, "edp": rank, "ep": 0}
        pred, state = predict_rank(cfg, 2, coords)
        ranks.append({"rank": rank, "coords": coords, "bytes": {f"{a}/{o}": v for (a, o), v in pred.items()},
                      "wait_s": {f"{a}/{o}": 0.005 * (rank + 1) for (a, o) in pred}, "step_time_s": 0.12,
                      "comm_wait_s": 0.01, "state": {k: int(v) for k, v in state.items()}})
    (run / "comm.json").write_text(json.dumps({"step": 3, "ranks": ranks}))
    return run


def test_report_of_a_synthetic_run_has_every_section_and_the_files_figures(tmp_path):
    run = _synthetic_run(tmp_path)
    path = write_report(run, sample="def x")
    text = path.read_text()
    for section in SECTIONS:
        assert section in text, section
    png = run / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "![train and validation loss](loss.png)" in text
    comm = json.loads((run / "comm.json").read_text())
    for r in comm["ranks"]:  # each (axis, op) row shows comm.json's bytes for every rank
        for key, value in r["bytes"].items():
            row = next(ln for ln in text.splitlines() if ln.startswith(f"| {key} |"))
            assert f"{value:,}" in row
    steady = [0.1 + 0.01 * s for s in range(4, 9)]  # steps after the 3 warm-up steps
    assert step_time_summary(RunFiles(run))["measured_s"] == pytest.approx(statistics.median(steady))
    assert f"step time {statistics.median(steady) * 1e3:,.1f} ms" in text
    assert "every byte count equal, state memory within 5%" in text  # check_run against the planner's bytes
    assert "validation loss 3.300" in text and "unigram baseline 3.250" in text
    assert "## Sample" in text and "def x" in text


def test_report_reads_a_skipped_step_written_as_null(tmp_path):
    """metrics.jsonl writes a skipped step's non-finite loss and norm as null (strict JSON); the report reads
    them as NaN and leaves the step out of the loss curve."""
    run = _synthetic_run(tmp_path)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    row = {**json.loads(lines[4]), "loss": None, "grad_norm": None, "skipped": True}
    (run / "metrics.jsonl").write_text("\n".join([*lines[:4], json.dumps(row), *lines[5:]]) + "\n")
    assert "loss 4.800 at step 1 -> 3.400 at step 8" in write_report(run).read_text()
    assert math.isnan(RunFiles(run).records[4]["loss"])


def test_report_refuses_a_folder_that_is_not_a_finished_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.yaml"):
        write_report(tmp_path)


@pytest.mark.slow
def test_demo_plans_trains_two_processes_and_reports_from_the_run_files(tmp_path):
    from meshtrain.train.prepare import prepare_data

    data = tmp_path / "data"
    prepare_data(Path(email.__file__).parent, data, val_fraction=0.2)
    cache = tmp_path / "cache"  # a profile for 2 processes, as `meshtrain plan --calibrate` leaves it
    save_profile(Hardware("cpu-local", "test machine", 5e10, 4e9, 1e10, intra_bw=1e9, inter_bw=1e9,
                          devices_per_node=2, domain=2, tp_max=2, source="test", cores=2, elem_s=1e-9, block_s=1e-4,
                          param_s=1e-9, step_s=1e-3, dtype="fp32"), cache / "hardware" / "cpu-local.json")
    out = tmp_path / "run"
    env = {**os.environ, "MESHTRAIN_CACHE": str(cache),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "meshtrain", "demo", "--config", "tiny", "--out", str(out),
                        "--nproc", "2", f"data.path={data}", "train.steps=6", "train.eval_every=3",
                        "train.sample_tokens=20", "train.tensorboard=false"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    chosen = re.search(r"^chosen: (.+)$", r.stdout, re.M).group(1)
    plan = json.loads((out / "plan.json").read_text())
    assert "calibration of" in r.stdout and plan["why"].startswith("Why #1") and plan["why"] in r.stdout
    assert "predicted against measured" in r.stdout and "step time: predicted" in r.stdout
    assert "sample:\ndef " in r.stdout
    assert plan["chosen"]["describe"] == chosen
    run = RunFiles(out)
    lay = plan["chosen"]["layout"]  # the run trained under the planner's layout
    p = run.cfg.parallel
    assert (p.dp, p.tp, p.pp, p.cp, p.zero) == (lay["dp"], lay["tp"], lay["pp"], lay["cp"], lay["zero"])
    text = (out / "report.md").read_text()
    for section in SECTIONS:
        assert section in text, section
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    for rank in run.comm["ranks"]:  # the bytes in the report are comm.json's, rank by rank
        assert rank["bytes"], "a 2-process layout moves bytes"
        for key, value in rank["bytes"].items():
            row = next(ln for ln in text.splitlines() if ln.startswith(f"| {key} |"))
            assert f"{value:,}" in row
    t = step_time_summary(run)
    assert f"step time {t['measured_s'] * 1e3:,.1f} ms" in text
    assert f"| blocked in collectives (and the bubble) | {t['comm_wait_s'] * 1e3:,.1f} ms |" in text
    assert "every byte count equal" in text and plan["why"] in text
    assert t["predicted_s"] == pytest.approx(plan["chosen"]["step_s"])


def test_demo_recalibrates_a_cached_profile_without_measured_step_costs(tmp_path, monkeypatch):
    """A profile from before the step-cost calibration (datasheet-style: no elem/block/param/step costs) is not
    reused: the demo measures again rather than plan with a model it no longer has."""
    from meshtrain import calibrate, demo

    monkeypatch.setenv("MESHTRAIN_CACHE", str(tmp_path))
    old = Hardware("cpu-local", "old", 5e10, 4e9, 1e10, intra_bw=1e9, inter_bw=1e9, devices_per_node=2, domain=2,
                   source="old")
    save_profile(old, tmp_path / "hardware" / "cpu-local.json")
    calls = []
    monkeypatch.setattr(calibrate, "calibrate_cpu_local",
                        lambda path, world_size, dtype: calls.append((world_size, dtype)) or old)
    _, note = demo.machine_profile(2)
    assert calls == [(2, "bf16")] and "calibrated just now" in note


def test_demo_recalibrates_a_profile_measured_in_another_dtype(tmp_path, monkeypatch):
    """A CPU without native bf16 trains the demo in fp32 (train.dtype=auto): a cached profile whose step costs were
    measured in bf16 prices the wrong steps, so the demo measures again in fp32; one measured in the run's dtype is
    reused."""
    from meshtrain import calibrate, demo

    monkeypatch.setenv("MESHTRAIN_CACHE", str(tmp_path))
    cached = Hardware("cpu-local", "bf16 one", 5e10, 4e9, 1e10, intra_bw=1e9, inter_bw=1e9, devices_per_node=2,
                      domain=2, elem_s=1e-9, block_s=1e-4, param_s=1e-9, step_s=1e-3, source="bf16", dtype="bf16")
    save_profile(cached, tmp_path / "hardware" / "cpu-local.json")
    calls = []
    monkeypatch.setattr(calibrate, "calibrate_cpu_local",
                        lambda path, world_size, dtype: calls.append((world_size, dtype)) or cached)
    hw, note = demo.machine_profile(2, dtype="bf16")
    assert calls == [] and hw.dtype == "bf16" and "cached" in note
    _, note = demo.machine_profile(2, dtype="fp32")
    assert calls == [(2, "fp32")] and "calibrated just now" in note


def test_demo_outside_the_repository_says_where_its_default_config_is(tmp_path, monkeypatch, capsys):
    """Its default, configs/small.yaml, is relative to the repository's root: elsewhere the error named --config,
    which the user never passed."""
    from meshtrain import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["demo", "--nproc", "1"]) == 2
    err = capsys.readouterr().err
    assert f"runs the repository's configs/small.yaml by default, and {tmp_path} holds none" in err
    assert len(err.strip().splitlines()) == 1 and "(option --config)" not in err
