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
        diff, scale = (params[key] - want).norm().item(), want.norm().item()
        rel = diff / scale if scale > 0 else diff  # an all-zero tensor (an unused MoE bias) must stay zero
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


def prepared_stdlib(tmp_path_factory, name: str) -> str:
    """The stdlib corpus prepared in a fresh temporary folder (one per test module: each module's run
    folders sit next to it, for ``assert_planner_predicts_runs``)."""
    from meshtrain.train.prepare import default_source_dir, prepare_data

    out = tmp_path_factory.mktemp(name) / "stdlib"
    prepare_data(default_source_dir(), out)
    return str(out)


def train_and_gather(data: str, overrides: list[str], out: str | None = None, preset: str = "tiny"):
    """Train the preset on ``data`` with ``overrides`` (writing to ``out``); return (every step's record,
    the logical parameters gathered from whatever layout ran, the trainer). Collective: call on every rank."""
    from meshtrain.config import load_config
    from meshtrain.train.trainer import Trainer

    trainer = Trainer(load_config(preset, [f"data.path={data}", *overrides]), out)
    records = trainer.train()
    params, _ = trainer.parallel.gather_state(trainer.optimizer)
    return records, params, trainer


def layouts_worker(rank: int, world_size: int, data: str, base: list[str], layouts: list[tuple[str, list[str]]]
                   ) -> dict[str, tuple[list[float], dict[str, torch.Tensor]] | None]:
    """Spawned-rank body shared by the equivalence files: train every (name, overrides) layout in turn into
    its ``run_dir``; rank 0 returns {name: (losses, parameters)}."""
    out = {}
    for name, overrides in layouts:
        records, params, _ = train_and_gather(data, [*base, *overrides], run_dir(data, world_size, name))
        out[name] = ([r["loss"] for r in records], params) if rank == 0 else None
    return out


def cli_train(data: str, out: Path, overrides: list[str], timeout: float = 300) -> tuple[list[dict], str]:
    """Run ``meshtrain train --config tiny`` as a user would (``--nproc N`` among the overrides launches torchrun);
    return its metrics.jsonl records and stdout. A failed run raises with the lines of stderr that say why."""
    import json
    import subprocess
    import sys

    args = [sys.executable, "-m", "meshtrain.cli", "train", "--config", "tiny", "--out", str(out),
            f"data.path={data}", *overrides]
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    clues = [ln for ln in r.stderr.splitlines() if any(w in ln for w in ("terminate", "Error", "exitcode"))]
    assert r.returncode == 0, "\n".join(clues[:20]) + "\n" + r.stderr[-2000:]
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return records, r.stdout
