"""The run report: ``report.md`` and ``loss.png`` in a finished run folder, every figure read from the run's files.

Inputs (all written by the run, or by ``meshtrain demo`` before it):

- ``config.yaml``: the layout and the model;
- ``metrics.jsonl``: rank 0's step records (loss, val_loss, step_time_s, comm_wait_s, tokens_per_s, mfu, memory);
- ``comm.json``: every rank's bytes per (axis, op), seconds blocked in each, and state bytes in one steady step;
- ``plan.json`` (optional, ``meshtrain demo``): the planner's prediction for the layout, the runner-up and why.

Predicted against measured bytes and state memory come from ``meshtrain plan --check-run``'s own function
(``plan/check.py``), so the report and that command cannot disagree.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from meshtrain.config import Config, resolve_dp, update_from_dict
from meshtrain.plan.check import check_run
from meshtrain.plan.flops import param_count

WARMUP_STEPS = 3  # the first steps build buffers and caches: left out of the medians


class RunFiles:
    """The parsed files of one run folder."""

    def __init__(self, run_dir: str | Path) -> None:
        import yaml

        self.dir = Path(run_dir)
        for name in ("config.yaml", "metrics.jsonl", "comm.json"):
            if not (self.dir / name).is_file():
                raise FileNotFoundError(f"{self.dir} has no {name}: pass the --out folder of a finished meshtrain run "
                                        f"(comm.json is written after its third step).")
        self.cfg: Config = update_from_dict(Config(), yaml.safe_load((self.dir / "config.yaml").read_text()),
                                            str(self.dir / "config.yaml"))
        # A non-finite value (a skipped step's loss or norm) is written as null (``MetricsLogger.log``): NaN here.
        self.records: list[dict[str, Any]] = [
            {k: float("nan") if v is None else v for k, v in json.loads(ln).items()}
            for ln in (self.dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        self.comm: dict[str, Any] = json.loads((self.dir / "comm.json").read_text())
        plan = self.dir / "plan.json"
        self.plan: dict[str, Any] | None = json.loads(plan.read_text()) if plan.is_file() else None

    @property
    def world(self) -> int:
        return len(self.comm["ranks"])

    def steady(self) -> list[dict[str, Any]]:
        """Step records after warm-up (all of them in a run too short to have any after it)."""
        rows = [r for r in self.records if "step_time_s" in r]
        return [r for r in rows if r["step"] > WARMUP_STEPS] or rows

    def median(self, key: str) -> float:
        values = [r[key] for r in self.steady() if key in r]
        return statistics.median(values) if values else float("nan")

    def baseline(self) -> float | None:
        return next((r["unigram_loss"] for r in self.records if "unigram_loss" in r), None)


def _mb(x: float) -> str:
    return f"{x / 1e6:,.2f} MB"


def _ms(x: float) -> str:
    return f"{x * 1e3:,.1f} ms" if x == x else "not recorded"  # nan: a run from before comm_wait_s was logged


def step_time_summary(run: RunFiles) -> dict[str, float]:
    """Median seconds per step after warm-up on rank 0: the whole step, blocked in collectives, the rest
    (compute, the optimizer, Python); the planner's prediction where ``plan.json`` holds one (else nan)."""
    step, wait = run.median("step_time_s"), run.median("comm_wait_s")
    predicted = run.plan["chosen"]["step_s"] if run.plan else float("nan")
    return {"measured_s": step, "comm_wait_s": wait, "other_s": step - wait, "predicted_s": predicted}


def bytes_per_axis(run: RunFiles) -> dict[str, list[int]]:
    """{axis/op: [bytes on rank 0, rank 1, ...]} of the measured step, as comm.json holds them."""
    keys = sorted({k for r in run.comm["ranks"] for k in r["bytes"]})
    return {k: [r["bytes"].get(k, 0) for r in run.comm["ranks"]] for k in keys}


def summary_lines(run: RunFiles) -> list[str]:
    """The terminal's closing lines: step time, bytes and memory, predicted against measured."""
    t = step_time_summary(run)
    lines = []
    if run.plan:
        ratio = t["measured_s"] / t["predicted_s"] if t["predicted_s"] else float("nan")
        lines.append(f"step time: predicted {_ms(t['predicted_s'])}, measured {_ms(t['measured_s'])} "
                     f"(median after warm-up, {ratio:.2f}x the prediction); {_ms(t['comm_wait_s'])} of it "
                     f"blocked in collectives")
    else:
        lines.append(f"step time: measured {_ms(t['measured_s'])} (median after warm-up); "
                     f"{_ms(t['comm_wait_s'])} of it blocked in collectives")
    moved = sum(sum(v) for v in bytes_per_axis(run).values()) / run.world
    lines.append(f"bytes moved per step: {_mb(moved)} per rank on average (comm.json, step {run.comm['step']})")
    if run.plan:
        mem = run.plan["chosen"]["memory_bytes"]
        state = sum(mem.get(k, 0.0) for k in ("params", "grads", "optim"))
        measured = max(sum(r["state"][k] for k in ("params", "grads", "optim")) for r in run.comm["ranks"])
        lines.append(f"memory: parameters + gradients + optimizer state {_mb(state)} predicted, {_mb(measured)} "
                     f"measured on the fullest rank; {_mb(mem['total'])} predicted in all with activations")
    return lines


def plot_loss(run: RunFiles, path: Path) -> Path:
    """Train loss per step, validation loss where measured, and the unigram baseline, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    train = [(r["step"], r["loss"]) for r in run.records if "loss" in r and not r.get("skipped")]
    val = [(r["step"], r["val_loss"]) for r in run.records if "val_loss" in r]
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation loss", lw=1.5)
    base = run.baseline()
    if base is not None:
        ax.axhline(base, ls="--", color="grey", lw=1, label=f"unigram baseline {base:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"{run.dir.name}: {_mesh(run)}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _mesh(run: RunFiles) -> str:
    p = run.cfg.parallel
    dp = resolve_dp(run.cfg, run.world)
    return f"pp={p.pp} dp={dp} cp={p.cp} tp={p.tp} ep={p.ep} ({run.world} processes)"


def _layout_section(run: RunFiles) -> list[str]:
    p, t = run.cfg.parallel, run.cfg.train
    extras = [f"ZeRO-{p.zero}" if p.zero else "plain data parallelism (ZeRO off)" if resolve_dp(run.cfg, run.world)
              > 1 else ""]
    extras += [f"HSDP shard groups of {p.dp_shard}" if p.dp_shard else "",
               "sequence parallelism" if p.sp else "",
               f"pipeline schedule {p.schedule}, {p.microbatches} microbatches" if p.pp > 1 else "",
               f"{t.grad_accum} accumulation steps" if t.grad_accum > 1 else "",
               f"recompute {t.recompute}" if t.recompute != "none" else "",
               f"gradients reduced in {p.reduce_dtype}", f"compute in {t.dtype}"]
    out = ["## Layout", "", f"Mesh {_mesh(run)}: {', '.join(e for e in extras if e)}.", ""]
    if run.plan:
        c = run.plan["chosen"]
        out += [f"Chosen by the planner (`meshtrain plan`) as **{c['describe']}** from {run.plan['tried']} layouts "
                f"tried on the `{run.plan['hardware']['key']}` profile ({run.plan['hardware']['name']}; "
                f"{run.plan['hardware_note']}).", "", run.plan["why"], ""]
        if run.plan.get("ranked"):
            out += ["| # | layout | predicted step | MFU |", "|---|---|---|---|"]
            out += [f"| {i + 1} | {e['describe']} | {_ms(e['step_s'])} | {e['mfu']:.1%} |"
                    for i, e in enumerate(run.plan["ranked"])]
            out.append("")
    return out


def _bytes_section(run: RunFiles) -> list[str]:
    ranks = run.comm["ranks"]
    out = ["## What each axis moved", "",
           f"Payload bytes of one training step (step {run.comm['step']}, counted by the comm meter in `comm.json`), "
           f"and the time each rank was blocked waiting in those collectives in that step:", "",
           "| axis/op | " + " | ".join(f"rank {r['rank']} bytes" for r in ranks) + " | " +
           " | ".join(f"rank {r['rank']} waited" for r in ranks) + " |",
           "|---|" + "---:|" * (2 * len(ranks))]
    keys = sorted({k for r in ranks for k in (*r["bytes"], *r.get("wait_s", {}))})
    for k in keys:
        out.append(f"| {k} | " + " | ".join(f"{r['bytes'].get(k, 0):,}" for r in ranks) + " | " +
                   " | ".join(_ms(r.get("wait_s", {}).get(k, 0.0)) for r in ranks) + " |")
    out += ["", "(`metrics` is the loss and norm reductions every step needs; its bytes are not counted as the "
                "layout's traffic.)", ""]
    return out


def _timing_section(run: RunFiles) -> list[str]:
    t = step_time_summary(run)
    steady = run.steady()
    rows = [r for r in run.records if "step_time_s" in r]
    last = run.records[-1] if run.records else {}
    vals = [r["val_loss"] for r in run.records if "val_loss" in r]
    base = run.baseline()
    out = ["## Timings", "",
           f"- {len(rows)} steps logged, {sum(r['step_time_s'] for r in rows):,.1f} s of training steps "
           f"(evaluation and checkpoints not included)",
           f"- step time {_ms(t['measured_s'])} (median of {len(steady)} steps after warm-up)",
           f"- {run.median('tokens_per_s'):,.0f} tokens/s, MFU {run.median('mfu'):.1%} (median; MFU against this "
           f"device's measured peak)",
           f"- loss {rows[0]['loss']:.3f} at step 1 -> {last.get('loss', float('nan')):.3f} at step "
           f"{last.get('step', 0)}" if rows else "- no steps logged"]
    if vals:
        out.append(f"- validation loss {vals[-1]:.3f}" + (f" (unigram baseline {base:.3f}: a model that ignores "
                                                           f"context)" if base is not None else ""))
    out.append("")
    return out


def _where_section(run: RunFiles) -> list[str]:
    t = step_time_summary(run)
    share = (lambda x: f"{x / t['measured_s']:.0%}") if t["measured_s"] > 0 else (lambda x: "-")
    out = ["## Where time went", "",
           "Measured on rank 0, median per step after warm-up: the time blocked in collectives is what the comm "
           "layer timed inside waits and blocking calls (`comm_wait_s` in metrics.jsonl); the rest is compute, "
           "the optimizer and Python.", "",
           "| part | measured | share |" + (" predicted |" if run.plan else ""),
           "|---|---:|---:|" + ("---:|" if run.plan else "")]
    pred = run.plan["chosen"]["step"] if run.plan else None
    # A pipeline bubble is spent waiting for a neighbour's activations: the comm layer times it as a wait.
    comm_pred = sum(pred[k] for k in ("tp", "cp", "ep", "p2p", "dp", "bubble")) if pred else 0.0
    other_pred = pred["compute"] + pred["optimizer"] if pred else 0.0
    for name, value, p in (("compute, optimizer, Python", t["other_s"], other_pred),
                           ("blocked in collectives (and the bubble)", t["comm_wait_s"], comm_pred),
                           ("whole step", t["measured_s"], t["predicted_s"])):
        out.append(f"| {name} | {_ms(value)} | {share(value)} |" + (f" {_ms(p)} |" if pred else ""))
    if pred:
        out += ["", "The planner's parts: " + ", ".join(f"{k} {_ms(pred[k])}" for k in
                                                        ("compute", "dp", "tp", "cp", "ep", "p2p", "bubble",
                                                         "optimizer") if pred[k]) + f"; bound by {pred['bound']}."]
    out.append("")
    return out


def _memory_section(run: RunFiles) -> list[str]:
    out = ["## Memory per rank", "", "Live bytes of what each rank holds (comm.json), predicted by the planner's "
           "memory model:", "", "| rank | params | grads | optimizer | total |", "|---|---:|---:|---:|---:|"]
    for r in run.comm["ranks"]:
        s = r["state"]
        out.append(f"| {r['rank']} | {_mb(s['params'])} | {_mb(s['grads'])} | {_mb(s['optim'])} | "
                   f"{_mb(s['params'] + s['grads'] + s['optim'])} |")
    if run.plan:
        m = run.plan["chosen"]["memory_bytes"]
        out.append(f"| predicted | {_mb(m.get('params', 0))} | {_mb(m.get('grads', 0))} | {_mb(m.get('optim', 0))} "
                   f"| {_mb(sum(m.get(k, 0) for k in ('params', 'grads', 'optim')))} |")
        rest = {k: v for k, v in m.items() if k not in ("params", "grads", "optim", "total") and v}
        if rest:
            out.append("")
            out.append("The planner adds per device: " + ", ".join(f"{k} {_mb(v)}" for k, v in rest.items()) + ".")
    peak = run.median("peak_mem_bytes")
    if peak == peak:
        out += ["", f"Rank 0's peak resident memory: {_mb(peak)} (the whole process: Python, torch, buffers)."]
    out.append("")
    return out


def _check_section(run: RunFiles) -> list[str]:
    text, exact, memory_ok = check_run(run.dir)
    verdict = ("every byte count equal" if exact else "some byte counts differ") + ", " + \
        ("state memory within 5%" if memory_ok else "some state memory off by more than 5%")
    return ["## Predicted vs measured", "", f"`meshtrain plan --check-run {run.dir}`: {verdict}.", "",
            "```", text, "```", "", *[f"- {ln}" for ln in summary_lines(run)], ""]


def write_report(run_dir: str | Path, sample: str | None = None) -> Path:
    """Write ``report.md`` and ``loss.png`` into a finished run folder; returns the report's path."""
    run = RunFiles(run_dir)
    plot_loss(run, run.dir / "loss.png")
    m, t = run.cfg.model, run.cfg.train
    n = param_count(m).total
    lines = [f"# Run report: {run.dir.name}", "",
             f"Written {time.strftime('%Y-%m-%d %H:%M')} from the files of `{run.dir}`. Model: {n / 1e6:.2f}M "
             f"parameters (d_model {m.d_model}, {m.n_layers} layers, {m.n_heads} heads, {m.kv_heads} kv heads), "
             f"{t.global_batch} x {t.seq_len} = {t.global_batch * t.seq_len:,} tokens per step, {t.steps} steps.", ""]
    lines += _layout_section(run) + _bytes_section(run) + _timing_section(run) + _where_section(run)
    lines += _memory_section(run) + _check_section(run)
    lines += ["## Loss", "", "![train and validation loss](loss.png)", ""]
    if sample:
        lines += ["## Sample", "", "```", sample, "```", ""]
    path = run.dir / "report.md"
    path.write_text("\n".join(lines))
    return path
