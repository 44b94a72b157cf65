"""Random valid layouts against one device: the equivalence matrix's blind spots, found by sampling.

The equivalence files test layouts someone thought of. Options combine: a schedule with a recompute mode, a ZeRO
level with HSDP groups and expert parallelism, kv heads fewer than tp with SP, Ulysses or all-gather attention with
tp and ZeRO, embeddings tied across pipeline stages, Gemma's GeGLU and scaled embedding with experts.
``random_layouts(seed, n, world)`` draws ``n`` layouts from every parallel option that must not change the result
(and a few model shapes), keeps those ``validate_layout`` accepts for ``world`` ranks, and ``check_random_layouts``
compares each with the single-device run, as every equivalence test does. Its first run found zero-bubble schedules
under recompute training on wrong weight gradients (``pipeline/wgrad.py``), which no hand-written layout had
combined.

What it compares: every step's loss and grad norm, the step-1 gradient of every tensor and the last step's
validation loss (LOSS_RTOL, GRAD_RTOL), and that the layout really ran (mesh, bytes on every axis, pipeline
actions), and that the planner predicted its bytes (``plan/check.check_run``). Not the final parameters: AdamW
divides each entry by the root of its running square, so an entry whose gradient is near zero moves by a sign that
summation order can decide. One device against itself with ``train.grad_accum=4`` instead of 1 (a different
summation order, nothing else; d_model 64, 8 heads) differs by up to 2.6e-5 in a parameter after four steps, with
every loss within 1.2e-7; sampled layouts land on both sides of PARAM_RTOL that way. The hand-written equivalence
files check parameters on the layouts they chose.

What it leaves out, and why: ``moe_capacity_factor`` (capacity is per local token group, so it is
layout-dependent by definition: docs/expert-parallel.md), bf16 (its own k·u tests; an MoE router's top-k flips
on bf16 roundings), ``train.compile`` (minutes per layout on a CPU; test_compile.py), and options that change the
single-device run itself (those ``reference_key`` does not carry, e.g. ``train.weight_decay``).

``python -m meshtrain.testing.fuzz --seed 7 --layouts 24 --world 4`` prints one line per layout and exits 1 on a
mismatch; CI runs a fixed sample (tests/test_layout_fuzz.py).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import traceback
from pathlib import Path

from meshtrain.testing.equivalence import (
    GRAD_RTOL,
    LOSS_RTOL,
    assert_layout_ran,
    planner_mismatch,
    reference_runs,
    run_dir,
    run_layout,
    run_overrides,
    worst_rel,
)

STEPS = 4
BASE = [*run_overrides(STEPS), "model.n_layers=4"]  # 4 blocks: two pipeline stages of two virtual stages each
SCHEDULES = ("afab", "1f1b", "interleaved", "zb-h1", "dualpipev")


def random_overrides(rng: random.Random, world: int) -> list[str]:
    """One draw of ``parallel.*``, ``train.*`` and ``model.*`` overrides for ``world`` ranks (not yet validated)."""
    o: dict[str, object] = {}
    wide = [4] if world >= 8 else []
    pp, tp, cp = rng.choice([1, 1, 2, *wide]), rng.choice([1, 2, *wide]), rng.choice([1, 1, 2])
    while pp * tp * cp > world:
        cp, tp = (1, tp) if cp > 1 else (cp, tp // 2)
    dp = world // (pp * tp * cp)
    o.update({"parallel.pp": pp, "parallel.tp": tp, "parallel.cp": cp})
    o["parallel.zero"] = rng.choice([0, 1, 2, 3] if pp == 1 else [0, 1])
    if o["parallel.zero"] in (1, 2):
        o["parallel.zero_layout"] = rng.choice(["flat", "per_tensor"])
    if o["parallel.zero"] and dp >= 4 and rng.random() < 0.3:
        o["parallel.dp_shard"] = 2
    if o["parallel.zero"] == 3:
        o["parallel.reshard_after_forward"] = rng.choice(["true", "false"])
    if tp > 1 and rng.random() < 0.6:
        o["parallel.sp"], o["parallel.sp_regather"] = "true", rng.choice(["true", "false"])
    if cp > 1:
        o["parallel.cp_layout"] = rng.choice(["zigzag", "contiguous"])
        o["parallel.cp_attention"] = rng.choice(["ring", "allgather", "ulysses"])
    if pp > 1:
        schedule = rng.choice(SCHEDULES)
        o["parallel.schedule"], o["parallel.microbatches"] = schedule, rng.choice([2, 4])
        if schedule in ("interleaved", "dualpipev"):
            o["parallel.virtual_stages"] = 2
        if rng.random() < 0.3:
            o["parallel.p2p_posting"] = "ordered"
    elif rng.random() < 0.4:
        o["train.grad_accum"] = 2
    o["train.recompute"] = rng.choice(["none", "full", "selective"])
    if rng.random() < 0.3:
        o["model.d_model"], o["model.n_heads"] = 64, 8
    # Ulysses splits each tp rank's kv heads over cp: draw only kv head counts it can run with
    ulysses = o.get("parallel.cp_attention") == "ulysses"
    kv = [k for k in (1, 2, 4) if not ulysses or (k >= tp and (k // tp) % cp == 0)]
    o["model.n_kv_heads"] = rng.choice(kv or [1, 2, 4])
    if rng.random() < 0.3:  # with pp > 1 the weight lives on both end stages (parallel/tied.py)
        o["model.tie_embeddings"] = "true"
    if rng.random() < 0.2:  # Gemma's GeGLU and scaled embedding
        o["model.mlp_activation"], o["model.embed_scale"] = "gelu_tanh", "true"
    if rng.random() < 0.35:
        o["model.moe_experts"], o["model.moe_top_k"] = 4, rng.choice([1, 2])
        if rng.random() < 0.4:
            o["model.moe_shared_experts"] = 1
        if rng.random() < 0.3:
            o["model.moe_aux_loss_coef"] = 0.0
        o["parallel.ep"] = rng.choice([e for e in (1, 2, 4) if (dp * cp) % e == 0])
    if rng.random() < 0.5:
        o["parallel.bucket_mb"] = 0.01  # many small buckets
    if rng.random() < 0.2:
        o["train.grad_clip"] = 0.0
    if rng.random() < 0.15:
        o["train.optimizer"] = "muon"
    return [f"{k}={v}" for k, v in o.items()]


def random_layouts(seed: int, n: int, world: int) -> list[tuple[str, list[str]]]:
    """``n`` distinct layouts that ``validate_layout`` accepts on ``world`` ranks, named ``L<seed>_<i>``; the
    same seed gives the same layouts."""
    from meshtrain.config import ConfigError, load_config
    from meshtrain.plan.validate import validate_layout

    rng, seen, out = random.Random(seed), set(), []
    for _ in range(200 * n):
        if len(out) == n:
            break
        overrides = random_overrides(rng, world)
        if tuple(overrides) in seen:
            continue
        seen.add(tuple(overrides))
        try:
            validate_layout(load_config("tiny", [*BASE, *overrides]), world)
        except ConfigError:
            continue
        out.append((f"L{seed}_{len(out)}", overrides))
    return out


def fuzz_worker(rank: int, world: int, data: str, layouts: list[tuple[str, list[str]]]) -> dict[str, dict]:
    """Spawned-rank body: train every layout in turn; a layout that raises returns its traceback instead."""
    out = {}
    for name, overrides in layouts:
        try:
            out[name] = run_layout(data, [*BASE, *overrides], run_dir(data, world, name))
        except Exception:  # noqa: BLE001 - reported per layout; the others still run
            out[name] = {"error": traceback.format_exc()[-3000:]}
    return out


def compare(data: str, world: int, layouts: list[tuple[str, list[str]]], per_rank: list[dict],
            reference) -> list[dict]:
    """One record per layout: its worst relative loss, grad norm and step-1 gradient over ranks and steps, and
    ``problem`` (None, or why it failed: an exception, a layout that did not run as asked, or a mismatch)."""
    rows = []
    for name, overrides in layouts:
        results = [r[name] for r in per_rank]
        row = {"name": name, "overrides": overrides, "problem": None}
        rows.append(row)
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            row["problem"] = "raised:\n" + errors[0]
            continue
        try:
            assert_layout_ran(name, overrides, world, results, run_dir(data, world, name))
        except AssertionError as e:
            row["problem"] = f"did not run as asked: {e}"
            continue
        ref = reference(overrides)
        row["loss"] = max(abs(a / b - 1) for r in results for a, b in zip(r["losses"], ref["losses"], strict=True))
        row["grad_norm"] = max(abs(a / b - 1) for r in results
                               for a, b in zip(r["grad_norms"], ref["grad_norms"], strict=True))
        row["grads"] = max(worst_rel(r["grads"], ref["grads"]) for r in results)
        # The last step's validation loss: evaluation runs its own path (the pipeline's forward_only, no backward).
        row["val_loss"] = max(abs(r["records"][-1]["val_loss"] / ref["records"][-1]["val_loss"] - 1) for r in results)
        if max(row["loss"], row["val_loss"]) > LOSS_RTOL or max(row["grad_norm"], row["grads"]) > GRAD_RTOL:
            row["problem"] = (f"differs from one device: loss {row['loss']:.1e}, validation loss "
                              f"{row['val_loss']:.1e}, grad norm {row['grad_norm']:.1e}, step-1 gradient "
                              f"{row['grads']:.1e} (tolerances {LOSS_RTOL:g}, {GRAD_RTOL:g})")
            continue
        row["problem"] = _planner_problem(run_dir(data, world, name), row)
    return rows


def _planner_problem(run: str, row: dict) -> str | None:
    """The planner's prediction of the run, judged as for the hand-written layouts (``planner_mismatch``). A layout
    the planner does not model (per-tensor ZeRO with tp or HSDP: its bytes follow which rank owns each tensor) is
    recorded in ``row["planner"]``, not failed."""
    try:
        mismatch = planner_mismatch(run)
    except ValueError as e:
        row["planner"] = str(e)
        return None
    row["planner"] = "bytes exact"
    return None if mismatch is None else "the planner's prediction differs from the run:\n" + mismatch


def check_random_layouts(data: str, seed: int, n: int, world: int) -> list[dict]:
    """Train ``random_layouts(seed, n, world)`` in one process group of ``world`` ranks on ``data`` and compare each
    with the single-device run (``compare``)."""
    from meshtrain.testing.spawn import spawn

    layouts = random_layouts(seed, n, world)
    per_rank = spawn(fuzz_worker, world, args=(data, layouts), timeout=300 + 60 * n)
    return compare(data, world, layouts, per_rank, reference_runs(data, BASE))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m meshtrain.testing.fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layouts", type=int, default=24, help="how many random layouts (default 24)")
    ap.add_argument("--world", type=int, default=4, help="processes (default 4)")
    args = ap.parse_args(argv)
    if args.layouts < 1 or args.world < 1:
        ap.error(f"--layouts and --world must be >= 1, got {args.layouts} and {args.world}.")
    from meshtrain.train.prepare import default_source_dir, prepare_data

    with tempfile.TemporaryDirectory() as tmp:
        data = str(Path(tmp) / "stdlib")
        prepare_data(default_source_dir(), data)
        rows = check_random_layouts(data, args.seed, args.layouts, args.world)
    for row in rows:
        figures = (f"loss {row['loss']:.1e}  val {row['val_loss']:.1e}  grad norm {row['grad_norm']:.1e}  "
                   f"step-1 gradient {row['grads']:.1e}"
                   if "grads" in row else "")
        print(f"{'FAIL' if row['problem'] else 'ok':4s} {row['name']:8s} {figures}  {' '.join(row['overrides'])}"
              + (f"  [planner: {row['planner']}]" if "planner" in row else ""))
        if row["problem"]:
            print("     " + row["problem"].replace("\n", "\n     "))
    bad = sum(bool(r["problem"]) for r in rows)
    print(f"{len(rows) - bad} of {len(rows)} layouts equal one device on {args.world} ranks (seed {args.seed})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
