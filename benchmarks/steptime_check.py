"""The planner's step time against real runs (issue 15, point 3): every layout runs through the real CLI
(``meshtrain train --nproc N``, the demo model ``configs/small.yaml`` on synthetic data), its measured step time is
the median ``step_time_s`` of ``metrics.jsonl`` after the warm-up steps, and its prediction is the planner's on the
calibrated ``cpu-local`` profile (``plan/check.py::step_time_check``, the same row ``meshtrain plan --check-run``
prints). The table: layout, predicted ms, measured ms, error; then the median and worst absolute error and the
Spearman rank correlation of predicted against measured.

This machine's speed drifts (2 virtual cores shared by several people: the same reference step takes from 1x to 3x
its fastest time within minutes), so the script also times ``calibrate.probe_speed``'s reference step between runs.
``drift`` = the probe around a run (mean of the one before and the one after) / the probe at calibration; the
``corrected`` columns are the prediction times that drift: the same one factor for every layout, measured, not
fitted, the reference-in-the-same-run rule of benchmarks/README.md. Both are reported.

    python benchmarks/steptime_check.py [--calibrate] [--steps 10] [--rounds 2] [--only NAME,...]

Every layout runs ``--rounds`` times, the rounds in alternating order (forward, then reversed); a layout's measured
time is its fastest round's median step, the same statistic the calibration keeps (its fastest repeat), and the
spread over rounds is printed beside it.

The machine is shared: the load average before each run is printed beside it, so a contended row can be told.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshtrain.calibrate import probe_speed  # noqa: E402
from meshtrain.config import Config, update_from_dict  # noqa: E402
from meshtrain.plan.check import step_time_check  # noqa: E402
from meshtrain.plan.hardware import get_hardware  # noqa: E402

MOE = ["model.moe_experts=4", "model.moe_top_k=2"]
# (name, processes, overrides of configs/small.yaml): every axis (cp with each attention; tp with and without SP, and
# under both recomputes, which rerun its forward collectives), three pipeline schedules, 2 and 4 processes.
LAYOUTS: list[tuple[str, int, list[str]]] = [
    ("dp2 zero0", 2, ["parallel.zero=0"]),
    ("dp2 zero1", 2, ["parallel.zero=1"]),
    ("dp2 zero3", 2, ["parallel.zero=3"]),
    ("dp2 zero2 accum4", 2, ["parallel.zero=2", "train.grad_accum=4"]),
    ("dp2 rc=selective", 2, ["parallel.zero=0", "train.recompute=selective"]),
    ("tp2", 2, ["parallel.tp=2"]),
    ("tp2+sp", 2, ["parallel.tp=2", "parallel.sp=true"]),
    ("tp2+sp rc=selective", 2, ["parallel.tp=2", "parallel.sp=true", "train.recompute=selective"]),
    ("tp2+sp rc=full", 2, ["parallel.tp=2", "parallel.sp=true", "train.recompute=full"]),
    ("pp2 1f1b m4", 2, ["parallel.pp=2", "parallel.schedule=1f1b", "parallel.microbatches=4"]),
    ("pp2 zb-h1 m4", 2, ["parallel.pp=2", "parallel.schedule=zb-h1", "parallel.microbatches=4"]),
    ("pp2 interleaved(v2) m4", 2, ["parallel.pp=2", "parallel.schedule=interleaved", "parallel.microbatches=4",
                                   "parallel.virtual_stages=2"]),
    ("cp2", 2, ["parallel.cp=2"]),
    ("cp2 allgather", 2, ["parallel.cp=2", "parallel.cp_attention=allgather"]),
    ("cp2 ulysses", 2, ["parallel.cp=2", "parallel.cp_attention=ulysses"]),
    ("moe dp2 ep2", 2, [*MOE, "parallel.ep=2"]),
    ("dp4 zero1", 4, ["parallel.zero=1"]),
    ("dp2 tp2+sp", 4, ["parallel.tp=2", "parallel.sp=true"]),
    ("dp2 pp2 1f1b m4", 4, ["parallel.pp=2", "parallel.microbatches=4"]),
]
COMMON = ["train.eval_every=0", "train.eval_batches=1", "train.sample_tokens=0", "train.progress=false",
          "train.tensorboard=false", "train.ckpt_every=0", "data.source=synthetic"]


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    def ranks(x: list[float]) -> np.ndarray:
        x = np.asarray(x, dtype=float)
        order = x.argsort()
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for v in np.unique(x):  # ties share their mean rank
            r[x == v] = r[x == v].mean()
        return r
    ra, rb = ranks(a), ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1])


def run_layout(name: str, nproc: int, overrides: list[str], steps: int, out: Path, config: str) -> dict:
    """Train one layout through the CLI and compare its step time with the planner's."""
    run = out / name.replace(" ", "_").replace("(", "").replace(")", "").replace("+", "")
    load = os.getloadavg()[0]
    cmd = [sys.executable, "-m", "meshtrain", "train", "--nproc", str(nproc), "--config", config, "--out", str(run),
           *COMMON, f"train.steps={steps}", *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        return {"name": name, "error": (proc.stderr.strip().splitlines() or ["?"])[-1], "load": load}
    import yaml

    cfg = update_from_dict(Config(), yaml.safe_load((run / "config.yaml").read_text()), str(run / "config.yaml"))
    line, predicted, measured = step_time_check(run, cfg, nproc)
    return {"name": name, "nproc": nproc, "predicted_s": predicted, "measured_s": measured, "load": load,
            "wall_s": wall, "line": line}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibrate", action="store_true", help="run `meshtrain plan --calibrate` first")
    ap.add_argument("--steps", type=int, default=10, help="training steps per layout (the first 2 are left out)")
    ap.add_argument("--config", default="configs/small.yaml")
    ap.add_argument("--rounds", type=int, default=2,
                    help="runs of every layout, in alternating order; the fastest round counts")
    ap.add_argument("--only", default="", help="comma-separated layout names")
    ap.add_argument("--out", default="", help="folder for the runs (default: a temporary one)")
    ap.add_argument("--json", default="", help="write the results here")
    ap.add_argument("--markdown", action="store_true", help="also print the table as markdown (docs/planner.md)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.steps < 3:
        ap.error("--rounds must be at least 1 and --steps at least 3 (the first 2 steps are left out)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if args.calibrate:
        subprocess.run([sys.executable, "-m", "meshtrain", "plan", "--calibrate"], cwd=ROOT, env=env, check=True)
    out = Path(args.out or tempfile.mkdtemp(prefix="steptime-check-"))
    out.mkdir(parents=True, exist_ok=True)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    hw = get_hardware("cpu-local")
    cal_probe = hw.probe_s
    selected = [lay for lay in LAYOUTS if not only or lay[0] in only]
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in selected}
    print(f"{'round':>5} {'layout':<24} {'procs':>5} {'predicted':>10} {'measured':>10} {'drift':>6}  load")
    before = probe_speed(dtype=hw.dtype)  # the reference step in the dtype the profile measured
    for rnd in range(args.rounds):
        # Alternate the order, so a slow stretch of the machine does not always land on the same layouts.
        for name, nproc, overrides in (selected if rnd % 2 == 0 else selected[::-1]):
            r = run_layout(name, nproc, overrides, args.steps, out / f"round{rnd}", args.config)
            after = probe_speed(dtype=hw.dtype)
            r["drift"] = (before + after) / 2 / cal_probe if cal_probe else 1.0
            before = after
            runs[name].append(r)
            if "error" in r:
                print(f"{rnd:>5} {name:<24} {nproc:>5}  failed: {r['error']}")
            elif r["predicted_s"] is None:
                print(f"{rnd:>5} {name:<24} {nproc:>5}  {r['line']}")
            else:
                print(f"{rnd:>5} {name:<24} {nproc:>5} {r['predicted_s'] * 1e3:>8.0f}ms "
                      f"{r['measured_s'] * 1e3:>8.0f}ms {r['drift']:>6.2f}  {r['load']:.1f}", flush=True)
    rows = []
    print(f"\n{'layout':<24} {'procs':>5} {'predicted':>10} {'measured':>10} {'rounds':>13} {'error':>7} "
          f"{'drift':>6} {'corrected':>10} {'error':>7}  load")
    for name, nproc, _ in selected:
        good = [r for r in runs[name] if "error" not in r and r["predicted_s"] is not None]
        if not good:
            rows.append(runs[name][-1])
            continue
        # The fastest of the rounds: what the layout costs when the machine is not busy with someone else's work
        # (the calibration, too, keeps the fastest of its repeats).
        r = dict(min(good, key=lambda g: g["measured_s"]))
        r["rounds_s"] = [g["measured_s"] for g in good]
        r["error"] = None
        r["err"] = r["predicted_s"] / r["measured_s"] - 1.0
        r["corrected_s"] = r["predicted_s"] * r["drift"]
        r["err_corrected"] = r["corrected_s"] / r["measured_s"] - 1.0
        rows.append(r)
        spread = f"{min(r['rounds_s']) * 1e3:.0f}-{max(r['rounds_s']) * 1e3:.0f}ms"
        print(f"{name:<24} {nproc:>5} {r['predicted_s'] * 1e3:>8.0f}ms {r['measured_s'] * 1e3:>8.0f}ms {spread:>13} "
              f"{r['err']:>+7.0%} {r['drift']:>6.2f} {r['corrected_s'] * 1e3:>8.0f}ms {r['err_corrected']:>+7.0%}  "
              f"{r['load']:.1f}", flush=True)
    done = [r for r in rows if r.get("err") is not None]
    if len(done) >= 2:
        for label, key, pred in (("as predicted", "err", "predicted_s"),
                                 ("drift-corrected", "err_corrected", "corrected_s")):
            errs = [abs(r[key]) for r in done]
            rho = spearman([r[pred] for r in done], [r["measured_s"] for r in done])
            print(f"{label:>16}: {len(done)} layouts, median |error| {statistics.median(errs):.0%}, worst "
                  f"{max(errs):.0%} ({max(done, key=lambda r, k=key: abs(r[k]))['name']}), Spearman {rho:.2f}")
        rho = spearman([r["predicted_s"] for r in done], [r["measured_s"] / r["drift"] for r in done])
        print(f"{'ranking':>16}: Spearman of the predictions against measured / drift {rho:.2f}")
    if args.markdown:
        print("\n| layout | procs | predicted ms | measured ms | rounds ms | error | drift | predicted x drift | error "
              "| load |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in done:
            print(f"| {r['name']} | {r['nproc']} | {r['predicted_s'] * 1e3:.0f} | {r['measured_s'] * 1e3:.0f} | "
                  f"{min(r['rounds_s']) * 1e3:.0f}-{max(r['rounds_s']) * 1e3:.0f} | "
                  f"{r['err']:+.0%} | {r['drift']:.2f} | {r['corrected_s'] * 1e3:.0f} | {r['err_corrected']:+.0%} | "
                  f"{r['load']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
