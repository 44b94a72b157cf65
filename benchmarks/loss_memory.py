"""Peak memory and time of the training loss over the logits: ours (``parallel/cross_entropy.py``) against
``F.cross_entropy`` (``model/llama.cross_entropy_sum``, what a plain PyTorch trainer writes), and inductor's
compiled cross-entropy (what ``train.compile=true`` runs at tp = 1).

Each measurement is one fresh process: it makes the logits the LM head would give ([tokens, vocab], bf16 as
under autocast, or fp32) and the targets (and, for the compiled loss, compiles it on the same shapes), resets the
process's resident peak to its resident set (Linux ``/proc/self/clear_refs``), runs the loss forward and
backward to the logits' gradient, and reports the rise of the peak over that set, per logit: what the loss adds
to the logits. Allocations this large are mapped and unmapped by glibc one by one, so the resident peak follows
the live tensors. Rounds alternate the order of the variants; each reports its median over rounds, and every
variant's loss and logits' gradient are checked against F.cross_entropy's (the same run: loss 1e-5; gradient
1e-5 in fp32, 1e-2 in bf16).

    python benchmarks/loss_memory.py [--tokens 16384] [--vocab 32000] [--dtype bf16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

VARIANTS = ("F.cross_entropy", "ours", "compiled F.cross_entropy")


def resident(field: str) -> int:
    """A size from /proc/self/status in bytes (VmRSS: now, VmHWM: the peak since the last ``reset_peak``)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def reset_peak() -> None:
    """Set this process's resident peak to its current resident set (Linux: ``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure(variant: str, tokens: int, vocab: int, dtype: str) -> dict:
    """One variant in this process: peak resident bytes the loss adds to its logits, seconds, loss, checksum of
    the logits' gradient."""
    import torch

    from meshtrain.model.llama import cross_entropy_sum
    from meshtrain.parallel.cross_entropy import lean_cross_entropy

    torch.manual_seed(0)
    torch.set_num_threads(1)  # the same kernels in every process; threads would not change the bytes
    # The LM head's output: bf16 under autocast (train.dtype=bf16), else fp32.
    logits = (torch.randn(tokens, vocab) * 2).to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    logits.requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,))
    targets[: tokens // 50] = -100
    fn = {"F.cross_entropy": cross_entropy_sum, "ours": lean_cross_entropy,
          "compiled F.cross_entropy": torch.compile(cross_entropy_sum)}[variant]
    if variant.startswith("compiled"):  # compile outside the measurement, on the same shapes
        torch.autograd.grad(fn(logits, targets), logits)
    reset_peak()
    base = resident("VmHWM")
    t0 = time.perf_counter()
    loss = fn(logits, targets)
    (grad,) = torch.autograd.grad(loss, logits)
    seconds = time.perf_counter() - t0
    peak = resident("VmHWM") - base
    return {"variant": variant, "peak_bytes": peak, "bytes_per_logit": peak / (tokens * vocab), "seconds": seconds,
            "loss": float(loss), "grad_sum": float(grad.double().abs().sum())}


def _one(variant: str, args: argparse.Namespace) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", variant, "--tokens", str(args.tokens), "--vocab",
                          str(args.vocab), "--dtype", args.dtype],
                         capture_output=True, text=True)
    if out.returncode != 0:  # one line: the child's last, e.g. a MemoryError at a size too large for this machine
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        sys.exit(f"loss_memory.py: the {variant} measurement failed (exit {out.returncode}): {last}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384, help="tokens in the microbatch (default 16384: 8 x 2048)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    ap.add_argument("--json", action="store_true", help="print the per-variant medians as one JSON line")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.tokens, args.vocab, args.dtype)))
        return []
    for flag, low in {"tokens": 1, "vocab": 2, "rounds": 1}.items():
        if getattr(args, flag) < low:
            ap.error(f"--{flag} must be at least {low}, got {getattr(args, flag)}")
    try:  # the peak is reset through /proc (Linux); say so before any measurement
        reset_peak()
        resident("VmHWM")
    except (OSError, StopIteration) as e:
        ap.error(f"this script needs Linux's /proc/self/clear_refs and VmHWM to measure a peak ({e})")
    names = args.variants.split(",")
    if any(n not in VARIANTS for n in names) or names[0] != VARIANTS[0]:
        ap.error(f"--variants: names from {', '.join(VARIANTS)}, the first {VARIANTS[0]!r} (the reference)")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            runs[n].append(_one(n, args))
    ref = runs[names[0]][0]
    rows = []
    for n in names:
        for x in runs[n]:
            assert abs(x["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), (n, x["loss"], ref["loss"])
            tol = 1e-5 if args.dtype == "fp32" else 1e-2
            assert abs(x["grad_sum"] - ref["grad_sum"]) <= tol * ref["grad_sum"], (n, x["grad_sum"], ref["grad_sum"])
        per = [x["bytes_per_logit"] for x in runs[n]]
        secs = [x["seconds"] for x in runs[n]]
        rows.append({"variant": n, "bytes_per_logit": statistics.median(per), "min": min(per), "max": max(per),
                     "seconds": statistics.median(secs), "peak_mib": statistics.median(x["peak_bytes"] for x in
                                                                                        runs[n]) / 2**20})
    eager = rows[0]
    if args.json:
        print(json.dumps(rows))
        return rows
    print(f"{args.tokens} tokens x vocab {args.vocab} ({args.tokens * args.vocab / 1e6:.0f}M logits), {args.dtype} "
          f"logits; {args.rounds} rounds, each variant in a fresh process\n")
    print("| loss | peak above the logits (MiB) | bytes per logit (min-max) | vs F.cross_entropy | seconds (fwd+bwd) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['peak_mib']:.0f} | {r['bytes_per_logit']:.2f} ({r['min']:.2f}-{r['max']:.2f}) | "
              f"{r['bytes_per_logit'] / eager['bytes_per_logit']:.2f} | {r['seconds']:.2f} |")
    print(f"\nsame run: every variant's loss within 1e-5 of F.cross_entropy's ({ref['loss']:.6g}) and its logits' "
          f"gradient within {'1e-5' if args.dtype == 'fp32' else '1e-2'} (sum of absolute values)")
    return rows


if __name__ == "__main__":
    main()
