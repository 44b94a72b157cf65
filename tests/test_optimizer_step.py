"""benchmarks/optimizer_step.py runs its three sides and checks they trained the same parameters (its timings are
claims for docs/benchmarks.md, not asserted here); bad input is refused in one line."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "optimizer_step.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_the_three_sides_run_and_train_the_same_parameters():
    r = _run("--runs", "1", "--rounds", "3", "--steps", "1", "--warmup", "0")
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and "ms per step" not in line]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows] == ["foreach, clip pass", "fused, clip pass",
                                                                  "fused, clip inside"]
    assert "| fused, clip pass | " in r.stdout and "| 1.000 | 1.000-1.000 |" in r.stdout
    assert "same run: every side's parameters within" in r.stdout


def test_bad_input_is_refused_in_one_line():
    r = _run("--config", "missing.yaml")
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [
        "optimizer_step.py: --config missing.yaml is not a file: give a YAML config (configs/small.yaml)"]
    r = _run("--runs", "0")
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "--runs" in r.stderr
