"""``meshtrain plan``: pick a layout before spending a GPU.

    meshtrain plan --model llama3-70b --hardware h100 --nodes 128 --batch-tokens 4M [--top 3]
                   [--json] [--emit run.yaml] [--plot out.png] [--revision 003|000] [--all]
    meshtrain plan --calibrate                      # measure this machine -> the cpu-local profile
    meshtrain plan --check-run runs/x               # a finished run: predicted against measured bytes
    meshtrain plan --list-hardware
    meshtrain plan <query> ... [--json]           # one of the book's analyses: plan/query_cli.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from meshtrain.config import (
    BYTE_VOCAB,
    CP_ATTENTIONS,
    REDUCE_DTYPES,
    SCHEDULES,
    ArgumentParser,
    ConfigError,
    check_output_file,
)
from meshtrain.plan.book import DEFAULT_REVISION, MIXED_REVISIONS
from meshtrain.plan.explain import explain, format_table, why_best
from meshtrain.plan.figure import plot_comm_vs_compute
from meshtrain.plan.flops import param_count
from meshtrain.plan.hardware import HARDWARE, get_hardware, hardware_cache_dir
from meshtrain.plan.memory import DTYPE_BYTES, PRECISIONS, run_precision
from meshtrain.plan.problem import Problem, plan_config
from meshtrain.plan.search import DEFAULT_SCHEDULES, SearchOptions, check_runnable, emit_yaml, parse_tokens, search


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


DEFAULT_MAX_PP = 16


def check_search_flags(args: argparse.Namespace) -> None:
    """The search's flags, each refused in one line naming it: sizes >= 1, ZeRO stages 0-3, known schedules, no
    empty list, a top, a max pp and a token budget that make sense."""
    def listed(values: tuple[int, ...] | None) -> str:
        return ",".join(map(str, values or ())) or "none"

    for flag in ("tp", "pp", "cp"):
        sizes = getattr(args, flag)
        if sizes is not None and (not sizes or min(sizes) < 1):
            raise ValueError(f"--{flag} takes sizes >= 1, e.g. --{flag} 1,2,4; got {listed(sizes)}.")
    if not args.zero or not set(args.zero) <= {0, 1, 2, 3}:
        raise ValueError(f"--zero takes ZeRO stages from 0 to 3, e.g. --zero 1,3; got {listed(args.zero)}.")
    if args.pp and min(args.pp) > 1 and min(args.zero) >= 2:  # config.validate refuses parallel.zero >= 2 with pp
        raise ValueError(f"--zero {listed(args.zero)} with --pp {listed(args.pp)}: ZeRO-2/3 do not combine with "
                         f"pipeline parallelism (each microbatch would reduce-scatter its gradients); add --zero 0 or "
                         f"1, or --pp 1.")
    schedules = [s for s in args.schedules.split(",") if s]
    unknown = [s for s in schedules if s not in SCHEDULES]
    if not schedules or unknown:
        raise ValueError(f"--schedules takes some of {', '.join(SCHEDULES)}; got {', '.join(unknown) or 'none'}.")
    attns = [a for a in args.cp_attention.split(",") if a]
    if not attns or set(attns) - set(CP_ATTENTIONS):
        raise ValueError(f"--cp-attention takes some of {', '.join(CP_ATTENTIONS)}, e.g. --cp-attention ring,ulysses; "
                         f"got {args.cp_attention or 'none'}.")
    if args.top < 1 or args.max_pp < 1:
        raise ValueError(f"--top and --max-pp must be >= 1, got {args.top} and {args.max_pp}.")
    if args.pp and args.max_pp != DEFAULT_MAX_PP and max(args.pp) > args.max_pp:  # which one did the user mean?
        raise ValueError(f"--pp {listed(args.pp)} goes above --max-pp {args.max_pp}: drop the sizes above it, or "
                         f"raise --max-pp.")
    if not (math.isfinite(args.train_tokens) and args.train_tokens >= 0):
        raise ValueError(f"--train-tokens must be a number of tokens >= 0, got {args.train_tokens}.")


# The modes of ``meshtrain plan`` besides the search, and the options each reads (others would be ignored).
MODES = {"jax_check": {"model", "seq_len"}, "check_run": set(), "calibrate": set(), "list_hardware": set()}


def check_one_mode(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One mode at a time, without options it does not read: each was ignored without a word (``--list-hardware
    --json`` printed text, ``--check-run DIR --list-hardware`` only the check)."""
    def flag(dest: str) -> str:
        return "--" + dest.replace("_", "-")

    modes = [m for m in MODES if getattr(args, m)]
    if len(modes) > 1:
        raise ValueError(f"{' and '.join(map(flag, modes))} are separate modes of meshtrain plan: give one.")
    if modes:
        ignored = [flag(d) for d, v in vars(args).items()
                   if d not in MODES and d not in MODES[modes[0]] and v != ap.get_default(d)]
        if ignored:
            raise ValueError(f"{flag(modes[0])} reads no {', '.join(ignored)}: leave "
                             f"{'it' if len(ignored) == 1 else 'them'} out, or plan without {flag(modes[0])}.")


def build_problem(args: argparse.Namespace) -> Problem:
    """The Problem the options describe (model preset or YAML, batch, cluster, assumptions)."""
    cfg = plan_config(args.model)
    if cfg.model.vocab_size == 0:  # taken from the tokenizer at run time; plan with the byte tokenizer's
        cfg.model.vocab_size = BYTE_VOCAB
    if args.seq_len < 0:
        raise ValueError(f"--seq-len must be >= 0 (0: the config's train.seq_len), got {args.seq_len}.")
    seq_len = args.seq_len or cfg.train.seq_len
    tokens = parse_tokens(args.batch_tokens)
    sequences = tokens // seq_len
    if sequences < 1:
        raise ValueError(f"--batch-tokens {args.batch_tokens} is less than one sequence of {seq_len} tokens.")
    hw = get_hardware(args.hardware)
    if args.devices is not None and args.nodes is not None:  # two sizes of one slice: which did the user mean?
        raise ValueError(f"--nodes {args.nodes} and --devices {args.devices} both give the slice's size: give one "
                         f"(--nodes counts {hw.devices_per_node}-device hosts of {args.hardware}, --devices counts "
                         f"devices).")
    if args.devices is not None:
        if args.devices < 1:
            raise ValueError(f"--devices must be >= 1, got {args.devices}.")
        if args.devices < hw.devices_per_node and not hw.mesh_axes:
            hw = hw.part_of_node(args.devices)  # one GPU, say
        elif args.devices % hw.devices_per_node:
            raise ValueError(f"--devices {args.devices} is not a whole number of {hw.devices_per_node}-device nodes.")
        nodes = args.devices // hw.devices_per_node
    else:
        nodes = 1 if args.nodes is None else args.nodes
    if nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {nodes}")
    if args.revision not in MIXED_REVISIONS:
        raise ValueError(f"--revision must be one of {', '.join(MIXED_REVISIONS)}, got {args.revision}")
    precision = PRECISIONS[args.precision]
    if args.precision == "meshtrain" and hw.dtype == "fp32":  # a CPU calibrated without native bf16 trains in fp32
        precision = run_precision("fp32")
    if args.reduce_dtype:  # the DP family's gradient collectives in another dtype (parallel.reduce_dtype)
        precision = dataclasses.replace(precision, reduce=DTYPE_BYTES[args.reduce_dtype])
    return Problem(cfg.model, seq_len, sequences, hw, nodes, model_name=str(args.model),
                   precision=precision, efficiency=args.efficiency,
                   memory_fraction=args.memory_fraction, revision=args.revision, train_tokens=args.train_tokens,
                   documents=cfg.train.attention_mask == "document")


def jax_check(args: argparse.Namespace) -> int:
    """``--jax-check``: the seed's cases for the model's layer (x [global_batch x seq_len, D], W_in [D, F]),
    predicted and compiled; 0 when XLA's collectives equal one predicted plan in every case."""
    try:
        import jax  # noqa: F401
    except ImportError:
        raise ConfigError("meshtrain plan --jax-check needs jax, which is not installed: pip install "
                          "'meshtrain[jax]'.") from None
    from meshtrain.jax import use_host_devices

    use_host_devices(8)
    from meshtrain.jax.hlo import report, seed_cases

    cfg = plan_config(args.model)
    m, seq = cfg.model, args.seq_len or cfg.train.seq_len
    batch = cfg.train.global_batch
    if batch % 2 or m.d_model % 4 or m.hidden_dim % 4:
        raise ConfigError(f"--jax-check splits the batch ({batch}) over 2 and d_model ({m.d_model}) and the MLP "
                          f"({m.hidden_dim}) over 4: choose a --model whose sizes divide.")
    cases = seed_cases(batch, seq, m.d_model, m.hidden_dim)
    print(report(cases, {"dp": 2, "tp": 4}, f"{args.model}: batch {batch} x seq {seq}, D {m.d_model}, F "
                                             f"{m.hidden_dim}, fp32, mesh X (dp) = 2 x Y (tp) = 4; bytes per device"))
    return 0 if all(c.chosen for c in cases) else 1


def main(argv: list[str]) -> int:
    """Parse ``argv`` (without the command name), run the search and print/write what was asked; return 0.
    A first argument naming a query (``min-devices``, ``critical-batch``, ...) runs that analysis instead."""
    from meshtrain.plan.query_cli import QUERIES

    if argv and argv[0] in QUERIES:
        from meshtrain.plan.query_cli import main as query_main

        return query_main(argv)
    ap = ArgumentParser(prog="meshtrain plan", description="Search parallel layouts by predicted step time. "
                                 "Queries: " + ", ".join(f"`meshtrain plan {q}` ({d})" for q, d in QUERIES.items()))
    ap.add_argument("--model", default="llama3-8b",
                    help="preset name (llama3-70b, ...), a YAML config, or a HuggingFace model folder")
    ap.add_argument("--hardware", default="h100", help=f"one of {', '.join(HARDWARE)}, cpu-local or a profile .json")
    ap.add_argument("--nodes", type=int, default=None, help="nodes (hosts) of --hardware (default 1)")
    ap.add_argument("--devices", type=int, default=None, help="devices, instead of --nodes")
    ap.add_argument("--batch-tokens", default="4M", help="global batch in tokens (4M = 4 x 2^20)")
    ap.add_argument("--seq-len", type=int, default=0, help="sequence length (default: the config's train.seq_len)")
    ap.add_argument("--top", type=int, default=10, help="layouts to print")
    ap.add_argument("--train-tokens", type=float, default=0.0, help="token budget to report days for, e.g. 15e12")
    ap.add_argument("--precision", default="meshtrain", choices=sorted(PRECISIONS),
                    help="meshtrain: fp32 params/grads/Adam + bf16 compute (what meshtrain runs); mixed: "
                         "16-bit params/grads + fp32 master and Adam")
    ap.add_argument("--reduce-dtype", default=None, choices=REDUCE_DTYPES,
                    help="dtype of the data-parallel gradient collectives (parallel.reduce_dtype; default: the "
                         "precision's: fp32 for meshtrain, bf16 for mixed); bf16 halves their bytes")
    ap.add_argument("--efficiency", type=float, default=0.75, help="fraction of peak FLOP/s a large matmul reaches")
    ap.add_argument("--memory-fraction", type=float, default=0.9, help="usable fraction of device memory")
    ap.add_argument("--revision", default=DEFAULT_REVISION,
                    help="mixed FSDP+TP analysis: 003 (comms of the two axes overlap; default) or 000 (they add)")
    ap.add_argument("--tp", type=_ints, help="tensor-parallel sizes to try, e.g. 4,8")
    ap.add_argument("--pp", type=_ints, help="pipeline sizes to try")
    ap.add_argument("--cp", type=_ints, default=(1, 2, 4), help="context-parallel sizes to try")
    ap.add_argument("--cp-attention", default="ring,ulysses",
                    help="context-parallel attentions to try (parallel.cp_attention): some of ring, allgather, ulysses")
    ap.add_argument("--zero", type=_ints, default=(0, 1, 2, 3), help="ZeRO stages to try")
    ap.add_argument("--schedules", default=",".join(DEFAULT_SCHEDULES), help="pipeline schedules to try")
    ap.add_argument("--max-pp", type=int, default=DEFAULT_MAX_PP)
    ap.add_argument("--no-hsdp", action="store_true", help="do not try HSDP shard groups")
    ap.add_argument("--all", action="store_true",
                    help="no effect, kept for old command lines: the search tries every parallelism, as the "
                         "runtime runs them all")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table and explanation")
    ap.add_argument("--emit", help="write the best runnable layout as a config for meshtrain train --config")
    ap.add_argument("--plot", help="draw communication vs compute time per layer against the batch (PNG)")
    ap.add_argument("--calibrate", action="store_true", help="measure this machine and save the cpu-local profile")
    ap.add_argument("--list-hardware", action="store_true", help="print the hardware presets with their sources")
    ap.add_argument("--check-run", metavar="DIR", help="a finished run folder: predicted against measured bytes")
    ap.add_argument("--jax-check", action="store_true",
                    help="compile seed 002's sharded-matmul cases for one --model layer with JAX on a 2 x 4 CPU mesh "
                         "and compare the HLO's collectives with the prediction (needs the jax extra; docs/jax.md)")
    args = ap.parse_args(argv)
    check_one_mode(ap, args)

    if args.jax_check:
        return jax_check(args)

    if args.check_run:  # predicted against measured (meshtrain/plan/check.py)
        from meshtrain.plan.check import check_run

        text, ok, _ = check_run(args.check_run)
        print(text)
        return 0 if ok else 1

    if args.calibrate:  # measured (processes, collectives): meshtrain/calibrate.py
        from meshtrain.calibrate import calibrate_cpu_local

        report: list[str] = []
        hw = calibrate_cpu_local(report=report)
        print("\n".join(report))
        print(f"wrote {hardware_cache_dir() / 'cpu-local.json'}: {hw.dtype} matmul {hw.bf16_flops / 1e9:.1f} "
              f"GFLOP/s per process, non-matmul {hw.elem_s * 1e9:.2f} ns/element, "
              f"{hw.score_s * 1e9:.2f} ns/attention score, {hw.block_s * 1e6:.0f} us/block, optimizer "
              f"{hw.param_s * 1e9:.2f} ns/parameter, {hw.step_s * 1e3:.2f} ms/step; gloo {hw.intra_bw / 1e9:.2f} "
              f"GB/s per process, {hw.intra_latency * 1e6:.0f} us latency; memory copy {hw.hbm_bw / 1e9:.1f} GB/s")
        return 0
    if args.list_hardware:
        for key, hw in HARDWARE.items():
            print(f"{key:<9} {hw.bf16_flops / 1e12:7.0f} TFLOP/s  {hw.hbm_bytes / 1e9:5.0f} GB  "
                  f"HBM {hw.hbm_bw / 1e12:.2f} TB/s  fast {hw.intra_bw / 1e9:.0f} GB/s"
                  f"{' per axis ' + 'x'.join(map(str, hw.mesh_axes)) if hw.torus else ''}  "
                  f"slow {hw.inter_bw / 1e9:.2f} GB/s  {hw.devices_per_node}/node\n          {hw.source}")
        return 0
    if not (0 < args.efficiency <= 1 and 0 < args.memory_fraction <= 1):
        raise ValueError("--efficiency and --memory-fraction must be in (0, 1]")
    check_search_flags(args)
    if args.emit is not None:
        check_output_file("--emit", args.emit)
    if args.plot is not None:
        check_output_file("--plot", args.plot, ".png")
    problem = build_problem(args)
    opts = SearchOptions(tps=args.tp, pps=args.pp, cps=args.cp, zeros=args.zero,
                         cp_attentions=tuple(a for a in args.cp_attention.split(",") if a),
                         schedules=tuple(s for s in args.schedules.split(",") if s), max_pp=args.max_pp,
                         hsdp=not args.no_hsdp)
    result = search(problem, opts)
    top = result.ranked[: max(1, args.top)]
    for est in top:
        check_runnable(problem, est)
    emitted = None
    if args.emit:
        chosen = next((e for e in top if e.runnable), None)
        if chosen is None:
            chosen = next((check_runnable(problem, e) for e in result.ranked[len(top):]
                           if check_runnable(problem, e).runnable), None)
        if chosen is None and not result.ranked:  # none tried (the rules named) or none fits (memory)
            raise ConfigError(f"nothing to --emit: {explain(problem, result)}")
        if chosen is None:
            raise ConfigError("no layout that fits is runnable by meshtrain today; nothing to --emit")
        emitted = (emit_yaml(problem, chosen, args.emit), chosen)
    if args.plot:  # after --emit's refusal, which would leave it behind
        plot_comm_vs_compute(problem, args.plot)
        if not args.json:
            print(f"wrote {args.plot}")
    if args.json:
        out = {
            "problem": {"model": problem.model_name, "hardware": problem.hw.to_dict(), "nodes": problem.nodes,
                        "devices": problem.devices, "seq_len": problem.seq_len, "sequences": problem.sequences,
                        "batch_tokens": problem.batch_tokens, "precision": args.precision,
                        "act_bytes": problem.precision.act, "reduce_bytes": problem.precision.reduce,
                        "efficiency": problem.efficiency, "memory_fraction": problem.memory_fraction,
                        "revision": problem.revision},
            "tried": result.tried, "fitting": len(result.ranked), "why": why_best(problem, result),
            "top": [e.to_dict() for e in top],
            "explanation": explain(problem, result),  # with no layout: why (the rules of ``rejected``, or memory)
            "rejected": list(result.rejected),
            "emitted": str(emitted[0]) if emitted else None,
        }
        print(json.dumps(out, indent=2))
        return 0
    print(f"{problem.model_name}: {param_count(problem.model).total:,} parameters, "
          f"{problem.batch_tokens:,} tokens per step ({problem.sequences} x {problem.seq_len}) on "
          f"{problem.nodes} x {problem.hw.devices_per_node} {problem.hw.name} = {problem.devices} devices")
    reduced = "bf16" if problem.precision.reduce == 2 else "fp32"
    speed = "measured step costs (--calibrate)" if problem.hw.measured_steps else \
        f"matmuls at {problem.efficiency:.0%} of peak" + (", other kernels as measured on an H100 (GPU_KERNELS)"
                                                          if problem.hw.gpu_kernels else "")
    print(f"assumptions: {args.precision} precision (gradients reduced in {reduced}), {speed}, "
          f"{problem.memory_fraction:.0%} of device memory usable, mixed FSDP+TP revision {problem.revision}")
    print(f"{result.tried:,} layouts tried, {len(result.ranked):,} fit in "
          f"{problem.memory_budget / 1e9:.1f} GB per device")
    why = why_best(problem, result)
    print((why + "\n") if why else "")
    if top:
        print(format_table(problem, top))
        print()
    print(explain(problem, result, why=False))
    if emitted:
        path, est = emitted
        note = "" if est is result.best else f" (the best layout the runtime accepts today; #1 is not: " \
                                             f"{result.best.not_runnable_reason})"
        print(f"\nwrote {path}: {est.layout.describe()}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
