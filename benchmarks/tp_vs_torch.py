"""Our tensor (+ sequence) parallelism against torch's DTensor tensor parallelism, on 4 gloo ranks.

Same plain model, data and seed. Theirs is ``parallelize_module`` with ColwiseParallel (wq, wk, wv,
w1, w3, output), RowwiseParallel (wo, w2, the embedding), SequenceParallel (norms) with SP, and
``loss_parallel`` for the vocabulary-sharded loss. Both clip the gradient norm and step AdamW.
Ratios are ours/theirs of the median step time (the slowest rank's), alternating rounds.

    python benchmarks/tp_vs_torch.py [--steps 12] [--rounds 3] [--d-model 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from meshtrain.config import ModelConfig, ParallelConfig, TrainConfig
from meshtrain.mesh import Mesh
from meshtrain.model.llama import build_model
from meshtrain.parallel.tensor import apply_tensor_parallel
from meshtrain.rules import rules_for
from meshtrain.testing.spawn import spawn
from meshtrain.train.data import SyntheticDataset
from meshtrain.train.optim import build_adamw, model_params


def _cfg(args) -> ModelConfig:
    return ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=8, n_kv_heads=4,
                       max_seq_len=args.seq)


def _batches(args):
    data = SyntheticDataset(args.vocab)
    return [data.batch(0, s, args.batch, args.seq) for s in range(args.steps)]


def _ours(args, sp, world):
    model = build_model(_cfg(args), seed=0)
    tp = apply_tensor_parallel(model, Mesh(tp=world), rules_for(ParallelConfig(tp=world, sp=sp)), sp=sp)
    params = model_params(model, tp.placements)
    opt = build_adamw(params, TrainConfig())
    replicated = [op.tensor for op in params if op.replicas > 1]
    times, losses = [], []
    for x, y in _batches(args):
        t0 = time.perf_counter()
        loss = tp.loss_fn(model(x), y) / y.numel()
        losses.append(float(loss))
        loss.backward()
        tp.sync_replicated_grads([p.grad for p in replicated])
        plain = [op.tensor.grad for op in params if op.replicas == 1]
        rep = [p.grad for p in replicated]
        local = sum(float(g.float().pow(2).sum()) for g in plain) + sum(float(g.float().pow(2).sum())
                                                                        for g in rep) / world
        from meshtrain import comm
        norm = comm.all_reduce_scalars([local], tp.group)[0] ** 0.5
        coef = min(1.0, 1.0 / (norm + 1e-6))
        torch._foreach_mul_([op.tensor.grad for op in params], coef)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[args.warmup:], losses


def _torch(args, sp, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )

    model = build_model(_cfg(args), seed=0)
    mesh = init_device_mesh("cpu", (world,))
    seq = Shard(1) if sp else Replicate()
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        plan["norm"] = SequenceParallel()
    parallelize_module(model, mesh, plan)
    for block in model.layers.values():
        bplan = {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if sp:
            bplan.update({
                "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(block, mesh, bplan)
    opt = build_adamw(model_params(model), TrainConfig())
    times, losses = [], []
    for x, y in _batches(args):
        t0 = time.perf_counter()
        with loss_parallel():
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / y.numel()
            loss.backward()
        losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
        _clip_mixed(model, world)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[args.warmup:], losses


def _clip_mixed(model, world: int) -> None:
    """Clip by the global norm when DTensor and plain (replicated) parameters mix, which
    torch.nn.utils.clip_grad_norm_ refuses: the same arithmetic as ours, one all-reduce."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    local = 0.0
    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor):
            sharded = any(pl.is_shard() for pl in g.placements)
            local += float(g.to_local().float().pow(2).sum()) / (1 if sharded else world)
        else:
            local += float(g.float().pow(2).sum()) / world
    t = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(t)
    coef = min(1.0, 1.0 / (float(t) ** 0.5 + 1e-6))
    for p in model.parameters():
        g = p.grad
        (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)


def _worker(rank, world, args):
    out = {}
    for sp in (False, True):
        out[sp] = [(_ours(args, sp, world), _torch(args, sp, world)) for _ in range(args.rounds)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=257)
    ap.add_argument("--world", type=int, default=4)
    args = ap.parse_args()
    results = spawn(_worker, args.world, args=(args,), timeout=3000)
    n = args.steps - args.warmup
    print(f"{args.world} gloo ranks (tp={args.world}), d_model={args.d_model}, layers={args.layers}, seq={args.seq}, "
          f"batch={args.batch}, vocab={args.vocab}, {n} timed steps x {args.rounds} rounds\n")
    print("| ours vs torch | ours median (ms) | torch median (ms) | ratio ours/torch | per-round min-max |")
    print("|---|---|---|---|---|")
    for sp in (False, True):
        ratios, ours_all, theirs_all = [], [], []
        for r in range(args.rounds):
            ours = [max(res[sp][r][0][0][i] for res in results) for i in range(n)]
            theirs = [max(res[sp][r][1][0][i] for res in results) for i in range(n)]
            # Both must compute the same training run, or the timing means nothing.
            a, b = results[0][sp][r][0][1], results[0][sp][r][1][1]
            # (fp32 rounding differs, so the trajectories drift apart slowly: tight at first, loose later.)
            assert abs(a[0] - b[0]) / abs(b[0]) < 1e-5, (a, b)
            assert max(abs(u - v) / abs(v) for u, v in zip(a, b, strict=True)) < 1e-3, (a, b)
            ratios.append(statistics.median(ours) / statistics.median(theirs))
            ours_all += ours
            theirs_all += theirs
        mo, mt = statistics.median(ours_all), statistics.median(theirs_all)
        name = "TP + SP vs DTensor TP + SequenceParallel" if sp else "TP vs DTensor TP"
        print(f"| {name} | {mo * 1e3:.1f} | {mt * 1e3:.1f} | {mo / mt:.3f} | {min(ratios):.3f}-{max(ratios):.3f} |")


if __name__ == "__main__":
    main()
