"""``meshtrain plan --calibrate``: measure what a training step costs on this machine -> the ``cpu-local`` profile.

Four measurements, the first three in as many local processes as the machine has cores, one thread each (what
``meshtrain train --nproc N`` runs: torchrun gives every worker one thread), so each process sees the machine the
way a worker does:

1. whole training steps (forward in the run's ``train.dtype``: bf16 autocast or fp32; backward, gradient clipping,
   AdamW) of a few small single-process
   models whose FLOPs, activation elements, blocks and parameters vary independently; the step-cost terms
   (matmul rate, seconds per non-matmul element, per block, per parameter, per step: ``plan/costfit.py``) are the
   non-negative least-squares fit of those times;
2. gloo all-reduce, all-gather, reduce-scatter, all-to-all and send at sizes from 4 KB to 16 MB through
   ``meshtrain.comm``; latency and bandwidth are the fit of ``network.collective_time``'s form to them, for all
   ops together and for each op on its own (``collective_fits``, what the planner prices); and a small
   all-reduce issued right after compute, as training issues its collectives: what it costs beyond the same
   call back to back is the host work of one call (``call_s``), which the planner charges per call;
3. a large tensor copy (the memory bandwidth, for the planner's HBM-bound terms);
4. the parallel runtime's own work per axis (``measure_axis_work``): a calibration model trained a few steps through
   the real ``Trainer`` / ``parallelize()`` on 2 processes as plain DP and with tp+SP, ring cp, MoE+ep, ZeRO-3,
   a zero-bubble pipeline (its split backward) and selective recompute (its policy), at four sizes (more tokens,
   more blocks, wider blocks; TP at a fifth, wider and longer), each size in fresh processes; what each axis costs
   beyond plain DP and beyond what the terms above price for it, per block call, per activation element, per
   microbatch and per block parameter, is ``Hardware.axis_block_s``.

More processes than cores share them: the planner slows every process by ``devices / cores`` (``plan/steptime.py``).
Measuring needs processes and collectives (``meshtrain.testing.spawn``, ``meshtrain.comm``), so this module sits at
the command-line layer; the plan layer keeps the profile format (``plan/hardware.py``) and the fit.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from meshtrain import comm
from meshtrain.config import BYTE_VOCAB, ModelConfig, TrainConfig
from meshtrain.mesh import Mesh
from meshtrain.model.llama import build_model, cross_entropy_sum
from meshtrain.parallel.grad_sync import grad_norm_squared
from meshtrain.plan.costfit import (
    StepCosts,
    fit_axis_work,
    fit_collective_ops,
    fit_latency_bandwidth,
    fit_step_costs,
    step_features,
)
from meshtrain.plan.hardware import Hardware, hardware_cache_dir, save_profile
from meshtrain.plan.network import wire_factor
from meshtrain.testing.spawn import spawn
from meshtrain.train.optim import build_adamw, clip_divisor, model_params, non_finite, optimizer_step

# (d_model, n_layers, n_heads, batch, seq_len): FLOPs (d^2 x tokens), elements (d x tokens), blocks and
# parameters (d^2 x layers, not tokens) vary independently across them.
CALIBRATION_MODELS = [
    (64, 1, 4, 2, 64), (64, 4, 4, 16, 128), (128, 2, 4, 8, 256), (128, 6, 4, 2, 128), (256, 1, 8, 8, 256),
    (256, 4, 8, 4, 256), (256, 2, 8, 2, 64), (384, 2, 6, 4, 256), (512, 2, 8, 1, 64), (192, 3, 6, 12, 192),
    (64, 2, 8, 2, 512), (128, 1, 2, 16, 64), (320, 1, 10, 2, 512), (96, 8, 6, 4, 96),
]
PROBE_MODEL = (128, 2, 4, 8, 128)  # the reference step whose time tracks the machine's speed (``probe_speed``)
COLLECTIVE_SIZES = (4e3, 64e3, 1e6, 4e6, 16e6)  # payload bytes


def _time_steps(model_spec: tuple[int, int, int, int, int], reps: int, dtype: str = "bf16") -> float:
    """Seconds of one training step (``dtype`` bf16: under autocast, as the trainer) of a single-process model: the
    fastest of ``reps``."""
    d, layers, heads, batch, seq = model_spec
    cfg = ModelConfig(d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=max(1, heads // 2), vocab_size=BYTE_VOCAB,
                      max_seq_len=seq)
    model = build_model(cfg, 0)
    opt = build_adamw(model_params(model), TrainConfig(lr=1e-4))  # the trainer's optimizer and step (below)
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        start = time.perf_counter()
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = model(tokens[:, :-1])
        loss = cross_entropy_sum(logits, tokens[:, 1:]) / (batch * seq)
        loss.backward()
        norm = grad_norm_squared([p.grad for p in params]).sqrt()
        optimizer_step(opt, clip_divisor(norm, 1.0), non_finite(loss.detach(), norm))
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return min(times[1:])  # the least disturbed: the machine may be shared


def _matmul_rate(shapes: list[tuple[int, int, int]], seconds: float = 0.2, dtype: str = "bf16") -> float:
    """FLOP/s of ``dtype`` matmuls at ``shapes`` (m, k, n): total FLOPs over total time, as a step mixes them."""
    flops = elapsed = 0.0
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=torch_dtype), torch.randn(k, n, dtype=torch_dtype)
        a @ b  # warm-up
        iters, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            iters += 1
        elapsed += time.perf_counter() - start
        flops += 2.0 * m * k * n * iters
    return flops / elapsed


def matmul_shapes(specs: list[tuple[int, int, int, int, int]]) -> list[tuple[int, int, int]]:
    """The projections' shapes of the calibration models (tokens x d_model into d_model and the MLP hidden)."""
    out = []
    for d, _, _, batch, seq in specs:
        hidden = ModelConfig(d_model=d).hidden_dim
        out += [(batch * seq, d, d), (batch * seq, d, 2 * hidden), (batch * seq, hidden, d)]
    return out


def _compute_worker(rank: int, world_size: int, specs: list, reps: int, dtype: str
                    ) -> tuple[float, float, list[float]]:
    torch.set_num_threads(1)  # as a torchrun worker
    probe = _time_steps(PROBE_MODEL, reps, dtype)  # first, as probe_speed's fresh processes run it
    return probe, _matmul_rate(matmul_shapes(specs), dtype=dtype), [_time_steps(s, reps, dtype) for s in specs]


def _collective_worker(rank: int, world_size: int, sizes: tuple[float, ...], iters: int, rounds: int = 5
                       ) -> list[tuple]:
    """(op, payload bytes, seconds per call) through meshtrain.comm on a dp mesh group: the median over ``rounds``
    rounds (every op and size once per round, ``iters`` calls each) of the mean per call. On a shared machine a
    small call takes either ~0.1 ms or a scheduler time slice (~1-2 ms) when a peer is descheduled; one round's
    mean swings by 10x, the median of rounds much less. Last, ("call_between_compute", bytes, seconds): what a
    small all-reduce issued right after compute costs beyond the same call back to back (``Hardware.call_s``)."""
    torch.set_num_threads(1)
    mesh = Mesh(dp=world_size, device=torch.device("cpu"))
    group = mesh.group("dp", "cp")
    timed: dict[tuple[str, int], list[float]] = {}
    # A small all-reduce issued between compute, as training issues its TP/SP, CP and loss collectives, also pays
    # the peers' skew (one rank waits for the other's compute jitter) and the wake-up of a busy process.
    a, small = torch.randn(128, 128), torch.ones(1024)
    def work() -> None:
        for _ in range(8):
            a @ a
    inline = {"compute": work, "compute+call": lambda: (work(), comm.all_reduce(small, group)),
              "call": lambda: comm.all_reduce(small, group)}
    for _ in range(rounds):
        for nbytes in sizes:
            n = max(world_size, int(nbytes / 4) // world_size * world_size)
            full, part, out_a2a = torch.ones(n), torch.ones(n // world_size), torch.empty(n)
            calls = {  # the tensors are bound as defaults: each dict is used only in this iteration anyway
                "all_reduce": lambda f=full: comm.all_reduce(f, group),
                "all_gather": lambda f=full, p=part: comm.all_gather(f, p, group),
                "reduce_scatter": lambda f=full, p=part: comm.reduce_scatter(p, f, group),
                "all_to_all": lambda f=full, o=out_a2a: comm.all_to_all(o, f, group),
                "send": lambda f=full: comm.send(f, 1, group) if rank == 0 else comm.recv(f, 0, group),
            }
            for op, call in calls.items():
                call()  # warm-up
                comm.barrier(group)
                start = time.perf_counter()
                for _ in range(iters):
                    call()
                timed.setdefault((op, n * 4), []).append((time.perf_counter() - start) / iters)
        for name, body in inline.items():
            comm.barrier(group)
            start = time.perf_counter()
            for _ in range(2 * iters):
                body()
            timed.setdefault((name, 0), []).append((time.perf_counter() - start) / (2 * iters))
    med = {k: sorted(v)[len(v) // 2] for k, v in timed.items()}
    out = [(op, nbytes, sec) for (op, nbytes), sec in med.items() if nbytes]
    extra = [tc - c - b for tc, c, b in zip(timed[("compute+call", 0)], timed[("compute", 0)], timed[("call", 0)],
                                            strict=True)]
    out.append(("call_between_compute", small.numel() * 4, max(0.0, sorted(extra)[len(extra) // 2])))
    return out


# The parallel runtime's own work per axis (``Hardware.axis_block_s``): short runs of one calibration model through
# the real ``Trainer`` / ``parallelize()`` on 2 processes, each axis against plain DP on the same model, at four
# sizes (``AXIS_SIZES``: 4x the tokens, 2x the blocks, 2x d_model; for TP also both) so the work per block call, per
# activation element, per microbatch (outside the blocks: TP's vocab-parallel embedding, head and loss) and per
# parameter of a block (ZeRO-3's flat-buffer copies) separate. The model is not the demo model the step-time check
# runs (configs/small.yaml: d_model 256, 4 layers, 16 x 256 tokens).
AXIS_MODEL = ["model.d_model=128", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
              f"model.vocab_size={BYTE_VOCAB}", "data.source=synthetic", "train.eval_every=0", "train.sample_tokens=0",
              "train.progress=false", "train.tensorboard=false", "train.ckpt_every=0"]
AXIS_SIZES = {"small": ["train.seq_len=128", "model.max_seq_len=128", "train.global_batch=8"],
              "large": ["train.seq_len=256", "model.max_seq_len=256", "train.global_batch=16"],
              "deep": ["train.seq_len=128", "model.max_seq_len=128", "train.global_batch=8", "model.n_layers=4"],
              "wide": ["train.seq_len=128", "model.max_seq_len=128", "train.global_batch=8", "model.d_model=256"],
              "wide-large": ["train.seq_len=256", "model.max_seq_len=256", "train.global_batch=16",
                             "model.d_model=256"]}
# Sizes only the axes named run (beside plain DP). TP's work per activation element, fitted on the four sizes above
# (up to 0.5M elements a block), came out at 23-45 ns in five fits and priced the demo model's tp2 blocks (1M
# elements) at up to twice what they cost (docs/planner.md); TP's figures are not linear in the elements, and a point
# at that scale keeps the fit from extrapolating. The other axes' rows have not needed it, and a size costs a run.
AXIS_SIZE_ONLY = {"wide-large": ("tp",)}
AXIS_RUNS = {"base": ["parallel.zero=0"], "tp": ["parallel.tp=2", "parallel.sp=true"], "cp": ["parallel.cp=2"],
             "cp_ulysses": ["parallel.cp=2", "parallel.cp_attention=ulysses"],
             "moe": ["model.moe_experts=4", "model.moe_top_k=2", "parallel.ep=2"], "zero3": ["parallel.zero=3"],
             "zb": ["parallel.pp=2", "parallel.schedule=zb-h1", "parallel.microbatches=4"],
             "selective": ["parallel.zero=0", "train.recompute=selective"]}
# Which terms of ``steptime.axis_features`` (0 per block call, 1 per activation element, 2 per microbatch, 3 per block
# parameter, 4 per attention score) each axis's work can have, from what its runtime does: four sizes fitted to four
# free terms fit their noise (TP's extrapolated to +47% on the demo model). TP: autograd functions per call,
# activation copies, the vocab-parallel embedding/head/loss once per microbatch; MoE: routing of tokens, the
# per-expert loop; ZeRO-3: flat-buffer gathers and frees of the block's parameters; zero-bubble: the deferred weight
# gradients (their activations and parameters); context parallelism: ring and all-gather attention run each chunk
# pair's attention and its online-softmax merge apart (scores, activations), Ulysses packs, reorders and slices q,
# k, v and the output around its all-to-alls (activations); selective recompute: its policy, a Python dispatch mode
# that sees every op of a block's forward and of its rerun (per call), and the element-wise rerun beyond what
# ``elem_s`` prices (activations). Without the score term the ring's work, fitted at 128-256 tokens, came out 3x too
# small on the demo model's 8 heads (cp2 predicted 31% fast). All-gather attention
# runs the ring's per-chunk attention and merges: measured on its own it fitted 15.12 ns per score against the
# ring's 14.76 (2026-11-27), so it is priced as the ring (``steptime._axis_work``) and the demo's first calibration
# spends no run on it.
AXIS_TERMS = {"tp": (0, 1, 2), "cp": (0, 1, 4), "cp_ulysses": (0, 1, 4), "moe": (0, 1, 2), "zero3": (0, 3),
              "zb": (0, 1, 3), "selective": (0, 1)}


def _axis_configs(dtype: str = "bf16") -> dict[tuple[str, str], list[str]]:
    """Every (size, run) of the axis-work calibration, in ``train.dtype`` ``dtype``: its overrides."""
    return {(size, name): [*AXIS_MODEL, f"train.dtype={dtype}", *sized, *over] for size, sized in AXIS_SIZES.items()
            for name, over in AXIS_RUNS.items() if name == "base" or name in AXIS_SIZE_ONLY.get(size, (name,))}


def _axis_worker(rank: int, world_size: int, runs: dict, steps: int, rounds: int) -> dict:
    """Seconds per training step of each run (its overrides): the fastest of ``rounds`` rounds (the runs interleaved,
    so a slow moment of the machine spreads over all of them) of each round's median step, the statistic the step
    calibration (its fastest repeat) and ``benchmarks/steptime_check.py`` (its fastest round) keep too."""
    from meshtrain.config import load_config
    from meshtrain.train.trainer import Trainer

    torch.set_num_threads(1)
    trainers = {key: Trainer(load_config(None, over)) for key, over in runs.items()}
    for tr in trainers.values():  # warm-up: buffers, buckets, connections
        tr.train_step(0)
        tr.train_step(1)
    times: dict = {key: [] for key in runs}
    for r in range(rounds):
        for key, tr in trainers.items():
            per = []
            for i in range(steps):
                start = time.perf_counter()
                tr.train_step(2 + r * steps + i)
                per.append(time.perf_counter() - start)
            times[key].append(sorted(per)[len(per) // 2])
    return {key: min(v) for key, v in times.items()}


def measure_axis_work(hw: Hardware, steps: int = 4, rounds: int = 7) -> tuple[dict[str, list[float]], list[str]]:
    """The runtime's own work of each axis (``AXIS_RUNS``) that ``hw``'s step costs and collectives leave unpriced:
    ({axis: [s per block call, per activation element, per microbatch, per block parameter]}, report lines). At each
    size, (measured - measured plain DP) - (predicted - predicted plain DP): the common error of the plain model
    cancels, what is left is the axis's work the model does not count; ``fit_axis_work`` splits the sizes' figures
    (more tokens, more blocks, wider blocks; ``AXIS_SIZE_ONLY``) into the terms (``steptime.axis_features``). Never
    negative."""
    from meshtrain.config import load_config
    from meshtrain.plan.check import layout_of, predict_step_time
    from meshtrain.plan.steptime import axis_features, tokens_per_microbatch

    runs, secs = _axis_configs(hw.dtype), {}
    for size in AXIS_SIZES:
        # Each size in fresh processes, as a run has them: in one process a size timed after the others' trainers
        # had run (and been freed) was slower than timed first (wide-large: plain DP 173 against 138 ms, tp2 326
        # against 253, with the freed trainers then leaking; 135 against 126 and 261 against 232 without the leak;
        # 2026-11-28), and so was the figure that difference left.
        mine = {key: over for key, over in runs.items() if key[0] == size}
        measured = spawn(_axis_worker, 2, (mine, steps, rounds), timeout=900.0)
        secs.update({key: max(r[key] for r in measured) for key in mine})
    cfgs = {key: load_config(None, over) for key, over in runs.items()}
    pred = {key: predict_step_time(cfg, 2, hw).step_s for key, cfg in cfgs.items()}
    out, lines = {}, []
    for name in AXIS_RUNS:
        if name == "base":
            continue
        points, sizes = [], [size for size in AXIS_SIZES if (size, name) in runs]
        for size in sizes:
            cfg, base = cfgs[(size, name)], (size, "base")
            extra = (secs[(size, name)] - secs[base]) - (pred[(size, name)] - pred[base])
            lay = layout_of(cfg, 2)
            t = tokens_per_microbatch(cfg.train.global_batch, cfg.train.seq_len, lay)
            points.append(([f * lay.microbatches for f in axis_features(cfg.model, lay, t, cfg.train.seq_len)], extra))
            lines.append(f"  {name:<12} {size:<5} measured {secs[(size, name)] * 1e3:6.1f} ms (plain DP "
                         f"{secs[base] * 1e3:6.1f}), predicted {pred[(size, name)] * 1e3:6.1f} ms "
                         f"({pred[base] * 1e3:6.1f}): {extra * 1e3:+.2f} ms")
        out[name] = fit_axis_work(points, AXIS_TERMS[name], noise=[secs[(size, name)] for size in sizes])
        lines.append(f"  {name:<12} fitted: {out[name][0] * 1e3:.2f} ms per block call + "
                     f"{out[name][1] * 1e9:.2f} ns per activation element + {out[name][2] * 1e3:.2f} ms per "
                     f"microbatch + {out[name][3] * 1e9:.2f} ns per block parameter + {out[name][4] * 1e9:.2f} ns per "
                     f"attention score")
    return out, lines


def _probe_worker(rank: int, world_size: int, reps: int, dtype: str) -> float:
    torch.set_num_threads(1)
    return _time_steps(PROBE_MODEL, reps, dtype)


def probe_speed(processes: int | None = None, reps: int = 5, dtype: str = "bf16") -> float:
    """Seconds of one reference training step (``PROBE_MODEL``) on ``processes`` (default: the cores) concurrent
    one-thread processes, the slowest's fastest of ``reps``. A shared machine's speed drifts (other users, a
    virtual CPU's neighbours); the profile keeps the probe's time at calibration, so a later probe says how much
    faster or slower the machine is now (``benchmarks/steptime_check.py``). At calibration the reference step is
    timed in the same processes, just before the calibration steps (``_compute_worker``): a separate probe taken
    after the other measurements read about 2x slower than the steps it was to stand for."""
    return max(spawn(_probe_worker, processes or os.cpu_count() or 1, (reps, dtype), timeout=300.0))


def measure_step_costs(processes: int, reps: int = 5, dtype: str = "bf16"
                       ) -> tuple[StepCosts, float, list[tuple], float]:
    """Fit the step-cost terms of ``dtype`` steps on ``processes`` concurrent one-thread processes; (costs, RMS
    relative error of the fit, [(model spec, measured s, fitted s)], the reference step's seconds in the same
    processes and moment)."""
    per_rank = spawn(_compute_worker, processes, (CALIBRATION_MODELS, reps, dtype), timeout=600.0)
    probe = max(r[0] for r in per_rank)
    rate = min(r[1] for r in per_rank)
    seconds = [max(r[2][i] for r in per_rank) for i in range(len(CALIBRATION_MODELS))]
    rows = [step_features(ModelConfig(d_model=d, n_layers=L, n_heads=h, n_kv_heads=max(1, h // 2),
                                      vocab_size=BYTE_VOCAB, max_seq_len=T), b, T)
            for d, L, h, b, T in CALIBRATION_MODELS]
    costs, err = fit_step_costs(rows, seconds, rate)
    return costs, err, [(s, t, costs.seconds(r)) for s, t, r in zip(CALIBRATION_MODELS, seconds, rows, strict=True)], \
        probe


def measure_collectives(world_size: int = 2, iters: int = 10
                        ) -> tuple[float, float, float, dict[str, tuple[float, float, float]], float]:
    """Gloo collectives between ``world_size`` local processes, fitted in ``network.collective_time``'s form:
    (latency s per tree level, per-process egress bandwidth B/s, RMS relative error) over all ops together,
    each op's own (latency, bandwidth, error), and the host seconds of one call issued between compute beyond
    the back-to-back call's own time (``Hardware.call_s``: Python, the meter, the peer's skew and wake-up)."""
    results = spawn(_collective_worker, world_size, (COLLECTIVE_SIZES, iters), timeout=600.0)
    samples, by_op = [], []
    for i, (op, nbytes, _) in enumerate(results[0][:-1]):
        secs = max(r[i][2] for r in results)
        steps = 1.0 if op == "send" else (2.0 if op == "all_reduce" else 1.0) * (world_size - 1).bit_length()
        wire = nbytes * wire_factor(op, world_size)
        samples.append((steps, wire, secs))
        by_op.append((op, steps, wire, secs))
    latency, bw, err = fit_latency_bandwidth(samples)
    per_op = fit_collective_ops(by_op)
    call_s = max(r[-1][2] for r in results)  # the slower rank's: the other waits for it
    return latency, bw, err, per_op, call_s


def measure_copy_bandwidth(mbytes: float = 256.0, iters: int = 5) -> float:
    """Memory bandwidth of a large tensor copy (read + write), bytes/s: the CPU's stand-in for HBM."""
    a = torch.empty(int(mbytes * 1e6 / 4))
    b = torch.empty_like(a)
    b.copy_(a)
    start = time.perf_counter()
    for _ in range(iters):
        b.copy_(a)
    return 2 * a.numel() * 4 * iters / (time.perf_counter() - start)


def calibrate_cpu_local(path: str | Path | None = None, world_size: int | None = None,
                        report: list[str] | None = None, dtype: str = "auto") -> Hardware:
    """Measure this machine and save the ``cpu-local`` profile (see the module docstring). ``world_size``: the
    processes measured at once (default: the cores); ``dtype``: the ``train.dtype`` measured (auto: bf16 where this
    CPU computes it natively, else fp32, as a run resolves it). Lines describing the fit are appended to
    ``report``."""
    from meshtrain.train.preflight import resolve_dtype

    dtype = resolve_dtype(dtype, torch.device("cpu"))
    cores = os.cpu_count() or 1
    procs = world_size or cores
    costs, fit_err, table, probe = measure_step_costs(procs, dtype=dtype)
    latency, bw, comm_err, per_op, call_s = measure_collectives(max(2, procs))
    mem_bw = measure_copy_bandwidth()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 8e9
    hw = Hardware(
        "cpu-local", f"this machine (CPU, {cores} cores, one thread per process)", costs.flop_rate,
        float(ram) / procs, mem_bw, intra_bw=bw, inter_bw=bw, devices_per_node=procs, domain=max(2, procs),
        tp_max=max(2, procs), intra_latency=latency, inter_latency=latency, cores=cores, elem_s=costs.elem_s,
        score_s=costs.score_s, block_s=costs.block_s, param_s=costs.param_s, step_s=costs.step_s, dtype=dtype,
        probe_s=probe,
        collective_fits={op: [lat, b] for op, (lat, b, _) in per_op.items()}, call_s=call_s,
        source=f"meshtrain plan --calibrate on {time.strftime('%Y-%m-%d %H:%M')}: {len(table)} {dtype} training steps "
               f"on {procs} one-thread processes at once (fit RMS error {fit_err:.1%}), gloo collectives "
               f"{COLLECTIVE_SIZES[0] / 1e3:.0f} KB-{COLLECTIVE_SIZES[-1] / 1e6:.0f} MB via meshtrain.comm "
               f"(fit RMS error {comm_err:.1%}), tensor copy")
    axis_work, axis_lines = measure_axis_work(hw)
    hw = replace(hw, axis_block_s=axis_work)
    save_profile(hw, path or hardware_cache_dir() / "cpu-local.json")
    if report is not None:
        report.append(f"step-cost fit over {len(table)} training steps, RMS relative error {fit_err:.1%}:")
        for (d, L, _, b, T), got, fit in table:
            report.append(f"  d_model {d:>3} layers {L} batch {b:>2} x {T:>3}: measured {got * 1e3:8.2f} ms, "
                          f"fitted {fit * 1e3:8.2f} ms")
        report.append(f"collectives: latency {latency * 1e6:.0f} us per step, {bw / 1e9:.2f} GB/s "
                      f"(fit RMS error {comm_err:.1%}, all ops together); op by op:")
        for op, (lat, b, e) in per_op.items():
            report.append(f"  {op:<15} latency {lat * 1e6:6.0f} us per step, {b / 1e9:6.2f} GB/s "
                          f"(fit RMS error {e:.1%})")
        report.append(f"host work per collective call between compute: {call_s * 1e6:.0f} us")
        report.append("the parallel runtime's own work per block (2 processes through parallelize(), each axis "
                      "against plain DP, beyond what the model above prices):")
        report += axis_lines
    return hw
