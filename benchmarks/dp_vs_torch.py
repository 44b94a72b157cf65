"""Our data parallelism against torch's, on 4 gloo processes, same model, data and seed.

- ours DP (bucketed, overlapped all-reduce)   vs  torch DistributedDataParallel
- ours ZeRO-3 (per-block units, prefetch)     vs  torch FSDP2 ``fully_shard`` per block + root

Each pair alternates in rounds (ours, theirs, ours, theirs, ...) so drift on a shared machine hits
both; the reported ratio is ours/theirs of the median step time, with the min-max of the per-round
ratios. It also reports the share of our gradient communication that ran while backward was still
computing (async-collective start/completion timestamps against the backward interval), and with
``--trace DIR`` writes a chrome-format torch.profiler trace per rank.

    python benchmarks/dp_vs_torch.py [--steps 12] [--rounds 3] [--d-model 256] [--trace DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from meshtrain import comm
from meshtrain.config import ModelConfig, ParallelConfig, TrainConfig
from meshtrain.mesh import Mesh
from meshtrain.model.llama import build_model, cross_entropy_sum
from meshtrain.parallel.grad_sync import clip_grads, grad_norm_squared
from meshtrain.parallel.parallelize import data_parallel, shard_rows
from meshtrain.testing.spawn import spawn
from meshtrain.train.data import SyntheticDataset
from meshtrain.train.optim import build_adamw, model_params


def _batches(args, rank, world):
    data = SyntheticDataset(257)
    out = []
    for step in range(args.steps):
        x, y = data.batch(0, step, args.batch * world, args.seq)
        out.append((shard_rows(x, rank, world), shard_rows(y, rank, world), y.numel()))
    return out


def _ours(args, zero, rank, world, trace_dir):
    cfg = ModelConfig(vocab_size=257, d_model=args.d_model, n_layers=args.layers, n_heads=8, max_seq_len=args.seq)
    model = build_model(cfg, seed=0)
    mesh = Mesh(dp=world)
    sync = data_parallel(model, mesh, ParallelConfig(zero=zero, bucket_mb=args.bucket_mb), {})
    opt = build_adamw(sync.optim_params(), TrainConfig())
    times, overlap = [], []
    for i, (x, y, n) in enumerate(_batches(args, rank, world)):
        prof = _profiler(trace_dir, f"ours_zero{zero}", rank) if (trace_dir and i == args.steps - 1) else None
        t0 = time.perf_counter()
        with sync.forward_context():
            loss = cross_entropy_sum(model(x), y) / n
        b0 = time.perf_counter()
        loss.backward()
        b1 = time.perf_counter()
        handles = list(sync.handles)
        sync.finish_grads()
        handles = handles + [h for h in sync.handles if h not in handles]
        grads = sync.grads()
        norm_sq = float(grad_norm_squared(grads))
        if sync.norm_group is not None:
            norm_sq = comm.all_reduce_scalars([norm_sq], sync.norm_group)[0]
        clip_grads(grads, 1.0, torch.tensor(norm_sq).sqrt())
        opt.step()
        sync.after_step()
        sync.zero_grad()
        times.append(time.perf_counter() - t0)
        overlap.append(_overlap_share(handles, b0, b1))
        if prof is not None:
            prof.__exit__(None, None, None)
    return times[args.warmup:], overlap[args.warmup:]


def _torch(args, zero, rank, world, trace_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    cfg = ModelConfig(vocab_size=257, d_model=args.d_model, n_layers=args.layers, n_heads=8, max_seq_len=args.seq)
    model = build_model(cfg, seed=0)
    if zero == 0:
        wrapped = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    else:
        dmesh = init_device_mesh("cpu", (world,))
        for block in model.layers.values():
            fully_shard(block, mesh=dmesh)
        fully_shard(model, mesh=dmesh)
        wrapped = model
    opt = build_adamw(model_params(model), TrainConfig())
    times = []
    for i, (x, y, n) in enumerate(_batches(args, rank, world)):
        prof = _profiler(trace_dir, f"torch_zero{zero}", rank) if (trace_dir and i == args.steps - 1) else None
        t0 = time.perf_counter()
        loss = cross_entropy_sum(wrapped(x), y) / n
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        if prof is not None:
            prof.__exit__(None, None, None)
    return times[args.warmup:], []


def _overlap_share(handles: list, b0: float, b1: float) -> float:
    """Fraction of async-communication time that lay inside the backward interval [b0, b1]."""
    total = inside = 0.0
    for h in handles:
        if h.completed is None:
            continue
        total += h.completed - h.started
        inside += max(0.0, min(h.completed, b1) - max(h.started, b0))
    return inside / total if total > 0 else float("nan")


def _profiler(trace_dir, name, rank):
    import os

    from torch.profiler import ProfilerActivity, profile

    os.makedirs(trace_dir, exist_ok=True)
    p = profile(activities=[ProfilerActivity.CPU],
                on_trace_ready=lambda pr: pr.export_chrome_trace(f"{trace_dir}/{name}_rank{rank}.json"))
    p.__enter__()
    return p


def _worker(rank, world, args):
    comm.METER.timing = True
    out = {}
    for zero in (0, 3):
        rounds = []
        for r in range(args.rounds):
            trace = args.trace if r == args.rounds - 1 else None
            ours, ov = _ours(args, zero, rank, world, trace)
            theirs, _ = _torch(args, zero, rank, world, trace)
            rounds.append((ours, theirs, ov))
        out[zero] = rounds
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--bucket-mb", type=float, default=2.0)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--trace", default="", help="folder for chrome traces of the last step")
    args = ap.parse_args()
    results = spawn(_worker, args.world, args=(args,), timeout=3000)
    print(f"{args.world} gloo ranks, d_model={args.d_model}, layers={args.layers}, seq={args.seq}, "
          f"batch/rank={args.batch}, {args.steps - args.warmup} timed steps x {args.rounds} rounds\n")
    print("| ours vs torch | ours median (ms) | torch median (ms) | ratio ours/torch | per-round min-max | "
          "comm under backward |")
    print("|---|---|---|---|---|---|")
    names = {0: ("DP", "DDP"), 3: ("ZeRO-3", "FSDP2 fully_shard")}
    for zero in (0, 3):
        # A step ends when the slowest rank ends: take the max over ranks of each step's time.
        per_round = []
        ours_all, theirs_all, ov_all = [], [], []
        for r in range(args.rounds):
            ours = [max(res[zero][r][0][i] for res in results) for i in range(args.steps - args.warmup)]
            theirs = [max(res[zero][r][1][i] for res in results) for i in range(args.steps - args.warmup)]
            per_round.append(statistics.median(ours) / statistics.median(theirs))
            ours_all += ours
            theirs_all += theirs
            ov_all += [v for res in results for v in res[zero][r][2] if v == v]
        mo, mt = statistics.median(ours_all), statistics.median(theirs_all)
        a, b = names[zero]
        print(f"| {a} vs {b} | {mo * 1e3:.1f} | {mt * 1e3:.1f} | {mo / mt:.3f} | "
              f"{min(per_round):.3f}-{max(per_round):.3f} | {statistics.median(ov_all):.0%} |")


if __name__ == "__main__":
    main()
