"""Ring attention against all-gather attention (Llama 3's context parallelism), on cp gloo ranks.

Same model, data and seed; both run the whole training step through the Trainer (zigzag layout,
synthetic data, AdamW, gradient sync over cp). In each round the two trainers' steps are
interleaved (ring, allgather, allgather, ring, ...) so drift on a shared machine hits both; the
reported ratio is ring/allgather of the median step time (the slowest rank's), with the min-max of
the per-round ratios. It also reports
what each rank moves on the ``cp`` axis per step (comm.METER payload bytes per op, and the bytes
it sends: ``wire_bytes``), and the share of the step spent waiting on cp communication.

    python benchmarks/cp_ring_vs_allgather.py [--cps 2,4] [--seq 2048] [--steps 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from meshtrain import comm
from meshtrain.config import load_config
from meshtrain.testing.spawn import spawn
from meshtrain.train.trainer import Trainer


def _trainer(args, cp: int, attention: str) -> Trainer:
    cfg = load_config(None, [
        "data.source=synthetic", "model.vocab_size=257", f"model.d_model={args.d_model}",
        f"model.n_layers={args.layers}", f"model.n_heads={args.heads}", f"model.n_kv_heads={args.kv_heads}",
        f"model.max_seq_len={args.seq}", f"train.seq_len={args.seq}", f"train.global_batch={args.batch}",
        f"train.steps={args.steps}", "train.progress=false", "train.tensorboard=false", "train.sample_tokens=0",
        "train.device=cpu", f"parallel.cp={cp}", f"parallel.cp_attention={attention}",
        f"parallel.cp_layout={args.layout}",
    ])
    return Trainer(cfg)


def _round(args, cp: int) -> dict[str, tuple[list[float], dict, list[float]]]:
    """Both trainers side by side, their steps interleaved (which goes first alternates), so load on
    the shared machine hits both alike."""
    trainers = {a: _trainer(args, cp, a) for a in ("ring", "allgather")}
    out = {a: ([], {}, []) for a in trainers}
    for step in range(args.steps):
        order = ("ring", "allgather") if step % 2 == 0 else ("allgather", "ring")
        for attention in order:
            times, snap, waits = out[attention]
            comm.METER.reset()
            t0 = time.perf_counter()
            trainers[attention].train_step(step)
            elapsed = time.perf_counter() - t0
            cp_stats = comm.METER.snapshot().get("cp", {})
            if step >= args.warmup:
                times.append(elapsed)
                waits.append(sum(v["seconds"] for v in cp_stats.values()) / elapsed)
            snap.clear()
            snap.update(cp_stats)
    return out


def _worker(rank, world, args):
    torch.manual_seed(0)
    out = {"ring": [], "allgather": []}
    for _ in range(args.rounds):
        res = _round(args, world)
        for attention in out:
            out[attention].append(res[attention])
    return out


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cps", default="2,4", help="comma-separated cp sizes (one spawn of cp ranks each)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--layout", default="zigzag")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"seq={args.seq}, batch={args.batch}, d_model={args.d_model}, layers={args.layers}, heads={args.heads} "
          f"(kv {args.kv_heads}), {args.layout}, fp32, {args.steps - args.warmup} timed steps after {args.warmup} "
          f"warm-up x {args.rounds} rounds\n")
    print("| cp | ring median (ms) | allgather median (ms) | ratio ring/allgather | per-round min-max | "
          "ring cp MiB/rank/step (sent) | allgather cp MiB/rank/step (sent) | cp wait share ring / allgather |")
    print("|---|---|---|---|---|---|---|---|")
    for cp in (int(c) for c in args.cps.split(",")):
        results = spawn(_worker, cp, args=(args,), timeout=3000)
        n = args.steps - args.warmup
        med, per_round, desc, wait = {}, [], {}, {}
        for attention in ("ring", "allgather"):
            steps_all = []
            for r in range(args.rounds):
                steps = [max(res[attention][r][0][i] for res in results) for i in range(n)]
                steps_all.append(statistics.median(steps))
            med[attention] = steps_all
            snap = results[0][attention][-1][1]
            ops = ", ".join(f"{op} {_mib(v['bytes'])}" for op, v in sorted(snap.items()))
            sent = sum(v["wire_bytes"] for v in snap.values())
            desc[attention] = f"{_mib(sent)} ({ops})"
            wait[attention] = statistics.median(w for res in results for rnd in res[attention] for w in rnd[2])
        per_round = [a / b for a, b in zip(med["ring"], med["allgather"], strict=True)]
        ring, ag = statistics.median(med["ring"]), statistics.median(med["allgather"])
        print(f"| {cp} | {ring * 1e3:.1f} | {ag * 1e3:.1f} | {ring / ag:.3f} | {min(per_round):.3f}-"
              f"{max(per_round):.3f} | {desc['ring']} | {desc['allgather']} | "
              f"{wait['ring']:.0%} / {wait['allgather']:.0%} |")


if __name__ == "__main__":
    main()
