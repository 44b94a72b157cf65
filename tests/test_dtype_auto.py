"""``train.dtype=auto``: bf16 where the device computes it natively, fp32 elsewhere (train/trainer.py resolve_dtype).

A CPU without AVX-512 or AMX (an AVX2-only EPYC, say) has no bf16 kernels in oneDNN: PyTorch's bf16 matmul there
ran at 0.9 GFLOP/s against fp32's 131 (2026-11-28), so a bf16 demo that takes minutes elsewhere took hours. The
demo's config asks for auto; a run records the dtype it resolved to, and an explicit bf16 on such a CPU is warned
about in one line naming the fix.
"""

import json

import torch

from meshtrain.config import ConfigError, load_config
from meshtrain.testing.spawn import spawn
from meshtrain.train import preflight
from meshtrain.train.preflight import resolve_dtype, slow_dtype_warning
from meshtrain.train.trainer import Trainer

CPU = torch.device("cpu")


def test_auto_is_bf16_only_where_the_device_computes_it_natively(monkeypatch):
    for native, want in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(preflight, "native_bf16", lambda device, n=native: n)
        assert resolve_dtype("auto", CPU) == want
        assert resolve_dtype("fp32", CPU) == "fp32" and resolve_dtype("bf16", CPU) == "bf16"  # as asked
        warning = slow_dtype_warning("bf16", CPU)
        assert (warning is None) == native
        assert slow_dtype_warning("fp32", CPU) is None
    assert "train.dtype=fp32" in warning and "\n" not in warning


def test_the_demo_config_asks_for_auto():
    assert load_config("configs/small.yaml").train.dtype == "auto"


def _tiny_run(tmp_path, dtype: str):
    over = ["data.source=synthetic", "train.progress=false", "train.device=cpu", "train.tensorboard=false",
            "train.steps=1", "train.eval_every=0", "train.sample_tokens=0", "train.ckpt_every=0",
            f"train.dtype={dtype}"]
    out = tmp_path / dtype
    trainer = Trainer(load_config("tiny", over), out)
    trainer.train()
    return trainer, out


def test_a_run_records_the_dtype_auto_resolved_to_and_says_why(tmp_path, monkeypatch, capsys):
    """The run computes in the resolved dtype, its config.yaml (what a resume and ``plan --check-run`` read) holds
    it, and the log's first lines say auto chose it; the same holds with the CPU taken as bf16-native."""
    for native in (False, True):
        monkeypatch.setattr(preflight, "native_bf16", lambda device, n=native: n)
        want = "bf16" if native else "fp32"
        trainer, out = _tiny_run(tmp_path / str(native), "auto")
        assert trainer.cfg.train.dtype == want
        assert trainer.dtype == (torch.bfloat16 if native else torch.float32)
        assert f"dtype: {want}" in (out / "config.yaml").read_text()
        assert f"train.dtype=auto: {want}" in capsys.readouterr().out  # the log's lines (the launcher files them)
        assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss"] > 0


def _on_mixed_machines(rank: int, world_size: int) -> list[str]:
    """Rank 0 on a node with native bf16, rank 1 on one without: auto must not train in two dtypes. Then both
    without: one fp32 run, no refusal."""
    said = []
    for native in (lambda device: rank == 0, lambda device: False):
        preflight.native_bf16 = native  # this process's own copy of the module
        try:
            trainer = Trainer(load_config("tiny", ["data.source=synthetic", "train.device=cpu", "train.dtype=auto",
                                                   "train.progress=false", "train.tensorboard=false"]), None)
            said.append(trainer.cfg.train.dtype)
        except ConfigError as e:
            said.append(str(e))
    return said


def test_ranks_whose_machines_resolve_auto_differently_are_refused_together_in_one_line():
    said = spawn(_on_mixed_machines, 2, timeout=120)
    assert said[0] == said[1], said  # every rank refuses, with the same words
    refusal, agreed = said[0]
    assert refusal.startswith("train.dtype=auto chose bf16 on 1 of the 2 ranks and fp32 on the others"), refusal
    assert "set train.dtype=fp32 or bf16" in refusal and "\n" not in refusal
    assert agreed == "fp32"


def test_an_explicit_bf16_without_native_kernels_is_warned_about_in_the_log(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(preflight, "native_bf16", lambda device: False)
    trainer, out = _tiny_run(tmp_path, "bf16")
    assert trainer.dtype == torch.bfloat16  # as asked: the warning does not override the config
    assert "warning: train.dtype=bf16 on a cpu without native bf16" in capsys.readouterr().out


def test_the_planner_plans_and_emits_a_cpu_profile_in_the_dtype_it_was_calibrated_in(tmp_path, capsys):
    """``meshtrain plan --hardware cpu-local`` on a profile calibrated in fp32 (a CPU without native bf16) prices
    4-byte activations and emits ``train.dtype: fp32``; the same profile calibrated in bf16 plans and emits bf16."""
    from meshtrain import cli
    from meshtrain.plan.hardware import Hardware, save_profile

    for dtype, act in (("fp32", 4), ("bf16", 2)):
        path = save_profile(Hardware("cpu-local", "test", 5e10, 4e9, 1e10, intra_bw=1e9, inter_bw=1e9,
                                     devices_per_node=2, domain=2, tp_max=2, cores=2, elem_s=1e-9, block_s=1e-4,
                                     param_s=1e-9, step_s=1e-3, dtype=dtype), tmp_path / f"{dtype}.json")
        out = tmp_path / f"{dtype}.yaml"
        assert cli.main(["plan", "--model", "tiny", "--hardware", str(path), "--devices", "2", "--batch-tokens", "2K",
                         "--top", "1", "--json", "--emit", str(out)]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["problem"]["act_bytes"] == act
        assert load_config(out).train.dtype == dtype
