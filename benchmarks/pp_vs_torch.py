"""Our pipeline schedules against torch.distributed.pipelining, same model, data and seed; and each
schedule's measured bubble against the simulator's prediction.

The machine decides the device: CUDA + NCCL (one GPU per rank) when ``--world`` GPUs are present, else
CPU + gloo. Pairs: afab vs ScheduleGPipe, 1f1b vs Schedule1F1B, interleaved (2 chunks/rank) vs
ScheduleInterleaved1F1B, dualpipev vs ScheduleDualPipeV (DeepSeek's order, which overlaps a forward
chunk with a backward chunk), and dualpipev vs ScheduleZBVZeroBubble (the ZBV zero-bubble schedule: the
same V placement and split backward, no such overlap); zb-h1 has no torch counterpart with one stage per
rank and is measured alone.

Both sides compute the same run: torch's schedules run with ``scale_grads=False`` and the loss
``sum over tokens / global token count`` per microbatch, which is exactly our engine's, so gradients,
optimizer steps and every step's loss (the sum over microbatches) agree; the script asserts that the
losses match within ``--loss-rtol`` (fp32: 1e-5 relative) on the rank holding the loss. Rounds
alternate the sides (ours, theirs / theirs, ours, ...), a barrier (and a CUDA sync) precedes every
timed step, and the report gives the median ratio ours/theirs of the slowest rank's step time with the
min-max of the per-round ratios.

For our runs the engine records each action's start (after its inputs arrived) and end on every
rank. From the mean measured cost of each (kind, stage), and the median measured hand-over time
between ranks, the simulator predicts the timeline; the report compares the measured bubble with
that prediction, and gives the peak number of microbatch-stages whose activations are alive at
once (measured from the same timelines) times the measured activation bytes of one
microbatch-stage. ``--png DIR`` draws measured and simulated charts.

    python benchmarks/pp_vs_torch.py [--world 4] [--steps 8] [--rounds 5] [--png DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from meshtrain import comm
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
         ("dualpipev", "ScheduleDualPipeV", 2), ("dualpipev", "ScheduleZBVZeroBubble", 2), ("zb-h1", None, 1)]


def _label(name: str, torch_name: str | None) -> str:
    return f"{name} vs {torch_name}" if torch_name else f"{name} (no torch counterpart)"


def _backend(world: int) -> str:
    """NCCL with one GPU per rank where the machine has them, else gloo on CPU."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        return "gloo"
    if n < world:
        raise SystemExit(f"error: --world {world} needs {world} GPUs for NCCL (one per rank), this machine has {n}: "
                         f"set --world {n} (at least 2), or CUDA_VISIBLE_DEVICES= to measure on CPU + gloo.")
    return "nccl"


def _timed_start(mesh: Mesh) -> float:
    """Every rank starts the step together: a barrier, and on CUDA an empty queue."""
    comm.barrier(mesh.group("pp"))
    if mesh.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def _timed_end(mesh: Mesh, t0: float) -> float:
    if mesh.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _cfg(args) -> ModelConfig:
    return ModelConfig(vocab_size=257, d_model=args.d_model, n_layers=args.layers, n_heads=8, max_seq_len=args.seq)


def _batches(args):
    data = SyntheticDataset(257)
    return [data.batch(0, s, args.batch, args.seq) for s in range(args.steps)]


def _setup(args, name, virtual, pp, defer=True):
    cfg = _cfg(args)
    mesh = Mesh(pp=pp)  # device: this rank's GPU on CUDA machines
    model = build_model(cfg, seed=0, device=mesh.device)
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
                            recv_ahead=args.recv_ahead, posting=None if args.posting == "auto" else args.posting)
    times, traces, losses = [], [], []
    for x, y in _batches(args):
        t0 = _timed_start(mesh)
        loss = float(engine.run(x, y, y.numel()))  # loss sum / global tokens on the loss's rank, 0 elsewhere
        opt.step()
        sync.zero_grad()
        times.append(_timed_end(mesh, t0))
        traces.append(list(engine.trace.actions))
        losses.append(loss)
    return times[args.warmup:], traces[args.warmup:], losses


def _torch(args, name, torch_name, virtual, pp):
    import torch.distributed.pipelining as tp_

    model, mesh, schedule, stages, _ = _setup(args, name, virtual, pp, defer=False)
    n_tokens = args.batch * args.seq
    pipe_stages = [tp_.PipelineStage(stages[s], s, schedule.n_stages, mesh.device, group=mesh.group("pp").pg)
                   for s in sorted(stages)]
    cls = getattr(tp_, torch_name)

    def loss_fn(out, tgt):
        return cross_entropy_sum(out, tgt) / n_tokens  # ours per microbatch: no 1/m on top (scale_grads=False)

    multi = len(pipe_stages) > 1 or virtual > 1
    sched = cls(pipe_stages if multi else pipe_stages[0], n_microbatches=args.microbatches, loss_fn=loss_fn,
                scale_grads=False)
    opt = build_adamw(model_params(model), TrainConfig())
    first = 0 in stages
    last = schedule.n_stages - 1 in stages
    times, losses = [], []
    for x, y in _batches(args):
        x, y = x.to(mesh.device), y.to(mesh.device)
        mb_losses: list[torch.Tensor] = []
        kwargs = {"target": y, "losses": mb_losses} if last else {}
        t0 = _timed_start(mesh)
        sched.step(x, **kwargs) if first else sched.step(**kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(_timed_end(mesh, t0))
        losses.append(float(sum(float(v.detach()) for v in mb_losses)))
    return times[args.warmup:], losses


def _pairs(args) -> list[tuple[str, str | None, int]]:
    keep = set(args.schedules.split(",")) if args.schedules else None
    return [(n, None if args.no_torch else t, v) for n, t, v in PAIRS if keep is None or n in keep]


def _worker(rank, world, args):
    out = {}
    for name, torch_name, virtual in _pairs(args):
        rounds = []
        for r in range(args.rounds):
            # ours, theirs / theirs, ours: drift on a shared machine hits both sides alike
            got = {}
            for side in (("ours", "theirs") if r % 2 == 0 else ("theirs", "ours")):
                if side == "ours":
                    got[side] = _ours(args, name, virtual, world)
                elif torch_name:
                    got[side] = _torch(args, name, torch_name, virtual, world)
            ours, traces, our_losses = got["ours"]
            theirs, their_losses = got.get("theirs", ([], []))
            rounds.append((ours, theirs, traces, our_losses, their_losses))
        out[_label(name, torch_name)] = rounds
    return out


def _assert_same_run(args, label: str, schedule, results) -> float:
    """Ours and torch's losses agree on the rank holding the loss, every step of every round; returns the largest
    relative difference."""
    loss_rank = schedule.placement[schedule.n_stages - 1]
    worst = 0.0
    for r, (_, _, _, ours, theirs) in enumerate(results[loss_rank][label]):
        if not all(ours):
            raise SystemExit(f"error: {label}: round {r}: rank {loss_rank} holds the loss but returned {ours}")
        for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            diff = abs(a - b) / max(abs(b), 1e-30)
            if not diff <= args.loss_rtol:
                raise SystemExit(f"error: {label}: round {r} step {step}: our loss {a!r} and torch's {b!r} differ by "
                                 f"{diff:.2e} relative (> --loss-rtol {args.loss_rtol}): not the same run")
            worst = max(worst, diff)
    return worst


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
    ap.add_argument("--rounds", type=int, default=5, help="rounds, alternating ours/theirs and theirs/ours")
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
    ap.add_argument("--posting", choices=("auto", "ahead", "ordered"), default="auto",
                    help="our engine's p2p posting policy (auto: ordered on NCCL, ahead on gloo)")
    ap.add_argument("--loss-rtol", type=float, default=1e-5,
                    help="largest relative difference allowed between our and torch's loss of a step (fp32)")
    ap.add_argument("--no-torch", action="store_true", help="only our engine (for bubble measurements)")
    ap.add_argument("--dump", default="", help="pickle every rank's measured timelines here (offline analysis)")
    args = ap.parse_args()
    if args.recv_ahead < 0:
        ap.error("--recv-ahead must be >= 0 (0: every receive at the step's start)")
    if args.batch % args.microbatches:
        ap.error(f"--batch {args.batch} must be a multiple of --microbatches {args.microbatches}")
    backend = _backend(args.world)
    results = spawn(_worker, args.world, args=(args,), timeout=3000, backend=backend)
    if args.dump:
        import pickle

        with open(args.dump, "wb") as fh:
            pickle.dump({"args": vars(args), "results": results}, fh)
    n = args.steps - args.warmup
    act = _act_bytes_per_stage(args)
    device = "CUDA" if backend == "nccl" else "CPU"
    print(f"{args.world} {backend} ranks on {device} (pp={args.world}), d_model={args.d_model}, layers={args.layers}, "
          f"seq={args.seq}, batch={args.batch}, microbatches={args.microbatches}, {n} timed steps x {args.rounds} "
          f"rounds (alternating ours/theirs), posting={args.posting}\n")
    print("| ours vs torch.distributed.pipelining | ours median (ms) | torch median (ms) | ratio (median of rounds) "
          "| per-round min-max "
          "| loss max rel diff | measured bubble | simulated (mean cost per kind+stage) "
          "| simulated (each action's measured cost) | peak live mb-stages/rank | peak activations/rank |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, torch_name, virtual in _pairs(args):
        label = _label(name, torch_name)
        ours_all, theirs_all, ratios, measured, simulated, replayed, peaks = [], [], [], [], [], [], []
        schedule = build_schedule(name, args.world, args.microbatches, virtual)
        same = f"{_assert_same_run(args, label, schedule, results):.1e}" if torch_name else "-"
        for r in range(args.rounds):
            ours = [max(res[label][r][0][i] for res in results) for i in range(n)]
            ours_all += ours
            if torch_name:
                theirs = [max(res[label][r][1][i] for res in results) for i in range(n)]
                theirs_all += theirs
                ratios.append(statistics.median(ours) / statistics.median(theirs))
            for i in range(n):
                timelines = [res[label][r][2][i] for res in results]
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
                    tag = name if torch_name != "ScheduleZBVZeroBubble" else f"{name}_zbv"
                    png_chart(timelines, f"{args.png}/{tag}_measured.png", f"{name} measured")
                    png_chart(sim, f"{args.png}/{tag}_simulated.png", f"{name} simulated")
        mo = statistics.median(ours_all)
        mt = statistics.median(theirs_all) if theirs_all else float("nan")
        span = f"{min(ratios):.3f}-{max(ratios):.3f}" if ratios else "-"
        ratio = f"{statistics.median(ratios):.3f}" if ratios else "-"  # the median of the per-round ratios
        peak = max(peaks)
        mt_txt = f"{mt * 1e3:.1f}" if theirs_all else "-"
        bubbles = [f"{statistics.median(x):.1%}" for x in (measured, simulated, replayed)]
        print(f"| {label} | {mo * 1e3:.1f} | {mt_txt} | {ratio} | {span} | {same} | {' | '.join(bubbles)} | {peak} | "
              f"{peak * act / virtual / 2**20:.1f} MiB |")


if __name__ == "__main__":
    main()
