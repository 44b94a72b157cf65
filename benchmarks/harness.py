"""What every ours-vs-theirs comparison in benchmarks/ shares, so each script says only what it compares.

- **Where it runs**: the machine decides. With a GPU per rank the processes use CUDA and NCCL (rank r
  on ``cuda:r``); otherwise CPU and gloo. ``backend_for`` / ``bench_device``.
- **How a step is timed** (``timed_step``): every rank waits at a barrier first, so no rank's clock
  starts while a peer is still finishing the previous step, and on CUDA the device is synchronised
  before the clock starts and before it stops (kernels are asynchronous). A step's time is the
  slowest rank's (``slowest``).
- **The order** (``order``): rounds alternate ours/theirs/theirs/ours/..., so drift of a shared machine
  (and warm caches, allocator growth) hits both sides alike.
- **The summary** (``Comparison``): the ratio ours/theirs of the median step times of each round, the
  median over rounds and their min–max; ``--runs`` repeats the whole comparison in fresh process
  groups, and the spread over those independent runs is what the docs quote.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from meshtrain import comm
from meshtrain.mesh import AxisGroup
from meshtrain.testing.spawn import spawn


def backend_for(world: int) -> str:
    """NCCL when this machine has a CUDA device for each of ``world`` ranks, else gloo."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"


def bench_device() -> torch.device:
    """This rank's device: its GPU under NCCL (``spawn`` set it), else the CPU."""
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def one_device(dry_run_cpu: bool, no_cuda: str) -> torch.device | None:
    """The one-device scripts' device (``gpu_single.py``, ``kernel_forms.py``): the current CUDA device, or the CPU
    under ``--dry-run-cpu``; without either, ``no_cuda`` on stderr and None (the script exits 2)."""
    if dry_run_cpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        print(no_cuda, file=sys.stderr)
        return None
    return torch.device("cuda", torch.cuda.current_device())


def world_group() -> AxisGroup:
    """Every rank, for the barrier before a timed step."""
    world = torch.distributed.get_world_size()
    return AxisGroup("world", tuple(range(world)), torch.distributed.group.WORLD)


def order(round_index: int) -> tuple[str, str]:
    """Which side runs first in this round: ours/theirs, theirs/ours, ours/theirs, ..."""
    return ("ours", "theirs") if round_index % 2 == 0 else ("theirs", "ours")


def timed_step(step: Callable[[], Any], group: AxisGroup | None = None) -> tuple[Any, float]:
    """Run one training step and return (its result, seconds): barrier first, device-synchronised clock."""
    group = group or world_group()
    comm.barrier(group)
    cuda = torch.cuda.is_available() and torch.distributed.get_backend() == "nccl"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = step()
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def slowest(per_rank: list[list[float]]) -> list[float]:
    """Each step's time as the slowest rank saw it (a step ends when its last rank does)."""
    return [max(ts) for ts in zip(*per_rank, strict=True)]


@dataclass
class Comparison:
    """Step times of ours and theirs, round by round, for one row of a table."""

    name: str
    ours: list[list[float]] = field(default_factory=list)  # per round: the slowest rank's step times
    theirs: list[list[float]] = field(default_factory=list)

    def add_round(self, ours: list[float], theirs: list[float]) -> None:
        self.ours.append(ours)
        self.theirs.append(theirs)

    def round_ratios(self) -> list[float]:
        return [statistics.median(o) / statistics.median(t) for o, t in zip(self.ours, self.theirs, strict=True)]

    def ratio(self) -> float:
        """The median over rounds of ours/theirs (each round: median step over median step)."""
        return statistics.median(self.round_ratios())

    def medians_ms(self) -> tuple[float, float]:
        return (statistics.median(t for r in self.ours for t in r) * 1e3,
                statistics.median(t for r in self.theirs for t in r) * 1e3)


def run_independent(worker: Callable[..., Any], world: int, runs: int, args: tuple) -> list[list[Any]]:
    """``runs`` fresh process groups of ``world`` ranks, each returning every rank's result."""
    return [spawn(worker, world, args=args, timeout=3000, backend=backend_for(world)) for _ in range(runs)]


def spread_line(ratios: list[float]) -> str:
    """'0.97 (0.95–0.99 over 3 runs)' style: the median ratio and its spread over independent runs."""
    if len(ratios) == 1:
        return f"{ratios[0]:.3f}"
    return f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} runs)"
