"""The optimizer's part of a step: the gradient clip and AdamW, three ways, on one device, same gradients.

- ``foreach, clip pass``: ``clip_grad_norm_(foreach=True)`` then ``AdamW(foreach=True)``: what the trainer ran on
  CPU until the clip moved into the optimizer (and on CUDA with a fused AdamW: the next row).
- ``fused, clip pass``: ``clip_grad_norm_(foreach=True)`` then ``AdamW(fused=True)``: a competent torch user's
  step, the reference of the ratios.
- ``fused, clip inside`` (meshtrain's step, ``train/optim.optimizer_step``): the same norm, then ``AdamW(fused=True)``
  told to divide each gradient by ``clip_divisor(norm)`` as it reads it and to skip the step on the device if the
  norm is not finite: no separate pass over the gradients and no host read.

Each step first writes the same fixed gradients into every side's parameters (untimed; their norm is far above
``--clip``, so the clip acts), then times the clip and the step on this thread's clock (``time.thread_time``; on
CUDA, wall time between device syncs). Rounds rotate the three sides' order; a round runs ``--steps`` timed steps
of each side after ``--warmup``. Reported per run: each side's median over rounds of its per-round median, the
ratios to the reference, and the min-max of the per-round ratios; ``--runs`` fresh processes give the spread over
independent runs. The sides must have trained the same parameters (``FIRST_RTOL`` after one untimed step,
``RUN_RTOL`` after the run), or it fails.

    python benchmarks/optimizer_step.py [--config configs/small.yaml] [--runs 3] [--rounds 6] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

# The sides' parameters, relative to the reference's largest entry: after one step (the same computation up to
# rounding: foreach and fused AdamW, and a multiply by the clip or a divide by its inverse, round differently), and
# after the whole run, where the roundings compound over hundreds of AdamW steps on the same gradients.
FIRST_RTOL, RUN_RTOL = 1e-6, 1e-4
SIDES = ("foreach, clip pass", "fused, clip pass", "fused, clip inside")
REFERENCE = "fused, clip pass"


def _side(name: str, model: torch.nn.Module, cfg, clip: float) -> Callable[[], None]:
    """One side's clip-and-step over ``model``'s parameters (their ``.grad`` already written)."""
    from meshtrain.parallel.grad_sync import grad_norm_squared
    from meshtrain.train.optim import adamw_groups, clip_divisor, model_params, non_finite, optimizer_step

    params = [p for p in model.parameters()]
    groups = adamw_groups(model_params(model), cfg.weight_decay)
    fused = name.startswith("fused")
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused,
                            foreach=not fused)
    if name.endswith("clip inside"):
        def step() -> None:
            norm = grad_norm_squared([p.grad for p in params]).sqrt()  # the trainer's norm
            optimizer_step(opt, clip_divisor(norm, clip), non_finite(norm))
    else:
        def step() -> None:
            torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
            opt.step()
    return step


def load_config_vocab(path: str) -> int:
    """The vocabulary size ``path`` sets (0 where the tokenizer is to decide it)."""
    import yaml

    return int(((yaml.safe_load(Path(path).read_text()) or {}).get("model") or {}).get("vocab_size") or 0)


def one_run(args) -> dict:
    from meshtrain.config import load_config
    from meshtrain.model.llama import build_model

    torch.set_num_threads(args.threads)
    # The config's model; a vocabulary the trainer would take from the tokenizer is the byte-level one (257).
    cfg = load_config(args.config, [] if load_config_vocab(args.config) else ["model.vocab_size=257"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    models = {s: build_model(cfg.model, seed=0).to(device) for s in SIDES}
    steps = {s: _side(s, models[s], cfg.train, args.clip) for s in SIDES}
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen).to(device) for p in models[SIDES[0]].parameters()]

    def timed(side: str) -> float:
        for p, g in zip(models[side].parameters(), grads, strict=True):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
        if device.type == "cuda":
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            steps[side]()
            torch.cuda.synchronize()
            return time.perf_counter() - t0
        t0 = time.thread_time()
        steps[side]()
        return time.thread_time() - t0

    def worst() -> dict[str, float]:
        ref = [p.detach() for p in models[REFERENCE].parameters()]
        scale = max(float(p.abs().max()) for p in ref)
        return {s: max(float((p.detach() - q).abs().max()) for p, q in zip(models[s].parameters(), ref, strict=True))
                / scale for s in SIDES}

    for side in SIDES:
        timed(side)
    first = worst()
    for side in SIDES:
        for _ in range(args.warmup):
            timed(side)
    per_round: dict[str, list[float]] = {s: [] for s in SIDES}
    for r in range(args.rounds):
        for side in SIDES[r % 3:] + SIDES[:r % 3]:  # rotate who goes first
            per_round[side].append(statistics.median(timed(side) for _ in range(args.steps)))
    return {"median_ms": {s: 1e3 * statistics.median(v) for s, v in per_round.items()},
            "ratios": {s: [a / b for a, b in zip(per_round[s], per_round[REFERENCE], strict=True)] for s in SIDES},
            "first_rel": first, "run_rel": worst(), "params": sum(p.numel() for p in models[REFERENCE].parameters()),
            "device": str(device)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/small.yaml", help="the model (and AdamW settings) to step")
    ap.add_argument("--runs", type=int, default=3, help="independent runs, each in a fresh process")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per side per round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: as each of make train's 2 ranks)")
    ap.add_argument("--one-run", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if min(args.runs, args.rounds, args.steps, args.threads) < 1 or args.warmup < 0 or args.clip <= 0:
        sys.exit("optimizer_step.py: --runs, --rounds, --steps and --threads must be >= 1, --warmup >= 0, --clip > 0")
    if not Path(args.config).is_file():
        sys.exit(f"optimizer_step.py: --config {args.config} is not a file: give a YAML config "
                 f"(configs/small.yaml)")
    if args.one_run:
        print(json.dumps(one_run(args)))
        return
    runs = []
    for _ in range(args.runs):
        out = subprocess.run([sys.executable, __file__, "--one-run", *sys.argv[1:]], capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "optimizer_step.py: a run failed")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first = runs[0]
    print(f"{args.config}: {first['params'] / 1e6:.2f}M parameters on {first['device']}, {args.threads} thread(s); "
          f"{args.runs} runs x {args.rounds} rounds x {args.steps} steps per side, clip {args.clip}")
    print(f"| side | ms per step (each run) | / {REFERENCE} (median per run) | per-round min-max |")
    print("|---|---|---|---|")
    for s in SIDES:
        ms = ", ".join(f"{r['median_ms'][s]:.2f}" for r in runs)
        med = ", ".join(f"{statistics.median(r['ratios'][s]):.3f}" for r in runs)
        lo = min(min(r["ratios"][s]) for r in runs)
        hi = max(max(r["ratios"][s]) for r in runs)
        print(f"| {s} | {ms} | {med} | {lo:.3f}-{hi:.3f} |")
    first = max(max(r["first_rel"].values()) for r in runs)
    whole = max(max(r["run_rel"].values()) for r in runs)
    if first > FIRST_RTOL or whole > RUN_RTOL:
        sys.exit(f"the sides trained different parameters ({first:.2e} after one step, {whole:.2e} after the run, of "
                 f"the largest entry; bounds {FIRST_RTOL}, {RUN_RTOL}): not the same run")
    print(f"same run: every side's parameters within {first:.1e} of the reference's largest entry after one step, "
          f"{whole:.1e} after the run")


if __name__ == "__main__":
    main()
