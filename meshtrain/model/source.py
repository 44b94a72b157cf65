"""Where weights come from, one logical region at a time: the interface every state path shares.

A *logical* tensor is a tensor of the plain single-device model, by its parameter name (``layers.0.attention.
wq.weight``), or an optimizer state of one (``layers.0.attention.wq.weight/exp_avg``). A ``Box`` is a
rectangular region of a logical tensor: one ``(start, stop)`` per dimension.

A ``TensorSource`` answers "give me this box of that tensor". Sharded construction, resuming from a
checkpoint and importing HuggingFace weights are the same operation with different sources: each rank
asks only for the boxes it holds (its TP slice, pipeline stage, ZeRO shard, experts), so no rank reads or
materialises the whole model. The sources are the deterministic init (``init.InitSource``), a meshtrain
checkpoint (``train/checkpoint.py``) and a HuggingFace folder (``model/hf.py``).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

Box = tuple[tuple[int, int], ...]  # (start, stop) per dimension of a logical tensor; () for a scalar


def full_box(shape: Iterable[int]) -> Box:
    """The box covering a whole tensor of ``shape``."""
    return tuple((0, int(s)) for s in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def box_numel(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


def intersect(a: Box, b: Box) -> Box | None:
    """The common region of two boxes of the same tensor, or None if they do not meet."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def relative(box: Box, origin: Box) -> tuple[slice, ...]:
    """Index of ``box`` inside a tensor that holds the region ``origin`` (which contains it)."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin, strict=True))


class TensorSource(Protocol):
    """Logical tensors, readable a box at a time."""

    def shape(self, key: str) -> tuple[int, ...] | None:
        """The logical shape of ``key``, or None if this source does not have it."""

    def read(self, key: str, box: Box) -> torch.Tensor:
        """The region ``box`` of logical tensor ``key`` (in the stored dtype; callers cast)."""


@torch.no_grad()
def load_full(model: nn.Module, source: TensorSource) -> None:
    """Fill every parameter (and persistent buffer the source has) of a whole, single-device ``model``.

    For tools that hold the whole model anyway (generation, export checks); training ranks fill only their
    pieces (``parallel/state.py``).
    """
    for name, p in model.named_parameters():
        shape = source.shape(name)
        if shape is None:
            raise KeyError(f"{name} is missing from the weights: they were written for another model.")
        if tuple(shape) != tuple(p.shape):
            raise ValueError(f"{name} has shape {tuple(shape)} in the weights but {tuple(p.shape)} in the model: "
                             f"check the model config.")
        p.copy_(source.read(name, full_box(p.shape)))
    for name, b in model.named_buffers():
        shape = source.shape(name)
        if shape is not None and tuple(shape) == tuple(b.shape):
            b.copy_(source.read(name, full_box(b.shape)))


class DictSource:
    """Whole tensors in memory as a ``TensorSource`` (tests, and tools that hold a whole model anyway)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def shape(self, key: str) -> tuple[int, ...] | None:
        t = self.tensors.get(key)
        return None if t is None else tuple(t.shape)

    def read(self, key: str, box: Box) -> torch.Tensor:
        return self.tensors[key][relative(box, full_box(self.tensors[key].shape))]


def state_source(model: nn.Module) -> DictSource:
    """A whole single-device model's parameters and persistent buffers as a source (tied names included)."""
    tensors = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
    persistent = {n for n, _ in model.state_dict().items()}
    tensors.update({n: b for n, b in model.named_buffers() if n in persistent})
    return DictSource(tensors)


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Names of tied parameters -> the name they are stored under (the first, as ``named_parameters`` gives)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...], torch.dtype, Callable[[], torch.Tensor]]],
                      metadata: dict[str, str] | None = None) -> None:
    """A safetensors file streamed one tensor at a time: ``tensors`` lists (name, shape, dtype, produce); the
    header is computed from the shapes, then each tensor is produced, written straight from its memory and
    dropped. (safetensors' own ``save_file`` first copies every tensor of the file into one bytes object,
    which would double the memory of a checkpoint or an export.) Readers are the safetensors library's own.

    Written as ``path.part``, synced and renamed: a file under its final name is always complete.
    """
    header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}  # transformers wants it
    offset = 0
    for name, shape, dtype, _ in tensors:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    part = path.with_name(path.name + ".part")
    try:
        with open(part, "wb") as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            for name, shape, dtype, produce in tensors:
                t = produce().detach().to(dtype).contiguous().cpu()
                if tuple(t.shape) != tuple(shape):
                    raise ValueError(f"{name}: produced shape {tuple(t.shape)}, expected {tuple(shape)}")
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
