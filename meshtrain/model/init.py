"""The deterministic initial weights: any element of any parameter from (seed, parameter name, index) alone.

Element ``i`` (row-major flat index) of parameter ``name`` is a standard normal made from the ``i``-th 64-bit
output of a Philox4x64-10 generator keyed by ``sha256(f"{seed}:{name}")``, times the parameter's init scale.
Philox is counter-based (Salmon et al., SC 2011; the generator of cuRAND and JAX): output ``i`` is a pure function
of (key, i), so a rank draws exactly the elements it holds, whatever their shape (a tensor-parallel column slice,
a ZeRO-3 shard that starts mid-row, one expert), in any order, and gets the single-device values bit for bit.

Why not torch's generator: on CPU it is a Mersenne Twister, a sequential stream, so a region must be drawn from the
start of its seed's stream. Seeding one stream per row made a tensor-parallel rank draw whole rows of the
column-sharded ``wo`` and ``w2`` (~3.5x its share of a layer at tp 8), and its seeds are 32 bits: the ~7M rows of a
70B model would hold thousands of pairs of identical rows. numpy's Philox (a well-kept implementation whose raw
stream numpy keeps stable across versions) has a 128-bit key and a counter we can set.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import nn

from meshtrain.config import ModelConfig
from meshtrain.model.source import Box, box_shape, full_box

__all__ = ["InitSource", "init_box", "init_std", "init_weights", "standard_normals"]

CHUNK = 1 << 18  # elements one thread draws at a time: its temporaries are ~30 bytes an element, whatever the region
_TWO_PI_ULP = np.float32(2 * math.pi / (1 << 24))


class _Stream:
    """Parameter ``name``'s Philox stream: its 64-bit outputs from any flat index."""

    def __init__(self, seed: int, name: str) -> None:
        key = np.frombuffer(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:16], dtype="<u8").copy()
        self.gen = np.random.Philox(key=key)
        # the state as constructed (nothing buffered), with the counter set per read: ~10x cheaper than a new
        # generator for each row of a column slice
        self.state = self.gen.state

    def raw(self, start: int, stop: int) -> np.ndarray:
        # a counter value gives four outputs: start at the one holding index ``start``, drop those before it
        self.state["state"]["counter"][:] = (start // 4, 0, 0, 0)
        self.gen.state = self.state
        return self.gen.random_raw(stop - start + start % 4)[start % 4:]


def _to_normals(raw: np.ndarray, out: np.ndarray) -> None:
    """One standard normal per 64-bit output: Box-Muller's cosine branch on its two 24-bit halves (float32)."""
    halves = raw.astype("<u8", copy=False).view("<u4").reshape(-1, 2)
    radius = (halves[:, 0] >> 8).astype(np.float32)
    radius += 1  # (0, 1] in steps of 2^-24: log never sees 0
    radius *= np.float32(1 / (1 << 24))
    np.log(radius, out=radius)
    radius *= -2
    np.sqrt(radius, out=radius)
    angle = (halves[:, 1] >> 8).astype(np.float32)
    angle *= _TWO_PI_ULP
    np.cos(angle, out=angle)
    np.multiply(radius, angle, out=out)


def _pieces(ranges: Iterable[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """``ranges`` cut into pieces of at most ``CHUNK`` outputs, in order (the rows of a column slice share one)."""
    pieces: list[list[tuple[int, int]]] = [[]]
    filled = 0
    for a, b in ranges:
        while a < b:
            n = min(b - a, CHUNK - filled)
            pieces[-1].append((a, a + n))
            filled, a = filled + n, a + n
            if filled == CHUNK:
                pieces.append([])
                filled = 0
    return [p for p in pieces if p]


def _draw(seed: int, name: str, ranges: Iterable[tuple[int, int]], out: np.ndarray) -> np.ndarray:
    """The normals at the flat index ``ranges`` of parameter ``name``'s stream, one after another into ``out``.

    Pieces run on ``torch.get_num_threads()`` threads (numpy leaves the GIL in both the generator and the
    arithmetic), so the draw uses the cores torch's own kernels would; each piece has its own generator.
    """
    pieces = _pieces(ranges)
    starts = np.cumsum([0] + [sum(b - a for a, b in p) for p in pieces]).tolist()

    def fill(i: int) -> None:
        stream = _Stream(seed, name)
        raw = np.concatenate([stream.raw(a, b) for a, b in pieces[i]])
        _to_normals(raw, out[starts[i]:starts[i + 1]])

    workers = min(len(pieces), torch.get_num_threads())
    if workers <= 1:
        for i in range(len(pieces)):
            fill(i)
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(fill, range(len(pieces))))
    return out


def standard_normals(seed: int, name: str, start: int, stop: int) -> np.ndarray:
    """Standard normals (float32) at flat indices ``start:stop`` of parameter ``name``'s stream.

    Element ``i`` needs output ``i`` alone, and numpy evaluates ``log`` and ``cos`` with the same code at every
    position of an array (its vector loops load a partial last vector rather than finishing in scalar code), so the
    values do not depend on where a region starts (``tests/test_init.py`` checks every offset).
    """
    return _draw(seed, name, [(start, stop)], np.empty(stop - start, np.float32))


def init_std(cfg: ModelConfig, name: str) -> float:
    """The init scale of parameter ``name``: 0 for norms (they start at one), the residual-branch scale
    1/sqrt(2 * n_layers) for output projections (wo, w2, also every expert's w2) as in GPT-2, else init_std."""
    if name.endswith("norm.weight"):
        return 0.0
    if name.endswith(("wo.weight", "w2.weight")):
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return cfg.init_std


def init_box(cfg: ModelConfig, seed: int, name: str, shape: tuple[int, ...], box: Box) -> torch.Tensor:
    """The region ``box`` of parameter ``name``'s initial value (float32), drawing only its elements.

    Weights ~ N(0, ``init_std``); norms start at one; biases at zero (as in transformers and Megatron).
    """
    size = box_shape(box)
    if name.endswith(".bias"):
        return torch.zeros(size)
    std = init_std(cfg, name)
    if std == 0.0:
        return torch.ones(size)
    if not shape:  # a scalar: one element
        shape, box = (1,), ((0, 1),)
    # the box is runs of consecutive flat indices: one run per index of the dimensions before the last partial one
    last = max((d for d, (a, b) in enumerate(box) if (a, b) != (0, shape[d])), default=0)
    stride = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    run = (box[last][1] - box[last][0]) * stride[last]
    starts = (sum(j * s for j, s in zip(index, stride, strict=False)) + box[last][0] * stride[last]
              for index in itertools.product(*(range(a, b) for a, b in box[:last])))
    out = _draw(seed, name, ((a, a + run) for a in starts), np.empty(math.prod(size), np.float32))
    return torch.from_numpy(out).mul_(std).view(size)


class InitSource:
    """The deterministic initial weights as a ``TensorSource`` (``source.py``): any box of any parameter."""

    def __init__(self, cfg: ModelConfig, seed: int, shapes: dict[str, tuple[int, ...]]) -> None:
        self.cfg, self.seed, self.shapes = cfg, seed, shapes

    def shape(self, key: str) -> tuple[int, ...] | None:
        return self.shapes.get(key)

    def read(self, key: str, box: Box) -> torch.Tensor:
        return init_box(self.cfg, self.seed, key, self.shapes[key], box)


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Initialise every parameter of ``model`` from (seed, its name) only (``init_box``): the values do not depend
    on which parameters a module holds or in which order they are created, so any layout gets the same weights."""
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:  # tied weights are initialised once
            continue
        seen.add(id(p))
        p.copy_(init_box(cfg, seed, name, tuple(p.shape), full_box(p.shape)))
