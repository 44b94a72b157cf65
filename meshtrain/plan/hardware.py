"""Chip specifications (per device). The planner's issue extends this table; the trainer uses it
for the MFU denominator. Figures are dense (no sparsity) vendor peaks."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Chip:
    name: str
    bf16_flops: float  # FLOP/s, dense
    hbm_bytes: float
    hbm_bw: float  # bytes/s
    source: str


CHIPS: dict[str, Chip] = {
    "h100": Chip("H100 SXM", 989e12, 80e9, 3.35e12, "NVIDIA H100 datasheet (SXM5, dense BF16)"),
    "h200": Chip("H200 SXM", 989e12, 141e9, 4.8e12, "NVIDIA H200 datasheet (dense BF16)"),
    "a100": Chip("A100 SXM", 312e12, 80e9, 2.039e12, "NVIDIA A100 datasheet (80GB SXM, dense BF16)"),
    "b200": Chip("B200", 2.25e15, 192e9, 8e12, "NVIDIA B200 datasheet (dense BF16)"),
}


def chip_for_cuda_device(name: str) -> Chip | None:
    """Match torch.cuda.get_device_name() to a table entry."""
    lowered = name.lower()
    for key, chip in CHIPS.items():
        if key in lowered:
            return chip
    return None


def measure_matmul_flops(dtype: torch.dtype = torch.float32, device: str = "cpu", n: int = 512,
                         seconds: float = 0.3) -> float:
    """Measured FLOP/s of a square matmul: the CPU's practical peak for MFU (no datasheet applies)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        iters += 1
    if device != "cpu":
        torch.cuda.synchronize()
    return 2.0 * n**3 * iters / (time.perf_counter() - start)


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Peak FLOP/s of one device: the datasheet for known GPUs, else a quick measurement."""
    if device.type == "cuda":
        chip = chip_for_cuda_device(torch.cuda.get_device_name(device))
        if chip is not None:
            return chip.bf16_flops if dtype == torch.bfloat16 else chip.bf16_flops / 2
        return measure_matmul_flops(dtype, "cuda", n=4096)
    return measure_matmul_flops(dtype, "cpu")
