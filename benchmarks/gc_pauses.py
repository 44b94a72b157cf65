"""Python's garbage collector during training: what it takes inside steps under ``train.gc_every=N`` (automatic
collection off, a full collection every N steps over what training made since the first step, the rest frozen)
against Python's automatic collection (``train.gc_every=0``), through the real trainer.

Each side trains the same run in a fresh process (rounds alternate the order): the demo's model (``configs/small.yaml``)
on synthetic data, compiled by default, as a real run on a GPU is. Per side: the collector's milliseconds inside
steps after the first (``gc_ms`` of each step record), the collections it made there by generation, and the median
step. Then, in the scheduled side's process after training, what one full collection costs over the whole heap
(what automatic collection of the oldest generation walks) and over what is left outside the freeze (what a
scheduled collection walks). Both sides must give the same losses to the bit: the collector changes no arithmetic.

    python benchmarks/gc_pauses.py [--steps 60] [--runs 2] [--eager]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository: its config and package, from any working folder
SIDES = {"automatic": 0, "scheduled": 50}  # train.gc_every


def one_side(gc_every: int, steps: int, compile_: bool) -> dict:
    """Train ``steps`` steps in this process; the step records' collector time, and a full collection's cost over the
    whole heap and over what a scheduled collection walks."""
    from meshtrain.config import load_config
    from meshtrain.train.gc_schedule import GcSchedule
    from meshtrain.train.trainer import Trainer

    cfg = load_config(str(ROOT / "configs" / "small.yaml"), [
        "data.source=synthetic", f"train.steps={steps}", f"train.gc_every={gc_every}", f"train.compile={compile_}",
        "train.eval_every=0", "train.ckpt_every=0", "train.sample_tokens=0", "train.progress=false",
        "train.tensorboard=false", "train.threads=1"])
    records = Trainer(cfg, out_dir=None).train()
    after_first = records[1:]
    out = {"losses": [r["loss"] for r in records], "gc_ms": [r["gc_ms"] for r in after_first],
           "step_s": statistics.median(r["step_time_s"] for r in after_first), "tracked": len(gc.get_objects())}
    if gc_every:
        out["full_ms"] = _timed_collect()
        with GcSchedule(gc_every) as schedule:
            schedule.settle()
            out["after_freeze_ms"] = _timed_collect()
    return out


def _timed_collect() -> float:
    """Median ms of three full collections."""
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60, help="steps per side (default 60)")
    ap.add_argument("--runs", type=int, default=2, help="independent runs, each side in a fresh process (default 2)")
    ap.add_argument("--eager", action="store_true", help="no torch.compile (default: compiled, as on a GPU)")
    ap.add_argument("--one", choices=SIDES, help=argparse.SUPPRESS)  # a side, in its own process
    args = ap.parse_args()
    if args.steps < 2 or args.runs < 1:
        ap.error("--steps must be at least 2 and --runs at least 1")
    if args.one:
        print(json.dumps(one_side(SIDES[args.one], args.steps, not args.eager)))
        return 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    results: dict[str, list[dict]] = {side: [] for side in SIDES}
    for run in range(args.runs):
        for side in (list(SIDES) if run % 2 == 0 else list(SIDES)[::-1]):
            cmd = [sys.executable, __file__, "--one", side, "--steps", str(args.steps)] + (["--eager"] * args.eager)
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            if done.returncode:
                print(done.stderr, file=sys.stderr)
                return 1
            results[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"configs/small.yaml on synthetic data, {'eager' if args.eager else 'compiled'}, {args.steps} steps, "
          f"{args.runs} runs per side (fresh processes, order alternating); steps 2-{args.steps}:\n")
    print("| side (train.gc_every) | collector ms in steps, total | largest in one step | steps with a collection "
          "| median step (ms) |")
    print("|---|---|---|---|---|")
    for side, every in SIDES.items():
        for r in results[side]:
            print(f"| {side} ({every}) | {sum(r['gc_ms']):.2f} | {max(r['gc_ms']):.2f} | "
                  f"{sum(ms > 0 for ms in r['gc_ms'])} | {r['step_s'] * 1e3:.1f} |")
    sched = results["scheduled"]
    print(f"\none full collection after training ({statistics.median(r['tracked'] for r in sched):,.0f} tracked "
          f"objects): over the whole heap {statistics.median(r['full_ms'] for r in sched):.1f} ms, over what is "
          f"outside the freeze {statistics.median(r['after_freeze_ms'] for r in sched):.3f} ms")
    losses = [r["losses"] for side in SIDES for r in results[side]]
    same = all(ls == losses[0] for ls in losses)
    print("same run: every side's losses are equal to the bit" if same else "NOT THE SAME RUN: losses differ")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
