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


@pytest.mark.parametrize("nproc", [[], ["--nproc", "2"]], ids=["1 process", "nproc 2"])
def test_a_diverging_run_ends_with_one_error_line_and_only_finite_checkpoints(tmp_path, nproc):
    """Through the CLI, as the issue found it: a huge lr. The run stops after train.max_bad_steps skipped steps
    with the error line (exit code 2), once under torchrun too, and every checkpoint it left is finite."""
    res = _cli(["train", "--config", "tiny", *nproc, "--out", str(tmp_path), *SMALL, "train.lr=1e6",
                "train.steps=10", "train.ckpt_every=1"], timeout=300)
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
    assert "SIGTERM: stopped after step " in out, (out[-2000:], err[-2000:])
    # The launcher waited for its workers and says what happened, in one line, with the conventional exit code.
    assert proc.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in err and "Traceback" not in err
    stopped = int(out.split("SIGTERM: stopped after step ")[1].split()[0])
    assert 25 <= stopped < 120
    # The checkpoint of the step it stopped at is complete (not a multiple of ckpt_every: written for the stop).
    assert _checkpoints_are_finite(tmp_path / "checkpoints")[-1] == f"step_{stopped:06d}"
    res = _cli(["train", "--config", "tiny", "--nproc", "2", "--out", str(tmp_path), *LONG, "train.resume=true"],
               timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    losses = _losses(tmp_path)
    for step, loss in uninterrupted.items():
        assert loss == pytest.approx(losses[step], rel=1e-6), step


# ---- one clear line for every mistake (deliverables 3 and 4)
#
# Each bad input goes through the real CLI (`python -m meshtrain train ...`), in this process and under
# `--nproc 2`: a non-zero exit, exactly one `error:` line on stderr naming the option or file, no traceback and
# no torchrun ChildFailedError wall; a mistake found before launch starts no worker, and one found inside the
# workers leaves the full log (every rank, torchrun's report) in the run folder, named on stderr.

_TINY = ["--config", "tiny", "train.steps=1", "train.progress=false", "train.tensorboard=false",
         "train.peak_flops=1e11"]


def _meshtrain(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshtrain", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def _one_error_line(r: subprocess.CompletedProcess, *named: str) -> str:
    """The run failed with exactly one `error:` line naming every string of ``named``, and no wall."""
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, r.stderr
    for name in named:
        assert name in errors[0], (name, errors[0])
    assert "Traceback" not in out and "ChildFailedError" not in out, out
    return errors[0]


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory) -> Path:
    """A run folder holding one checkpoint of the tiny model with 4 experts (2 layers)."""
    out = tmp_path_factory.mktemp("moe") / "run"
    r = _meshtrain("train", *_TINY, "--out", str(out), "data.source=synthetic", "model.moe_experts=4")
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """A small prepared data folder (a few generated files, prepared in milliseconds)."""
    from meshtrain.train.prepare import prepare_data

    root = tmp_path_factory.mktemp("data")
    src = root / "src"
    src.mkdir()
    for i in range(6):
        (src / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 100)
    prepare_data(src, root / "prepared")
    return root / "prepared"


def _case_args(case: str, tmp: Path, moe_run: Path) -> tuple[list[str], dict[str, str], list[str]]:
    """(arguments, environment, what the error line must name) of a bad input."""
    (tmp / "a_file").write_text("not a folder")
    ckpt = str(moe_run / "checkpoints" / "step_000001")
    resume = ["--out", str(moe_run), "data.source=synthetic", "train.resume=true", "model.moe_experts=4"]
    cases = {
        "missing data.path": ([f"data.path={tmp / 'no_data'}"], {}, ["data.path", "no_data", "does not exist"]),
        "missing tokenizer": ([f"data.tokenizer={tmp / 'tok.json'}"], {}, ["tok.json", "is missing"]),
        "cuda without GPU": (["train.device=cuda", "data.source=synthetic"], {}, ["train.device=cuda"]),
        "--out is a file": (["--out", str(tmp / "a_file"), "data.source=synthetic"], {},
                            ["--out", "a_file is a file"]),
        "--out below a file": (["--out", str(tmp / "a_file" / "run"), "data.source=synthetic"], {},
                               ["--out", "a_file is a file"]),
        "data cache not writable": ([], {"MESHTRAIN_CACHE": str(tmp / "a_file" / "cache")},
                                    ["data cache", "MESHTRAIN_CACHE"]),
        "resume: another layer count": ([*resume, "model.n_layers=3"], {}, ["model.n_layers=2", ckpt]),
        "resume: another MoE shape": ([*resume[:-1], "model.moe_experts=8"], {}, ["model.moe_experts=4", ckpt]),
        "resume_required without checkpoint": (["--out", str(tmp / "typo"), "data.source=synthetic",
                                                "train.resume=true", "train.resume_required=true"], {},
                                               ["train.resume_required", "typo"]),
    }
    if os.geteuid() != 0:  # root writes through any mode bits: only a non-root user can see this one
        locked = tmp / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        cases["--out not writable"] = (["--out", str(locked / "run"), "data.source=synthetic"], {}, ["--out"])
    return cases[case]


CASES = ["missing data.path", "missing tokenizer", "cuda without GPU", "--out is a file", "--out below a file",
         "data cache not writable", "resume: another layer count", "resume: another MoE shape",
         "resume_required without checkpoint", "--out not writable"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [None, 2], ids=["one process", "nproc 2"])
@pytest.mark.parametrize("case", CASES)
def test_bad_input_gets_one_clear_line(case, nproc, tmp_path, moe_run):
    if case == "cuda without GPU":
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is visible")
    if case == "--out not writable" and os.geteuid() == 0:
        pytest.skip("root writes through any mode bits")
    args, env, named = _case_args(case, tmp_path, moe_run)
    launch = ["--nproc", str(nproc)] if nproc else []
    r = _meshtrain("train", *_TINY, *launch, *args, env=env)
    _one_error_line(r, *named)
    assert r.returncode == 2
    # Found before any process started: no rank printed anything.
    assert "[rank" not in r.stdout + r.stderr and "full log" not in r.stderr


@pytest.mark.slow
def test_nproc_zero_is_refused():
    r = _meshtrain("train", *_TINY, "--nproc", "0", "data.source=synthetic")
    _one_error_line(r, "--nproc 0", "leave --nproc out")


@pytest.mark.slow
def test_error_inside_workers_is_one_line_and_the_full_log_is_kept(tmp_path, prepared):
    """A truncated token file passes the pre-launch checks (they read meta.json, not the tokens) and fails in
    every worker: one line, not every rank's; the full log in <out>/logs holds both ranks' lines and torchrun's."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(prepared, data)
    with open(data / "train.bin", "r+b") as f:
        f.truncate(100)
    out = tmp_path / "run"
    r = _meshtrain("train", *_TINY, "--nproc", "2", "--out", str(out), f"data.path={data}")
    line = _one_error_line(r, "train.bin", "truncated", "prepare-data")
    assert r.returncode == 2
    logs = list((out / "logs").glob("train-*.log"))
    assert len(logs) == 1 and f"full log (every rank's stderr, torchrun's report): {logs[0]}" in r.stderr
    text = logs[0].read_text()
    assert f"[rank0]: {line}" in text and f"[rank1]: {line}" in text  # each rank's, printed once above
    assert "ChildFailedError" in text  # torchrun's report is kept, not shown


@pytest.mark.slow
def test_resume_without_checkpoint_says_it_starts_fresh_and_stale_saves_are_removed(tmp_path):
    """Under --nproc 2: rank 0's lines reach stdout through the launcher; the run says it starts fresh; the
    temporary folder of an interrupted save is removed before the run saves; the launch log stays in <out>/logs."""
    out = tmp_path / "run"
    stale = out / "checkpoints" / ".step_000005.tmp-0123abcd"
    stale.mkdir(parents=True)
    (stale / "rank_00000.safetensors").write_bytes(b"half-written")
    r = _meshtrain("train", *_TINY, "--nproc", "2", "--out", str(out), "data.source=synthetic", "train.resume=true")
    assert r.returncode == 0, r.stderr
    assert "train.resume=true: no checkpoint in" in r.stdout and "starts fresh from step 0" in r.stdout
    assert "train.resume_required=true makes this an error" in r.stdout
    assert "removed 1 unfinished save(s)" in r.stdout and ".step_000005.tmp-0123abcd" in r.stdout
    assert not stale.exists()
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_000001"]
    assert len(list((out / "logs").glob("train-*.log"))) == 1
    assert r.stderr == ""  # a good run prints nothing but its progress


def test_stale_temp_folders_go_and_complete_checkpoints_stay(tmp_path):
    from meshtrain.mesh import AxisGroup
    from meshtrain.train.checkpoint import Checkpointer

    root = tmp_path / "checkpoints"
    (root / "step_000002").mkdir(parents=True)
    (root / "step_000002" / "meta.json").write_text("{}")
    (root / ".step_000003.tmp-deadbeef").mkdir()
    group = AxisGroup("world", (0, 1), None)
    assert Checkpointer(root, group, 1).removed == []  # only rank 0 cleans up
    assert (root / ".step_000003.tmp-deadbeef").exists()
    assert [p.name for p in Checkpointer(root, group, 0).removed] == [".step_000003.tmp-deadbeef"]
    assert sorted(p.name for p in root.iterdir()) == ["step_000002"]
    assert (root / "step_000002" / "meta.json").read_text() == "{}"


def test_missing_optional_dependency_names_its_extra(tmp_path, monkeypatch, capsys):
    from meshtrain.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    code = main(["schedule", "--pp", "2", "--microbatches", "2", "--png", str(tmp_path / "s.png")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("error:") == 1
    assert "meshtrain schedule --png needs matplotlib" in err and "pip install 'meshtrain[plot]'" in err
    assert not (tmp_path / "s.png").exists()
    # The extra exists in pyproject.toml, under that name, with that package.
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert 'plot = ["matplotlib' in pyproject


def test_prepare_data_finding_no_files_names_the_extension_option(tmp_path, capsys):
    from meshtrain.train.prepare import main

    (tmp_path / "notes.txt").write_text("text, not .py")
    assert main(["--src", str(tmp_path), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "no files with extensions .py" in err and "--ext" in err


def test_resume_required_needs_resume():
    from meshtrain.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="train.resume_required=true .* with train.resume=true"):
        load_config("tiny", ["train.resume_required=true"])


# A worker's failure as torchrun's log shows it, without an `error:` line (a bug, or an out-of-memory kill).
_WALL = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "/x/meshtrain/comm.py", line 284, in barrier
[rank1]: RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:6569.
[rank0]: Traceback (most recent call last):
[rank0]:   File "/x/meshtrain/train/trainer.py", line 126, in __init__
[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB
E1123 10:59:09.931000 10747 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
"""


def test_worker_error_picks_the_cause_not_its_echoes():
    from meshtrain.cli import worker_error

    assert worker_error("noise\n[rank1]: error: data.path x does not exist\n" + _WALL, 1) == \
        ("data.path x does not exist", True)
    message, user = worker_error(_WALL, 1)
    assert not user and message == ("a training process failed: torch.OutOfMemoryError: CUDA out of memory. "
                                    "Tried to allocate 2.00 GiB (rank 0)")
    killed = "E1123 api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 7) of binary: python\n"
    assert worker_error(killed, 1) == ("local rank 1 was killed by SIGKILL (out of memory, or killed from outside)",
                                       False)
    assert worker_error("", 3) == ("torchrun exited with code 3", False)


def test_checkpoint_without_config_still_names_the_tensor(tmp_path):
    """A checkpoint whose meta.json has no config (an old or foreign one): the mismatch names the tensor."""
    from meshtrain.config import load_config
    from meshtrain.model.llama import Llama
    from meshtrain.train.checkpoint import CheckpointError, CheckpointReader, save_checkpoint
    from meshtrain.train.trainer import check_checkpoint_model

    cfg = load_config("tiny", ["model.vocab_size=257"])
    path = save_checkpoint(tmp_path, 1, Llama(cfg.model), None)
    meta = json.loads((path / "meta.json").read_text())
    assert "config" not in meta
    check_checkpoint_model(cfg.model, CheckpointReader(path))  # the same model: accepted
    cfg.model.n_layers = 3
    with pytest.raises(CheckpointError, match=r"layers\.2\.\S+ is not in the checkpoint.*model section"):
        check_checkpoint_model(cfg.model, CheckpointReader(path))
