"""``meshtrain plan --calibrate``: measure this machine and write the planner's ``cpu-local`` profile.

Measuring needs local processes and collectives (``meshtrain.testing.spawn``, ``meshtrain.comm``, ``meshtrain.mesh``),
so it lives at the command-line layer; the plan layer keeps the profile format and its cache
(``meshtrain/plan/hardware.py``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from meshtrain import comm
from meshtrain.mesh import Mesh
from meshtrain.plan.hardware import Hardware, hardware_cache_dir, measure_matmul_flops, save_profile
from meshtrain.testing.spawn import spawn


def _allreduce_worker(rank: int, world_size: int, numel: int, iters: int) -> float:
    """Seconds per all-reduce of ``numel`` fp32 values, through meshtrain.comm on a dp mesh group."""
    mesh = Mesh(dp=world_size, device=torch.device("cpu"))
    group = mesh.group("dp", "cp")
    x = torch.ones(numel)
    comm.all_reduce(x, group)  # warm-up: connections, buffers
    comm.barrier(group)
    start = time.perf_counter()
    for _ in range(iters):
        comm.all_reduce(x, group)
    return (time.perf_counter() - start) / iters


def measure_allreduce_bandwidth(world_size: int = 2, mbytes: float = 32.0, iters: int = 5) -> tuple[float, float]:
    """(bytes/s, seconds per call): gloo all-reduce on ``world_size`` local processes (meshtrain.testing.spawn),
    as per-device egress bandwidth: the ring sends 2 (n-1)/n x the tensor per device."""
    numel = int(mbytes * 1e6 / 4)
    secs = max(spawn(_allreduce_worker, world_size, (numel, iters), timeout=300.0))
    wire = 2 * (world_size - 1) / world_size * numel * 4
    return wire / secs, secs


def measure_copy_bandwidth(mbytes: float = 256.0, iters: int = 5) -> float:
    """Memory bandwidth of a large tensor copy (read + write), bytes/s: the CPU's stand-in for HBM."""
    a = torch.empty(int(mbytes * 1e6 / 4))
    b = torch.empty_like(a)
    b.copy_(a)
    start = time.perf_counter()
    for _ in range(iters):
        b.copy_(a)
    return 2 * a.numel() * 4 * iters / (time.perf_counter() - start)


def calibrate_cpu_local(path: str | Path | None = None, world_size: int = 2) -> Hardware:
    """Measure this machine and save the ``cpu-local`` profile: matmul FLOP/s (bf16 and fp32, the larger
    is what autocast would reach), gloo all-reduce bandwidth between ``world_size`` local processes (both
    fabrics: every process is on this host), memory-copy bandwidth, and RAM per process."""
    flops = max(measure_matmul_flops(torch.float32, n=1024, seconds=1.0),
                measure_matmul_flops(torch.bfloat16, n=1024, seconds=1.0))
    bw, secs = measure_allreduce_bandwidth(world_size)
    mem_bw = measure_copy_bandwidth()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 8e9
    hw = Hardware(
        "cpu-local", f"this machine (CPU, {os.cpu_count()} cores, {world_size} gloo processes)", flops,
        float(ram) / world_size, mem_bw, intra_bw=bw, inter_bw=bw, devices_per_node=world_size, domain=world_size,
        tp_max=world_size, intra_latency=min(secs, 1e-4), inter_latency=min(secs, 1e-4),
        source=f"meshtrain plan --calibrate on {time.strftime('%Y-%m-%d %H:%M')}: torch matmul n=1024, "
               f"gloo all-reduce of 32 MB over {world_size} processes via meshtrain.comm, tensor copy")
    save_profile(hw, path or hardware_cache_dir() / "cpu-local.json")
    return hw
