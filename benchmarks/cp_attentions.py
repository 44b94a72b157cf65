"""The three context-parallel attentions against each other on cp gloo ranks: ring, all-gather (Llama 3's) and
Ulysses (all-to-all; only where each rank's kv heads split over cp).

Same model, data and seed; every one runs the whole training step through the Trainer (zigzag layout, synthetic
data, AdamW, gradient sync over cp). In each round the trainers' steps are interleaved, the order reversed every
step (ring, allgather, ulysses, ulysses, allgather, ring, ...), so drift on a shared machine hits all alike; the
reported ratios are each attention's median step time (the slowest rank's) over the ring's, with the min-max of
the per-round ratios. It also reports what each rank moves on the ``cp`` axis per step (comm.METER payload bytes
per op, and the bytes it sends: ``wire_bytes``), the share of the step spent waiting on cp communication, and that
all of them computed the same run (the losses of the same steps within 1e-5).

    python benchmarks/cp_attentions.py [--cps 2,4] [--seq 2048] [--steps 8] [--rounds 3]
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


def attentions_for(args, cp: int) -> list[str]:
    """Ring and all-gather always; Ulysses where each rank's query and kv heads split over ``cp``."""
    return ["ring", "allgather"] + (["ulysses"] if args.heads % cp == 0 and args.kv_heads % cp == 0 else [])


def _round(args, cp: int) -> dict[str, tuple[list[float], dict, list[float], list[float]]]:
    """The trainers side by side, their steps interleaved (the order reversed every step), so load on the shared
    machine hits all alike: per attention (step seconds, the last step's cp meter, cp wait shares, losses)."""
    names = attentions_for(args, cp)
    trainers = {a: _trainer(args, cp, a) for a in names}
    out = {a: ([], {}, [], []) for a in trainers}
    for step in range(args.steps):
        for attention in (names if step % 2 == 0 else names[::-1]):
            times, snap, waits, losses = out[attention]
            comm.METER.reset()
            t0 = time.perf_counter()
            rec = trainers[attention].train_step(step)
            elapsed = time.perf_counter() - t0
            cp_stats = comm.METER.snapshot().get("cp", {})
            losses.append(float(rec["loss"]))
            if step >= args.warmup:
                times.append(elapsed)
                waits.append(sum(v["seconds"] for v in cp_stats.values()) / elapsed)
            snap.clear()
            snap.update(cp_stats)
    return out


def _worker(rank, world, args):
    torch.manual_seed(0)
    out = {a: [] for a in attentions_for(args, world)}
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
    print("| cp | attention | median (ms) | over ring | per-round min-max | cp MiB/rank/step sent (payload) | "
          "cp wait share |")
    print("|---|---|---|---|---|---|---|")
    for cp in (int(c) for c in args.cps.split(",")):
        results = spawn(_worker, cp, args=(args,), timeout=3000)
        n = args.steps - args.warmup
        names = attentions_for(args, cp)
        med = {}
        for attention in names:
            med[attention] = [statistics.median(max(res[attention][r][0][i] for res in results) for i in range(n))
                              for r in range(args.rounds)]
        for attention in names:  # the same run: every round's losses equal the ring's
            for r in range(args.rounds):
                ring_l, got = results[0]["ring"][r][3], results[0][attention][r][3]
                if any(abs(a - b) > 1e-5 * abs(b) for a, b in zip(got, ring_l, strict=True)):
                    raise SystemExit(f"cp={cp}: {attention}'s losses {got} differ from the ring's {ring_l}")
        for attention in names:
            per_round = [a / b for a, b in zip(med[attention], med["ring"], strict=True)]
            snap = results[0][attention][-1][1]
            ops = ", ".join(f"{op} {_mib(v['bytes'])}" for op, v in sorted(snap.items()))
            sent = sum(v["wire_bytes"] for v in snap.values())
            wait = statistics.median(w for res in results for rnd in res[attention] for w in rnd[2])
            mid = statistics.median(med[attention])
            print(f"| {cp} | {attention} | {mid * 1e3:.1f} | {mid / statistics.median(med['ring']):.3f} | "
                  f"{min(per_round):.3f}-{max(per_round):.3f} | {_mib(sent)} ({ops}) | {wait:.0%} |")
    print("\nevery attention computed the ring's run (each step's loss within 1e-5 relative, every round)")


if __name__ == "__main__":
    main()
