"""Weights & Biases logging (``train.wandb=true``): the same scalars as metrics.jsonl at the same steps, from the
logging rank only, offline unless asked, one W&B run across a resume, and a missing package refused in one line.

The trainer tests use a small fake ``wandb`` module (injected into ``sys.modules``) that records its calls; the
last test runs the real package in offline mode when it is installed (``pip install 'meshtrain[wandb]'``).
"""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

import pytest

from meshtrain.cli import main as cli_main
from meshtrain.config import ConfigError, load_config
from meshtrain.train.metrics import MetricsLogger, wandb_mode

SMALL = ["data.source=synthetic", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=2", "model.n_layers=1",
         "train.seq_len=16", "train.global_batch=2", "train.progress=false", "train.tensorboard=false",
         "train.peak_flops=1e11", "train.sample_tokens=0", "train.wandb=true", "train.wandb_project=proj"]


class FakeRun:
    def __init__(self, calls: list, kwargs: dict) -> None:
        self.calls, self.kwargs = calls, kwargs

    def log(self, data: dict, step: int, commit: bool) -> None:
        assert commit
        self.calls.append(("log", step, dict(data)))

    def finish(self) -> None:
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> list:
    """A stand-in ``wandb`` module; returns the list of its calls."""
    calls: list = []

    def init(**kwargs: object) -> FakeRun:
        calls.append(("init", kwargs))
        return FakeRun(calls, kwargs)

    module = types.SimpleNamespace(init=init, Settings=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "wandb", module)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return calls


def test_wandb_logs_what_metrics_jsonl_holds_and_one_run_across_resume(fake_wandb: list, tmp_path: Path) -> None:
    from meshtrain.train.trainer import Trainer

    out = tmp_path / "run"
    Trainer(load_config("tiny", [*SMALL, "train.steps=3", "train.ckpt_every=2"]), out).train(until=2)
    Trainer(load_config("tiny", [*SMALL, "train.steps=3", "train.resume=true"]), out).train()
    inits = [c[1] for c in fake_wandb if c[0] == "init"]
    run_id = (out / "wandb_run_id").read_text().strip()
    assert len(inits) == 2 and inits[0]["id"] == inits[1]["id"] == run_id  # the resumed run logs into the same run
    first = inits[0]
    assert (first["project"], first["mode"], first["dir"], first["resume"]) == ("proj", "offline", str(out), "allow")
    assert first["config"]["train"]["wandb_project"] == "proj" and first["config"]["model"]["d_model"] == 32
    logged = [(c[1], c[2]) for c in fake_wandb if c[0] == "log"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s for s, _ in logged] == [1, 2, 3] == [r["step"] for r in records]
    for (_, data), rec in zip(logged, records, strict=True):
        scalars = {k: v for k, v in rec.items() if k != "step" and isinstance(v, (int, float))}
        assert data == pytest.approx(scalars) and {"loss", "lr", "grad_norm", "tokens_per_s"} <= set(data)
    assert [c[0] for c in fake_wandb].count("finish") == 2


def test_wandb_only_on_the_logging_rank_and_mode(fake_wandb: list, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    log = MetricsLogger(tmp_path, 3, enabled=False, progress=False, tensorboard=False, wandb_project="proj")
    log.log({"step": 1, "loss": 2.0})
    log.close()
    assert fake_wandb == [] and not (tmp_path / "wandb_run_id").exists()
    assert wandb_mode() == "offline"

    def no_network(**kwargs: object) -> None:
        raise RuntimeError("could not reach api.wandb.ai")

    monkeypatch.setattr(sys.modules["wandb"], "init", no_network)
    with pytest.raises(ConfigError, match=r"W&B could not start a run in offline mode \(could not reach api.wandb.ai\)"
                                          r".*WANDB_MODE=offline"):
        MetricsLogger(tmp_path, 3, progress=False, tensorboard=False, wandb_project="proj")
    monkeypatch.setenv("WANDB_API_KEY", "k")
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"


def test_missing_wandb_is_one_line_before_training(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from meshtrain.train.preflight import check_before_launch
    from meshtrain.train.trainer import Trainer

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    cfg = load_config("tiny", [*SMALL, "train.steps=1"])
    with pytest.raises(ImportError, match=r"pip install 'meshtrain\[wandb\]'"):
        check_before_launch(cfg, tmp_path / "a", 2)
    with pytest.raises(ImportError, match=r"train.wandb=true needs wandb"):
        Trainer(cfg, tmp_path / "b")
    assert cli_main(["train", "--config", "tiny", "--out", str(tmp_path / "c"), *SMALL, "train.steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "meshtrain[wandb]" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "c" / "metrics.jsonl").exists()
    with pytest.raises(Exception, match="train.wandb_project"):
        load_config("tiny", [*SMALL, "train.wandb_project="])


def test_real_wandb_offline_writes_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # offline: nothing needs the network
    log = MetricsLogger(tmp_path, 3, progress=False, tensorboard=False, wandb_project="proj",
                        run_config={"train": {"lr": 0.1}})
    for step in (1, 2, 3):
        log.log({"step": step, "loss": 4.0 - step, "lr": 0.1, "expert_load": [1, 2]})
    run = log._wandb.run
    assert run.offline and run.project == "proj" and run.config["train"] == {"lr": 0.1}
    assert run.summary["loss"] == 1.0 and run.summary["_step"] == 3
    log.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    assert len(runs) == 1 and runs[0].name.endswith(run_id)
    # The history `wandb sync` uploads later; W&B's service process may still be writing it when finish() returns.
    deadline = time.monotonic() + 30
    while b"loss" not in (runs[0] / f"run-{run_id}.wandb").read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b"loss" in (runs[0] / f"run-{run_id}.wandb").read_bytes()
