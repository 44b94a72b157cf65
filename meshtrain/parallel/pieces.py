"""What a rank holds of each logical (single-device) tensor, as explicit data.

Tensor parallelism gives a rank a slice of some parameters (``TPSlice``) and a replica of others; ZeRO
then cuts the rank's local tensors into pieces. ``Placement`` records the first, by logical parameter
name, in a table that ``tensor.parallelize`` returns (no attribute is hung on the parameters), and
``OptimParam`` combines both for every tensor the optimizer updates. Checkpoints, the gradient norm and
the equivalence tests read these to rebuild single-device tensors from any layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPSlice:
    """Where a tensor-parallel parameter sits in its logical tensor: ``logical.narrow(dim, start,
    length) == local.narrow(dim, 0, length)`` (the local tensor may carry padding rows after that)."""

    dim: int
    start: int
    length: int


@dataclass(frozen=True)
class Placement:
    """A local parameter's place in its logical one: the logical shape, the tensor-parallel slice (None:
    whole), and how many tensor-parallel ranks hold the same values (norm weights: tp; sliced weights: 1)."""

    shape: tuple[int, ...]
    tp: TPSlice | None = None
    replicas: int = 1


Placements = dict[str, Placement]  # logical parameter name -> placement; absent: whole and not replicated


@dataclass(frozen=True)
class OptimParam:
    """What the optimizer updates: ``tensor`` is the whole parameter, or the piece of it this rank owns.

    ``name`` and ``shape`` are the logical (single-device) parameter's. ``offset`` is where the piece
    starts in the flattened *local* parameter (ZeRO cuts pieces), whose shape is ``local_shape``;
    ``tp`` places the local parameter in the logical one (tensor parallelism), and ``replicas`` says
    how many tensor-parallel ranks hold the same values (norm weights: tp; sharded weights: 1).
    """

    name: str
    tensor: torch.Tensor
    shape: tuple[int, ...]
    offset: int = 0
    local_shape: tuple[int, ...] | None = None
    tp: TPSlice | None = None
    replicas: int = 1

    @property
    def is_whole(self) -> bool:
        return tuple(self.tensor.shape) == self.shape

    @property
    def local(self) -> tuple[int, ...]:
        return self.local_shape if self.local_shape is not None else self.shape


def optim_param(name: str, p: torch.Tensor, placements: Placements, piece: torch.Tensor | None = None,
                offset: int = 0, local_shape: tuple[int, ...] | None = None) -> OptimParam:
    """The OptimParam of local parameter ``p`` named ``name`` (or of ``piece``, a ZeRO piece of it starting at
    ``offset`` in its flattened local tensor of ``local_shape``), placed by ``placements``."""
    local = tuple(local_shape if local_shape is not None else p.shape)
    place = placements.get(name, Placement(local))
    return OptimParam(name, p if piece is None else piece, tuple(place.shape), offset, local, place.tp,
                      place.replicas)
