"""Chip specifications (per device) and the planner's cluster profiles with their sources. The trainer uses
the chip table for the MFU denominator. Figures are dense (no sparsity) vendor peaks.

A measured ``cpu-local`` profile is written by ``meshtrain plan --calibrate`` (``meshtrain/calibrate.py``,
which needs processes and collectives, so it sits above this layer); here are only its file format
(``save_profile`` / ``load_profile``) and where it is cached."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the functions that measure a device import torch when called: the planner itself runs without
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
    "h100 pcie": Chip("H100 PCIe", 756e12, 80e9, 2.0e12, "NVIDIA H100 datasheet (PCIe: 1,513 TFLOP/s BF16 with "
                      "sparsity, 756 dense)"),
    "h100 nvl": Chip("H100 NVL", 835e12, 94e9, 3.9e12, "NVIDIA H100 datasheet (NVL: 1,671 TFLOP/s BF16 with "
                     "sparsity, 835 dense)"),
    "h200": Chip("H200 SXM", 989e12, 141e9, 4.8e12, "NVIDIA H200 datasheet (dense BF16)"),
    "h200 nvl": Chip("H200 NVL", 835e12, 141e9, 4.8e12, "NVIDIA H200 datasheet (NVL: 1,671 TFLOP/s BF16 with "
                     "sparsity, 835 dense)"),
    "a100": Chip("A100 SXM", 312e12, 80e9, 2.039e12, "NVIDIA A100 datasheet (80GB SXM, dense BF16)"),
    "b200": Chip("B200", 2.25e15, 192e9, 8e12, "NVIDIA B200 datasheet (dense BF16)"),
}


def chip_for_cuda_device(name: str) -> Chip | None:
    """Match torch.cuda.get_device_name() to a table entry, the most specific key first: "NVIDIA H100 PCIe" is
    the PCIe part (756 TFLOP/s), "NVIDIA H100 80GB HBM3" the SXM one (989)."""
    lowered = name.lower()
    for key in sorted(CHIPS, key=len, reverse=True):
        if key in lowered:
            return CHIPS[key]
    return None


def measure_matmul_flops(dtype: torch.dtype | None = None, device: str = "cpu", n: int = 512,
                         seconds: float = 0.3) -> float:
    """Measured FLOP/s of a square matmul (fp32 unless ``dtype``): the CPU's practical peak for MFU (no
    datasheet applies)."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
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


def datasheet_chip(device: torch.device, dtype: torch.dtype) -> Chip | None:
    """The chip whose datasheet gives ``device``'s peak for ``dtype``, or None where ``peak_flops`` measures it:
    a CPU, a GPU not in the table, and fp32 under torch's default matmul precision, "highest", which runs fp32
    matmuls on the CUDA cores (~67 TFLOP/s on an H100) rather than at the TF32 tensor-core rate (494)."""
    import torch

    if device.type != "cuda":
        return None
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return None
    return chip_for_cuda_device(torch.cuda.get_device_name(device))


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Peak FLOP/s of one device: the datasheet where ``datasheet_chip`` names one (16-bit: its bf16 rate; TF32:
    half that), else a quick measurement."""
    import torch

    chip = datasheet_chip(device, dtype)
    if chip is not None:
        return chip.bf16_flops if dtype in (torch.bfloat16, torch.float16) else chip.bf16_flops / 2
    return measure_matmul_flops(dtype, "cuda", n=4096) if device.type == "cuda" else measure_matmul_flops(dtype, "cpu")


# ----------------------------------------------------------------------------- cluster profiles for the planner
# A profile is one device plus the two fabrics it talks over. Bandwidths are what one device can send
# per second into a collective (egress), the quantity the ring formulas divide by:
# - intra_bw: the fast fabric. NVLink: one direction of the GPU's NVLink bandwidth (any peer, through
#   NVSwitch). TPU ICI: one torus axis, i.e. two links (both neighbours) x the one-way link bandwidth;
#   this is the book's W_ici = 2 x 9e10 = 1.8e11 for v5p (seed 000). A group spread over a axes gets a x.
# - inter_bw: off the fast domain. GPUs: the node's InfiniBand NICs divided by its GPUs (one 400 Gb/s
#   NIC per GPU = 5e10 B/s). TPUs: the host's DCN bandwidth divided by its chips (seed 003: 6.25e9 on v5p).


@dataclass(frozen=True)
class Hardware:
    """A device and its interconnect, as the planner sees it.

    ``domain`` is how many devices share the fast fabric (the NVLink domain of one node, or a TPU pod
    over ICI); ``mesh_axes`` is the ICI torus shape of that domain, empty for a switched fabric, where
    any group inside the domain gets the full ``intra_bw``. ``tp_max`` is the largest tensor-parallel
    group the planner places on the fast fabric (a node's GPUs; one torus axis).
    """

    key: str
    name: str
    bf16_flops: float  # dense FLOP/s per device
    hbm_bytes: float
    hbm_bw: float  # bytes/s
    intra_bw: float  # bytes/s per device on the fast fabric (per axis for a torus)
    inter_bw: float  # bytes/s per device leaving the fast domain (IB / DCN)
    devices_per_node: int  # devices per host (what --nodes counts)
    domain: int  # devices on one fast fabric
    mesh_axes: tuple[int, ...] = ()
    tp_max: int = 8
    intra_latency: float = 5e-6  # seconds per tree level of a collective
    inter_latency: float = 1e-5
    source: str = ""
    # Measured step costs (``meshtrain plan --calibrate``, ``plan/costfit.py``); all 0 for the datasheet presets,
    # whose compute is the roofline at --efficiency x peak. With them ``bf16_flops`` is the matmul rate reached
    # at small shapes (efficiency 1), and processes beyond ``cores`` share the cores (each slowed devices/cores).
    cores: int = 0
    elem_s: float = 0.0  # seconds per non-matmul activation element (forward + backward)
    score_s: float = 0.0  # seconds per causal attention score (forward + backward)
    block_s: float = 0.0  # seconds per block forward + backward call (dispatch overhead)
    param_s: float = 0.0  # seconds per parameter of gradient clipping + the optimizer step
    step_s: float = 0.0  # fixed seconds per optimizer step
    # The compute dtype the step costs were measured in (``train.dtype``; a CPU without native bf16 is calibrated
    # in fp32, where ``bf16_flops`` then holds the fp32 rate): a run in another dtype is calibrated again.
    dtype: str = "bf16"
    # A GPU step's work outside its matmuls (``GPU_KERNELS``, measured on an H100; 0 on the TPU presets, whose step
    # is the book's roofline): HBM bytes per activation element a block keeps (``activation_elems_per_token``),
    # forward + backward; attention's cost per causal score beyond its FLOPs at the matmul rate, in FLOPs at peak;
    # HBM bytes per parameter per microbatch (autocast's weight cast, the gradient's cast back and its copy into the
    # bucket) and per local parameter per step (the clip's norm and scale, fused AdamW).
    elem_bytes: float = 0.0
    score_flops: float = 0.0
    cast_bytes: float = 0.0
    optim_bytes: float = 0.0
    probe_s: float = 0.0  # seconds of calibrate.probe_speed's reference step when measured (drift check)
    # Measured collectives (``--calibrate``): each op's own latency per tree level and bandwidth {op: [s, B/s]}
    # (gloo's all-reduce, all-gather, reduce-scatter, all-to-all and send differ more than one pair describes),
    # and the host work of one collective call issued between compute (Python, the comm meter, waking a peer).
    collective_fits: dict = field(default_factory=dict)
    call_s: float = 0.0
    # The parallel runtime's own work per block call and microbatch that the single-process steps do not contain
    # (``--calibrate`` times short runs through ``parallelize()`` on 2 processes at four sizes): {"tp", "cp" (ring and
    # all-gather), "cp_ulysses", "moe", "zero3", "zb", "selective" (recompute's policy): [s per block call, per
    # activation element, per microbatch, per block parameter, per attention score]} (``steptime.axis_features``).
    axis_block_s: dict = field(default_factory=dict)

    @property
    def torus(self) -> bool:
        return bool(self.mesh_axes)

    @property
    def measured_steps(self) -> bool:
        """Whether the profile carries measured step costs (``--calibrate``) rather than a datasheet peak."""
        return any(x > 0 for x in (self.elem_s, self.block_s, self.param_s, self.step_s))

    @property
    def gpu_kernels(self) -> bool:
        """Whether the datasheet roofline is completed by the measured GPU kernel costs (``GPU_KERNELS``)."""
        return not self.measured_steps and self.elem_bytes > 0

    def part_of_node(self, devices: int) -> Hardware:
        """This profile for ``devices`` devices of one node (one GPU, say): a node of that many on the same fabric."""
        from dataclasses import replace

        if self.mesh_axes or not 1 <= devices <= self.devices_per_node:
            raise ValueError(f"{self.name}: {devices} devices are not part of one switched-fabric node")
        return replace(self, devices_per_node=devices, domain=min(self.domain, devices),
                       tp_max=min(self.tp_max, devices))

    def oversubscription(self, devices: int) -> float:
        """How much slower each of ``devices`` processes runs when they share ``cores`` (1 for real devices)."""
        return max(1.0, devices / self.cores) if self.cores > 0 else 1.0

    def shared_by(self, devices: int) -> Hardware:
        """This profile as each of ``devices`` processes sees it when they share ``cores``: every rate divided
        and every cost multiplied by ``oversubscription`` (gloo's collectives are CPU work too). Unchanged for
        real devices and up to one process per core."""
        from dataclasses import replace

        k = self.oversubscription(devices)
        if k == 1.0:
            return self
        return replace(self, bf16_flops=self.bf16_flops / k, hbm_bw=self.hbm_bw / k, intra_bw=self.intra_bw / k,
                       inter_bw=self.inter_bw / k, intra_latency=self.intra_latency * k,
                       inter_latency=self.inter_latency * k, elem_s=self.elem_s * k, score_s=self.score_s * k,
                       block_s=self.block_s * k, param_s=self.param_s * k, step_s=self.step_s * k,
                       call_s=self.call_s * k, axis_block_s={a: _scaled(v, k) for a, v in self.axis_block_s.items()},
                       collective_fits={op: [lat * k, bw / k] for op, (lat, bw) in self.collective_fits.items()})

    def to_dict(self) -> dict:
        from dataclasses import asdict

        d = asdict(self)
        d["mesh_axes"] = list(self.mesh_axes)
        return d


# What a GPU step spends beyond its matmuls at --efficiency x peak: ``benchmarks/gpu_kernels_fit.py`` over
# ``benchmarks/gpu_single.py --profile 2`` runs on one H100 (2026-11-26 at b13d967, tests/fixtures/h100_b13d967/;
# docs/benchmarks.md "Figures: one NVIDIA H100"): the ~1B Llama, bf16, train.compile=true, batch 8 and 24, each
# kernel's device time by kind, at the H100's datasheet 989 TFLOP/s and 3.35 TB/s (so the bytes include the kernels'
# shortfall from the datasheet bandwidth). Element-wise (the norms, RoPE, SwiGLU, residual adds and the loss, fused by
# torch.compile; eager moves ~3x more): 7.6 bytes per kept activation element. Attention (cuDNN's flash kernels,
# head_dim 64): 1,830 FLOPs per causal score beyond its own FLOPs (softmax's exponentials: a cost per score, which
# does not grow with head_dim). Per parameter: 15 bytes a microbatch (by hand 6 + 6 = 12 for the weight's cast and
# the gradient's cast back; the fit also takes in the step's fixed element-wise work) and 46 a step (by hand 36: the
# norm reads each fp32 gradient, 4; fused AdamW moves 28 and writes the gradient back divided by the clip, 4; 36 B
# at ~78% of the datasheet bandwidth). The wider model (d_model 4096, 8 blocks), not fitted, is the check (predicted
# 0.94 of its measured step, whose host gaps the planner does not model). The weight's cast is charged per
# microbatch as the fitted runs (compiled blocks, which cast inside their graphs) made it; an eager step casts each
# weight once for all its microbatches (parallel/microsteps.py), 6 of those bytes per microbatch after the first
# (tests/test_gpu_kernels.py), except tensor parallelism's column layers, which cast in each forward and again in
# each backward (parallel/tensor.py).
GPU_KERNELS = {"elem_bytes": 7.6, "score_flops": 1830.0, "cast_bytes": 15.0, "optim_bytes": 46.0}

_BOOK_TPU = ("How to Scale Your Model (Austin et al., 2025), Part 2 'How to Think About TPUs', chip and ICI "
             "tables (seed 000 quotes the v5p figures)")

HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        "h100", "H100 SXM (HGX/DGX H100)", 989e12, 80e9, 3.35e12, intra_bw=450e9, inter_bw=50e9,
        devices_per_node=8, domain=8, **GPU_KERNELS,
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM5: 989 TFLOP/s dense BF16, 80 GB HBM3, 3.35 TB/s, "
               "NVLink 900 GB/s bidirectional = 450 GB/s per direction); DGX H100 user guide (8 GPUs, "
               "8x ConnectX-7 400 Gb/s InfiniBand NDR, one per GPU = 50 GB/s)"),
    "h200": Hardware(
        "h200", "H200 SXM (HGX H200)", 989e12, 141e9, 4.8e12, intra_bw=450e9, inter_bw=50e9,
        devices_per_node=8, domain=8, **GPU_KERNELS,
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM: 989 TFLOP/s dense BF16, 141 GB HBM3e, 4.8 TB/s, "
               "NVLink 900 GB/s bidirectional); HGX H200 with one 400 Gb/s NDR NIC per GPU"),
    "b200": Hardware(
        "b200", "B200 (HGX/DGX B200)", 2.25e15, 192e9, 8e12, intra_bw=900e9, inter_bw=50e9,
        devices_per_node=8, domain=8, **GPU_KERNELS,
        source="NVIDIA B200 / HGX B200 datasheet (2.25 PFLOP/s dense BF16 per GPU, 192 GB HBM3e, 8 TB/s, "
               "NVLink 5 1.8 TB/s bidirectional = 900 GB/s per direction); DGX B200: 8x ConnectX-7 400 Gb/s"),
    "a100": Hardware(
        "a100", "A100 SXM 80GB (DGX A100)", 312e12, 80e9, 2.039e12, intra_bw=300e9, inter_bw=25e9,
        devices_per_node=8, domain=8, **GPU_KERNELS,
        source="NVIDIA A100 datasheet (80GB SXM: 312 TFLOP/s dense BF16, 2,039 GB/s, NVLink 3 600 GB/s "
               "bidirectional = 300 GB/s per direction); DGX A100: 8x ConnectX-6 200 Gb/s HDR, one per GPU"),
    "tpu-v4p": Hardware(
        "tpu-v4p", "TPU v4p", 2.75e14, 32e9, 1.2e12, intra_bw=2 * 4.5e10, inter_bw=6.25e9,
        devices_per_node=4, domain=4096, mesh_axes=(16, 16, 16), tp_max=16,
        source=_BOOK_TPU + ": 2.75e14 bf16 FLOP/s, 32 GB, 1.2e12 B/s HBM, ICI 4.5e10 B/s one-way per link, "
               "3-D torus pod 16x16x16, 2x2x1 chips per host; DCN assumed as v5p (25 GB/s per host)"),
    "tpu-v5e": Hardware(
        "tpu-v5e", "TPU v5e", 1.97e14, 16e9, 8.1e11, intra_bw=2 * 4.5e10, inter_bw=3.125e9,
        devices_per_node=8, domain=256, mesh_axes=(16, 16), tp_max=16,
        source=_BOOK_TPU + ": 1.97e14 bf16 FLOP/s, 16 GB, 8.1e11 B/s HBM, ICI 4.5e10 B/s one-way per link, "
               "2-D torus pod 16x16, 4x2 chips per host; DCN 6.4 Tb/s per 256-chip pod (Cloud TPU v5e docs)"),
    "tpu-v5p": Hardware(
        "tpu-v5p", "TPU v5p", 4.59e14, 96e9, 2.8e12, intra_bw=2 * 9e10, inter_bw=6.25e9,
        devices_per_node=4, domain=8960, mesh_axes=(16, 20, 28), tp_max=16,
        source=_BOOK_TPU + ": 4.59e14 bf16 FLOP/s, 96 GB, 2.8e12 B/s HBM, ICI 9e10 B/s one-way per link "
               "(W = 1.8e11 per axis, seed 000), 3-D torus pod 16x20x28 = 8960 chips, 2x2x1 chips per host; "
               "DCN 25 GB/s per host = 6.25e9 per chip (seed 003)"),
}
_ALIASES = {"v4p": "tpu-v4p", "v5e": "tpu-v5e", "v5p": "tpu-v5p", "h100-sxm": "h100", "tpuv5p": "tpu-v5p"}


def hardware_cache_dir() -> Path:
    """Where calibrated profiles live: ``$MESHTRAIN_CACHE/hardware`` or ``~/.cache/meshtrain/hardware``."""
    base = os.environ.get("MESHTRAIN_CACHE") or "~/.cache/meshtrain"
    return Path(base).expanduser() / "hardware"


def load_profile(path: str | Path) -> Hardware:
    """Read a profile written by ``save_profile`` (JSON of the ``Hardware`` fields); a file that is not one is a
    ``ValueError`` naming it."""
    fix = "pass a file written by `meshtrain plan --calibrate` or a preset name"
    try:
        data = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--hardware {path} is not a hardware profile (not JSON: {e}): {fix}.") from None
    except OSError as e:
        raise ValueError(f"--hardware {path} cannot be read ({e.strerror or e}): {fix}.") from None
    known = {f.name for f in fields(Hardware)}
    required = {f.name for f in fields(Hardware) if f.default is MISSING and f.default_factory is MISSING}
    if not isinstance(data, dict) or required - set(data):
        missing = sorted(required - set(data)) if isinstance(data, dict) else ["(not a JSON object)"]
        raise ValueError(f"--hardware {path} is not a hardware profile: it lacks {', '.join(missing)}; {fix}.")
    for f in fields(Hardware):
        if f.name in data and (why := _bad_field(f.name, f.type, data[f.name], f.name in required)):
            raise ValueError(f"--hardware {path}: {f.name} is {data[f.name]!r}, {why}; {fix}.")
        if f.type == "int" and f.name in data:
            data[f.name] = int(data[f.name])  # 8.0 -> 8: counts index ranges
    data["mesh_axes"] = tuple(data.get("mesh_axes", ()))
    return Hardware(**{k: v for k, v in data.items() if k in known})


def _bad_field(name: str, kind: str, value: object, required: bool) -> str | None:
    """Why a profile's value cannot be that field's (None: it can). Sizes and rates are finite numbers, those
    every profile has positive, the measured ones >= 0 (0: not measured); counts whole."""
    if kind in ("float", "int"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return "not a finite number"
        if kind == "int" and value != int(value):
            return "not a whole number"
        if required and value <= 0 or value < 0:
            return "not positive" if required else "negative"
        if name == "tp_max" and value < 1:
            return "not positive"
    elif kind == "str" and not isinstance(value, str):
        return "not a string"
    elif kind == "dict" and not isinstance(value, dict):
        return "not a JSON object"
    elif name == "mesh_axes" and not (isinstance(value, list) and all(
            isinstance(a, int) and not isinstance(a, bool) and a > 0 for a in value)):
        return "not a list of positive whole numbers"
    return None


def save_profile(hw: Hardware, path: str | Path) -> Path:
    """Write ``hw`` as JSON (creating the folder); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(hw.to_dict(), indent=2) + "\n")
    return path


def get_hardware(name: str) -> Hardware:
    """A preset by name (h100, h200, b200, a100, tpu-v4p, tpu-v5e, tpu-v5p; v5p etc. also work), the
    calibrated ``cpu-local`` profile, or a profile JSON file."""
    key = name.lower()
    key = _ALIASES.get(key, key)
    if key in HARDWARE:
        return HARDWARE[key]
    if key == "cpu-local":
        path = hardware_cache_dir() / "cpu-local.json"
        if not path.exists():
            raise FileNotFoundError(f"--hardware cpu-local: no calibrated profile at {path}. Run "
                                    f"`meshtrain plan --calibrate` first (it measures this machine's matmul "
                                    f"FLOP/s and gloo all-reduce bandwidth and writes that file).")
        return load_profile(path)
    if name.endswith(".json") and Path(name).exists():
        return load_profile(name)
    raise ValueError(f"--hardware {name!r} is not known: choose one of {', '.join(HARDWARE)}, cpu-local "
                     f"(after `meshtrain plan --calibrate`) or a profile .json file.")


def _scaled(work: float | list[float], k: float) -> float | list[float]:
    """An ``axis_block_s`` entry (a number, or a list of terms) times ``k``."""
    return work * k if isinstance(work, (int, float)) else [w * k for w in work]
