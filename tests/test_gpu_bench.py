"""benchmarks/gpu_single.py without a GPU: the one-line refusal, and its whole path on a tiny CPU model.
Also the chip table's match of CUDA device names, which decides the MFU denominator."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshtrain.plan.hardware import chip_for_cuda_device

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_single.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=600, cwd=ROOT)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_refuses_without_cuda_in_one_line():
    out = _run("--steps", "1")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_single.py needs a CUDA device;"), out.stderr
    assert "--dry-run-cpu" in lines[0] and out.stdout == ""


@pytest.mark.slow
def test_dry_run_prints_every_row_and_checks_the_same_run():
    out = _run("--dry-run-cpu", "--steps", "1", "--warmup", "1", "--rounds", "1", "--profile", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [ln for ln in out.stdout.splitlines() if ln.startswith("| ")]
    for name in ("ours eager", "HF eager", "HF compiled", "ours compiled"):
        assert any(ln.startswith(f"| {name} |") for ln in rows), out.stdout
    assert "| ours eager / HF eager | " in out.stdout
    # Same weights and batches in fp32: HF's losses are ours within 1e-5 at the first step, 1e-3 at every step.
    assert "HF eager: first" in out.stdout and "NOT THE SAME RUN" not in out.stdout
    # --profile: each row's time by kind, named as train.profile_steps names them (train/profiling.py).
    for name in ("ours eager", "HF eager"):
        assert f"profile of {name}: " in out.stdout and "by kind (ms per step): communication" in out.stdout


def test_rows_need_one_of_ours_as_the_reference():
    """Every row's losses are checked against ours eager, or ours compiled without it; the dry run compiles
    nothing, so there ours eager must be asked for. Refused by argparse before any model is built."""
    for rows, says in (("HF eager,HF compiled", "neither of ours is asked for"),
                       ("ours compiled,HF compiled", "ours compiled cannot be the reference")):
        out = _run("--dry-run-cpu", "--rows", rows)
        assert out.returncode == 2 and says in out.stderr.strip().splitlines()[-1], out.stderr


def test_the_model_shape_flags_build_both_sides(tmp_path):
    """--d-model, --layers, --heads and --kv-heads shape ours and HF's alike (the same run from the same weights),
    and reach the JSON, whose args gpu_kernels_fit.py reads back; shapes that cannot be built are refused first."""
    import json

    out = _run("--dry-run-cpu", "--d-model", "128", "--layers", "3", "--heads", "4", "--kv-heads", "1", "--steps", "1",
               "--rounds", "1", "--rows", "ours eager,HF eager", "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr
    assert "(d_model 128, 3 layers, 4/1 heads" in out.stdout and "HF eager: first" in out.stdout
    args = json.loads((tmp_path / "r.json").read_text())["args"]
    assert (args["d_model"], args["layers"], args["heads"], args["kv_heads"]) == (128, 3, 4, 1)
    for flags, says in ((["--heads", "3"], "the heads must divide the width"), (["--d-model", "0"], "--d-model 0")):
        out = _run("--dry-run-cpu", *flags)
        assert out.returncode == 2 and says in out.stderr.strip().splitlines()[-1], out.stderr


def test_the_gpu_session_script_refuses_an_out_it_cannot_write_in_one_line(tmp_path):
    """$OUT that is a file (or cannot be made) stops the script before any run, with one line naming OUT."""
    (tmp_path / "a_file").write_text("")
    env = {**os.environ, "OUT": str(tmp_path / "a_file"), "PYTHON": sys.executable}
    out = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh"), "--dry-run-cpu"],
                         capture_output=True, text=True, env=env, timeout=60)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "OUT=" in lines[0] and "writable" in lines[0], out.stderr
    assert (tmp_path / "a_file").read_text() == ""


def test_the_gpu_session_script_refuses_a_gpu_mem_that_is_no_number_in_one_line(tmp_path):
    """GPU_MEM_GIB=8x stops the script before it makes $OUT or runs anything, with one line naming it."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "GPU_MEM_GIB": "8x"}
    out = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh"), "--dry-run-cpu"],
                         capture_output=True, text=True, env=env, timeout=60)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "GPU_MEM_GIB=8x" in lines[0], out.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("mem, runs", [
    ("", (("b32", 32), ("b32lt", 32), ("b48", 48))),  # no GPU memory read: the H200 plan
    ("80", (("b8c", 8), ("b24", 24), ("w8", 8), ("b8e", 8), ("b24b", 24))),  # an H100: pairs, 24, a wider model
])
def test_the_gpu_session_script_runs_its_measurements(tmp_path, mem, runs):
    """benchmarks/gpu_session.sh, the next GPU session's one command, on the CPU dry run: its runs (the H200 plan:
    ours compiled at 32 with the profile, the floor under its matmuls (benchmarks/gemm_floor.py), 32 again on
    cuBLASLt, 48 with the profile; the H100 plan: ours compiled alone at 24, the kernel forms, 24
    again with Python's automatic garbage collection, the compiled pair at 8 with the profile, a wider model's pair,
    the eager pair at 8)
    each leave their output and JSON in $OUT, beside the machine's facts; the extra arguments reach every run and
    win over the script's own (here --rows, as the dry run needs ours eager)."""
    import json

    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "",
           "GPU_MEM_GIB": mem, "SESSION_S": "3600"}  # every step, however slow this machine is today
    out = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh"), "--dry-run-cpu", "--steps", "1",
                          "--warmup", "1", "--rounds", "1", "--rows", "ours eager,HF eager"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "env.txt").read_text().strip()
    for name, batch in runs:
        record = json.loads((tmp_path / f"{name}.json").read_text())
        assert record["args"]["batch"] == batch and record["args"]["rows"] == ["ours eager", "HF eager"], record["args"]
        assert record["rows"]["HF eager"]["losses"], name
        assert "same run:" in (tmp_path / f"{name}.txt").read_text()
    assert "profile of ours eager" in (tmp_path / f"{runs[0][0]}.txt").read_text()
    kernels = json.loads((tmp_path / f"{runs[0][0]}.json").read_text())["rows"]["ours eager"]["kernels_ms_per_step"]
    assert kernels and all(ms > 0 for _, ms, _ in kernels)  # the whole table, not only the printed top
    assert sorted(p.name for p in tmp_path.glob("*.json")) == sorted(f"{n}.json" for n, _ in runs)
    given = {k: v for k, v in os.environ.items() if k.startswith("TORCHINDUCTOR_")}  # this machine's own, if any
    for name, _ in runs:  # each JSON says how its run was compiled: here, with this machine's settings alone
        record = json.loads((tmp_path / f"{name}.json").read_text())
        assert record["inductor_env"] == given and record["args"]["rope"] == "ours", name
    if not mem:  # the H200's: every matmul of b32's step alone, and b32's step at that floor (gemm_floor.py)
        floor = (tmp_path / "floor.txt").read_text()
        assert "| wk | weight grad dy^T x |" in floor and "ours eager step, measured: " in floor, floor
        assert json.loads((tmp_path / "b32lt.json").read_text())["args"]["blas"] == "cublaslt"
        return
    forms = (tmp_path / "forms.txt").read_text()  # benchmarks/kernel_forms.py, on its own dry run
    assert "| rope swap |" in forms and "| norm split |" in forms and "same run: rope swap output:" in forms, forms
    assert "| attn flash |" in forms and "attn math gradient: " in forms, forms  # the CPU's attention backends
    assert "| gemm qkv 1 |" in forms and "gemm gate-up 1 gradient: " in forms, forms  # fused projections
    # the wider model is another shape (the dry run's own: twice the width, one block)
    args = json.loads((tmp_path / "w8.json").read_text())["args"]
    assert (args["d_model"], args["layers"]) == (128, 1)
    # batch 24 as the trainer collects garbage, and again with Python's automatic collection
    assert [json.loads((tmp_path / f"{n}.json").read_text())["args"]["gc_every"] for n in ("b24", "b24b")] == [50, 0]


def test_the_gpu_session_fits_the_planner_on_its_runs(tmp_path):
    """On a GPU the session ends by fitting the planner's kernel costs on its two profiled batches and checking
    every compiled run, the wider model's too (benchmarks/gpu_kernels_fit.py -> $OUT/fit.txt). Here a stand-in for
    Python answers each gpu_single.py run with the H100's recorded run of the same name (tests/fixtures/h100_b13d967:
    b8c, b24 and w8; none for the eager pair b8e or the repeat b24b, which the fit does not read) and runs
    everything else for real."""
    fixtures = ROOT / "tests" / "fixtures" / "h100_b13d967"
    fake = tmp_path / "python"
    fake.write_text(f"""#!/usr/bin/env bash
if [ "$1" = benchmarks/gpu_single.py ]; then  # ... --json PATH: the recorded run named like PATH, if any
    while [ $# -gt 0 ]; do case $1 in --json) j=$2;; esac; shift; done
    r={fixtures}/$(basename "$j")
    [ "$(basename "$j" .json)" = "${{SKIP_RUN:-}}" ] || [ ! -f "$r" ] || cp "$r" "$j"
    exit 0
fi
[ "$1" != benchmarks/kernel_forms.py ] || exit 0  # the kernel forms need a GPU and are not fitted
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": str(fake), "GPU_MEM_GIB": "80"}
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh")], capture_output=True, text=True,
                         env=env, timeout=300)
    fit = (out / "fit.txt").read_text()
    assert run.returncode == 0, run.stderr + fit
    assert "fitted on batches 8, 24 of ours compiled" in fit and "GPU_KERNELS = {" in fit
    assert "| d2048 L16 h32/8 | 8 | 178.0 |" in fit and "| d2048 L16 h32/8 | 24 | 496.5 |" in fit
    wide = next(line for line in fit.splitlines() if line.startswith("| d4096 L8 h32/8 | 8 | 294.8 |"))
    assert wide.endswith("| no |")  # another shape: checked, not fitted
    assert sum(line.startswith("| d") for line in fit.splitlines()) == 3  # b8e (eager) and b24b: neither fitted

    # A run this call did not make is not read, though its folder holds one from earlier (a machine's /tmp kept
    # from another session): here w8 fails to write and an older w8.json lies in $OUT.
    stale = tmp_path / "again"
    stale.mkdir()
    (stale / "w8.json").write_bytes((fixtures / "w8.json").read_bytes())
    os.utime(stale / "w8.json", (1e9, 1e9))
    again = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh")], capture_output=True, text=True,
                           env={**env, "OUT": str(stale), "SKIP_RUN": "w8"}, timeout=300)
    fit = (stale / "fit.txt").read_text()
    assert again.returncode == 0, again.stderr + fit
    assert "| d4096" not in fit and sum(line.startswith("| d2048") for line in fit.splitlines()) == 2, fit


def test_the_gpu_session_drops_its_last_steps_when_their_timeouts_no_longer_fit_the_call(tmp_path):
    """Each step of the session runs only while its timeout fits the call (SESSION_S): a small budget drops the
    later steps, never the first, so on an H100 the goal's batch-24 runs come back before anything else. A stand-in
    for Python answers each run at once."""
    fake = tmp_path / "python"
    fake.write_text(f"""#!/usr/bin/env bash
if [ "$1" = benchmarks/gpu_single.py ]; then
    while [ $# -gt 0 ]; do case $1 in --json) echo '{{}}' > "$2";; esac; shift; done
    exit 0
fi
[ "$1" != benchmarks/kernel_forms.py ] || exit 0
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": str(fake), "GPU_MEM_GIB": "80", "SESSION_S": "140"}
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh")], capture_output=True, text=True,
                         env=env, timeout=120)
    ran = sorted(p.stem for p in out.glob("*.json"))
    assert ran == ["b24", "b24b", "b8e"], run.stderr  # 130 s and 110 s fit 140; 150 s does not; 100 s does
    for name in ("forms", "b8c", "w8"):
        assert f"[gpu_session] {name} skipped: " in run.stderr and "could overrun the call's 140" in run.stderr
    bad = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh")], capture_output=True, text=True,
                         env={**env, "SESSION_S": "9m", "OUT": str(tmp_path / "bad")}, timeout=60)
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 1 and "SESSION_S=9m" in lines[0], bad.stderr
    assert not (tmp_path / "bad").exists()  # refused before it makes anything


@pytest.mark.parametrize("name, key", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200 SXM"), ("NVIDIA H200 NVL", "H200 NVL"), ("NVIDIA A100-SXM4-80GB", "A100 SXM"),
])
def test_cuda_device_names_find_their_chip(name, key):
    assert chip_for_cuda_device(name).name == key
    assert chip_for_cuda_device("NVIDIA GeForce GTX 1080") is None


def test_fp32_peak_is_the_datasheet_tf32_rate_only_where_tf32_is_on(monkeypatch):
    """MFU's denominator: bf16 on a known GPU is its datasheet rate; fp32 is too (TF32) only under
    float32_matmul_precision "high"; under torch's default, "highest", and on a CPU it is measured (None)."""
    from meshtrain.plan.hardware import datasheet_chip

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    gpu = torch.device("cuda", 0)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert datasheet_chip(gpu, torch.bfloat16).name == "H200 SXM"
        assert datasheet_chip(gpu, torch.float32) is None
        torch.set_float32_matmul_precision("high")
        assert datasheet_chip(gpu, torch.float32).name == "H200 SXM"
        assert datasheet_chip(torch.device("cpu"), torch.bfloat16) is None
    finally:
        torch.set_float32_matmul_precision(before)


def test_the_report_says_what_the_allocator_did_over_each_rows_timed_steps(capsys, monkeypatch):
    """On CUDA each row carries the caching allocator's counts over its timed steps (a retry frees the cache and
    synchronises: the batch-24 runs' idle gaps are the suspect) and the process's peak reserved memory; the report
    prints them after the table, for the rows that have them. Filled by hand here: this machine has no CUDA."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_single

    from meshtrain.config import load_config

    args = gpu_single.parse_args(["--dry-run-cpu"])
    cfg = load_config(None, gpu_single.model_overrides(args) + gpu_single.train_overrides(args, 10))
    rows = {name: gpu_single.Row(name) for name in gpu_single.ROWS}
    rows["ours compiled"].times = [[0.5, 0.5]]
    rows["ours compiled"].allocator = {"num_alloc_retries": 3, "num_sync_all_streams": 1, "num_device_alloc": 7,
                                       "num_device_free": 6, "reserved_peak": 75 * 2**30}
    rows["HF compiled"].times = [[0.6, 0.6]]
    gpu_single.report(args, cfg, torch.device("cpu"), rows, [])
    said = capsys.readouterr().out
    assert ("allocator over ours compiled's timed steps: 3 cudaMalloc retries (each frees the cache and "
            "synchronises), 1 syncs of all streams, 7 device allocations, 6 frees; the process's peak reserved "
            "75.00 GiB") in said
    assert "allocator over HF compiled" not in said  # no counts (a CPU row): no line


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_swap_form_of_rope_is_rope_real_to_the_bit_and_gpu_single_can_put_it_in_its_place(dtype, monkeypatch):
    """``gpu_single.py --rope swap`` (the session's b24v) runs the trainer with ``kernel_forms.rope_swap`` where
    compiled blocks call ``rope_real``: a drop-in only if output and gradient are the same bits, which this checks
    eagerly (the kernel forms check it compiled); and ``--sdpa flash`` leaves torch's flash switch alone on."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_single
    import kernel_forms

    import meshtrain.model.layers as layers
    from meshtrain.model.layers import rope_real, rope_tables

    torch.manual_seed(0)
    cos, sin = (t.unsqueeze(-2) for t in rope_tables(16, 32, 10000.0))
    x = torch.randn(2, 32, 3, 16, dtype=dtype)
    grads = []
    for form in (rope_real, kernel_forms.rope_swap):
        xi = x.clone().requires_grad_(True)
        y = form(xi, cos, sin)
        y.backward(torch.linspace(-1, 1, y.numel()).view_as(y).to(dtype))
        grads.append((y.detach(), xi.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    switches = {"flash_sdp_enabled": "enable_flash_sdp", "mem_efficient_sdp_enabled": "enable_mem_efficient_sdp",
                "cudnn_sdp_enabled": "enable_cudnn_sdp", "math_sdp_enabled": "enable_math_sdp"}  # query: setter
    before = {n: getattr(torch.backends.cuda, n)() for n in switches}
    monkeypatch.setattr(layers, "rope_real", layers.rope_real)  # restored after the test
    try:
        gpu_single.choose_kernels(gpu_single.parse_args(["--dry-run-cpu", "--rope", "swap", "--sdpa", "flash"]))
        assert layers.rope_real is kernel_forms.rope_swap
        assert [getattr(torch.backends.cuda, n)() for n in switches] == [True, False, False, False]
    finally:
        for n, on in before.items():
            getattr(torch.backends.cuda, switches[n])(on)


def test_the_kernel_forms_refuse_without_cuda_in_one_line():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_forms.py")], capture_output=True,
                         text=True, env=env, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("kernel_forms.py needs a CUDA device"), \
        out.stderr


def test_the_kernel_forms_time_only_the_forms_that_computed_the_same(monkeypatch, capsys):
    """A form whose output or gradient is not its reference's within bf16 rounding is named, left out of the
    timings, and the script exits 1 after the other forms' figures (here the CPU's math attention, made wrong)."""
    from torch.nn.attention import SDPBackend

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import kernel_forms

    real = kernel_forms.attention

    def wrong_math(backend, heads, kv_heads):
        core = real(backend, heads, kv_heads)
        return (lambda x: core(x) * 1.5) if backend == SDPBackend.MATH else core

    monkeypatch.setattr(kernel_forms, "attention", wrong_math)
    rc = kernel_forms.main(["--dry-run-cpu", "--rounds", "1", "--iters", "1"])
    out, err = capsys.readouterr()
    assert rc == 1 and "attn math's output differs from attn flash's beyond bf16 rounding" in err, err
    assert "| attn math |" not in out and "| attn flash |" in out and "| rope swap |" in out, out


def test_the_collector_runs_as_the_trainer_schedules_it_for_every_row(tmp_path, monkeypatch, capsys):
    """--gc-every N: every row's timed steps run with automatic collection off and a full collection inside each
    N-th step (train.gc_every's schedule), and the report and JSON say what the collector took per row. Steps 2-5
    are timed here (one warm-up, two rounds of two), so steps 2 and 4 collect: 2 collections of generation 2."""
    import gc
    import json

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_single

    out = tmp_path / "run.json"
    assert gpu_single.main(["--dry-run-cpu", "--steps", "2", "--warmup", "1", "--rounds", "2", "--gc-every", "2",
                            "--rows", "ours eager,HF eager", "--json", str(out)]) == 0
    assert gc.isenabled() and gc.get_freeze_count() == 0
    said = capsys.readouterr().out
    for name in ("ours eager", "HF eager"):
        g = json.loads(out.read_text())["rows"][name]["gc"]
        assert g["collections"] == [0, 0, 2] and g["ms"] > 0, g
        assert f"Python's garbage collector over {name}'s timed steps: {g['ms']:.1f} ms in 0/0/2 collections" in said


def test_the_matmul_floor_times_every_linear_layer_of_the_model_once(monkeypatch):
    """benchmarks/gemm_floor.py's list of the step's matmuls: each linear layer of the model (Llama's blocks and the
    head, GQA's narrower k and v), its weight's shape as the model holds it, as many times as the model has it; the
    fused form covers the same weights. A layer left out or counted twice would put the floor under or over the
    step's real matmuls."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gemm_floor import linears

    from meshtrain.config import ModelConfig
    from meshtrain.model.llama import Llama

    cfg = ModelConfig(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, multiple_of=32, vocab_size=96)
    model = Llama(cfg)
    held: dict[tuple[int, int], int] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            held[tuple(module.weight.shape)] = held.get(tuple(module.weight.shape), 0) + 1
    listed: dict[tuple[int, int], int] = {}
    for _, n, k, count in linears(cfg, fused_qkv=False):
        listed[n, k] = listed.get((n, k), 0) + count
    assert listed == held, (listed, held)
    fused = linears(cfg, fused_qkv=True)
    assert sum(n * k * c for _, n, k, c in fused) == sum(n * k * c for (n, k), c in held.items())
    assert ("wqkv", 64 + 2 * 32, 64, 3) in fused
