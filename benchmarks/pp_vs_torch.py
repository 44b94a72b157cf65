"""Our pipeline schedules against torch.distributed.pipelining on 4 gloo ranks (pp=4), same model,
data and seed; and each schedule's measured bubble against the simulator's prediction.

Pairs: afab vs ScheduleGPipe, 1f1b vs Schedule1F1B, interleaved (2 chunks/rank) vs
ScheduleInterleaved1F1B, dualpipev vs ScheduleZBVZeroBubble (both V-shaped, split backward);
zb-h1 has no torch counterpart with one stage per rank and is measured alone.

For our runs the engine records each action's start (after its inputs arrived) and end on every
rank. From the mean measured cost of each (kind, stage), and the median measured hand-over time
between ranks, the simulator predicts the timeline; the report compares the measured bubble with
that prediction, and gives the peak number of microbatch-stages whose activations are alive at
once (measured from the same timelines) times the measured activation bytes of one
microbatch-stage. ``--png DIR`` draws measured and simulated charts.

    python benchmarks/pp_vs_torch.py [--world 4] [--steps 8] [--rounds 2] [--png DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from meshtrain.config import ModelConfig, TrainConfig
from meshtrain.mesh import Mesh
from meshtrain.model.llama import build_model, cross_entropy_sum
from meshtrain.parallel.data import DataParallel
from meshtrain.parallel.microsteps import ForwardLoss
from meshtrain.parallel.pipeline.engine import PipelineEngine, split
from meshtrain.parallel.pipeline.wgrad import WeightGradStore
from meshtrain.plan.partition import partition_model
from meshtrain.plan.schedules import build_schedule, dependencies, done_key
from meshtrain.plan.simulator import bubble_of_timelines, inflight_peaks, simulate
from meshtrain.testing.spawn import spawn
from meshtrain.train.data import SyntheticDataset
from meshtrain.train.optim import build_adamw, model_params

PAIRS = [("afab", "ScheduleGPipe", 1), ("1f1b", "Schedule1F1B", 1), ("interleaved", "ScheduleInterleaved1F1B", 2),
         ("dualpipev", "ScheduleZBVZeroBubble", 2), ("zb-h1", None, 1)]


def _cfg(args) -> ModelConfig:
    return ModelConfig(vocab_size=257, d_model=args.d_model, n_layers=args.layers, n_heads=8, max_seq_len=args.seq)


def _batches(args):
    data = SyntheticDataset(257)
    return [data.batch(0, s, args.batch, args.seq) for s in range(args.steps)]


def _setup(args, name, virtual, pp, defer=True):
    cfg = _cfg(args)
    model = build_model(cfg, seed=0)
    mesh = Mesh(pp=pp)
    schedule = build_schedule(name, pp, args.microbatches, virtual)
    part = partition_model(cfg, args.seq, schedule.n_stages)
    wgrad = WeightGradStore() if schedule.split_backward and defer else None  # ours defers W; torch's own
    stages = split(model, mesh, schedule, part, wgrad)
    return model, mesh, schedule, stages, wgrad


def _ours(args, name, virtual, pp):
    model, mesh, schedule, stages, wgrad = _setup(args, name, virtual, pp)
    sync = DataParallel(model, mesh.group("dp", "cp"), {})  # size 1: no communication, same API as training
    opt = build_adamw(model_params(model), TrainConfig())
    engine = PipelineEngine(schedule, stages, mesh, (args.batch // args.microbatches, args.seq, args.d_model),
                            ForwardLoss(cross_entropy_sum, sync, torch.float32, mesh.device), wgrad,
                            recv_ahead=args.recv_ahead)
    times, traces = [], []
    for x, y in _batches(args):
        t0 = time.perf_counter()
        engine.run(x, y, y.numel())
        opt.step()
        sync.zero_grad()
        times.append(time.perf_counter() - t0)
        traces.append(list(engine.trace.actions))
    return times[args.warmup:], traces[args.warmup:]


def _torch(args, name, torch_name, virtual, pp):
    import torch.distributed.pipelining as tp_

    model, mesh, schedule, stages, _ = _setup(args, name, virtual, pp, defer=False)
    n_tokens = args.batch * args.seq
    pipe_stages = [tp_.PipelineStage(stages[s], s, schedule.n_stages, torch.device("cpu"),
                                     group=mesh.group("pp").pg) for s in sorted(stages)]
    cls = getattr(tp_, torch_name)

    def loss_fn(out, tgt):
        return cross_entropy_sum(out, tgt) / n_tokens

    multi = len(pipe_stages) > 1 or virtual > 1
    sched = cls(pipe_stages if multi else pipe_stages[0], n_microbatches=args.microbatches, loss_fn=loss_fn)
    opt = build_adamw(model_params(model), TrainConfig())
    first = 0 in stages
    last = schedule.n_stages - 1 in stages
    times = []
    for x, y in _batches(args):
        t0 = time.perf_counter()
        kwargs = {"target": y, "losses": []} if last else {}
        sched.step(x, **kwargs) if first else sched.step(**kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[args.warmup:]


def _pairs(args) -> list[tuple[str, str | None, int]]:
    keep = set(args.schedules.split(",")) if args.schedules else None
    return [(n, None if args.no_torch else t, v) for n, t, v in PAIRS if keep is None or n in keep]


def _worker(rank, world, args):
    out = {}
    for name, torch_name, virtual in _pairs(args):
        rounds = []
        for _ in range(args.rounds):
            ours, traces = _ours(args, name, virtual, world)
            theirs = _torch(args, name, torch_name, virtual, world) if torch_name else []
            rounds.append((ours, theirs, traces))
        out[name] = rounds
    return out


def _p2p_latency(schedule, timelines) -> float:
    """Median measured hand-over time between ranks: when a rank sat waiting for a peer's result, the
    gap from the peer finishing that action to this rank starting (transfer + wake-up)."""
    end = {}
    for tl in timelines:
        for _, a1, a in tl:
            end[done_key(a)] = a1
    gaps = []
    for r, tl in enumerate(timelines):
        prev_end = None
        for a0, a1, a in tl:
            for dep in dependencies(a, schedule.n_stages):
                if schedule.placement[dep[2]] != r and dep in end and (prev_end is None or end[dep] > prev_end):
                    gaps.append(a0 - end[dep])
            prev_end = a1
    return statistics.median(gaps) if gaps else 0.0


def _act_bytes_per_stage(args) -> float:
    """Activation bytes one microbatch keeps for backward in one stage (measured on the plain model)."""
    from meshtrain.parallel.recompute import saved_activation_bytes

    cfg = _cfg(args)
    model = build_model(cfg, seed=0)
    x = torch.randint(0, 257, (args.batch // args.microbatches, args.seq))
    return saved_activation_bytes(lambda: model(x), exclude=list(model.buffers())) / args.world


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--png", default="", help="folder for measured/simulated timeline charts")
    ap.add_argument("--schedules", default="", help="comma-separated subset, e.g. interleaved,zb-h1")
    ap.add_argument("--recv-ahead", type=int, default=0,
                    help="receives our engine posts ahead of use (0: all at the step's start)")
    ap.add_argument("--no-torch", action="store_true", help="only our engine (for bubble measurements)")
    ap.add_argument("--dump", default="", help="pickle every rank's measured timelines here (offline analysis)")
    args = ap.parse_args()
    if args.recv_ahead < 0:
        ap.error("--recv-ahead must be >= 0 (0: every receive at the step's start)")
    results = spawn(_worker, args.world, args=(args,), timeout=3000)
    if args.dump:
        import pickle

        with open(args.dump, "wb") as fh:
            pickle.dump({"args": vars(args), "results": results}, fh)
    n = args.steps - args.warmup
    act = _act_bytes_per_stage(args)
    print(f"{args.world} gloo ranks (pp={args.world}), d_model={args.d_model}, layers={args.layers}, seq={args.seq}, "
          f"batch={args.batch}, microbatches={args.microbatches}, {n} timed steps x {args.rounds} rounds\n")
    print("| ours vs torch.distributed.pipelining | ours median (ms) | torch median (ms) | ratio | per-round min-max "
          "| measured bubble | simulated (mean cost per kind+stage) | simulated (each action's measured cost) "
          "| peak live mb-stages/rank | peak activations/rank |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, torch_name, virtual in _pairs(args):
        ours_all, theirs_all, ratios, measured, simulated, replayed, peaks = [], [], [], [], [], [], []
        schedule = build_schedule(name, args.world, args.microbatches, virtual)
        for r in range(args.rounds):
            ours = [max(res[name][r][0][i] for res in results) for i in range(n)]
            ours_all += ours
            if torch_name:
                theirs = [max(res[name][r][1][i] for res in results) for i in range(n)]
                theirs_all += theirs
                ratios.append(statistics.median(ours) / statistics.median(theirs))
            for i in range(n):
                timelines = [res[name][r][2][i] for res in results]
                measured.append(bubble_of_timelines(timelines)[1])
                durs: dict[tuple[str, int], list[float]] = {}
                for tl in timelines:
                    for a0, a1, a in tl:
                        durs.setdefault((a.kind, a.stage), []).append(a1 - a0)
                costs = {k: [statistics.mean(durs.get((k, s), [0.0])) for s in range(schedule.n_stages)]
                         for k in ("F", "B", "I", "W")}
                latency = _p2p_latency(schedule, timelines)
                sim = simulate(schedule, costs={k: v for k, v in costs.items() if any(v)}, p2p=latency)
                simulated.append(sim.bubble)
                own = {a: a1 - a0 for tl in timelines for a0, a1, a in tl}
                replayed.append(simulate(schedule, p2p=latency, action_costs=own).bubble)
                peaks.append(max(inflight_peaks(timelines)[0]))
                if args.png and r == args.rounds - 1 and i == n - 1:
                    import os

                    from meshtrain.plan.simulator import png_chart

                    os.makedirs(args.png, exist_ok=True)
                    png_chart(timelines, f"{args.png}/{name}_measured.png", f"{name} measured")
                    png_chart(sim, f"{args.png}/{name}_simulated.png", f"{name} simulated")
        mo = statistics.median(ours_all)
        mt = statistics.median(theirs_all) if theirs_all else float("nan")
        span = f"{min(ratios):.3f}-{max(ratios):.3f}" if ratios else "-"
        ratio = f"{mo / mt:.3f}" if theirs_all else "-"
        peak = max(peaks)
        label = f"{name} vs {torch_name}" if torch_name else f"{name} (no torch counterpart)"
        mt_txt = f"{mt * 1e3:.1f}" if theirs_all else "-"
        print(f"| {label} | {mo * 1e3:.1f} | {mt_txt} | {ratio} | {span} | {statistics.median(measured):.1%} | "
              f"{statistics.median(simulated):.1%} | {statistics.median(replayed):.1%} | {peak} | "
              f"{peak * act / virtual / 2**20:.1f} MiB |")


if __name__ == "__main__":
    main()
