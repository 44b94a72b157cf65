"""Our tensor (+ sequence) parallelism against torch's DTensor tensor parallelism, tp = every rank.

Same plain model, data and seed on both sides; both clip the global gradient norm and step AdamW.
Theirs is what a user tuning DTensor TP would write (``parallelize_module``):

- TP: ColwiseParallel (wq, wk, wv, w1, w3, output), RowwiseParallel (wo, w2, the embedding), and
  ``PrepareModuleInput`` on attention and feed-forward, so each block's input becomes a replicated
  DTensor once: one input-gradient all-reduce per attention and per MLP, as ours (without it every
  ColwiseParallel converts its own input and backward all-reduces three times per attention).
- TP + SP: the same with SequenceParallel on the norms and PrepareModuleInput gathering the sequence
  (Shard(1) -> Replicate) before attention and feed-forward; ``loss_parallel`` on both rows.

Ours runs with ``parallel.sp_regather`` as configured by default (column-parallel inputs gathered again in
backward); the third row compares that with keeping the gathered inputs (ours against ours), which is what
re-gathering costs in time. The fourth (ours against ours, no SP) compares the column-parallel layers'
input-gradient all-reduce started beside the weight-gradient matmul (``_CopyLinear``) with the same layers built
from separate pieces, ``copy_to_tp`` then ``F.linear``, whose all-reduce starts after both matmuls. The script
first counts the DTensor side's collectives in one step and asserts its input collectives are one per block entry,
like ours; in every round it asserts both sides computed the same run (first-step loss within 1e-5 relative, every
step within 1e-3: fp32 summation order differs, so trajectories drift apart slowly). Rounds alternate
ours/theirs/theirs/ours, a barrier precedes every timed step (and a device sync on CUDA); the device is the
machine's (CUDA + NCCL with a GPU per rank, else CPU + gloo). Reported: the median over rounds of ours/theirs
(median step over median step, the slowest rank's), and the per-round min-max; ``--runs`` repeats it in fresh
process groups.

    python benchmarks/tp_vs_torch.py [--steps 14] [--warmup 4] [--rounds 5] [--runs 1] [--d-model 256]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from harness import Comparison, bench_device, order, run_independent, slowest, spread_line, timed_step

from meshtrain import comm
from meshtrain.config import ModelConfig, ParallelConfig, TrainConfig
from meshtrain.mesh import Mesh
from meshtrain.model.llama import build_model
from meshtrain.parallel.tensor import ColumnParallelLinear, VocabParallelHead, apply_tensor_parallel, copy_to_tp
from meshtrain.rules import rules_for
from meshtrain.train.data import SyntheticDataset
from meshtrain.train.optim import build_adamw, model_params

ROWS = {
    "tp": "TP vs DTensor TP + PrepareModuleInput",
    "sp": "TP + SP (re-gather) vs DTensor TP + SequenceParallel",
    "regather": "TP + SP re-gather vs TP + SP kept inputs (ours vs ours)",
    "async": "TP input-grad all-reduce beside the weight-grad matmul vs after it (ours vs ours)",
}


class _AfterLinear(ColumnParallelLinear):
    """The column-parallel layer from separate pieces: f, then the matmul (its backward all-reduces the input
    gradient after the linear's whole backward)."""

    def matmul(self, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.group), torch.cat(weights) if len(weights) > 1 else weights[0])


class _AfterLinearHead(VocabParallelHead):
    matmul = _AfterLinear.matmul


def _cfg(args) -> ModelConfig:
    return ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=8, n_kv_heads=4,
                       max_seq_len=args.seq)


def _batches(args, device: torch.device):
    data = SyntheticDataset(args.vocab)
    return [tuple(t.to(device) for t in data.batch(0, s, args.batch, args.seq)) for s in range(args.steps)]


def _ours(args, sp: bool, regather: bool, world: int, after_linear: bool = False):
    """Build our TP model (``after_linear``: its column-parallel layers from separate pieces, ``_AfterLinear``);
    returns one training step (-> loss) per batch."""
    device = bench_device()
    model = build_model(_cfg(args), seed=0).to(device)
    tp = apply_tensor_parallel(model, Mesh(tp=world, device=device), rules_for(ParallelConfig(tp=world, sp=sp)),
                               sp=sp, sp_regather=regather)
    if after_linear:
        swap = {ColumnParallelLinear: _AfterLinear, VocabParallelHead: _AfterLinearHead}
        columns = [m for m in model.modules() if type(m) in swap]
        assert len(columns) == 5 * args.layers + 1, len(columns)  # wq, wk, wv, w1, w3 a block, and the head
        for m in columns:
            m.__class__ = swap[type(m)]
    params = model_params(model, tp.placements)
    opt = build_adamw(params, TrainConfig())
    replicated = [op.tensor for op in params if op.replicas > 1]

    def step(x, y) -> float:
        loss = tp.loss_fn(model(x), y) / y.numel()
        loss.backward()
        tp.sync_replicated_grads([p.grad for p in replicated])
        plain = [op.tensor.grad for op in params if op.replicas == 1]
        local = sum(float(g.float().pow(2).sum()) for g in plain) + \
            sum(float(p.grad.float().pow(2).sum()) for p in replicated) / world
        norm = comm.all_reduce_scalars([local], tp.group)[0] ** 0.5
        torch._foreach_mul_([op.tensor.grad for op in params], min(1.0, 1.0 / (norm + 1e-6)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def _torch(args, sp: bool, world: int):
    """Build DTensor TP on the same plain model; returns one training step (-> loss)."""
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

    device = bench_device()
    model = build_model(_cfg(args), seed=0).to(device)
    mesh = init_device_mesh(device.type, (world,))
    seq = Shard(1) if sp else Replicate()  # the layout between blocks
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        plan["norm"] = SequenceParallel()
    parallelize_module(model, mesh, plan)
    for block in model.layers.values():
        bplan = {
            # The block's input arrives as a plain tensor (seq layout); converting it once per module makes
            # the column-parallel matmuls share one input collective (forward gather / backward reduction).
            # (attention's inputs: x, cos, sin, the KV cache and the documents; only x is distributed)
            "attention": PrepareModuleInput(input_layouts=(seq, None, None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None, None)),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if sp:
            bplan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
        parallelize_module(block, mesh, bplan)
    opt = build_adamw(model_params(model), TrainConfig())

    def step(x, y) -> float:
        with loss_parallel():
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / y.numel()
            loss.backward()
        _clip_mixed(model, world)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)

    return step


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
    t = torch.tensor([local], dtype=torch.float64, device=bench_device())
    dist.all_reduce(t)
    coef = min(1.0, 1.0 / (float(t) ** 0.5 + 1e-6))
    for p in model.parameters():
        g = p.grad
        (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)


def _their_input_collectives(args, sp: bool, world: int) -> dict[str, int]:
    """Collectives of one DTensor step by kind (CommDebugMode), on a throwaway model."""
    from torch.distributed.tensor.debug import CommDebugMode

    step = _torch(args, sp, world)
    x, y = _batches(args, bench_device())[0]
    mode = CommDebugMode()
    with mode:
        step(x, y)
    return {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items()}


def _run(args, side: str, row: str, world: int) -> tuple[list[float], list[float]]:
    """One side of one row: (step seconds after warm-up, every step's loss)."""
    if side == "theirs" and row in ("tp", "sp"):
        step = _torch(args, row == "sp", world)
    else:
        step = _ours(args, sp=row in ("sp", "regather"), regather=not (row == "regather" and side == "theirs"),
                     world=world, after_linear=row == "async" and side == "theirs")
    times, losses = [], []
    for x, y in _batches(args, bench_device()):
        loss, sec = timed_step(lambda x=x, y=y: step(x, y))
        times.append(sec)
        losses.append(loss)
    return times[args.warmup:], losses


def _worker(rank, world, args):
    counts = {sp: _their_input_collectives(args, sp, world) for sp in (False, True)}
    out: dict[str, list[dict[str, tuple[list[float], list[float]]]]] = {}
    for row in args.rows:
        out[row] = []
        for r in range(args.rounds):
            out[row].append({side: _run(args, side, row, world) for side in order(r)})
    return out, counts


def _check_their_collectives(counts: dict[bool, dict[str, int]], args) -> str:
    """DTensor's activation collectives are one per block entry and exit, like ours (asserted exactly)."""
    entries = 2 * args.layers + 1  # the embedding's output, and each block's attention and MLP (TP: their inputs)
    tp, sp = counts[False], counts[True]
    # TP: forward all-reduces the embedding's and each row-parallel output, backward each column-parallel
    # entry's input gradient and the head's; loss_parallel adds three (max, sum of exp, target logit).
    # Without PrepareModuleInput backward would all-reduce once per ColwiseParallel (5 per block).
    assert tp.get("all_reduce", 0) == 2 * entries + 3, f"not one input collective per block entry: {tp}"
    # TP + SP: an all-gather into each entry (and the head) forward, and of each exit's gradient backward.
    assert sp.get("all_gather_into_tensor", 0) == 2 * entries, sp
    return f"DTensor collectives of one step: TP {tp}; TP + SP {sp}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runs", type=int, default=1, help="independent process groups (the spread across them)")
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=257)
    ap.add_argument("--world", type=int, default=4)
    args = ap.parse_args()
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")
    runs = run_independent(_worker, args.world, args.runs, (args,))
    n = args.steps - args.warmup
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= args.world else "gloo"
    print(f"{args.world} {backend} ranks (tp={args.world}), d_model={args.d_model}, layers={args.layers}, "
          f"seq={args.seq}, batch={args.batch}, vocab={args.vocab}, {n} timed steps x {args.rounds} rounds x "
          f"{args.runs} run(s)")
    print(_check_their_collectives(runs[0][0][1], args) + "\n")
    print("| comparison | ours median (ms) | theirs median (ms) | ratio ours/theirs | per-round min-max |")
    print("|---|---|---|---|---|")
    for row in args.rows:
        run_ratios, every = [], Comparison(ROWS[row])  # every: all runs' rounds together
        for results in runs:
            cmp = Comparison(ROWS[row])
            for r in range(args.rounds):
                per_rank = [res[0][row][r] for res in results]
                # Both must compute the same training run, or the timing means nothing.
                a, b = per_rank[0]["ours"][1], per_rank[0]["theirs"][1]
                assert abs(a[0] - b[0]) / abs(b[0]) < 1e-5, (row, a, b)
                assert max(abs(u - v) / abs(v) for u, v in zip(a, b, strict=True)) < 1e-3, (row, a, b)
                ours, theirs = slowest([p["ours"][0] for p in per_rank]), slowest([p["theirs"][0] for p in per_rank])
                cmp.add_round(ours, theirs)
                every.add_round(ours, theirs)
            run_ratios.append(cmp.ratio())
        mo, mt = every.medians_ms()
        ratios = every.round_ratios()
        spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
        ratio = spread_line(run_ratios) if args.runs > 1 else f"{statistics.median(ratios):.3f}"
        print(f"| {ROWS[row]} | {mo:.1f} | {mt:.1f} | {ratio} | {spread} |")


if __name__ == "__main__":
    main()
