"""The benchmarks against torch-native parallelism (``benchmarks/{dp,tp,pp}_vs_torch.py``, issue 14's comparisons)
still run end to end at a tiny size: both sides build, train the same run (each script asserts it) and print
their rows. No timing is asserted: the figures belong in docs/benchmarks.md. (The DTensor side of
``tp_vs_torch.py`` once broke unnoticed when attention gained arguments.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--rounds", "1", "--steps", "3", "--warmup", "1", "--d-model", "32", "--seq", "16", "--world", "2"]
RUNS = {
    "dp_vs_torch.py": (["--layers", "2", "--batch", "2"],
                       ["| DP vs DDP", "| ZeRO-3 vs FSDP2 fully_shard", "both sides computed the same run"]),
    "tp_vs_torch.py": (["--layers", "1", "--batch", "2"],
                       ["| TP vs DTensor TP", "| TP + SP (re-gather) vs DTensor TP + SequenceParallel",
                        "| TP input-grad all-reduce beside the weight-grad matmul vs after it"]),
    "pp_vs_torch.py": (["--layers", "4", "--batch", "8", "--microbatches", "4", "--schedules", "1f1b,dualpipev"],
                       ["| 1f1b vs Schedule1F1B", "| dualpipev vs ScheduleDualPipeV"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(RUNS))
def test_the_torch_comparison_runs_both_sides(script):
    extra, rows = RUNS[script]
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *TINY, *extra], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for row in rows:
        assert row in out.stdout, (row, out.stdout[-2000:])
