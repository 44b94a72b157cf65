"""Fit the planner's GPU kernel costs (``plan/hardware.GPU_KERNELS``) from ``gpu_single.py --profile N --json``
runs of ours compiled, and check the planner's one-device step against each run's measured step.

    python benchmarks/gpu_kernels_fit.py runs/gpu/b8c.json runs/gpu/b24.json [runs/gpu/b16.json ...]

Every JSON with a profile of ours compiled and the first JSON's model is fitted (two batch sizes at least); every
JSON is checked, other shapes included: the step the planner predicts with the fitted costs and with the preset's
own (``--hardware``, default the preset the device's name matches) against the median measured step (wall time: it
includes the host's gaps, which the planner does not model). ``--json PATH`` writes the fit and the checks. The
matmuls stay the preset's roofline at ``--efficiency`` (default 0.75) of peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

from gpu_single import GPU_DEFAULTS, model_overrides  # benchmarks/, beside this script

from meshtrain.config import load_config
from meshtrain.plan.costfit import fit_gpu_kernels
from meshtrain.plan.hardware import get_hardware
from meshtrain.plan.problem import Layout, Problem
from meshtrain.plan.steptime import evaluate
from meshtrain.train.profiling import kind_of

ROW = "ours compiled"


def load_run(path: str) -> dict:
    """One gpu_single.py JSON: batch, seq, the model, ours compiled's median step and its kinds (if profiled)."""
    try:
        with open(path) as f:
            data = json.load(f)
        args, row = data["args"], data["rows"].get(ROW, {})
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, AttributeError, TypeError):
        raise ValueError(f"{path}: not a gpu_single.py --json file") from None
    if not row.get("times"):
        raise ValueError(f"{path}: no timed steps of {ROW} (run gpu_single.py with it in --rows)")
    overrides = model_overrides(argparse.Namespace(**{**GPU_DEFAULTS, **args}))  # the model gpu_single.py built
    kinds: dict[str, float] = {}
    for name, ms, _ in row.get("kernels_ms_per_step", []):
        kinds[kind_of(name)] = kinds.get(kind_of(name), 0.0) + ms
    return {"path": path, "batch": args["batch"], "seq": args["seq"], "cfg": load_config(None, overrides).model,
            "device": data.get("device", ""),
            "step_ms": 1e3 * statistics.median(statistics.median(t) for t in row["times"]),  # times: s per step
            "kinds": kinds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="gpu_single.py --json files with ours compiled")
    ap.add_argument("--hardware", help="planner preset (default: from the device's name)")
    ap.add_argument("--efficiency", type=float, default=0.75, help="matmul fraction of peak (default 0.75)")
    ap.add_argument("--json", metavar="PATH", help="write the fit and the checks here")
    args = ap.parse_args(argv)
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        ap.error(f"--json {args.json}: its folder does not exist; create it or name a file in an existing folder")
    try:
        runs = [load_run(p) for p in args.runs]
    except (OSError, ValueError) as e:
        print(f"gpu_kernels_fit.py: {e}", file=sys.stderr)
        return 2
    key = args.hardware or next((k for k in ("h100", "h200", "b200", "a100") if k in runs[0]["device"].lower()), None)
    if key is None:
        print(f"gpu_kernels_fit.py: no preset matches the device {runs[0]['device']!r}: pass --hardware",
              file=sys.stderr)
        return 2
    try:
        preset = get_hardware(key)
    except ValueError as e:  # names the option and the choices
        print(f"gpu_kernels_fit.py: {e}", file=sys.stderr)
        return 2
    if preset.mesh_axes or preset.measured_steps:
        print(f"gpu_kernels_fit.py: --hardware {key}: the kernel costs are a GPU preset's; choose one of h100, "
              f"h200, b200, a100", file=sys.stderr)
        return 2
    hw = preset.part_of_node(1)
    # Fitted: the profiled runs of the first run's model and sequence; runs of another shape are checks only.
    cfg, seq = runs[0]["cfg"], runs[0]["seq"]
    fits = [r for r in runs if r["kinds"] and r["cfg"] == cfg and r["seq"] == seq]
    profiled = [(r["batch"], r["kinds"]) for r in fits]
    try:
        fit = fit_gpu_kernels(cfg, seq, profiled, hw.bf16_flops, hw.hbm_bw, args.efficiency)
    except ValueError as e:
        print(f"gpu_kernels_fit.py: {e} (profiled: {', '.join(r['path'] for r in runs if r['kinds']) or 'none'})",
              file=sys.stderr)
        return 2
    fitted = dataclasses.replace(hw, **fit)
    print(f"{hw.name}, fitted on batches {', '.join(str(b) for b, _ in profiled)} of ours compiled:")
    print("GPU_KERNELS = {" + ", ".join(f'"{k}": {v:.4g}' for k, v in fit.items()) + "}")
    print("\n| model | batch | measured step (ms) | predicted with this fit (ms) | / measured | with the preset's "
          "GPU_KERNELS (ms) | / measured | fitted on it |")
    print("|---|---|---|---|---|---|---|---|")
    checks = []
    for r in runs:
        ms = [evaluate(Problem(r["cfg"], r["seq"], r["batch"], h, 1, efficiency=args.efficiency),
                       Layout(dp=1)).step_s * 1e3 for h in (fitted, hw)]
        checks.append({"path": r["path"], "batch": r["batch"], "d_model": r["cfg"].d_model, "fitted": r in fits,
                       "measured_ms": r["step_ms"], "predicted_ms": ms[0], "preset_ms": ms[1]})
        m = r["cfg"]
        print(f"| d{m.d_model} L{m.n_layers} h{m.n_heads}/{m.kv_heads} | {r['batch']} | {r['step_ms']:.1f} "
              f"| {ms[0]:.1f} | {ms[0] / r['step_ms']:.3f} | {ms[1]:.1f} | {ms[1] / r['step_ms']:.3f} "
              f"| {'yes' if r in fits else 'no'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hardware": key, "fit": fit, "checks": checks}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
