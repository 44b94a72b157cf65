"""Where DP's last ~1% against DDP lives: the main-thread CPU that gradient synchronisation adds to backward.

``dp_vs_torch.py`` times whole steps of 4 ranks sharing 2 cores; its ratio moves by about ±1.5% from one
process group to the next, as much as the difference it looks for. This script measures the one phase where
the two data-parallel implementations differ, with far less noise: on 2 ranks (a core each), the main thread's
CPU time (``time.thread_time``) of

- **bare**: ``loss.backward()`` of the plain model, no hooks and no communication (the floor);
- **DDP**: ``loss.backward()`` through ``DistributedDataParallel`` (``gradient_as_bucket_view=True``, the same
  bucket size): its C++ reducer copies each gradient into its bucket, launches each bucket's all-reduce and
  waits for them all at the end of backward;
- **ours**: ``loss.backward()`` and ``finish_grads()`` of ``DataParallel``: the same copies, launches and waits,
  from Python gradient hooks through the comm module (meter, log and timed wait).

The model, data, seed and bucket size are ``dp_vs_torch.py``'s, so both synced sides build the same six buckets.
The three sides rotate (and reverse) from round to round, and each side's first step of each round is a warm-up.
Both synced sides must compute the same gradients: the script checks ours against DDP's (whose loss is scaled by
the world size, as in ``dp_vs_torch.py``) on every rank after the first step, to 1e-5 relative.

    python benchmarks/dp_backward_cost.py [--rounds 8] [--runs 2] [--steps 20] [--world 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from dp_vs_torch import batches_for, ddp_baseline, model_for
from harness import run_independent, world_group

from meshtrain import comm
from meshtrain.config import ParallelConfig
from meshtrain.mesh import Mesh
from meshtrain.model.llama import cross_entropy_sum
from meshtrain.parallel.parallelize import data_parallel

SIDES = ("bare", "ddp", "ours")


def _side(args, kind: str, rank: int, world: int) -> tuple[list[float], torch.Tensor]:
    """(main-thread CPU seconds of each timed backward, the flat gradient of the first step)."""
    device = torch.device("cpu")
    model = model_for(args, device)
    params = list(model.parameters())
    scale, finish = 1.0, (lambda: None)

    def zero_grad() -> None:  # what ``optimizer.zero_grad()`` does for DDP and the bare model
        for p in params:
            p.grad = None

    if kind == "ddp":
        forward = ddp_baseline(model, args.bucket_mb)
        scale = float(world)  # DDP averages; our loss is divided by the global token count and summed
    elif kind == "ours":
        sync = data_parallel(model, Mesh(dp=world, device=device), ParallelConfig(zero=0, bucket_mb=args.bucket_mb),
                             {})
        forward, finish, zero_grad = model, sync.finish_grads, sync.zero_grad
    else:
        forward = model
    batches = batches_for(args, rank, world, device)
    cpu, first = [], None
    for i in range(args.steps):
        x, y, n = batches[i % len(batches)]
        comm.barrier(world_group())  # every rank starts the pass together
        loss = cross_entropy_sum(forward(x), y) / n * scale
        c0 = time.thread_time()
        loss.backward()
        finish()
        cpu.append(time.thread_time() - c0)
        if i == 0:
            first = torch.cat([p.grad.reshape(-1) for p in params])  # a copy, kept past zero_grad
        zero_grad()  # each side's own (ours: ``DataParallel.zero_grad``, which the trainer calls)
    return cpu[1:], first


def _worker(rank: int, world: int, args) -> dict:
    cpu: dict[str, list[list[float]]] = {k: [] for k in SIDES}
    worst = 0.0
    for r in range(args.rounds):
        turn = SIDES[r % 3:] + SIDES[:r % 3]
        grads = {}
        for kind in (turn if r % 2 == 0 else turn[::-1]):
            times, grads[kind] = _side(args, kind, rank, world)
            cpu[kind].append(times)
        worst = max(worst, float((grads["ours"] - grads["ddp"]).norm() / grads["ddp"].norm()))
    return {"cpu": cpu, "worst": worst}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="backward passes per side and round (the first untimed)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--runs", type=int, default=1, help="independent process groups (spread over runs)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--bucket-mb", type=float, default=2.0)
    args = ap.parse_args()
    if args.steps < 2 or args.rounds < 1 or args.world < 2:
        raise SystemExit("dp_backward_cost.py: needs --steps >= 2, --rounds >= 1 and --world >= 2")
    if args.d_model <= 0 or args.d_model % 8 or min(args.layers, args.seq, args.batch) < 1 or args.bucket_mb <= 0:
        raise SystemExit("dp_backward_cost.py: --d-model must be a positive multiple of 8 (the model has 8 heads), "
                         "--layers, --seq and --batch at least 1, --bucket-mb above 0")
    if torch.cuda.is_available():
        raise SystemExit("dp_backward_cost.py measures host CPU on the CPU backend; on GPUs use dp_vs_torch.py")
    runs = run_independent(_worker, args.world, args.runs, (args,))
    print(f"{args.world} ranks (cpu/gloo), d_model={args.d_model}, layers={args.layers}, seq={args.seq}, "
          f"batch/rank={args.batch}, bucket {args.bucket_mb} MB, {args.steps - 1} timed backward passes per side "
          f"and round, {args.rounds} rounds x {args.runs} runs\n")
    print("| run | bare (ms) | DDP (ms) | ours (ms) | DDP over bare | ours over bare | ours - DDP, per-round min-max |"
          " backward ours/DDP |")
    print("|---|---|---|---|---|---|---|---|")
    gaps, ratios = [], []
    for i, ranks in enumerate(runs, 1):
        worst = max(res["worst"] for res in ranks)
        if worst > 1e-5:
            raise SystemExit(f"run {i}: our gradients differ from DDP's by {worst:.2e} relative: not the same run")
        # Per round: the median over every rank's timed passes; then the median over rounds.
        per_round = {k: [statistics.median(t for res in ranks for t in res["cpu"][k][r]) * 1e3
                         for r in range(args.rounds)] for k in SIDES}
        med = {k: statistics.median(v) for k, v in per_round.items()}
        diff = [o - d for o, d in zip(per_round["ours"], per_round["ddp"], strict=True)]
        gaps.append(statistics.median(diff))
        ratios.append(med["ours"] / med["ddp"])
        print(f"| {i} | {med['bare']:.2f} | {med['ddp']:.2f} | {med['ours']:.2f} | {med['ddp'] - med['bare']:+.2f} | "
              f"{med['ours'] - med['bare']:+.2f} | {gaps[-1]:+.2f} ({min(diff):+.2f} to {max(diff):+.2f}) | "
              f"{ratios[-1]:.4f} |")
    if len(runs) > 1:
        print(f"\nours - DDP over {len(runs)} runs: median {statistics.median(gaps):+.2f} ms "
              f"({min(gaps):+.2f} to {max(gaps):+.2f}); backward ours/DDP {statistics.median(ratios):.4f}")
    print("\nours and DDP computed the same gradients (every rank, every round, within 1e-5 relative)")


if __name__ == "__main__":
    main()
