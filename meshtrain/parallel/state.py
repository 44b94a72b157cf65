"""Each rank's share of the logical state, as boxes: what it initialises, loads and saves.

Every tensor the optimizer updates is an ``OptimParam``: a piece (ZeRO: a flat range) of a local tensor
(tensor parallelism: a slice of the logical tensor along one dimension, maybe padded) of a logical
parameter. ``regions`` cuts a piece into runs that are each one rectangular ``Box`` of the logical tensor
(a flat range of a matrix is at most a partial row, whole rows and a partial row). With that, one
mechanism serves every layout and every source of weights:

- **initialise / load** (``load_state``): each rank asks its ``TensorSource`` (the seeded init, a checkpoint,
  a HuggingFace folder) for exactly the boxes it holds; no rank reads or builds a whole tensor. Ranks that
  hold parameters without owning them (ZeRO-1/2) get them from their owners (``sync.after_step``).
- **save** (``local_state``): each rank lists the (key, box, tensor) it holds; the checkpointer writes each
  distinct box once (``train/checkpoint.py``), so a checkpoint is a set of boxes any other layout can read.

Optimizer state follows its parameter: ``<name>/exp_avg`` has the parameter's boxes; scalars (``step``)
are whole. The MoE selection bias (a buffer, whole on the ranks of its pipeline stage) is state too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from meshtrain import comm
from meshtrain.mesh import AxisGroup
from meshtrain.model.source import Box, TensorSource, box_numel, box_shape, full_box, relative
from meshtrain.parallel.pieces import OptimParam


def flat_boxes(shape: tuple[int, ...], a: int, b: int) -> list[tuple[int, int, Box]]:
    """The flat range [a, b) of a row-major tensor of ``shape`` as (lo, hi, box) runs, each run a box."""
    if a >= b:
        return []
    if len(shape) <= 1:
        return [(a, b, ((a, b),) if shape else ())]
    inner = math.prod(shape[1:])
    first, last = a // inner, (b - 1) // inner
    if first == last:  # inside one row: a box of the row, one row high
        base = first * inner
        return [(lo + base, hi + base, ((first, first + 1), *box))
                for lo, hi, box in flat_boxes(shape[1:], a - base, b - base)]
    head = -(-a // inner) * inner  # end of a partial first row (a itself if a starts a row)
    tail = (b // inner) * inner  # start of a partial last row (b itself if b ends a row)
    out = flat_boxes(shape, a, head)
    if head < tail:
        out.append((head, tail, ((head // inner, tail // inner), *full_box(shape[1:]))))
    return out + flat_boxes(shape, tail, b)


@dataclass(frozen=True)
class Region:
    """A run ``[lo, hi)`` of a piece's flat storage that is one box of the logical tensor: ``piece.view(-1)[lo:hi]
    .view(shape)[valid]`` is logical region ``box`` (``valid`` leaves out tensor-parallel padding)."""

    lo: int
    hi: int
    shape: tuple[int, ...]
    valid: tuple[slice, ...]
    box: Box

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """This region of ``t`` (the piece, or a tensor laid out like it), as a view."""
        return t.reshape(-1)[self.lo: self.hi].view(self.shape)[self.valid]


def regions(op: OptimParam) -> list[Region]:
    """The logical boxes that piece ``op`` holds (padding of a tensor-parallel slice is in none)."""
    start = op.offset
    out = []
    for lo, hi, lbox in flat_boxes(op.local, start, start + op.tensor.numel()):
        valid, box = [slice(None)] * len(lbox), list(lbox)
        if op.tp is not None:
            d = op.tp.dim
            a, b = lbox[d]
            stop = min(b, op.tp.length)
            if stop <= a:
                continue  # all padding
            valid[d] = slice(0, stop - a)
            box[d] = (a + op.tp.start, stop + op.tp.start)
        out.append(Region(lo - start, hi - start, box_shape(lbox), tuple(valid), tuple(box)))
    return out


@dataclass
class Held:
    """A logical tensor's part on this rank: ``tensor`` (a piece, or its optimizer state) and its regions."""

    key: str  # "name" for a parameter or buffer, "name/state" for optimizer state
    shape: tuple[int, ...]  # the logical shape
    tensor: torch.Tensor
    regions: list[Region]

    def parts(self) -> list[tuple[Box, torch.Tensor]]:
        return [(r.box, r.of(self.tensor)) for r in self.regions]


def _whole(key: str, t: torch.Tensor) -> Held:
    shape = tuple(t.shape)
    return Held(key, shape, t, [Region(0, t.numel(), shape, tuple(slice(None) for _ in shape), full_box(shape))])


def local_state(pieces: list[OptimParam], optimizer: torch.optim.Optimizer | None,
                buffers: dict[str, torch.Tensor] | None = None) -> list[Held]:
    """Everything this rank holds of the logical state: parameters, optimizer state (if ``optimizer``) and
    ``buffers`` (whole tensors by logical name, e.g. the MoE selection bias)."""
    out = []
    for op in pieces:
        regs = regions(op)
        out.append(Held(op.name, op.shape, op.tensor.detach(), regs))
        if optimizer is None:
            continue
        for k, v in sorted(optimizer.state.get(op.tensor, {}).items()):
            if not torch.is_tensor(v):
                continue
            if v.dim() == 0:  # a counter: the same for every piece of the tensor
                out.append(_whole(f"{op.name}/{k}", v.detach()))
            else:
                out.append(Held(f"{op.name}/{k}", op.shape, v.detach(), regs))
    for name, b in (buffers or {}).items():
        out.append(_whole(name, b.detach()))
    return out


def _fill(t: torch.Tensor, key: str, regs: list[Region], source: TensorSource) -> None:
    t.zero_()  # tensor-parallel padding stays zero
    for r in regs:
        r.of(t).copy_(source.read(key, r.box))


def check_shapes(pieces: list[OptimParam], source: TensorSource, what: str) -> None:
    """Every parameter this rank holds is in ``source`` with its logical shape, or one clear error."""
    for op in pieces:
        shape = source.shape(op.name)
        if shape is None:
            raise ValueError(f"{what} has no tensor {op.name}: it was written for another model.")
        if tuple(shape) != tuple(op.shape):
            raise ValueError(f"{op.name} has shape {tuple(shape)} in {what} but {op.shape} in the model: "
                             f"check the model config.")


@torch.no_grad()
def load_state(pieces: list[OptimParam], source: TensorSource, optimizer: torch.optim.Optimizer | None = None,
               optim_keys: dict[str, list[str]] | None = None) -> None:
    """Fill this rank's pieces from ``source``, a box at a time; with ``optimizer``, also install the optimizer
    state ``optim_keys`` lists per parameter name (e.g. {"w": ["exp_avg", "exp_avg_sq", "step"]}).

    The caller then runs ``sync.after_step()`` so that ranks holding parameters they do not own get them.
    """
    for op in pieces:
        _fill(op.tensor, op.name, regions(op), source)
    if optimizer is None:
        return
    optimizer.state.clear()
    # AdamW keeps its step counter on the parameter's device when fused or capturable, else on the CPU.
    step_on_device = bool(optimizer.defaults.get("fused") or optimizer.defaults.get("capturable"))
    for op in pieces:
        state = {}
        for k in (optim_keys or {}).get(op.name, []):
            key = f"{op.name}/{k}"
            if source.shape(key) == ():
                device = op.tensor.device if (k != "step" or step_on_device) else "cpu"
                state[k] = source.read(key, ()).to(device=device, dtype=torch.float32).clone()
            else:
                t = torch.empty_like(op.tensor)
                _fill(t, key, regions(op), source)
                state[k] = t
        if state:
            optimizer.state[op.tensor] = state


def gather_full(held: list[Held], group: AxisGroup) -> dict[str, torch.Tensor]:
    """Whole logical tensors from every rank's ``held`` parts, on every rank of ``group``.

    A test and debugging path for tiny models (it sends tensors as objects): training and checkpoints never
    build whole tensors (``train/checkpoint.py`` writes each rank's boxes instead).
    """
    mine = [(h.key, h.shape, [(box, t.detach().cpu().clone()) for box, t in h.parts()]) for h in held]
    full: dict[str, torch.Tensor] = {}
    for rank_parts in comm.gather_objects(mine, group):
        for key, shape, parts in rank_parts:
            out = full.setdefault(key, torch.zeros(shape, dtype=torch.float32))
            for box, t in parts:
                out[relative(box, full_box(shape))] = t
    return full


def held_numel(held: list[Held]) -> int:
    """Elements of logical state this rank holds (for memory checks)."""
    return sum(box_numel(r.box) for h in held for r in h.regions)
