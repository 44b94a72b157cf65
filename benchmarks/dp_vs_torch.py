"""Our data parallelism against torch's, same model, data and seed, on 4 ranks (gloo on CPU, NCCL on GPUs).

- ours DP (bucketed, overlapped all-reduce)   vs  torch ``DistributedDataParallel``
  (``gradient_as_bucket_view=True``, ``forward_sync_buffers=False``: the model's only buffers are constant
  RoPE tables; the same bucket size)
- ours ZeRO-3 (per-block units, prefetch)     vs  torch FSDP2 ``fully_shard`` per block + root

Both sides run the same step: forward, backward, global-norm clip at 1.0, fused AdamW (ours divides by the clip in
AdamW's kernel, as the trainer does; torch's side runs ``clip_grad_norm_`` as its users do). DDP and FSDP2 average
gradients over the ranks while our loss is already divided by the global token count (we sum), so torch's
loss is scaled by the world size: both then apply the same gradients, and the script asserts that both
computed the same run (first loss within 1e-5, the whole trajectory within 1e-3 relative). Rounds
alternate ours/theirs/theirs/ours (benchmarks/harness.py); a barrier precedes every timed step. It also
reports the share of our gradient communication that ran while backward was still computing (timestamped in
the untimed warm-up steps only: the completion callbacks are instrumentation training does not run), and each
side's CPU time per step on the main thread (``time.thread_time``: the host work, without the backend's
communication threads and without the time a rank waits or is descheduled; on a machine whose ranks share
cores it is far less noisy than the step time); with ``--trace DIR`` it writes a chrome-format torch.profiler
trace per rank.

    python benchmarks/dp_vs_torch.py [--runs 3] [--rounds 6] [--steps 12] [--d-model 256] [--trace DIR]
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import time

import torch
from harness import Comparison, bench_device, order, run_independent, slowest, spread_line, timed_step

from meshtrain import comm
from meshtrain.config import ModelConfig, ParallelConfig, TrainConfig
from meshtrain.mesh import Mesh
from meshtrain.model.llama import build_model, cross_entropy_sum
from meshtrain.parallel.grad_sync import grad_norm_squared
from meshtrain.parallel.parallelize import data_parallel, shard_rows
from meshtrain.train.data import SyntheticDataset
from meshtrain.train.optim import build_adamw, clip_divisor, model_params, non_finite, optimizer_step


def batches_for(args, rank, world, device):
    """This rank's rows of ``args.steps`` global batches of synthetic data, with each batch's global token count."""
    data = SyntheticDataset(257)
    out = []
    for step in range(args.steps):
        x, y = data.batch(0, step, args.batch * world, args.seq)
        out.append((shard_rows(x, rank, world).to(device), shard_rows(y, rank, world).to(device), y.numel()))
    return out


def model_for(args, device):
    """The benchmark's Llama (vocab 257, 8 heads), initialised from seed 0: the same on every rank and side."""
    cfg = ModelConfig(vocab_size=257, d_model=args.d_model, n_layers=args.layers, n_heads=8, max_seq_len=args.seq)
    return build_model(cfg, seed=0).to(device)


def ddp_baseline(model: torch.nn.Module, bucket_mb: float) -> torch.nn.Module:
    """DDP as a competent user sets it: gradients as views into its buckets, our bucket size, and no buffer sync.
    Constant RoPE tables are the model's only buffers, so nothing needs broadcasting each forward (torch 2.13 names
    that forward_sync_buffers=False and deprecates broadcast_buffers; the one broadcast at construction is untimed)."""
    from torch.nn.parallel import DistributedDataParallel

    no_sync = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(
        DistributedDataParallel.__init__).parameters else "broadcast_buffers"
    return DistributedDataParallel(model, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True, **{no_sync: False})


def _host_cpu(step):
    """(what ``step()`` returns, the CPU seconds this thread spent in it)."""
    c0 = time.thread_time()
    out = step()
    return out, time.thread_time() - c0


def _ours(args, zero, rank, world, trace_dir):
    device = bench_device()
    model = model_for(args, device)
    mesh = Mesh(dp=world, device=device)
    sync = data_parallel(model, mesh, ParallelConfig(zero=zero, bucket_mb=args.bucket_mb), {})
    opt = build_adamw(sync.optim_params(), TrainConfig())

    def step(x, y, n):
        with sync.forward_context():
            loss = cross_entropy_sum(model(x), y) / n
        b0 = time.perf_counter()
        loss.backward()
        b1 = time.perf_counter()
        handles = list(sync.handles)
        sync.finish_grads()
        handles = handles + [h for h in sync.handles if h not in handles]
        # As the trainer: the norm stays on the device, the fused AdamW divides by the clip in its kernel.
        norm_sq = grad_norm_squared(sync.grads())
        if sync.norm_group is not None:
            comm.all_reduce_metrics(norm_sq, sync.norm_group)
        norm = norm_sq.sqrt()
        optimizer_step(opt, clip_divisor(norm, 1.0), non_finite(loss.detach(), norm))
        sync.after_step()
        sync.zero_grad()
        return float(loss.detach()), _overlap_share(handles, b0, b1)

    times, losses, overlap, cpu = [], [], [], []
    for i, (x, y, n) in enumerate(batches_for(args, rank, world, device)):
        # Completion timestamps (a callback per collective on the backend's thread, a poller where gloo has no
        # future) are instrumentation training does not run: only the untimed warm-up steps after the first
        # (which rebuilds the buckets) take them, for the overlap column.
        comm.METER.timing = 0 < i < args.warmup
        prof = _profiler(trace_dir, f"ours_zero{zero}", rank) if (trace_dir and i == args.steps - 1) else None
        ((loss, ov), c), t = timed_step(lambda: _host_cpu(lambda: step(x, y, n)))  # noqa: B023 - called at once
        times.append(t)
        losses.append(loss)
        cpu.append(c)
        if comm.METER.timing:
            overlap.append(ov)
        if prof is not None:
            prof.__exit__(None, None, None)
    comm.METER.timing = False
    return times[args.warmup:], losses, overlap, cpu[args.warmup:]


def _torch(args, zero, rank, world, trace_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = bench_device()
    model = model_for(args, device)
    if zero == 0:
        wrapped = ddp_baseline(model, args.bucket_mb)
    else:
        dmesh = init_device_mesh(device.type, (world,))
        for block in model.layers.values():
            fully_shard(block, mesh=dmesh)
        fully_shard(model, mesh=dmesh)
        wrapped = model
    opt = build_adamw(model_params(model), TrainConfig())

    def step(x, y, n):
        # DDP / FSDP2 average gradients over the ranks: scale by world so the applied gradient is ours.
        loss = cross_entropy_sum(wrapped(x), y) / n * world
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach()) / world

    times, losses, cpu = [], [], []
    for i, (x, y, n) in enumerate(batches_for(args, rank, world, device)):
        prof = _profiler(trace_dir, f"torch_zero{zero}", rank) if (trace_dir and i == args.steps - 1) else None
        (loss, c), t = timed_step(lambda: _host_cpu(lambda: step(x, y, n)))  # noqa: B023 - called at once
        times.append(t)
        losses.append(loss)
        cpu.append(c)
        if prof is not None:
            prof.__exit__(None, None, None)
    return times[args.warmup:], losses, [], cpu[args.warmup:]


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
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(trace_dir, exist_ok=True)
    p = profile(activities=[ProfilerActivity.CPU],
                on_trace_ready=lambda pr: pr.export_chrome_trace(f"{trace_dir}/{name}_rank{rank}.json"))
    p.__enter__()
    return p


def _worker(rank, world, args):
    sides = {"ours": _ours, "theirs": _torch}
    out = {}
    for zero in (0, 3):
        rounds = []
        for r in range(args.rounds):
            trace = args.trace if r == args.rounds - 1 else None
            got = {side: sides[side](args, zero, rank, world, trace) for side in order(r)}
            rounds.append(got)
        out[zero] = rounds
    return out


def _same_run(name: str, ours: list[float], theirs: list[float]) -> None:
    """Both sides must have trained the same model on the same data, or the timing compares nothing."""
    if abs(ours[0] - theirs[0]) > 1e-5 * abs(theirs[0]):
        raise SystemExit(f"{name}: first losses differ ({ours[0]} vs {theirs[0]}): not the same run")
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True))
    if worst > 1e-3:
        raise SystemExit(f"{name}: loss trajectories differ by {worst:.2e} relative: not the same run")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--runs", type=int, default=1, help="independent process groups (spread over runs)")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--bucket-mb", type=float, default=2.0)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--trace", default="", help="folder for chrome traces of the last step")
    args = ap.parse_args()
    runs = run_independent(_worker, args.world, args.runs, (args,))
    names = {0: ("DP", "DDP (gradient_as_bucket_view)"), 3: ("ZeRO-3", "FSDP2 fully_shard")}
    device = "cuda/nccl" if torch.cuda.is_available() else "cpu/gloo"
    print(f"{args.world} ranks ({device}), d_model={args.d_model}, layers={args.layers}, seq={args.seq}, "
          f"batch/rank={args.batch}, bucket {args.bucket_mb} MB, {args.steps - args.warmup} timed steps after "
          f"{args.warmup} warm-up, {args.rounds} rounds x {args.runs} runs\n")
    print("| ours vs torch | ours median (ms) | torch median (ms) | ratio ours/torch | per-round min-max | "
          "comm under backward | main-thread CPU/step ours, torch (ms) |")
    print("|---|---|---|---|---|---|---|")
    for zero in (0, 3):
        ratios, lines = [], []
        for results in runs:
            rows = Comparison(names[zero][0])
            overlap, cpu_ours, cpu_theirs = [], [], []
            for r in range(args.rounds):
                for rank_res in results:
                    _same_run(f"{names[zero][0]} rank round {r}", rank_res[zero][r]["ours"][1],
                              rank_res[zero][r]["theirs"][1])
                rows.add_round(slowest([res[zero][r]["ours"][0] for res in results]),
                               slowest([res[zero][r]["theirs"][0] for res in results]))
                overlap += [v for res in results for v in res[zero][r]["ours"][2] if v == v]
                cpu_ours += [c for res in results for c in res[zero][r]["ours"][3]]
                cpu_theirs += [c for res in results for c in res[zero][r]["theirs"][3]]
            ratios.append(rows.ratio())
            mo, mt = rows.medians_ms()
            rr = rows.round_ratios()
            ov = f"{statistics.median(overlap):.0%}" if overlap else "-"
            co, ct = statistics.median(cpu_ours) * 1e3, statistics.median(cpu_theirs) * 1e3
            lines.append(f"| {names[zero][0]} vs {names[zero][1]} | {mo:.1f} | {mt:.1f} | {rows.ratio():.3f} | "
                         f"{min(rr):.3f}-{max(rr):.3f} | {ov} | {co:.1f}, {ct:.1f} ({co / ct:.3f}) |")
        print("\n".join(lines))
        if len(runs) > 1:
            print(f"| {names[zero][0]}: ratio over independent runs | | | {spread_line(ratios)} | | | |")
    print("\nboth sides computed the same run (losses checked on every rank, every round)")


if __name__ == "__main__":
    main()
