"""Profiling a window of training steps (``train.profile_steps`` from ``train.profile_start``) with torch.profiler.

Each rank writes its trace, ``<out>/profile/rank<r>.json.gz`` (Chrome trace format: open it in Perfetto,
ui.perfetto.dev, or chrome://tracing), and the logging rank writes where its step time went: milliseconds per
step by kind of kernel (``KERNEL_KINDS``) and the top kernels. On CUDA that is device time, the kernels
themselves; on a CPU it is the CPU time of the aten ops.

Why a fixed window rather than torch's wait/warmup/active schedule around the whole run: the steps outside the
window then pay nothing, and a window placed after the first steps misses compilation and the allocator's
warm-up, as torchtitan's and Megatron's (``--profile-step-start``) do. ``benchmarks/gpu_single.py --profile``
summarises its rows with the same functions, so the benchmark and a real run name their kinds alike.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

# Kinds of kernel, matched in this order on the lower-cased kernel (or aten op) name; anything else is "other".
KERNEL_KINDS = {
    "communication": ("nccl", "gloo", "c10d", "allreduce", "all_reduce", "allgather", "all_gather",
                      "reduce_scatter", "reducescatter", "alltoall", "sendrecv"),
    "matmul": ("nvjet", "gemm", "cutlass", "aten::mm", "aten::addmm", "aten::bmm"),
    "attention": ("sdpa", "flash", "fmha", "attention"),
    "optimizer": ("multi_tensor_apply", "adam", "foreach"),
    "compiled": ("triton_",),
}


def kind_of(name: str) -> str:
    """The ``KERNEL_KINDS`` kind of a kernel or op name, or "other"."""
    low = name.lower()
    return next((k for k, words in KERNEL_KINDS.items() if any(w in low for w in words)), "other")


def kernel_times(prof: profile, cuda: bool) -> list[tuple[str, float, int]]:
    """(name, microseconds, calls) of every kernel (CUDA: device time) or aten op (CPU: self CPU time) in ``prof``.
    User annotations (the step marker, the optimizer's step region) span kernels already counted: left out."""
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    return [(e.key, getattr(e, key), e.count) for e in prof.key_averages()
            if getattr(e, key) > 0 and not getattr(e, "is_user_annotation", False)
            and not e.key.startswith("Optimizer.") and (not cuda or e.device_type.name == "CUDA")]


# Each profiled step runs inside record_function(STEP_MARK + " N"): its CPU span is the step's window on the
# profiler's one clock, which the device's kernels share (``idle_gaps``).
STEP_MARK = "meshtrain step"


def device_spans(prof: profile) -> list[tuple[float, float, str]]:
    """(start, end, name) in microseconds of every CUDA kernel, copy and set in ``prof``, on the profiler's clock
    (none on a CPU). The device-side mirrors of user annotations span kernels already listed: left out."""
    return [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False)
            and not e.name.startswith(STEP_MARK)]


def step_windows(prof: profile) -> list[tuple[float, float]]:
    """(start, end) in microseconds of each step marked with ``STEP_MARK`` in ``prof``, host side."""
    return [(e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type.name == "CPU" and e.name.startswith(STEP_MARK)]


def idle_gaps(spans: Iterable[tuple[float, float, str]], windows: Iterable[tuple[float, float]],
              top: int = 3) -> tuple[float, float, list[tuple[float, str, str]]]:
    """Where the device sat idle inside the steps' ``windows``, given its kernels' ``spans`` (microseconds):
    (idle ms per step, of it the ms per step before each step's first kernel, the ``top`` largest gaps anywhere
    as (ms, what ran before, what ran after)). A gap at a step's start, while the host builds and queues the step,
    runs "after" ``(step start)``; one at its end, "before" ``(step end)``. Kernels on several streams may overlap:
    the device is idle only where none runs."""
    spans, windows = sorted(spans), list(windows)
    gaps: list[tuple[float, str, str]] = []
    lead = 0.0
    for ws, we in windows:
        inside = [(max(s, ws), min(e, we), n) for s, e, n in spans if e > ws and s < we]
        free_from, last = ws, "(step start)"
        for s, e, n in inside:
            if s > free_from:
                gaps.append(((s - free_from) / 1e3, last, n))
                if last == "(step start)":
                    lead += (s - free_from) / 1e3
            if e > free_from:
                free_from, last = e, n
        if we > free_from:
            gaps.append(((we - free_from) / 1e3, last, "(step end)"))
            if last == "(step start)":  # no kernel ran in the step at all
                lead += (we - free_from) / 1e3
    n = max(len(windows), 1)
    return sum(g for g, _, _ in gaps) / n, lead / n, sorted(gaps, key=lambda g: -g[0])[:top]


def gaps_line(idle_ms: float, lead_ms: float, largest: list[tuple[float, str, str]]) -> str:
    """One line saying ``idle_gaps``' result."""
    where = "; ".join(f"{ms:.2f} ms after {a[:60]}, before {b[:60]}" for ms, a, b in largest)
    return (f"device idle inside the steps: {idle_ms:.1f} ms per step, {lead_ms:.1f} of it before each step's "
            f"first kernel; largest gaps: {where}")


def summary(times: Iterable[tuple[str, float, int]], n_steps: int, where: str, wall_s: float, top: int = 14) -> str:
    """Lines saying where ``n_steps`` steps' time went: the total against the wall time ``wall_s`` of the steps
    (on CUDA, the rest is the device waiting for the host), each kind in ms per step, then the ``top`` kernels."""
    times = sorted(times, key=lambda t: -t[1])
    per_step = [(name, us / 1e3 / n_steps, calls // n_steps) for name, us, calls in times]
    kinds = dict.fromkeys([*KERNEL_KINDS, "other"], 0.0)
    for name, ms, _ in per_step:
        kinds[kind_of(name)] += ms
    busy, wall = sum(kinds.values()), wall_s * 1e3 / n_steps
    lines = [f"{busy:.1f} ms of {where} time per step of {wall:.1f} ms wall ({busy / wall:.0%}) over {n_steps} "
             f"steps; by kind (ms per step): " + ", ".join(f"{k} {v:.1f}" for k, v in kinds.items()),
             "top kernels (ms per step, calls per step):"]
    lines += [f"  {ms:8.2f} ms  {calls:5d}x  {name[:100]}" for name, ms, calls in per_step[:top]]
    return "\n".join(lines)


class StepProfiler:
    """Traces steps ``start`` .. ``start + steps - 1`` of a run, numbered as the log numbers them (the first
    step is 1); ``steps == 0``: does nothing.

    ``trace`` is this rank's trace file (None: no file, only the summary). After the window's last step,
    ``summary`` holds what ``summary()`` says of it (and is taken once by ``take_summary``)."""

    def __init__(self, start: int, steps: int, device: torch.device, trace: Path | None) -> None:
        self.start, self.stop, self.device, self.trace = start, start + steps, device, trace
        self._prof: profile | None = None
        self._first = start  # the window's first traced step (later when a run resumes inside it)
        self._wall_s = 0.0  # the traced steps' wall time
        self._summary: str | None = None

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Wrap training step ``step`` (as logged; the caller synchronises the device inside, so the step's
        kernels are done when it ends)."""
        if not self.start <= step < self.stop:
            yield
            return
        if self._prof is None:  # the window's first step, or a run resumed inside the window
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._prof = profile(activities=acts)
            self._prof.start()
            self._first, self._wall_s = step, 0.0
        start = time.perf_counter()
        try:
            with record_function(f"{STEP_MARK} {step}"):
                yield
        except BaseException:
            self._prof.stop()  # a failing step ends the run: the profiler must not outlive it
            raise
        self._wall_s += time.perf_counter() - start
        if step == self.stop - 1:
            self._finish(step + 1 - self._first)

    def _finish(self, n_steps: int) -> None:
        prof, self._prof = self._prof, None
        prof.stop()
        cuda = self.device.type == "cuda"
        where = "device" if cuda else "CPU"
        self._summary = f"profile of steps {self._first}-{self._first + n_steps - 1}: " + summary(
            kernel_times(prof, cuda), n_steps, where, self._wall_s)
        if cuda:
            self._summary += "\n" + gaps_line(*idle_gaps(device_spans(prof), step_windows(prof)))
        if self.trace is not None:
            self.trace.parent.mkdir(parents=True, exist_ok=True)
            part = self.trace.with_name(f".{self.trace.name[:-len('.json.gz')]}.part.json.gz")
            prof.export_chrome_trace(str(part))  # gzip by the suffix; renamed whole, so no half-written trace
            os.replace(part, self.trace)
            self._summary += f"\ntrace: {self.trace} (open in ui.perfetto.dev)"

    def take_summary(self) -> str | None:
        """The finished window's summary, once; None before the window ends (and after it was taken)."""
        text, self._summary = self._summary, None
        return text


__all__ = ["KERNEL_KINDS", "STEP_MARK", "StepProfiler", "device_spans", "gaps_line", "idle_gaps", "kernel_times",
           "kind_of", "step_windows", "summary"]
