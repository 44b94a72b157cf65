"""``meshtrain demo`` (what ``make train`` runs): the product end to end on this machine.

    meshtrain demo [--config configs/small.yaml] [--out runs/small] [--nproc N] [--recalibrate] [key=value ...]

1. calibrate this machine once (``meshtrain plan --calibrate``'s function; the profile is cached and reused);
2. ask the planner for the fastest layout of the config's model and batch on N local processes, keeping only
   layouts this config runs (``validate_layout`` on the merged config), and say why it beat the runner-up
   (the planner's own sentence, ``plan.explain.why_best``);
3. train under it with ``meshtrain train --nproc N`` (the config written as ``<out>/run.yaml``);
4. print predicted against measured bytes, memory and step time, a sample from the last checkpoint, and write
   ``report.md`` and ``loss.png`` into the run folder (``meshtrain/train/report.py``).

A command of its own rather than ``train --plan auto``: it calibrates, samples and reports around a training run,
steps that a plain ``train`` (also used under SLURM, with restarts) must not take on its own.
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from meshtrain.config import BYTE_VOCAB, ArgumentParser, Config, ConfigError, load_config, refuse_empty, save_config
from meshtrain.plan.explain import format_table, why_best
from meshtrain.plan.hardware import Hardware, hardware_cache_dir, load_profile
from meshtrain.plan.memory import run_precision
from meshtrain.plan.problem import Estimate, Problem
from meshtrain.plan.search import SearchResult, search, to_config
from meshtrain.plan.validate import validate_layout

DEMO_CONFIG = "configs/small.yaml"  # the repository's, relative to its root (README's command runs there)


def default_nproc() -> int:
    """One process per core this process may use, at most 4 (the demo model gains nothing from more)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, 4))


def machine_profile(nproc: int, recalibrate: bool = False, dtype: str = "bf16") -> tuple[Hardware, str]:
    """The calibrated ``cpu-local`` profile for ``nproc`` processes computing in ``dtype``: the cached one when it
    was measured with as many, in that dtype, and carries measured step costs (a profile from an older calibration
    does not), else measured now (minutes) and cached; and a note saying which."""
    path = hardware_cache_dir() / "cpu-local.json"
    if path.is_file() and not recalibrate:
        hw = load_profile(path)
        if hw.devices_per_node == nproc and hw.dtype == dtype and hw.measured_steps:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(path.stat().st_mtime))
            return hw, f"calibration of {when} cached in {path}; --recalibrate measures again"
    from meshtrain.calibrate import calibrate_cpu_local

    print(f"calibrating this machine for {nproc} process{'es' if nproc > 1 else ''} ({dtype} training steps, gloo "
          f"collectives, memory copy) ...", flush=True)
    hw = calibrate_cpu_local(path, world_size=nproc, dtype=dtype)
    return hw, f"calibrated just now, cached in {path}"


def with_layout(cfg: Config, layout_cfg: Config) -> Config:
    """The demo's config with a planned layout's parallel section, accumulation and recompute."""
    out = copy.deepcopy(cfg)
    out.parallel = copy.deepcopy(layout_cfg.parallel)
    out.parallel.reduce_dtype = cfg.parallel.reduce_dtype  # the run's own choice; the planner modelled it (below)
    out.train.grad_accum, out.train.recompute = layout_cfg.train.grad_accum, layout_cfg.train.recompute
    return out


def runnable_ranked(problem: Problem, cfg: Config, nproc: int) -> tuple[list[tuple[Estimate, Config]], int]:
    """The planner's layouts that fit, fastest first, each merged into ``cfg`` and kept only if that config
    validates on ``nproc`` processes (the runtime's own check, before any process starts); and how many layouts
    the planner tried."""
    out = []
    result = search(problem)
    for est in result.ranked:
        run_cfg = with_layout(cfg, to_config(problem, est.layout))
        try:
            validate_layout(run_cfg, nproc)
        except ConfigError:
            continue
        est.runnable = True  # the table's "runs" column
        out.append((est, run_cfg))
    return out, result.tried


def why(problem: Problem, ranked: list[Estimate], tried: int) -> str:
    """The planner's one sentence on why the first of ``ranked`` (the runnable layouts, fastest first) beats the
    second (``plan.explain.why_best``), or that it is the only one."""
    if len(ranked) < 2:
        return f"{ranked[0].layout.describe()} is the only layout that fits and runs on these processes."
    return why_best(problem, SearchResult(ranked, tried, None))


def _problem(cfg: Config, hw: Hardware, name: str) -> Problem:
    """The planner's problem: the config's model and global batch on one node of ``hw``, in meshtrain's precision
    for the config's (resolved) compute dtype and gradient reduce dtype."""
    model = copy.deepcopy(cfg.model)
    if model.vocab_size == 0:  # taken from the tokenizer at run time: the byte tokenizer's, as `meshtrain plan`
        model.vocab_size = BYTE_VOCAB
    precision = run_precision(cfg.train.dtype, cfg.parallel.reduce_dtype)
    return Problem(model, cfg.train.seq_len, cfg.train.global_batch, hw, 1, model_name=name, precision=precision,
                   documents=cfg.train.attention_mask == "document")


def main(argv: list[str], launch: Callable[[list[str]], int], sample: Callable[..., str]) -> int:
    """Parse ``argv`` (without the command name), plan, train, check and report; 0 when all of it worked.
    ``launch`` is ``meshtrain train``'s (argv -> exit code) and ``sample`` ``cli.sample_checkpoint``: passed in by
    the command line, which imports this module."""
    ap = ArgumentParser(prog="meshtrain demo", description="Plan a layout for this machine, train under "
                                 "it on several processes, then compare with the prediction and write a report.")
    ap.add_argument("--config", default=None,
                    help=f"YAML config or preset (default: the repository's {DEMO_CONFIG}, from its root)")
    ap.add_argument("--out", default="runs/small", help="the run folder (must hold no earlier run's checkpoints)")
    ap.add_argument("--nproc", type=int, default=None,
                    help=f"local processes (default: one per core, at most 4; here {default_nproc()})")
    ap.add_argument("--recalibrate", action="store_true", help="measure this machine again, not the cached profile")
    ap.add_argument("overrides", nargs="*", help="dotted overrides of the config, e.g. train.steps=100")
    args = ap.parse_intermixed_args(argv)
    nproc = default_nproc() if args.nproc is None else args.nproc
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc}: run at least 1 process.")
    refuse_empty(args, {"config": "a YAML file or preset name", "out": "a run folder"})
    if args.config is None and not Path(DEMO_CONFIG).is_file():  # a relative default: say so, not "--config"
        raise ConfigError(f"meshtrain demo runs the repository's {DEMO_CONFIG} by default, and {Path.cwd()} holds "
                          f"none: run it from the repository's root, or pass --config (e.g. --config small).")
    args.config = args.config or DEMO_CONFIG
    cfg = load_config(args.config, args.overrides)
    if cfg.parallel.dp or cfg.parallel.tp > 1 or cfg.parallel.pp > 1 or cfg.parallel.cp > 1:
        mine = [o for o in args.overrides if o.split("=", 1)[0] in ("parallel.dp", "parallel.tp", "parallel.pp",
                                                                      "parallel.cp")]
        who = f"the override{'s' if len(mine) > 1 else ''} {' '.join(mine)}" if mine else args.config
        raise ConfigError(f"{who} sets a layout (parallel.*): meshtrain demo lets the planner choose it; "
                          f"run `meshtrain train --nproc {nproc}` to train under your own.")
    import matplotlib  # noqa: F401  (the report's figure: refused now, not after the training)

    from meshtrain.train.preflight import check_before_launch, resolve_device, resolve_dtype
    from meshtrain.train.report import RunFiles, summary_lines, write_report

    out = Path(args.out)
    check_before_launch(copy.deepcopy(cfg), out, 1)  # the run folder, the data, no earlier run: one line each
    # The dtype this CPU trains in (auto: bf16 where it is native, else fp32), calibrated, planned and run in it.
    asked, cfg.train.dtype = cfg.train.dtype, resolve_dtype(cfg.train.dtype, resolve_device(cfg.train.device))

    hw, note = machine_profile(nproc, args.recalibrate, cfg.train.dtype)
    chose = f" (train.dtype=auto: {'native' if cfg.train.dtype == 'bf16' else 'no native bf16 here'})"
    print(f"machine: {hw.name}: {cfg.train.dtype}{chose if asked == 'auto' else ''} matmul "
          f"{hw.bf16_flops / 1e9:.0f} GFLOP/s, all-reduce {hw.intra_bw / 1e9:.2f} GB/s per process ({note})")
    problem = _problem(cfg, hw, str(args.config))
    ranked, tried = runnable_ranked(problem, cfg, nproc)
    if not ranked:
        raise ConfigError(f"the planner found no layout of {args.config} that runs on {nproc} processes: try "
                          f"--nproc 1, or a global batch divisible by {nproc}.")
    (best, run_cfg), runner = ranked[0], (ranked[1][0] if len(ranked) > 1 else None)
    reason = why(problem, [e for e, _ in ranked], tried)
    print(f"planner: {tried} layouts tried, {len(ranked)} fit and run {args.config} on {nproc} "
          f"process{'es' if nproc > 1 else ''}; the "
          f"fastest predicted:\n")
    print(format_table(problem, [e for e, _ in ranked[:5]]))
    print(f"\nchosen: {best.layout.describe()}\n{reason}\n", flush=True)

    out.mkdir(parents=True, exist_ok=True)
    run_yaml = out / "run.yaml"
    sample_tokens, sample_prompt = run_cfg.train.sample_tokens, run_cfg.train.sample_prompt
    run_cfg.train.sample_tokens = 0  # sampled below from the checkpoint, on one process, whatever the layout
    save_config(run_cfg, run_yaml)
    run_yaml.write_text(f"# meshtrain demo: {args.config} under the planner's layout {best.layout.describe()} "
                        f"(predicted {best.step_s * 1e3:.1f} ms per step), sampled afterwards from the checkpoint\n"
                        f"# again: meshtrain train --config {run_yaml} --nproc {nproc} --out OTHER_DIR\n"
                        + run_yaml.read_text())
    plan = {"hardware": hw.to_dict(), "hardware_note": note, "tried": tried, "runnable": len(ranked), "why": reason,
            "chosen": best.to_dict(), "runner_up": runner.to_dict() if runner else None,
            "ranked": [e.to_dict() for e, _ in ranked[:5]]}
    (out / "plan.json").write_text(json.dumps(plan, indent=1))

    code = launch(["--config", str(run_yaml), "--out", str(out), "--nproc", str(nproc)])
    if code:
        return code
    from meshtrain.plan.check import check_run

    table, _, _ = check_run(out)
    print(f"\npredicted against measured (meshtrain plan --check-run {out}):\n{table}\n")
    for line in summary_lines(RunFiles(out)):
        print(line)
    generated = None
    if sample_tokens and run_cfg.data.source == "files":
        generated = sample_prompt + sample(out, sample_prompt, sample_tokens, seed=run_cfg.train.seed)
        print(f"\nsample:\n{generated}")
    report = write_report(out, generated)
    print(f"\nwrote {report} and {out / 'loss.png'}")
    return 0
