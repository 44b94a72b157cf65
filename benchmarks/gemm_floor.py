"""The floor under a training step's matmul time: each matmul of the ~1B model's step timed alone on the GPU.

    PYTHONPATH=. python benchmarks/gemm_floor.py --batch 32                      # one CUDA device, ~1 minute
    PYTHONPATH=. python benchmarks/gemm_floor.py --batch 32 --step-json b32.json # and the step at that floor
    PYTHONPATH=. python benchmarks/gemm_floor.py --dry-run-cpu                   # tiny shapes on CPU: checks it

Why: issue 14 asks 55% MFU of the trainer on one GPU, and the H200's profile (docs/benchmarks.md) has the step
matmul-bound: 441 of 640 ms at batch 32 are cuBLAS's matmuls, at ~702 TFLOP/s against the ~790 a large square
product reaches on the card. Whether the gap is ours (a layout, a cast, a transpose that makes cuBLAS pick a slow
kernel) or the shapes' own (N = 512 for k and v, K = 65,536 tokens for the weights' gradients) is what this
script measures: every matmul the step runs, in the layout the step runs it (``F.linear``'s ``x @ W^T`` forward;
the input's gradient ``dy @ W``; the weight's ``dy^T @ x``), bf16 on random data, alone, back to back between two
CUDA events. Their sum over the step (16 blocks and the head) is the time cuBLAS needs for the step's matmuls with
nothing else on the card: the step's matmuls cannot run faster than that without other kernels.

Printed: one row per matmul (shape, ms per step, TFLOP/s), the total against the same FLOPs at the square
product's rate, and the same for the form with q, k and v fused into one matmul (Megatron's fused QKV; not what
the model runs). With ``--step-json`` (``gpu_single.py --profile N --json``'s output), the step measured there
(its median step and its profile's matmul time by ``train/profiling.kind_of``) with its matmuls at this floor, and
the MFU that step would have: the bound on MFU from the matmuls alone.

Rounds alternate the order of the forms and of each layer's three products, so a drift of the card over the run
(it warms) touches every form alike. (Until 2026-11-28 the forms ran one after the other: the H200's figures at
072011e in docs/benchmarks.md show a 1-4% drift between forms on the layers they share.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
from harness import one_device  # benchmarks/, beside this script

from meshtrain.config import ModelConfig
from meshtrain.plan.flops import flops_per_token
from meshtrain.plan.hardware import peak_flops
from meshtrain.train.profiling import kind_of

NO_CUDA = ("gemm_floor.py needs a CUDA device; none is visible: run it on a GPU machine, or pass --dry-run-cpu to "
           "check the script on tiny shapes on CPU.")


def linears(cfg: ModelConfig, fused_qkv: bool) -> list[tuple[str, int, int, int]]:
    """(name, out features, in features, how many in the step) for every linear layer of a dense Llama."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    attn = [("wqkv", q + 2 * kv, cfg.d_model)] if fused_qkv else \
        [("wq", q, cfg.d_model), ("wk", kv, cfg.d_model), ("wv", kv, cfg.d_model)]
    block = [*attn, ("wo", cfg.d_model, q), ("w1 gate", cfg.hidden_dim, cfg.d_model),
             ("w3 up", cfg.hidden_dim, cfg.d_model), ("w2 down", cfg.d_model, cfg.hidden_dim)]
    return [(name, n, k, cfg.n_layers) for name, n, k in block] + [("head", cfg.vocab_size, cfg.d_model, 1)]


def products(tokens: int, n: int, k: int, device: torch.device):
    """The three matmuls of one linear layer [n, k] over ``tokens`` inputs, as a training step runs them: name ->
    (a function of no arguments, its FLOPs)."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g)
    dy = torch.randn(tokens, n, device=device, dtype=torch.bfloat16, generator=g)
    flops = 2 * tokens * n * k
    return dict(zip(PRODUCTS, ((lambda: torch.mm(x, w.t()), flops), (lambda: torch.mm(dy, w), flops),
                               (lambda: torch.mm(dy.t(), x), flops)), strict=True))


PRODUCTS = ("forward x W^T", "input grad dy W", "weight grad dy^T x")


def timed_ms(fn, iters: int, device: torch.device) -> float:
    """ms per call over ``iters`` back-to-back calls."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / iters
    import time
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


Form = tuple[str, bool, str | None]  # (title, q, k and v fused, BLAS library or None for torch's default)
Row = tuple[str, str, int, int, int, float, float]  # (layer, matmul, n, k, per step, median ms per call, FLOPs)


def measure(cfg: ModelConfig, tokens: int, forms: list[Form], rounds: int, iters: int,
            device: torch.device) -> dict[str, list[Row]]:
    """Every matmul of one step in each form: rounds alternate the order of the forms (a drift of the card over the
    run then touches each alike) and of each layer's three products; one layer's tensors on the device at a time."""
    default = torch.backends.cuda.preferred_blas_library()
    times: dict[tuple[str, str, str], list[float]] = {}
    flops: dict[tuple[str, str, str], float] = {}
    for r in range(rounds):
        for title, fused, library in (forms if r % 2 == 0 else forms[::-1]):
            if library is not None:
                torch.backends.cuda.preferred_blas_library(library)
            for name, n, k, _ in linears(cfg, fused):
                fns = products(tokens, n, k, device)
                for fn, _ in fns.values():
                    fn()  # cuBLAS's first call picks and loads its kernel
                for m in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                    times.setdefault((title, name, m), []).append(timed_ms(fns[m][0], iters, device))
                    flops[title, name, m] = fns[m][1]
                del fns
            torch.backends.cuda.preferred_blas_library(default)
    return {title: [(name, m, n, k, count, statistics.median(times[title, name, m]), flops[title, name, m])
                    for name, n, k, count in linears(cfg, fused) for m in PRODUCTS]
            for title, fused, _ in forms}


def square_rate(size: int, rounds: int, iters: int, device: torch.device) -> float:
    """FLOP/s of a square bf16 product of ``size``: the card's matmul rate at its best shape, on random data."""
    g = torch.Generator(device=device).manual_seed(1)
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
    torch.mm(a, b)
    ms = statistics.median(timed_ms(lambda: torch.mm(a, b), iters, device) for _ in range(rounds))
    return 2 * size ** 3 / (ms / 1e3)


def measured_step(path: str, row: str, batch: int, seq: int) -> tuple[float, float]:
    """From ``gpu_single.py --json``: the row's median step (ms) and its profile's matmul ms per step."""
    with open(path) as f:
        run = json.load(f)
    rows = run["rows"]
    if row not in rows or not rows[row]["times"] or not rows[row]["kernels_ms_per_step"]:
        raise SystemExit(f"gemm_floor.py: --step-json {path} has no timed, profiled row {row!r}; run gpu_single.py "
                         f"with --profile 2 and that row, or name another with --step-row")
    if (run["args"]["batch"], run["args"]["seq"]) != (batch, seq):
        raise SystemExit(f"gemm_floor.py: --step-json {path} ran batch {run['args']['batch']} x seq "
                         f"{run['args']['seq']}; pass --batch and --seq to match it")
    step = statistics.median(statistics.median(t) for t in rows[row]["times"]) * 1e3
    matmul = sum(ms for name, ms, _ in rows[row]["kernels_ms_per_step"] if kind_of(name) == "matmul")
    return step, matmul


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run-cpu", action="store_true", help="tiny shapes on CPU: checks the script, no figures")
    ap.add_argument("--batch", type=int, help="sequences per step (default 32; dry run 2)")
    ap.add_argument("--seq", type=int, help="tokens per sequence (default 2048; dry run 64)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per matmul (default 5)")
    ap.add_argument("--iters", type=int, default=10, help="calls per timing (default 10)")
    ap.add_argument("--step-json", metavar="PATH", help="gpu_single.py --profile's JSON: the step at this floor")
    ap.add_argument("--step-row", default="ours compiled", help="that JSON's row (default ours compiled)")
    args = ap.parse_args(argv)
    gpu = not args.dry_run_cpu
    args.batch = args.batch or (32 if gpu else 2)
    args.seq = args.seq or (2048 if gpu else 64)
    for flag in ("batch", "seq", "rounds", "iters"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be at least 1")
    if args.step_json and not os.path.isfile(args.step_json):
        ap.error(f"--step-json {args.step_json}: no such file; pass gpu_single.py --json's output, or leave it out")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = one_device(args.dry_run_cpu, NO_CUDA)
    if device is None:
        return 2
    # gpu_single.py's ~1B Llama (Llama 3.2 1B's shape at Llama 2's vocabulary); a tiny one on the dry run
    shape = dict(d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, multiple_of=256, vocab_size=32000) \
        if device.type == "cuda" else dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32,
                                           vocab_size=512)
    cfg = ModelConfig(**shape, max_seq_len=args.seq)
    tokens = args.batch * args.seq
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run: no figures)"
    square = 8192 if device.type == "cuda" else 256
    best = square_rate(square, args.rounds, args.iters, device)
    print(f"{where}; torch {torch.__version__}; {tokens:,} tokens ({args.batch} x {args.seq}), d_model "
          f"{cfg.d_model}, {cfg.n_layers} blocks, {cfg.n_heads}/{cfg.kv_heads} heads, hidden {cfg.hidden_dim}, vocab "
          f"{cfg.vocab_size}; bf16, random data; {args.rounds} rounds x {args.iters} calls")
    print(f"square {square}^3 product: {best / 1e12:.1f} TFLOP/s (the card's best shape)")
    # three forms: as the model runs (under torch's default BLAS library), the same under the other library
    # (cuBLAS or cuBLASLt: a setting, torch.backends.cuda.preferred_blas_library), and with q, k and v fused
    default = torch.backends.cuda.preferred_blas_library()
    other = "cublaslt" if default == torch._C._BlasBackend.Cublas else "cublas"
    forms = [("as the model runs", False, None), (f"as the model runs, under {other}", False, other),
             ("q, k and v fused into one matmul (not what the model runs)", True, None)]
    if device.type != "cuda":  # the CPU's matmuls use neither library
        del forms[1]
    totals = {}
    for (title, _, library), (_, rows) in zip(forms, measure(cfg, tokens, forms, args.rounds, args.iters,
                                                             device).items(), strict=True):
        ms = sum(r[5] * r[4] for r in rows)
        flops = sum(r[6] * r[4] for r in rows)
        totals[title] = ms
        print(f"\n{title} (BLAS {library or str(default).split('.')[-1]}):")
        print("| layer | matmul | [n, k] | per step | ms per call | ms per step | TFLOP/s |")
        print("|---|---|---|---|---|---|---|")
        for name, m, n, k, count, t, f in rows:
            print(f"| {name} | {m} | [{n}, {k}] | {count} | {t:.3f} | {t * count:.2f} | {f / t / 1e9:.0f} |")
        print(f"step's matmuls alone: {ms:.1f} ms for {flops:.3e} FLOPs, {flops / ms / 1e9:.0f} TFLOP/s; at the "
              f"square product's rate {flops / best * 1e3:.1f} ms")
    peak = peak_flops(device, torch.bfloat16)
    fpt = flops_per_token(cfg, args.seq)
    if args.step_json:
        step, matmul = measured_step(args.step_json, args.step_row, args.batch, args.seq)
        print(f"\n{args.step_row} step, measured: {step:.1f} ms, MFU {tokens * fpt / (step / 1e3) / peak:.1%} (its "
              f"profile's matmuls {matmul:.1f} ms)")
        for title, ms in totals.items():
            s = step - matmul + ms
            print(f"  with its matmuls at the floor {title}: {s:.1f} ms, MFU {tokens * fpt / (s / 1e3) / peak:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
