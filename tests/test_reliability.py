"""Reliability (issue 13, docs/reliability.md): no poisoned step or checkpoint, no silent hang, one clear line for
every mistake, restarts and preemptions that resume themselves. Real processes throughout."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from meshtrain.config import load_config
from meshtrain.testing.spawn import spawn

SMALL = ["data.source=synthetic", "train.progress=false", "train.tensorboard=false", "train.peak_flops=1e11",
         "train.sample_tokens=0", "train.device=cpu"]


def _cli(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshtrain", *args], capture_output=True, text=True, **kw)


def _checkpoints_are_finite(root: Path) -> list[str]:
    """Every tensor of every checkpoint under ``root`` is finite; returns the checkpoint names."""
    from meshtrain.train.checkpoint import CheckpointReader, list_checkpoints

    names = []
    for path in list_checkpoints(root):
        reader = CheckpointReader(path)
        for key in reader.keys():
            assert bool(torch.isfinite(reader.read_full(key)).all()), f"{path.name}: {key} is not finite"
        names.append(path.name)
    return names


# ---- non-finite guard (deliverable 1)


def _poisoned_session(rank: int, world: int, overrides: list[str], out: str, poison: list[int]) -> dict:
    """Train with a NaN planted in one gradient of the last rank at the steps in ``poison`` (0-based), after the
    gradients are synchronised: only that rank sees it, so every rank skipping proves the decision is global.
    Returns the records, snapshots of this rank's parameters and AdamW state taken before each step's update,
    and the error a stop raised (if any)."""
    from meshtrain.parallel.state import gather_full
    from meshtrain.train.trainer import NonFiniteError, Trainer

    snaps: dict[int, list[torch.Tensor]] = {}

    def hook(step: int, trainer: Trainer) -> None:
        pieces = [op.tensor for op in trainer.parallel.optim_params()]
        moments = [v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        snaps[step] = [t.detach().clone() for t in pieces + moments]
        if step in poison and rank == world - 1:
            pieces[0].grad.view(-1)[0] = float("nan")

    trainer = Trainer(load_config("tiny", overrides), out, grad_hook=hook)
    error = None
    records: list[dict] = []
    try:
        records = trainer.train()
    except NonFiniteError as e:
        error = str(e)
    full = gather_full(trainer.parallel.local_state(), trainer.mesh.group("world"))
    return {"records": records, "snaps": snaps, "error": error, "params": full, "step": trainer.step}


def test_a_non_finite_step_is_skipped_on_every_rank_and_the_run_goes_on_as_on_one_device(tmp_path):
    over = [*SMALL, "train.steps=6", "train.ckpt_every=1", "train.max_bad_steps=3"]
    ref = spawn(_poisoned_session, 1, args=(over, str(tmp_path / "one"), [2]), timeout=300)[0]
    ranks = spawn(_poisoned_session, 2, args=([*over, "parallel.zero=1"], str(tmp_path / "dp2"), [2]),
                  timeout=300)
    for r in [ref, *ranks]:
        assert r["error"] is None and len(r["records"]) == 6
        assert [bool(x.get("skipped")) for x in r["records"]] == [False, False, True, False, False, False]
        assert r["records"][-1]["skipped_steps"] == 1
        assert math.isnan(r["records"][2]["grad_norm"])
        # Nothing of the skipped step reached the weights or AdamW's moments (not even weight decay).
        for a, b in zip(r["snaps"][2], r["snaps"][3], strict=True):
            assert torch.equal(a, b)
        assert not torch.equal(r["snaps"][3][0], r["snaps"][4][0])  # the next step is applied
    for x, y in zip(ranks[0]["records"], ref["records"], strict=True):  # the layout equals one device
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
    for key, t in ref["params"].items():
        assert torch.allclose(ranks[1]["params"][key], t, rtol=1e-5, atol=1e-6), key
    # The skipped step's checkpoint slot holds no new state, and no checkpoint is anything but finite.
    assert _checkpoints_are_finite(tmp_path / "dp2" / "checkpoints") == ["step_000005", "step_000006"]


def test_bad_steps_in_a_row_stop_with_one_line_and_the_last_checkpoint_resumes(tmp_path):
    over = [*SMALL, "train.steps=6", "train.ckpt_every=1", "train.max_bad_steps=2", "train.ckpt_keep=2"]
    ranks = spawn(_poisoned_session, 2, args=([*over, "parallel.tp=2"], str(tmp_path), [2, 3]), timeout=300)
    for r in ranks:
        assert r["step"] == 4
        # Step 3 and 4 were skipped and not saved: the newest checkpoint is the state before the streak.
        assert r["error"].startswith("step 4: 2 steps in a row had a non-finite loss or gradient norm")
        assert "train.max_bad_steps=2" in r["error"] and "step_000002" in r["error"]
        assert "train.lr=0.0003" in r["error"]
    assert _checkpoints_are_finite(tmp_path / "checkpoints") == ["step_000001", "step_000002"]
    # Resuming from it (no poison now) finishes the run.
    again = spawn(_poisoned_session, 2, args=([*over, "parallel.tp=2", "train.resume=true", "train.lr=0.0003"],
                                              str(tmp_path), []), timeout=300)
    for r in again:
        assert r["error"] is None and r["step"] == 6
        assert [x["step"] for x in r["records"]] == [3, 4, 5, 6]
        assert all(math.isfinite(x["loss"]) for x in r["records"])


def _save_poisoned_state(rank: int, world: int, overrides: list[str], out: str) -> str:
    from meshtrain.train.trainer import NonFiniteError, Trainer

    trainer = Trainer(load_config("tiny", overrides), out)
    trainer.train(until=1)
    if rank == 1:  # a parameter only this rank holds goes bad
        with torch.no_grad():
            trainer.parallel.optim_params()[-1].tensor.view(-1)[0] = float("inf")
    try:
        trainer.save()
    except NonFiniteError as e:
        return str(e)
    return ""


def test_non_finite_state_is_never_saved(tmp_path):
    over = [*SMALL, "train.steps=4", "parallel.zero=3"]
    errors = spawn(_save_poisoned_state, 2, args=(over, str(tmp_path)), timeout=300)
    for e in errors:
        assert e.startswith("step 1: the model state is not finite (rank 1: ") and "no checkpoint was written" in e
    ckpts = tmp_path / "checkpoints"
    assert not ckpts.exists() or not any(ckpts.iterdir())  # not even a temp folder


def test_a_diverging_run_ends_with_one_error_line_and_only_finite_checkpoints(tmp_path):
    """Through the CLI, as the issue found it: a huge lr. The run stops after train.max_bad_steps skipped steps
    with the error line (exit code 2), and every checkpoint it left is finite."""
    res = _cli(["train", "--config", "tiny", "--out", str(tmp_path), *SMALL, "train.lr=1e6", "train.steps=10",
                "train.ckpt_every=1"], timeout=300)
    assert res.returncode == 2, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "train.max_bad_steps=3" in errors[0] and "Traceback" not in res.stderr
    assert "not applied" in res.stdout
    assert _checkpoints_are_finite(tmp_path / "checkpoints")


# ---- restarts and preemption (deliverable 5)

# Long enough on 2 ranks (about a second of steps) to be interrupted mid-run, with a checkpoint every 10 steps.
LONG = [*SMALL, "train.steps=120", "train.ckpt_every=10", "train.ckpt_keep=2", "train.log_every=1",
        "train.eval_every=0", "train.threads=1"]


def _losses(out: Path) -> dict[int, float]:
    """The last logged loss of every step (a resumed step is logged again)."""
    losses = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            losses[rec["step"]] = rec["loss"]
    return losses


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _worker_of_rank(launcher: int, rank: int) -> int | None:
    """The pid of the worker with RANK=rank below the launcher (launcher -> torchrun -> workers)."""
    todo = [launcher]
    while todo:
        pid = todo.pop()
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            env = []
        if f"RANK={rank}".encode() in env and any(e.startswith(b"LOCAL_RANK=") for e in env):
            return pid
        todo += _children(pid)
    return None


def _wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= step:
            return
        assert proc.poll() is None, "the run ended before it could be interrupted"
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached in {timeout} s")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    out = tmp_path_factory.mktemp("uninterrupted")
    res = _cli(["train", "--config", "tiny", "--nproc", "2", "--out", str(out), *LONG], timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return _losses(out)


def test_kill_9_of_a_rank_restarts_the_run_which_resumes_and_finishes_with_the_same_losses(tmp_path, uninterrupted):
    proc = subprocess.Popen([sys.executable, "-m", "meshtrain", "train", "--config", "tiny", "--nproc", "2",
                             "--max-restarts", "1", "--out", str(tmp_path), *LONG],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_step(tmp_path, 25, proc)
    victim = _worker_of_rank(proc.pid, 1)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "restart 1: resumed at step " in out
    resumed_at = int(out.split("restart 1: resumed at step ")[1].split()[0])
    assert 20 <= resumed_at < 120 and resumed_at % 10 == 0
    losses = _losses(tmp_path)
    assert sorted(losses) == list(range(1, 121))
    for step, loss in uninterrupted.items():
        assert loss == pytest.approx(losses[step], rel=1e-6), step
    assert _checkpoints_are_finite(tmp_path / "checkpoints")[-1] == "step_000120"


def test_sigterm_saves_at_the_next_step_and_exits_cleanly_and_the_run_resumes(tmp_path, uninterrupted):
    """A scheduler's preemption signals the whole job (here the launcher's process group): every rank finishes
    its step, they save together, and the run ends; train.resume=true then completes it exactly."""
    proc = subprocess.Popen([sys.executable, "-m", "meshtrain", "train", "--config", "tiny", "--nproc", "2",
                             "--out", str(tmp_path), *LONG], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    _wait_for_step(tmp_path, 25, proc)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    log = (tmp_path / "train.log").read_text() if (tmp_path / "train.log").exists() else out
    assert "SIGTERM: stopped after step " in log, (out[-2000:], err[-2000:])
    stopped = int(log.split("SIGTERM: stopped after step ")[1].split()[0])
    assert 25 <= stopped < 120
    # The checkpoint of the step it stopped at is complete (not a multiple of ckpt_every: written for the stop).
    assert _checkpoints_are_finite(tmp_path / "checkpoints")[-1] == f"step_{stopped:06d}"
    res = _cli(["train", "--config", "tiny", "--nproc", "2", "--out", str(tmp_path), *LONG, "train.resume=true"],
               timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    losses = _losses(tmp_path)
    for step, loss in uninterrupted.items():
        assert loss == pytest.approx(losses[step], rel=1e-6), step
