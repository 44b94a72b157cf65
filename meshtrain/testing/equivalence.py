"""Shared pieces of the equivalence tests: the comparison with the single-device run, where each
layout's run folder goes, and the planner's byte check over those folders."""

from __future__ import annotations

import re
from pathlib import Path

import torch

# fp32 on CPU: only the order of floating-point sums differs between layouts.
LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-5  # relative Frobenius norm per tensor: ||a - b|| / ||b||


def assert_same_run(name: str, got: tuple[list[float], dict[str, torch.Tensor]],
                    ref: tuple[list[float], dict[str, torch.Tensor]]) -> None:
    """Losses over the steps within LOSS_RTOL, every parameter tensor within PARAM_RTOL."""
    losses, params = got
    ref_losses, ref_params = ref
    assert len(losses) == len(ref_losses), f"{name}: {len(losses)} steps vs {len(ref_losses)}"
    for i, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"{name}: step {i + 1} loss {a} vs {b}"
    assert set(params) == set(ref_params), f"{name}: parameter names differ"
    for key, want in ref_params.items():
        rel = ((params[key] - want).norm() / want.norm()).item()
        assert rel <= PARAM_RTOL, f"{name}: {key} differs by {rel:.3g} relative"


def run_dir(data: str, world_size: int, name: str) -> str:
    """Each layout's run folder next to the test data (its comm.json feeds the planner check)."""
    return str(Path(data).parent / "runs" / f"{world_size}-{re.sub('[^A-Za-z0-9]+', '_', name)}")


def assert_planner_predicts_runs(data: str) -> None:
    """Every run folder's per-rank bytes equal the planner's prediction exactly; state bytes within 5%
    for flat AdamW layouts (per-tensor shards and Muon's single moment are uneven by design)."""
    from meshtrain.plan.check import check_run

    runs = sorted((Path(data).parent / "runs").iterdir())
    assert runs, "the equivalence tests write their runs here"
    for run in runs:
        text, exact, memory_ok = check_run(run)
        assert exact, text
        config = (run / "config.yaml").read_text()
        if "per_tensor" not in config and "optimizer: muon" not in config:
            assert memory_ok, text
