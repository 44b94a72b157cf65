"""Generation with a KV cache against the recompute-everything loop, and tensor-parallel generation (issue 17).

1. **One device, cached vs recompute**: the same model and prompt, greedy; ``generate`` (KV cache: one prefill,
   then one position per step) against ``sample`` (the earlier loop: the whole context again for every token).
   Rounds alternate cached/recompute/recompute/cached/... so drift of a shared machine hits both; every round
   asserts both produce the same tokens. Reported: tokens/s of each (median over rounds), the speed-up
   cached/recompute per round (median, min-max).
2. **Tensor parallel and pipelined**: a batch of prompts through ``meshtrain.train.inference`` (each rank loads
   only its pieces) on 1 and on ``--tp`` x ``--pp`` spawned processes (gloo on CPU, alternating 1/N/N/1/...),
   asserting every rank's tokens equal one device's; reported: tokens/s (slowest rank) of each and KV cache bytes
   per rank against one device's.
3. **bf16 against fp32** (``--bf16``): the same batch on one device loaded with ``train.dtype`` bf16 and fp32
   (weights and KV cache in that dtype; alternating fp32/bf16/bf16/fp32 launches), asserting every row got its
   new tokens and that bf16 holds exactly half the parameter and KV bytes (the tokens themselves may part at a near
   tie: bf16 rounds); reported: tokens/s of each and their ratio.

    python benchmarks/generate_kv.py [--d-model 256] [--layers 4] [--prompt 32] [--tokens 128] [--rounds 5]
                                     [--tp 2] [--pp 1] [--batch 4] [--device cpu|cuda] [--bf16]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch

from meshtrain.config import Config, ModelConfig, ParallelConfig
from meshtrain.generate import generate, sample
from meshtrain.model.init import InitSource
from meshtrain.model.llama import build_model
from meshtrain.parallel.next_token import VocabSlice
from meshtrain.testing.spawn import spawn

SEED = 0


def _model_cfg(args) -> ModelConfig:
    return ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                       n_kv_heads=args.kv_heads, max_seq_len=args.prompt + args.tokens, init_std=0.2)


def _prompts(args, batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    # different lengths: the batch is left-padded to the longest (args.prompt)
    return [torch.randint(0, args.vocab, (args.prompt - 3 * i,), generator=g).tolist() for i in range(batch)]


def _timed(fn, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def cached_vs_recompute(args) -> dict:
    device = torch.device(args.device)
    model = build_model(_model_cfg(args), SEED, device).eval()
    prompt = _prompts(args, 1)[0]
    whole = VocabSlice.whole(args.vocab)
    sides = {"cached": lambda: generate(model, [prompt], args.tokens, whole).tokens[0],
             "recompute": lambda: sample(model, prompt, args.tokens, args.prompt + args.tokens, temperature=0)}
    for fn in sides.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {"cached": [], "recompute": []}
    for r in range(args.rounds):
        order = ("cached", "recompute", "recompute", "cached") if r % 2 == 0 else \
            ("recompute", "cached", "cached", "recompute")
        outs = {}
        for side in order:
            outs[side], seconds = _timed(sides[side], device)
            times[side].append(seconds)
        assert outs["cached"] == outs["recompute"], "cached and recompute generation disagree"
    # per round: the two timings of each side, median ratio of their tokens/s
    per_round = []
    for r in range(args.rounds):
        c = statistics.median(times["cached"][2 * r: 2 * r + 2])
        p = statistics.median(times["recompute"][2 * r: 2 * r + 2])
        per_round.append(p / c)
    return {"cached_tok_s": args.tokens / statistics.median(times["cached"]),
            "recompute_tok_s": args.tokens / statistics.median(times["recompute"]),
            "speedup": statistics.median(per_round), "speedup_min": min(per_round), "speedup_max": max(per_round)}


def _tp_worker(rank: int, world: int, args, rounds: int, dtype: str = "fp32", pp: int = 1) -> dict:
    from meshtrain.train.inference import load_for_generation, run_generation

    cfg = Config(model=_model_cfg(args), parallel=ParallelConfig(tp=world // pp, pp=pp))
    cfg.train.device, cfg.train.seed, cfg.train.dtype = args.device, SEED, dtype
    shapes = {n: tuple(p.shape) for n, p in build_model(cfg.model, SEED, meta=True).named_parameters()}
    gm = load_for_generation(cfg, None, source=InitSource(cfg.model, SEED, shapes))
    prompts = _prompts(args, args.batch)
    run_generation(gm, prompts, 4, 0.0, 0, 0)  # warm-up
    runs = [run_generation(gm, prompts, args.tokens, 0.0, 0, 0) for _ in range(rounds)]
    return {"tokens": runs[0].out.tokens, "seconds": [r.seconds for r in runs], "new": runs[0].new_tokens,
            "kv_bytes": runs[0].out.kv_bytes, "param_bytes": gm.param_bytes}


def tensor_parallel(args) -> dict:
    backend = "nccl" if args.device == "cuda" else "gloo"
    n = args.tp * args.pp
    secs: dict[int, list[float]] = {1: [], n: []}
    results: dict[int, list[dict]] = {}
    for r in range(args.tp_rounds):
        for world in ((1, n) if r % 2 == 0 else (n, 1)):
            ranks = spawn(_tp_worker, world, (args, 3, "fp32", args.pp if world > 1 else 1), timeout=3000,
                          backend=backend, threads=args.threads)
            results[world] = ranks
            secs[world] += [max(s) for s in zip(*(x["seconds"] for x in ranks), strict=True)]  # slowest rank
    one = results[1][0]
    for x in results[n]:
        assert x["tokens"] == one["tokens"], "parallel tokens differ from one device's"
    tok_s = {w: one["new"] / statistics.median(s) for w, s in secs.items()}
    return {"tok_s_1": tok_s[1], "tok_s_tp": tok_s[n], "kv_1": one["kv_bytes"],
            "kv_tp": [x["kv_bytes"] for x in results[n]], "param_1": one["param_bytes"],
            "param_tp": [x["param_bytes"] for x in results[n]]}


def bf16_vs_fp32(args) -> dict:
    backend = "nccl" if args.device == "cuda" else "gloo"
    secs: dict[str, list[float]] = {"fp32": [], "bf16": []}
    results: dict[str, dict] = {}
    for r in range(args.tp_rounds):
        for dtype in (("fp32", "bf16") if r % 2 == 0 else ("bf16", "fp32")):
            results[dtype] = spawn(_tp_worker, 1, (args, 3, dtype), timeout=3000, backend=backend,
                                   threads=args.threads)[0]
            secs[dtype] += results[dtype]["seconds"]
    full, half = results["fp32"], results["bf16"]
    assert half["new"] == full["new"] == args.batch * args.tokens, "a row stopped early"
    assert 2 * half["param_bytes"] == full["param_bytes"] and 2 * half["kv_bytes"] == full["kv_bytes"]
    tok_s = {d: full["new"] / statistics.median(s) for d, s in secs.items()}
    return {"fp32": tok_s["fp32"], "bf16": tok_s["bf16"], "kv": (full["kv_bytes"], half["kv_bytes"]),
            "param": (full["param_bytes"], half["param_bytes"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=32, help="tokens of the (longest) prompt")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (each rank one stage's blocks and cache)")
    ap.add_argument("--tp-rounds", type=int, default=2, help="alternating tp1/tpN launches (each 3 timed runs)")
    ap.add_argument("--batch", type=int, default=4, help="prompts in the tensor-parallel batch")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per spawned rank")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--skip-tp", action="store_true", help="only the one-device comparison (one GPU: no tp)")
    ap.add_argument("--bf16", action="store_true", help="also bf16 against fp32 on one device (weights and cache)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)  # as each spawned rank: the one-device side gets no more cores than a rank
    now = datetime.datetime.now(datetime.UTC)
    print(f"# {now:%Y-%m-%d %H:%M} UTC, device {args.device}, torch {torch.__version__}; "
          f"model d={args.d_model} L={args.layers} heads={args.heads} kv={args.kv_heads} vocab={args.vocab}; "
          f"prompt {args.prompt}, {args.tokens} new tokens, greedy")
    c = cached_vs_recompute(args)
    print(f"one device, batch 1: cached {c['cached_tok_s']:,.1f} tok/s, recompute {c['recompute_tok_s']:,.1f} tok/s; "
          f"cached/recompute speed-up {c['speedup']:.2f}x (rounds {c['speedup_min']:.2f}-{c['speedup_max']:.2f}, "
          f"{args.rounds} rounds, same tokens asserted)")
    if args.bf16:
        b = bf16_vs_fp32(args)
        print(f"batch {args.batch}, one device: fp32 {b['fp32']:,.1f} tok/s, bf16 {b['bf16']:,.1f} tok/s (ratio "
              f"{b['bf16'] / b['fp32']:.2f}); parameters {b['param'][0]:,} -> {b['param'][1]:,} bytes, KV cache "
              f"{b['kv'][0]:,} -> {b['kv'][1]:,} (exactly half asserted)")
    if args.skip_tp:
        return
    t = tensor_parallel(args)
    kv_share = ", ".join(f"{b / t['kv_1']:.3f}" for b in t["kv_tp"])
    layout = f"tp={args.tp}" + (f" pp={args.pp}" if args.pp > 1 else "")
    print(f"batch {args.batch}: one device {t['tok_s_1']:,.1f} tok/s, {layout} {t['tok_s_tp']:,.1f} tok/s "
          f"(ratio {t['tok_s_tp'] / t['tok_s_1']:.2f}; same tokens asserted on every rank)")
    print(f"KV cache bytes: one device {t['kv_1']:,}; per rank {', '.join(f'{b:,}' for b in t['kv_tp'])} "
          f"(= {kv_share} of one device's); parameters per rank {', '.join(f'{b:,}' for b in t['param_tp'])} "
          f"vs {t['param_1']:,}")


if __name__ == "__main__":
    main()
