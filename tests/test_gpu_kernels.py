"""The planner's GPU kernel costs (plan/hardware.GPU_KERNELS): fitted from a real H100's kernel profile, and the
one-device step they predict against the step measured there, a batch the fit never saw included."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain.config import load_config
from meshtrain.plan.costfit import block_features, head_features
from meshtrain.plan.flops import param_count
from meshtrain.plan.hardware import GPU_KERNELS, HARDWARE, get_hardware
from meshtrain.plan.problem import Layout, Problem
from meshtrain.plan.steptime import evaluate, gpu_kernel_time
from meshtrain.plan.units import block_params

ROOT = Path(__file__).resolve().parents[1]
H100_RUNS = ROOT / "tests" / "fixtures" / "h100_b13d967"  # docs/benchmarks.md, "at b13d967"
SHAPE = ["model.d_model=2048", "model.n_layers=16", "model.n_heads=32", "model.n_kv_heads=8", "model.multiple_of=256",
         "model.vocab_size=32000", "model.max_seq_len=2048"]  # benchmarks/gpu_single.py's ~1B Llama


def _fit(tmp_path, *names: str) -> dict:
    out = tmp_path / "fit.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_kernels_fit.py"),
                          *(str(H100_RUNS / n) for n in names), "--json", str(out)],
                         capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    return json.loads(out.read_text())


def test_the_gpu_presets_carry_the_fit_of_the_h100_profile_and_predict_its_steps(tmp_path):
    """GPU_KERNELS is what benchmarks/gpu_kernels_fit.py fits from the H100's batch-8 and batch-24 profiles (to the
    rounding written in hardware.py), and with them the planner's one-device step is 0.90-1.00 of the measured one
    at batch 8 and 24 and for the wider model (d_model 4096, 8 blocks), the last not fitted. Below 1: the measured
    step is wall time, with the host's gaps (2-4% of it in these profiles), which the planner does not model."""
    result = _fit(tmp_path, "b8c.json", "b24.json", "w8.json")
    for key, value in GPU_KERNELS.items():
        assert result["fit"][key] == pytest.approx(value, rel=0.03), key
    checks = {(c["d_model"], c["batch"]): c["predicted_ms"] / c["measured_ms"] for c in result["checks"]}
    assert set(checks) == {(2048, 8), (2048, 24), (4096, 8)}
    for shape, ratio in checks.items():
        assert 0.90 <= ratio <= 1.0, (shape, ratio)
    assert all(HARDWARE[k].gpu_kernels for k in ("h100", "h200", "b200", "a100"))
    assert not any(hw.gpu_kernels for k, hw in HARDWARE.items() if k.startswith("tpu"))  # the book's roofline


def test_one_fitted_batch_is_refused(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_kernels_fit.py"), str(H100_RUNS / "b8c.json")],
                         capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and "two batch sizes" in lines[0], run.stderr


@pytest.mark.parametrize("args, says", [
    (["b8c.json", "b24.json", "--hardware", "h999"], "--hardware 'h999' is not known"),
    (["b8c.json", "b24.json", "--hardware", "tpu-v5p"], "--hardware tpu-v5p: the kernel costs are a GPU preset's"),
    (["b8c.json", "nope.json"], "nope.json"),
    (["b8c.json", "b24.json", "--json", "/nonexistent/fit.json"], "--json /nonexistent/fit.json"),
])
def test_the_fit_refuses_bad_input_in_one_line(args, says):
    files = [str(H100_RUNS / a) if a.endswith(".json") and not a.startswith("/") else a for a in args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_kernels_fit.py"), *files],
                         capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 2 and says in last and "Traceback" not in run.stderr, run.stderr


def test_gpu_kernel_terms_add_to_the_matmul_roofline():
    """The step with the kernel costs minus the step without is every block's and the head's kernel time (forward
    + backward, each charged once) plus the clip and AdamW's bytes: nothing double-counted or left out."""
    cfg = load_config(None, SHAPE).model
    with_k = get_hardware("h100").part_of_node(1)
    without = dataclasses.replace(with_k, elem_bytes=0.0, score_flops=0.0, cast_bytes=0.0, optim_bytes=0.0)
    assert with_k.gpu_kernels and not without.gpu_kernels
    tokens, seq = 8 * 2048, 2048
    step = {hw.name + str(hw.gpu_kernels): evaluate(Problem(cfg, seq, 8, hw, 1), Layout(dp=1)).step
            for hw in (with_k, without)}
    a, b = step[with_k.name + "True"], step[with_k.name + "False"]
    kernels = cfg.n_layers * gpu_kernel_time(with_k, block_features(cfg, tokens, seq), block_params(cfg)) \
        + gpu_kernel_time(with_k, head_features(cfg, tokens, seq), cfg.vocab_size * cfg.d_model)
    assert a.compute - b.compute == pytest.approx(kernels, rel=1e-9)
    n = param_count(cfg).total
    assert a.optimizer == pytest.approx(n * GPU_KERNELS["optim_bytes"] / with_k.hbm_bw, rel=1e-9)


def test_plan_takes_part_of_a_node(capsys):
    """--devices below a node's 8 GPUs plans that many (one GPU, say); above, it must still be whole nodes."""
    from meshtrain.cli import main

    assert main(["plan", "--model", "llama3-8b", "--hardware", "h100", "--devices", "1", "--batch-tokens", "16384",
                 "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "on 1 x 1 H100 SXM" in out and "other kernels as measured on an H100" in out
    assert main(["plan", "--model", "llama3-8b", "--hardware", "h100", "--devices", "12", "--batch-tokens", "1M"]) != 0
    assert "not a whole number of 8-device nodes" in capsys.readouterr().err


def test_the_runtime_casts_each_weight_once_per_step_and_each_gradient_once_per_microbatch():
    """What GPU_KERNELS' cast_bytes charges per microbatch, and what an eager runtime does: under bf16 autocast each
    fp32 weight is cast to bf16 once a step, shared by the step's microbatches (``ForwardLoss.one_cast_per_step``,
    since 2026-11-28; every forward cast them before), and every backward casts each gradient back to fp32. So a
    step of 4 accumulation microbatches makes the weight casts of a step of one and 4x its gradient casts. The
    planner still charges the weight's cast per microbatch (hardware.GPU_KERNELS: fitted on compiled runs, whose
    blocks cast inside their graphs, per microbatch); a change on either side shows here first."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    from meshtrain.train.trainer import Trainer

    def weight_casts(accum: int) -> dict[str, Counter]:
        """{dtype cast from: Counter of the 2-D parameter shapes cast} over one step."""
        trainer = Trainer(load_config("tiny", ["data.source=synthetic", "train.progress=false", "train.device=cpu",
                                               "train.tensorboard=false", "train.dtype=bf16",
                                               f"train.grad_accum={accum}"]))
        trainer.train_step(0)
        shapes = {tuple(p.shape) for p in trainer.model.parameters() if p.dim() == 2}
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            trainer.train_step(1)
        casts: dict[str, Counter] = {"float": Counter(), "c10::BFloat16": Counter()}
        for e in prof.events():
            if e.name == "aten::_to_copy" and e.input_shapes and tuple(e.input_shapes[0]) in shapes:
                casts[e.input_dtypes[0]][tuple(e.input_shapes[0])] += 1
        return casts

    one, four = weight_casts(1), weight_casts(4)
    weights, grads = sum(one["float"].values()), sum(one["c10::BFloat16"].values())
    assert weights > 0 and grads > 0 and set(one["float"]) == set(four["float"])  # every matrix shape is cast
    assert sum(four["float"].values()) == weights  # the weights: once a step
    assert sum(four["c10::BFloat16"].values()) == 4 * grads  # the gradients: once a microbatch
