"""Predicted against measured: the planner's bytes and memory for a finished run, rank by rank.

A run folder's ``comm.json`` (written by the trainer) holds, for every rank, the payload bytes of
each (axis, collective) in one steady-state training step and the live bytes of parameters,
gradients and optimizer state. ``predict_rank`` computes the same from the config alone with the
cost model (``plan/comm_bytes.py``, ``plan/memory.py``), using the rank's mesh coordinates: its tensor-parallel
shard of each unit (``plan/units.py``), and under pipeline parallelism only its stages' units and its p2p transfers.
``check_run`` prints the two side by side, and below them the step time: the planner's prediction for the run's
layout on a hardware profile (by default the calibrated ``cpu-local`` one, ``meshtrain plan --calibrate``) against the
median ``step_time_s`` of the run's ``metrics.jsonl`` (``step_time_check``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any

from meshtrain.config import BYTE_VOCAB, Config, resolve_dp, update_from_dict
from meshtrain.plan.comm_bytes import (
    cp_calls,
    cp_comm_bytes,
    dp_comm_bytes,
    dp_family_calls,
    ep_calls,
    ep_comm_bytes,
    pp_p2p_bytes,
    tp_calls,
    tp_comm_bytes,
)
from meshtrain.plan.hardware import Hardware, get_hardware
from meshtrain.plan.memory import DTYPE_BYTES, dp_state_bytes, run_precision
from meshtrain.plan.partition import partition_model
from meshtrain.plan.schedules import build_schedule
from meshtrain.plan.units import expert_params_per_rank, norm_elems_held, unit_numels


def pipeline_rank_p2p(schedule, pp_rank: int, transfer: int) -> dict[tuple[str, str], int]:
    """Sends and receives of one step on a pipeline rank: ``transfer`` bytes (``comm_bytes.pp_p2p_bytes``) per
    forward activation and per backward gradient that crosses to another rank."""
    sent = received = 0
    last = schedule.n_stages - 1
    for a in schedule.actions[pp_rank]:
        if a.kind not in ("F", "B", "I"):
            continue
        towards, back = (a.stage + 1, a.stage - 1) if a.kind == "F" else (a.stage - 1, a.stage + 1)
        if 0 <= back <= last and schedule.placement[back] != pp_rank:
            received += transfer
        if 0 <= towards <= last and schedule.placement[towards] != pp_rank:
            sent += transfer
    return {k: v for k, v in {("pp", "send"): sent, ("pp", "recv"): received}.items() if v}


def _rank_units(cfg: Config, coords: dict[str, int]):
    """What one rank holds of the model: (its pipeline schedule or None, its layers, whether it has the first
    and the last stage, its sharding units' sizes): shared by the byte and the call predictions."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    layers, first, last, schedule = None, True, True, None
    if p.pp > 1:
        schedule = build_schedule(p.schedule, p.pp, p.microbatches, p.virtual_stages)
        part = partition_model(m, t.seq_len, schedule.n_stages)
        mine = [s for s, r in enumerate(schedule.placement) if r == coords["pp"]]
        layers = [i for s in mine for i in part.layers[s]]
        first, last = 0 in mine, schedule.n_stages - 1 in mine
    layers = list(range(m.n_layers)) if layers is None else layers
    return schedule, layers, first, last, unit_numels(m, p.tp, layers, first, last, p.ep)


def predict_rank(cfg: Config, world_size: int, coords: dict[str, int]) -> tuple[dict[tuple[str, str], int],
                                                                                dict[str, float]]:
    """(bytes per (axis, op) of one training step, live state bytes) predicted for one rank."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    dp = resolve_dp(cfg, world_size)
    compute_bytes, reduce_bytes = DTYPE_BYTES[t.dtype], DTYPE_BYTES[p.reduce_dtype]
    schedule, layers, first, last, units = _rank_units(cfg, coords)
    ndp = dp * p.cp  # gradients are reduced over dp x cp (HSDP shards over dp_shard x cp)
    shard = p.dp_shard * p.cp if p.dp_shard else 0
    out: dict[tuple[str, str], int] = {}
    out.update(dp_comm_bytes(m, p.zero, ndp, grad_accum=t.grad_accum, layout=p.zero_layout, dp_shard=shard,
                             compute_bytes=compute_bytes, reshard_after_forward=p.reshard_after_forward,
                             units=units, reduce_bytes=reduce_bytes))
    rows = t.global_batch // dp
    micro = p.microbatches if p.pp > 1 else t.grad_accum
    tokens = rows // micro * t.seq_len // p.cp  # this rank's tokens of one microbatch
    moe_layers = len(layers) if m.moe_experts else 0
    experts = expert_params_per_rank(m, p.ep, moe_layers)
    edp = ndp // p.ep
    expert_units = [experts // moe_layers] * moe_layers if experts else []
    expert_zero = min(p.zero, 2) if experts and edp > 1 else 0  # experts are ZeRO-1/2-sharded over edp
    if p.tp > 1:
        if p.zero in (1, 2) and p.zero_layout == "per_tensor":
            raise ValueError("parallel.zero_layout=per_tensor with parallel.tp > 1 is not modelled: its tp bytes "
                             "depend on which rank owns each norm weight (the byte check covers zero_layout=flat)")
        n, k = _shard_slot(cfg, dp, coords)
        norms = norm_elems_held(m, p.tp, layers, first, last, p.zero, n, k, p.ep) + sum(
            _shard_overlap(u, edp if expert_zero else 1, coords["edp"] if expert_zero else 0) for u in expert_units)
        out.update(tp_comm_bytes(m, p.tp, p.sp, tokens, grad_accum=micro, act_bytes=compute_bytes,
                                 layers=len(layers),
                                 embedding=first, head=last, norm_elems=norms,
                                 recompute=t.recompute != "none", mlp_tp=not m.moe_experts,
                                 kv_elems=norm_elems_held(m, p.tp, layers, first, last, p.zero, n, k, p.ep,
                                                          over="tp_kv"),
                                 sp_regather=p.sp_regather))
    _add(out, cp_comm_bytes(m, p.cp, p.tp, tokens, p.cp_attention, len(layers), micro, compute_bytes,
                            t.recompute != "none"))
    if schedule is not None:
        out.update(pipeline_rank_p2p(schedule, coords["pp"],
                                     pp_p2p_bytes(tokens, m.d_model, p.tp, p.sp, compute_bytes)))
        tied = _tied_piece(cfg, dp, coords, schedule, first, last)
        if tied:  # the tied weight's gradient, added between the first and the last stage (parallel/tied.py)
            out[("pp_ends", "all_reduce")] = tied * reduce_bytes
    if moe_layers:
        _add(out, _moe_bytes(cfg, dp, tokens, micro, moe_layers, compute_bytes))
    if experts and edp > 1:  # the experts' own data-parallel sync over edp: all-reduce, or ZeRO-1/2
        for (_, op), v in dp_comm_bytes(m, expert_zero, edp, grad_accum=t.grad_accum, layout=p.zero_layout,
                                        units=expert_units, reduce_bytes=reduce_bytes).items():
            _add(out, {("edp", op): v})
    state = dp_state_bytes(m, p.zero, ndp, dp_shard=shard, units=units)
    if experts:  # fp32 parameters and gradients, AdamW's two moments: whole, or ZeRO-sharded over edp
        ex = dp_state_bytes(m, expert_zero, edp, units=expert_units)
        state = {k: state[k] + ex[k] for k in state}
    return out, state


def predict_rank_calls(cfg: Config, world_size: int, coords: dict[str, int]) -> dict[tuple[str, str], int]:
    """Collective calls per (axis, op) of one training step predicted for one rank (what ``comm.json``'s
    ``calls`` counts), the same cases as ``predict_rank``'s bytes (flat ZeRO layout)."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    dp = resolve_dp(cfg, world_size)
    schedule, layers, first, last, units = _rank_units(cfg, coords)
    ndp, shard = dp * p.cp, (p.dp_shard * p.cp if p.dp_shard else 0)
    micro = p.microbatches if p.pp > 1 else t.grad_accum
    recompute = t.recompute != "none"
    limit = max(int(p.bucket_mb * 2**20 / 4), 1)  # DataParallel's bucket, in elements (fp32 gradients)
    out: dict[tuple[str, str], int] = {}
    _add(out, dp_family_calls(len(units), p.zero, ndp, t.grad_accum, shard, p.reshard_after_forward,
                              max(1, -(-sum(units) // limit))))
    if p.tp > 1:
        n, k = _shard_slot(cfg, dp, coords)
        norms = norm_elems_held(m, p.tp, layers, first, last, p.zero, n, k, p.ep)
        kv = norm_elems_held(m, p.tp, layers, first, last, p.zero, n, k, p.ep, over="tp_kv") \
            if m.kv_heads < p.tp else 0
        _add(out, tp_calls(p.tp, p.sp, micro, len(layers), first, last, norms > 0 or bool(m.moe_experts), recompute,
                           not m.moe_experts, kv > 0, p.sp_regather))
    _add(out, cp_calls(p.cp, p.cp_attention, len(layers), micro, recompute))
    if schedule is not None:
        transfer = pp_p2p_bytes(1, 1)  # bytes of one token's unit: divide it out to count transfers
        _add(out, {k: v // transfer for k, v in pipeline_rank_p2p(schedule, coords["pp"], transfer).items()})
        if _tied_piece(cfg, dp, coords, schedule, first, last):
            out[("pp_ends", "all_reduce")] = 1
    moe_layers = len(layers) if m.moe_experts else 0
    if moe_layers:
        _add(out, ep_calls(p.ep, moe_layers, micro, recompute))
        split = [a for a, x in (("cp", p.cp), ("tp", p.tp if p.sp else 1)) if x > 1]
        if split and m.moe_aux_loss_coef > 0:
            _add(out, {("_".join(split), "all_reduce"): micro * moe_layers})
    experts = expert_params_per_rank(m, p.ep, moe_layers)
    edp = ndp // p.ep
    if experts and edp > 1:
        ez = min(p.zero, 2)
        for (_, op), v in dp_family_calls(moe_layers, ez, edp, t.grad_accum,
                                          buckets=max(1, -(-experts // limit))).items():
            _add(out, {("edp", op): v})
    return out


def _tied_piece(cfg: Config, dp: int, coords: dict[str, int], schedule, first: bool, last: bool) -> int:
    """Elements of the tied embedding whose gradient this rank adds over "pp_ends" (``parallel/tied.py``): its
    tensor-parallel slice, or the ZeRO-1 shard of it (a unit of its own); 0 where nothing is tied across ranks."""
    m, p = cfg.model, cfg.parallel
    if not m.tie_embeddings or schedule.placement[0] == schedule.placement[-1] or not (first or last):
        return 0
    emb = math.ceil(m.vocab_size / p.tp) * m.d_model
    if p.zero == 0:
        return emb
    return _shard_overlap(emb, *_shard_slot(cfg, dp, coords))


def _shard_slot(cfg: Config, dp: int, coords: dict[str, int]) -> tuple[int, int]:
    """(ranks in the ZeRO shard group: dp x cp, or dp_shard x cp for HSDP; this rank's index in it)."""
    p = cfg.parallel
    return (p.dp_shard or dp) * p.cp, coords["dp"] % (p.dp_shard or dp) * p.cp + coords["cp"]


def _shard_overlap(numel: int, n: int, k: int) -> int:
    """Elements of a flat unit of ``numel`` inside shard k of n (padded to a multiple of n)."""
    size = -(-numel // n)
    return max(0, min(numel, (k + 1) * size) - k * size)


def _add(out: dict[tuple[str, str], int], more: dict[tuple[str, str], int]) -> None:
    for k, v in more.items():
        if v:
            out[k] = out.get(k, 0) + v


def _moe_bytes(cfg: Config, dp: int, tokens: int, micro: int, layers: int, compute_bytes: int
               ) -> dict[tuple[str, str], int]:
    """A rank's mixture-of-experts traffic per step: the ep all-to-alls (balanced routing; exact summed over
    each ep group) and the aux loss's per-sequence expert counts summed over the ranks that split each
    sequence (cp, and tp under SP)."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    block_tokens = tokens // (p.tp if p.sp else 1)
    out = {("ep", "all_to_all"): micro * layers * ep_comm_bytes(block_tokens, m, p.ep, compute_bytes,
                                                                t.recompute != "none")}
    split = [a for a, n in (("cp", p.cp), ("tp", p.tp if p.sp else 1)) if n > 1]
    if split and m.moe_aux_loss_coef > 0:
        rows = t.global_batch // dp // micro
        out[("_".join(split), "all_reduce")] = micro * layers * rows * m.moe_experts * 4
    return out


WARMUP_STEPS = 2  # steps left out of the measured median: the first ones build buffers, connections, caches


def layout_of(cfg: Config, world_size: int):
    """The planner's ``Layout`` of a run config (the inverse of ``search.to_config``)."""
    from meshtrain.plan.problem import Layout

    p, t = cfg.parallel, cfg.train
    return Layout(dp=resolve_dp(cfg, world_size), tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, zero=p.zero,
                  dp_shard=p.dp_shard, sp=p.sp, schedule=p.schedule if p.pp > 1 else "1f1b",
                  virtual=p.virtual_stages if p.pp > 1 else 1,
                  microbatches=p.microbatches if p.pp > 1 else t.grad_accum, recompute=t.recompute,
                  cp_attention=p.cp_attention if p.cp > 1 else "ring", sp_regather=p.sp_regather or not p.sp)


def predict_step_time(cfg: Config, world_size: int, hw: Hardware):
    """The planner's ``Estimate`` for a run config on ``world_size`` processes of ``hw`` (all on one host of
    ``world_size`` devices, as ``meshtrain train --nproc`` runs them)."""
    from meshtrain.plan.problem import Problem
    from meshtrain.plan.steptime import evaluate

    model = dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size or BYTE_VOCAB)
    host = dataclasses.replace(hw, devices_per_node=world_size, domain=max(hw.domain, world_size))
    problem = Problem(model, cfg.train.seq_len, cfg.train.global_batch, host, 1, model_name="run",
                      precision=run_precision(cfg.train.dtype, cfg.parallel.reduce_dtype),
                      documents=cfg.train.attention_mask == "document")
    return evaluate(problem, layout_of(cfg, world_size))


def measured_step_time(run_dir: str | Path) -> tuple[float, int]:
    """(median ``step_time_s``, steps counted) of a run's ``metrics.jsonl``, its first ``WARMUP_STEPS`` left out."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl in the run folder")
    times = []
    for line in path.read_text().splitlines():
        rec = json.loads(line) if line.strip().startswith("{") else {}
        if "step_time_s" in rec and rec.get("step", 0) > WARMUP_STEPS:
            times.append(float(rec["step_time_s"]))
    if not times:
        raise ValueError(f"{path}: no step_time_s after the first {WARMUP_STEPS} steps (run more steps)")
    return statistics.median(times), len(times)


def step_time_check(run_dir: str | Path, cfg: Config, world_size: int, hardware: str = "cpu-local"
                    ) -> tuple[str, float | None, float | None]:
    """The step-time row of ``check_run``: (line, predicted s, measured s); a line saying why when either side
    is missing (no calibrated profile, no metrics)."""
    try:
        measured, n = measured_step_time(run_dir)
    except (FileNotFoundError, ValueError) as e:
        return f"step time: not measured ({e})", None, None
    try:
        hw = get_hardware(hardware)
    except (FileNotFoundError, ValueError) as e:
        return f"step time: measured {measured * 1e3:.1f} ms (median of {n} steps); no prediction: {e}", None, measured
    try:
        est = predict_step_time(cfg, world_size, hw)
    except Exception as e:  # noqa: BLE001 - a display row: a layout the step-time model cannot price must not hide
        #                     the byte check above it; the row names why
        return (f"step time: measured {measured * 1e3:.1f} ms (median of {n} steps); no prediction: "
                f"{type(e).__name__}: {e}", None, measured)
    err = est.step_s / measured - 1.0
    line = (f"{'step':>4}  {'time/step (' + hardware + ')':<28} {est.step_s * 1e3:>11.1f} ms {measured * 1e3:>11.1f} ms"
            f"  {err:+.0%} (median of {n} steps after {WARMUP_STEPS}; layout {est.layout.describe()})")
    return line, est.step_s, measured


def _read_comm_json(path: Path) -> dict[str, Any]:
    """A run's ``comm.json``, or a ``ValueError`` naming it when it is not the trainer's (damaged, or another file)."""
    try:
        measured = json.loads(path.read_text())
        ok = isinstance(measured, dict) and isinstance(measured.get("step"), int) and isinstance(
            measured.get("ranks"), list) and measured["ranks"] and all(
            isinstance(r, dict) and {"rank", "coords", "bytes", "state"} <= set(r) for r in measured["ranks"])
    except (json.JSONDecodeError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise ValueError(f"--check-run: {path} is not a meshtrain run's comm.json (damaged, or another file): train "
                         f"the run again past its third step to rewrite it.")
    return measured


def check_run(run_dir: str | Path, hardware: str = "cpu-local") -> tuple[str, bool, bool]:
    """Side-by-side table of predicted and measured bytes (and, shown only, collective calls where ``comm.json`` has
    them) for a finished run, and the step time (predicted on
    ``hardware`` against the run's median); (text, every byte count equal, every state size within 5%). The step
    time is shown, not judged: it depends on the machine and its load."""
    run = Path(run_dir)
    for f in ("config.yaml", "comm.json"):
        if not (run / f).is_file():
            raise FileNotFoundError(f"--check-run {run}: no {f}; pass the --out folder of a finished meshtrain run "
                                    f"(comm.json is written after its third step).")
    import yaml

    cfg = update_from_dict(Config(), yaml.safe_load((run / "config.yaml").read_text()), str(run / "config.yaml"))
    measured = _read_comm_json(run / "comm.json")
    world = len(measured["ranks"])
    lines = [f"run {run}: {world} ranks, step {measured['step']}",
             f"{'rank':>4}  {'axis/op':<28} {'predicted':>14} {'measured':>14}  match"]
    exact = memory_ok = True
    groups: dict[tuple, list[int]] = {}  # the ep all-to-all depends on routing: compared per ep group
    for r in measured["ranks"]:
        pred, state = predict_rank(cfg, world, r["coords"])
        keys = sorted(set(pred) | {tuple(k.split("/")) for k in r["bytes"]})
        for axis, op in keys:
            want = pred.get((axis, op), 0)
            got = r["bytes"].get(f"{axis}/{op}", 0)
            if (axis, op) == ("ep", "all_to_all"):
                c = r["coords"]
                g = groups.setdefault((c["pp"], c["tp"], c["edp"]), [0, 0])
                g[0], g[1] = g[0] + want, g[1] + got
                lines.append(f"{r['rank']:>4}  {axis + '/' + op:<28} {want:>14,} {got:>14,}  (routing; group below)")
                continue
            exact &= want == got
            mark = "yes" if want == got else "NO"
            lines.append(f"{r['rank']:>4}  {axis + '/' + op:<28} {want:>14,} {got:>14,}  {mark}")
        per_tensor = cfg.parallel.zero in (1, 2) and cfg.parallel.zero_layout == "per_tensor"
        if "calls" in r and not per_tensor:  # runs whose comm.json records the meter's calls: shown beside the
            # bytes, not judged (``exact`` is the bytes'): tests/test_steptime.py checks the counts on 16 layouts;
            # per-tensor ZeRO issues one call per tensor, not counted by predict_rank_calls
            calls = predict_rank_calls(cfg, world, r["coords"])
            for axis, op in sorted(set(calls) | {tuple(k.split("/")) for k in r["calls"]}):
                want, got = calls.get((axis, op), 0), r["calls"].get(f"{axis}/{op}", 0)
                lines.append(f"{r['rank']:>4}  {'calls ' + axis + '/' + op:<28} {want:>14,} {got:>14,}  "
                             f"{'yes' if want == got else 'NO'}")
        for kind in ("params", "grads", "optim"):
            want, got = state[kind], r["state"][kind]
            ok = abs(got - want) <= 0.05 * max(want, 1)
            memory_ok &= ok
            lines.append(f"{r['rank']:>4}  {'memory/' + kind:<28} {want:>14,.0f} {got:>14,}  "
                         f"{'within 5%' if ok else 'NO'}")
    capped = cfg.model.moe_capacity_factor > 0  # dropped rows are not sent: the prediction is then a bound
    for (pp, tp, edp), (want, got) in sorted(groups.items()):
        ok = got <= want if capped else want == got
        exact &= ok
        lines.append(f"ep group pp={pp} tp={tp} edp={edp}: ep/all_to_all summed {want:,} predicted"
                     f"{' (at most, capacity drops)' if capped else ''}, {got:,} measured  {'yes' if ok else 'NO'}")
    lines.append(step_time_check(run, cfg, world, hardware)[0])
    return "\n".join(lines), exact, memory_ok
