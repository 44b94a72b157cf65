"""One CUDA device: our trainer against HuggingFace transformers' ``LlamaForCausalLM``, eager and compiled.

The model is a ~1B Llama: d_model 2048, 16 layers, 32 query / 8 key-value heads (GQA, head_dim 64), SwiGLU
hidden 5632 (Llama's rule 2/3 x 4d rounded up to 256), vocabulary 32000 (Llama 2's; ``--vocab 128256`` for
Llama 3's), untied head, seq 2048, bf16 autocast over fp32 master weights (ours with its bf16 residual stream,
model/layers.py; HF's stays fp32 under autocast). Rows:

- ours eager: ``meshtrain.train.trainer.Trainer`` built from the same overrides ``meshtrain train`` takes
  (printed), synthetic data, each step ``Trainer.train_step`` (batch, forward/backward, clip, AdamW);
- ours compiled: the same with ``train.compile=true`` (skipped, with a note, where the option does not exist);
- HF eager: ``LlamaForCausalLM`` built from a config in code (no hub), ``attn_implementation="sdpa"``, fp32
  weights under ``torch.autocast(bf16)`` as ours, its own loss (``labels`` with ``shift_labels``), clipping
  with ``clip_grad_norm_(foreach=True)``, AdamW (fused on CUDA, foreach on CPU) with our hyperparameters,
  decay groups and learning-rate schedule;
- HF compiled: the same model wrapped in ``torch.compile``.

Every row starts from the same weights (ours, copied into HF's layout with the RoPE row permutation of
``model/hf.py``) and trains on the same batches, so the four loss trajectories are the same run: the script asserts
it. fp32: the first step within 1e-5 and every step within 1e-3 relative; that is what pins the weight mapping, the
batches and the optimizer exactly (the CPU dry run, and ``--dtype fp32`` for a few steps on the GPU). bf16: the
first three steps within 1e-3 (steps 1 and 2 carry the first updates, which move the loss 2-4% a step, so an update
a tenth off shows; what they cannot see, the fp32 check pins). Not every step: bf16 training is chaotic, and
rounding differences grow until single steps part by a few percent. On an H200 (2026-11-25) the first three steps
agreed within 7e-5 in every row, and by step 50 ours compiled, the same program as ours eager with other fusions,
was 3.3e-2 off at its worst step and 1.9e-2 in the mean of the last round. A fixed tolerance there would pass or
fail on chance; the script prints every row's losses, its worst step and its last-round mean, and ours compiled's
beside them as the yardstick. The reference is ours eager; ``--rows`` without it makes ours compiled the
reference, for a batch whose eager activations would not fit beside the other rows (``--batch 32 --rows "ours
compiled,HF compiled"``; benchmarks/gpu_session.sh runs it).

Rows alternate ours/theirs/theirs/ours, reversed each round; warm-up steps (compilation included) come before
the rounds; each timed step sits between two ``torch.cuda.synchronize()``. Ours includes building a batch
(``SyntheticDataset``, on the CPU, as ``meshtrain train`` does: since 2026-11-26 late, the next step's, once the
step is queued, ``train/data.BatchAhead``); HF's batch is on the device before its step, as a prefetching loader
would have it. MFU uses one FLOP count for every row, ``plan/flops.flops_per_token``
(the trainer's own), over the device's dense bf16 peak (``plan/hardware.py``, by the device's name). Peak
memory is ``torch.cuda.max_memory_allocated`` over a row's timed steps (reset before each) less what the other
rows keep resident (their weights and optimizer state, measured as each was built): what the row needs alone.
Beside it, the caching allocator's counts over the row's timed steps (``torch.cuda.memory_stats``): a cudaMalloc
that fails frees the cache and synchronises the device (a retry), which near the card's limit leaves the device
idle while the host queues again; and the process's peak reserved memory. ``--profile`` also says where the device
sat idle inside the profiled steps (``train/profiling.idle_gaps``).

Three experiments on the kernels, for every row of the process, off by default (what ``meshtrain train`` runs):
``--rope swap`` puts ``kernel_forms.rope_swap``, RoPE as one multiply-add with the same arithmetic, where compiled
blocks call ``model/layers.rope_real``; ``--sdpa BACKEND`` holds SDPA to one fused backend (torch's global switches,
set before anything compiles); ``--blas cublaslt`` (or ``cublas``) has torch's matmuls call that library
(``torch.backends.cuda.preferred_blas_library``; ``benchmarks/gemm_floor.py`` times the step's matmuls under
both). Each is adopted in the model only once a run here shows it faster (docs/
benchmarks.md). Inductor's own settings come from the environment (``TORCHINDUCTOR_*``), as the JSON records.

    PYTHONPATH=. python benchmarks/gpu_single.py [--steps 10] [--warmup 3] [--rounds 5] [--batch 4] [--seq 2048]
    PYTHONPATH=. python benchmarks/gpu_single.py --dry-run-cpu   # tiny model on CPU: checks the script itself
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # imported in main, after INDUCTOR_ENV is read
    from meshtrain.train.gc_schedule import GcClock, GcSchedule

NO_CUDA = ("gpu_single.py needs a CUDA device; none is visible (torch.cuda.is_available() is False): run it on a "
           "GPU machine, or pass --dry-run-cpu to check the script on a tiny model on CPU.")
GPU_DEFAULTS = {"steps": 10, "warmup": 3, "rounds": 5, "batch": 4, "seq": 2048, "vocab": 32000, "d_model": 2048,
                "layers": 16, "heads": 32, "kv_heads": 8}
DRY_DEFAULTS = {"steps": 3, "warmup": 1, "rounds": 2, "batch": 2, "seq": 64, "vocab": 512, "d_model": 64, "layers": 2,
                "heads": 4, "kv_heads": 2}
ROWS = ("ours eager", "HF eager", "HF compiled", "ours compiled")  # round 0's order; odd rounds reverse it
# Same-run tolerances (relative loss difference to the reference row, ours eager by default): (first step, every step).
TOLERANCE = {"fp32": (1e-5, 1e-3), "bf16": (1e-3, 1e-3)}
# Inductor's settings given in the environment (gpu_session.sh's kernel-tuning probe sets two), read before anything
# compiles (Inductor adds its own, its cache folder, once it runs): the JSON says how a run was compiled.
INDUCTOR_ENV = {k: v for k, v in sorted(os.environ.items()) if k.startswith("TORCHINDUCTOR_")}
# --sdpa: torch's global switches, each backend alone (math off too, so a backend with no kernel fails loudly).
SDPA_SWITCHES = {"auto": None, "cudnn": "enable_cudnn_sdp", "flash": "enable_flash_sdp",
                 "efficient": "enable_mem_efficient_sdp"}
BF16_CHECKED_STEPS = 3  # bf16: the steps checked (the module docstring says why not all)


@dataclass
class Row:
    name: str
    step: Callable[[int], float] | None = None  # step index -> loss; None: skipped (see note)
    note: str = ""
    resident: int = 0  # bytes this row keeps between steps (weights, optimizer state)
    losses: list[float] = field(default_factory=list)
    times: list[list[float]] = field(default_factory=list)  # per round, seconds per timed step
    peak: int = 0  # bytes, the row alone (see the module docstring)
    kernels: list[tuple[str, float, int]] = field(default_factory=list)  # --profile: (name, ms, calls) per step
    allocator: dict[str, int] = field(default_factory=dict)  # ALLOCATOR_COUNTS over the timed steps, reserved peak
    idle: dict = field(default_factory=dict)  # --profile on CUDA: idle_gaps' result
    gc: dict = field(default_factory=dict)  # Python's garbage collector over the timed steps: ms, per generation


# torch.cuda.memory_stats keys counted over a row's timed steps (module docstring).
ALLOCATOR_COUNTS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free")


def allocator_counts(device: torch.device) -> dict[str, int]:
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTS}


# Inductor settings the session's experiments change through the environment, read back as Inductor holds them:
# an environment variable this torch does not know changes nothing, and the JSON and report then say so.
INDUCTOR_SETTINGS = ("triton.mix_order_reduction", "triton.enable_pdl")


def inductor_settings() -> dict[str, object]:
    """INDUCTOR_SETTINGS as this process's Inductor holds them (None: this torch has no such setting)."""
    import torch._inductor.config as inductor

    out = {}
    for key in INDUCTOR_SETTINGS:
        section, _, attr = key.rpartition(".")
        out[key] = getattr(getattr(inductor, section, None), attr, None)
    return out


def choose_kernels(args: argparse.Namespace) -> None:
    """``--rope``, ``--sdpa`` and ``--blas`` (the module docstring), before any row is built or compiled."""
    if args.blas != "default" and not args.dry_run_cpu:  # the CPU's matmuls use neither library
        torch.backends.cuda.preferred_blas_library(args.blas)
    if args.rope == "swap":
        from kernel_forms import rope_swap  # benchmarks/, beside this script

        import meshtrain.model.layers as layers

        layers.rope_real = rope_swap  # apply_rope calls it by name under torch.compile
    switch = SDPA_SWITCHES[args.sdpa]
    if switch is not None:
        for name in ("enable_cudnn_sdp", "enable_flash_sdp", "enable_mem_efficient_sdp", "enable_math_sdp"):
            getattr(torch.backends.cuda, name)(name == switch)


def model_overrides(args: argparse.Namespace) -> list[str]:
    """The model section: ~1B Llama on a GPU, a tiny one for the dry run (unless --d-model etc. say otherwise)."""
    shape = {"d_model": args.d_model, "n_layers": args.layers, "n_heads": args.heads, "n_kv_heads": args.kv_heads,
             "multiple_of": 32 if args.dry_run_cpu else 256, "vocab_size": args.vocab, "max_seq_len": args.seq}
    return [f"model.{k}={v}" for k, v in shape.items()]


def train_overrides(args: argparse.Namespace, total_steps: int) -> list[str]:
    return [f"train.seq_len={args.seq}", f"train.global_batch={args.batch}", f"train.dtype={args.dtype}",
            f"train.device={'cpu' if args.dry_run_cpu else 'cuda'}", f"train.steps={total_steps}",
            f"train.warmup_steps={args.warmup}", "train.lr=3e-4", "train.sample_tokens=0", "train.progress=false",
            "train.tensorboard=false", "data.source=synthetic"]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_ours(overrides: list[str]):
    """A Trainer exactly as ``meshtrain train OVERRIDES`` builds it (world of one process)."""
    from meshtrain.config import load_config
    from meshtrain.train.trainer import Trainer

    trainer = Trainer(load_config(None, overrides))
    return trainer, lambda s: trainer.train_step(s)["loss"]


def hf_weights(trainer) -> dict[str, torch.Tensor]:
    """Our initial weights in HF's names and RoPE layout (``model/hf.py``), on CPU. One process: nothing is sent."""
    from meshtrain.model.hf import hf_names, interleaved_to_halves

    ours = trainer.parallel.logical_tensors()
    out = {}
    for name, t in hf_names(trainer.cfg.model).items():
        w = ours[name]
        out[t.hf_name] = interleaved_to_halves(w, t.rope_heads) if t.rope_heads is not None else w
    return out


def build_hf(cfg, weights: dict[str, torch.Tensor], device: torch.device, compiled: bool):
    """LlamaForCausalLM of our shape (config in code, sdpa), fp32 weights, AdamW as ours: returns a step fn."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from meshtrain.model.hf import hf_config_dict
    from meshtrain.parallel.parallelize import DTYPES
    from meshtrain.train.optim import lr_at

    t = cfg.train
    hf_cfg = LlamaConfig(**{k: v for k, v in hf_config_dict(cfg.model).items() if k != "architectures"},
                         attn_implementation="sdpa")
    hf_cfg.use_cache = False
    with torch.device(device):  # random init on the device (fast), then our weights over it
        model = LlamaForCausalLM(hf_cfg).float()
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    model.load_state_dict(weights, strict=True)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    on_cuda = device.type == "cuda"
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=on_cuda,
                            foreach=not on_cuda)
    forward = torch.compile(model) if compiled else model
    dtype = DTYPES[t.dtype]
    from meshtrain.train.data import SyntheticDataset

    data = SyntheticDataset(cfg.model.vocab_size, "train")
    batches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def prefetch(s: int) -> None:  # a competent user's loader has the batch on the device before the step
        if s not in batches:
            x, y = data.batch(t.seed, s, t.global_batch, t.seq_len)
            batches[s] = (x.to(device), y.to(device))

    def step(s: int) -> torch.Tensor:
        x, y = batches.pop(s)
        for g in opt.param_groups:
            g["lr"] = lr_at(s, t)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = forward(input_ids=x, labels=y, shift_labels=y).loss
        loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, t.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()  # read after the step's closing sync: no sync inside the timed step

    return step, prefetch


def timed(row: Row, s: int, device: torch.device, prefetch: Callable[[int], None] | None, mark: bool = False,
          after: Callable[[int], None] | None = None) -> float:
    """One step between two device synchronisations, in seconds; ``mark``: inside a profiler step mark, which
    spans exactly the timed part (``train/profiling.STEP_MARK``); ``after``: called with the step's number (from 1)
    inside its time, as the trainer calls ``GcSchedule.after_step``."""
    from torch.profiler import record_function

    from meshtrain.train.profiling import STEP_MARK

    if prefetch is not None:
        prefetch(s)
    sync(device)
    with record_function(f"{STEP_MARK} {s}") if mark else contextlib.nullcontext():
        t0 = time.perf_counter()
        loss = row.step(s)
        sync(device)
        if after is not None:
            after(s + 1)
        elapsed = time.perf_counter() - t0
    row.losses.append(float(loss))
    return elapsed


def progress(line: str) -> None:
    """Where the run is, on stderr as it happens (a run cut short by a time limit still says how far it got)."""
    print(f"[gpu_single {time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def compile_option_exists() -> bool:
    from meshtrain.config import TrainConfig

    return "compile" in {f.name for f in dataclasses.fields(TrainConfig)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, help="timed steps per row per round (default 10; dry run 3)")
    ap.add_argument("--warmup", type=int, help="untimed steps per row before the rounds (default 3; dry run 1)")
    ap.add_argument("--rounds", type=int, help="rounds, order reversed each round (default 5; dry run 2)")
    ap.add_argument("--batch", type=int, help="sequences per step (default 4; dry run 2)")
    ap.add_argument("--seq", type=int, help="tokens per sequence (default 2048; dry run 64)")
    ap.add_argument("--vocab", type=int, help="vocabulary (default 32000, Llama 2's; dry run 512)")
    ap.add_argument("--d-model", type=int, help="model width (default 2048; dry run 64)")
    ap.add_argument("--layers", type=int, help="blocks (default 16; dry run 2)")
    ap.add_argument("--heads", type=int, help="query heads (default 32, head_dim 64; dry run 4)")
    ap.add_argument("--kv-heads", type=int, help="key-value heads (default 8; dry run 2)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"rows to run, comma-separated from {', '.join(ROWS)}")
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="tiny model (d_model 64, 2 layers) on CPU, fp32, no compile: checks the script")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), help="compute dtype (default bf16; dry run fp32)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the rounds, profile N more steps of each row and print its top kernels by device time")
    ap.add_argument("--gc-every", type=int, metavar="N",
                    help="Python's garbage collector for every row as the trainer's train.gc_every=N schedules it "
                         "(default the trainer's, 50); 0: Python's automatic collection")
    ap.add_argument("--rope", choices=("ours", "swap"), default="ours",
                    help="RoPE in compiled blocks: ours (model/layers.rope_real) or kernel_forms.rope_swap")
    ap.add_argument("--sdpa", choices=tuple(SDPA_SWITCHES), default="auto",
                    help="SDPA's backend: torch's choice (auto), or cudnn, flash or efficient alone")
    ap.add_argument("--blas", choices=("default", "cublas", "cublaslt"), default="default",
                    help="the BLAS library torch's matmuls call on CUDA: torch's default, or cuBLAS or cuBLASLt")
    ap.add_argument("--json", metavar="PATH", help="also write every row's losses, step times and peak memory here")
    args = ap.parse_args(argv)
    defaults = DRY_DEFAULTS if args.dry_run_cpu else GPU_DEFAULTS
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.dtype = args.dtype or ("fp32" if args.dry_run_cpu else "bf16")
    if args.gc_every is None:
        from meshtrain.config import TrainConfig

        args.gc_every = TrainConfig().gc_every
    lows = {"steps": 1, "rounds": 1, "batch": 1, "seq": 2, "vocab": 2, "warmup": 0, "profile": 0, "gc_every": 0,
            "d_model": 8, "layers": 1, "heads": 1, "kv_heads": 1}
    for flag, low in lows.items():
        if getattr(args, flag) < low:
            ap.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least {low}")
    if args.d_model % args.heads or args.heads % args.kv_heads:
        ap.error(f"--d-model {args.d_model}, --heads {args.heads}, --kv-heads {args.kv_heads}: the heads must divide "
                 f"the width and the kv heads the heads")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        ap.error(f"--json {args.json}: its folder does not exist; create it or name a file in an existing folder")
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown or not {"ours eager", "ours compiled"} & set(args.rows):
        ap.error(f"--rows: {', '.join(unknown) or 'neither of ours is asked for'}; choose from {', '.join(ROWS)} "
                 f"with ours eager or ours compiled among them (the reference every row's losses are checked against)")
    # The reference: ours eager, or ours compiled where eager is left out (a batch whose eager activations would
    # not fit beside the other rows).
    args.reference = "ours eager" if "ours eager" in args.rows else "ours compiled"
    if args.dry_run_cpu and args.reference == "ours compiled":
        ap.error("--rows: the dry run compiles nothing, so ours compiled cannot be the reference; add ours eager")
    return args


def main(argv: list[str] | None = None) -> int:
    from harness import one_device  # benchmarks/, beside this script; imports meshtrain, after INDUCTOR_ENV is read

    from meshtrain.train.gc_schedule import GcClock, GcSchedule

    args = parse_args(argv)
    device = one_device(args.dry_run_cpu, NO_CUDA)
    if device is None:
        return 2
    choose_kernels(args)
    total = args.warmup + args.rounds * args.steps + args.profile
    overrides = model_overrides(args) + train_overrides(args, total)
    compile_ok = compile_option_exists()
    rows = {name: Row(name) for name in ROWS}
    prefetchers: dict[str, Callable[[int], None] | None] = {}

    def build(name: str, make: Callable[[], tuple]) -> None:
        """Build a row and run its warm-up. A row other than the reference that fails is skipped with its one-line
        reason, so one library's failure on a GPU machine does not lose the other rows."""
        row = rows[name]
        sync(device)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        t0 = time.perf_counter()
        try:
            row.step, prefetchers[name] = make()
            for s in range(args.warmup):
                timed(row, s, device, prefetchers[name])
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - reported per row; the reference re-raises
            if name == args.reference:
                raise
            row.step, row.note = None, f"failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
            row.losses.clear()
            progress(f"{name}: {row.note}")
            prefetchers[name] = None  # drop the failed row's model and optimizer
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return
        sync(device)
        row.resident = (torch.cuda.memory_allocated(device) if device.type == "cuda" else 0) - before
        progress(f"{name}: built and warmed up in {time.perf_counter() - t0:.0f} s, resident "
                 f"{row.resident / 2**30:.2f} GiB")

    # The reference first (ours eager, or ours compiled without it): its initial weights, taken before its warm-up,
    # are the HF rows'; ours are built from the same seed, so the same weights.
    trainer = None
    weights: dict[str, torch.Tensor] = {}

    def make_reference():
        nonlocal trainer
        trainer, step = build_ours(overrides + (["train.compile=true"] if args.reference == "ours compiled" else []))
        weights.update(hf_weights(trainer))
        return step, None

    def make_hf(compiled: bool):
        return lambda: build_hf(trainer.cfg, weights, device, compiled)

    if args.reference == "ours compiled" and not compile_ok:
        print("gpu_single.py: ours compiled is the reference (--rows has no ours eager), but this meshtrain has no "
              "train.compile option", file=sys.stderr)
        return 2
    build(args.reference, make_reference)
    if "ours eager" not in args.rows:
        rows["ours eager"].note = "not asked for (--rows)"
    cfg = trainer.cfg
    for name in ("HF eager", "HF compiled"):
        if name not in args.rows:
            rows[name].note = "not asked for (--rows)"
        elif name == "HF compiled" and args.dry_run_cpu:
            rows[name].note = "skipped: --dry-run-cpu runs no torch.compile"
        else:
            build(name, make_hf(name == "HF compiled"))
    weights.clear()
    name = "ours compiled"
    if name == args.reference:
        pass
    elif name not in args.rows:
        rows[name].note = "not asked for (--rows)"
    elif args.dry_run_cpu:
        rows[name].note = "skipped: --dry-run-cpu runs no torch.compile"
    elif not compile_ok:
        rows[name].note = "skipped: this meshtrain has no train.compile option yet (issue 14 point 4)"
    else:
        build(name, lambda: (build_ours(overrides + ["train.compile=true"])[1], None))

    live = [rows[n] for n in ROWS if rows[n].step is not None]
    # Python's garbage collector as the trainer schedules it (train.gc_every; 0: automatic), for every row alike:
    # the warm-ups were the first steps, so what they left is frozen now.
    with GcSchedule(args.gc_every) as schedule, GcClock() as clock:
        schedule.settle()
        timed_rounds(args, live, device, prefetchers, schedule, clock)
        if args.profile:
            s0 = args.warmup + args.rounds * args.steps
            for row in live:
                profile_row(row, range(s0, s0 + args.profile), device, prefetchers[row.name], schedule.after_step)
    report(args, cfg, device, rows, overrides)
    if args.json:
        write_json(args.json, args, rows)
    return check_same_run(args, rows)


def timed_rounds(args: argparse.Namespace, live: list[Row], device: torch.device,
                 prefetchers: dict[str, Callable[[int], None] | None], schedule: GcSchedule, clock: GcClock) -> None:
    """The rounds, rows alternating; each row's times, peak memory, allocator counts and collector time."""
    for r in range(args.rounds):
        for row in (live if r % 2 == 0 else live[::-1]):
            s0 = args.warmup + r * args.steps
            if device.type == "cuda":
                others = torch.cuda.memory_allocated(device) - row.resident
                torch.cuda.reset_peak_memory_stats(device)
                before = allocator_counts(device)
            clock.take()
            row.times.append([timed(row, s, device, prefetchers[row.name], after=schedule.after_step)
                              for s in range(s0, s0 + args.steps)])
            ms, collections = clock.take()
            row.gc["ms"] = row.gc.get("ms", 0.0) + ms
            row.gc["collections"] = [a + b for a, b in zip(row.gc.get("collections", [0, 0, 0]), collections,
                                                           strict=True)]
            if device.type == "cuda":
                row.peak = max(row.peak, torch.cuda.max_memory_allocated(device) - others)
                after = allocator_counts(device)
                for k in ALLOCATOR_COUNTS:
                    row.allocator[k] = row.allocator.get(k, 0) + after[k] - before[k]
                row.allocator["reserved_peak"] = max(row.allocator.get("reserved_peak", 0),
                                                     torch.cuda.max_memory_reserved(device))
        progress(f"round {r + 1}/{args.rounds} done")


def profile_row(row: Row, steps: range, device: torch.device, prefetch: Callable[[int], None] | None,
                after: Callable[[int], None] | None = None) -> None:
    """Where the row's step time goes over ``steps``: by kind and top kernels (``train/profiling.py``, the same
    summary ``train.profile_steps`` writes for a real run)."""
    from torch.profiler import ProfilerActivity, profile

    from meshtrain.train.profiling import device_spans, gaps_line, idle_gaps, kernel_times, step_windows, summary

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        wall = sum(timed(row, s, device, prefetch, mark=True, after=after) for s in steps)
    cuda = device.type == "cuda"
    times = kernel_times(prof, cuda)
    n = len(steps)
    row.kernels = sorted(((name, us / 1e3 / n, calls // n) for name, us, calls in times), key=lambda k: -k[1])
    print(f"\nprofile of {row.name}: " + summary(times, n, "device" if cuda else "CPU", wall))
    if cuda:
        idle = idle_gaps(device_spans(prof), step_windows(prof), top=5)
        row.idle = {"ms_per_step": idle[0], "before_first_kernel_ms": idle[1], "largest": idle[2]}
        print(gaps_line(*idle))


def write_json(path: str, args: argparse.Namespace, rows: dict[str, Row]) -> None:
    import json

    out = {"args": vars(args), "torch": torch.__version__,
           "inductor_env": INDUCTOR_ENV, "inductor_settings": inductor_settings(),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.dry_run_cpu else "cpu",
           "rows": {n: {"losses": r.losses, "times": r.times, "peak": r.peak, "note": r.note,
                        "kernels_ms_per_step": r.kernels, "allocator": r.allocator, "idle": r.idle,
                        "gc": r.gc}
                    for n, r in rows.items()}}
    tmp = f"{path}.tmp"  # renamed into place whole: never a half-written file at PATH
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, path)


def report(args: argparse.Namespace, cfg, device: torch.device, rows: dict[str, Row], overrides: list[str]) -> None:
    """The table: tokens/s (median of per-round medians, min-max), MFU, peak memory; then ours/HF ratios."""
    import transformers

    from meshtrain.parallel.parallelize import DTYPES
    from meshtrain.plan.flops import flops_per_token, mfu, param_count
    from meshtrain.plan.hardware import datasheet_chip, peak_flops

    tokens = args.batch * args.seq
    fpt = flops_per_token(cfg.model, args.seq)
    dtype = DTYPES[args.dtype]
    peak = peak_flops(device, dtype)
    if device.type == "cuda":
        gpu, chip = torch.cuda.get_device_name(device), datasheet_chip(device, dtype)
        where = f"{gpu} ({chip.name + ', datasheet' if chip else 'measured matmul'} peak {peak / 1e12:.0f} TFLOP/s " \
                f"{args.dtype})"
    else:
        where = f"CPU (dry run; measured matmul peak {peak / 1e9:.1f} GFLOP/s {args.dtype})"
    n = param_count(cfg.model)
    print(f"\n{where}; torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"model: {n.total / 1e6:.1f}M parameters (d_model {cfg.model.d_model}, {cfg.model.n_layers} layers, "
          f"{cfg.model.n_heads}/{cfg.model.kv_heads} heads, hidden {cfg.model.hidden_dim}, vocab "
          f"{cfg.model.vocab_size}), {args.batch} x {args.seq} tokens/step, {fpt:.4g} FLOP/token "
          f"(plan/flops.py); {args.warmup} warm-up + {args.steps} timed steps x {args.rounds} rounds")
    print(f"ours = meshtrain train {' '.join(overrides)}")
    chosen = [f"--rope {args.rope}"] * (args.rope != "ours") + [f"--sdpa {args.sdpa}"] * (args.sdpa != "auto") \
        + [f"--blas {args.blas}"] * (args.blas != "default")
    inductor = [f"{k}={v}" for k, v in INDUCTOR_ENV.items()]
    held = ", ".join(f"{k}={v}" for k, v in inductor_settings().items())
    print(f"kernel experiments: {', '.join(chosen + inductor) or 'none'} (Inductor holds {held})\n")
    print("| row | tokens/s (median) | per-round min-max | MFU | peak memory (GiB) | step (ms) |")
    print("|---|---|---|---|---|---|")
    medians: dict[str, list[float]] = {}
    for name in ROWS:
        row = rows[name]
        if not row.times:
            print(f"| {name} | {row.note or 'no timed steps'} | | | | |")
            continue
        medians[name] = [statistics.median(ts) for ts in row.times]
        tps = [tokens / m for m in medians[name]]
        mid = statistics.median(tps)
        mem = f"{row.peak / 2**30:.2f}" if device.type == "cuda" else "n/a (CPU)"
        print(f"| {name} | {mid:,.0f} | {min(tps):,.0f}-{max(tps):,.0f} | {mfu(mid, cfg.model, args.seq, peak):.1%} "
              f"| {mem} | {statistics.median(medians[name]) * 1e3:.1f} |")
    said = [f"allocator over {name}'s timed steps: {a['num_alloc_retries']} cudaMalloc retries (each frees the "
            f"cache and synchronises), {a['num_sync_all_streams']} syncs of all streams, {a['num_device_alloc']} "
            f"device allocations, {a['num_device_free']} frees; the process's peak reserved "
            f"{a['reserved_peak'] / 2**30:.2f} GiB" for name in ROWS if (a := rows[name].allocator)]  # CUDA only
    said += [f"Python's garbage collector over {name}'s timed steps: {g['ms']:.1f} ms in "
             f"{'/'.join(map(str, g['collections']))} collections of generations 0/1/2"
             for name in ROWS if (g := rows[name].gc)]
    if said:
        print("\n" + "\n".join(said))
    print("\n| ours / HF (step time, lower is better) | median ratio | per-round min-max |")
    print("|---|---|---|")
    for ours, theirs in (("ours eager", "HF eager"), ("ours compiled", "HF compiled"), ("ours compiled", "HF eager")):
        if ours in medians and theirs in medians:
            ratios = [a / b for a, b in zip(medians[ours], medians[theirs], strict=True)]
            print(f"| {ours} / {theirs} | {statistics.median(ratios):.3f} | {min(ratios):.3f}-{max(ratios):.3f} |")
        else:
            print(f"| {ours} / {theirs} | n/a ({ours if ours not in medians else theirs} did not run) | |")


def check_same_run(args: argparse.Namespace, rows: dict[str, Row]) -> int:
    """Every row's losses against the reference's (ours eager, or ours compiled without it: same weights, same
    batches; tolerances in the module docstring); returns the exit code."""
    first_tol, later_tol = TOLERANCE[args.dtype]
    ref = rows[args.reference].losses
    checked = len(ref) if args.dtype == "fp32" else min(len(ref), BF16_CHECKED_STEPS)
    last = slice(args.warmup + (args.rounds - 1) * args.steps, args.warmup + args.rounds * args.steps)
    every = max(1, len(ref) // 10)
    print(f"\nlosses (every {every} steps of {len(ref)}):")
    for name in ROWS:
        if rows[name].losses:
            print(f"  {name:>13}: {' '.join(f'{x:.4f}' for x in rows[name].losses[::every])}")
    print(f"\nsame run: first-step loss {ref[0]:.4f} (ln vocab = {math.log(args.vocab):.4f}); each row's relative "
          f"difference to {args.reference}, first step (tolerance {first_tol:g}) and largest over steps "
          f"0-{checked - 1} (tolerance {later_tol:g}), {args.dtype}" + ("" if checked == len(ref) else
          f"; reported, not checked: the largest over all {len(ref)} steps and the last round's mean "
          f"(steps {last.start}-{last.stop - 1})") + ":")
    bad = []
    for name in ROWS:
        losses = rows[name].losses
        if name == args.reference or rows[name].step is None or not losses:
            continue
        rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref, strict=True)]
        worst = max(rel[:checked])
        ok = rel[0] <= first_tol and worst <= later_tol
        line = f"  {name}: first {rel[0]:.2e}, largest {worst:.2e} (step {rel.index(worst)})"
        if checked < len(ref):
            mine, theirs = statistics.fmean(losses[last]), statistics.fmean(ref[last])
            line += (f"; all steps {max(rel):.2e} (step {rel.index(max(rel))}), last round "
                     f"{abs(mine - theirs) / abs(theirs):.2e} ({mine:.4f} vs {theirs:.4f})")
        print(f"{line} {'ok' if ok else 'NOT THE SAME RUN'}")
        bad += [] if ok else [name]
    if bad:
        print(f"error: {', '.join(bad)} did not compute the same run as {args.reference}: the timings above do not "
              f"compare like with like.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except torch.cuda.OutOfMemoryError:
        # Every row stays resident (weights, AdamW state) so rounds can alternate: four ~1B rows and one row's
        # activations must fit together.
        print("gpu_single.py: out of GPU memory with every asked row resident: run fewer rows at once (e.g. --rows "
              "'ours eager,HF eager', then --rows 'ours eager,ours compiled,HF compiled') or a smaller --batch.",
              file=sys.stderr)
        sys.exit(3)
