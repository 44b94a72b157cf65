"""Tied embeddings across pipeline stages: one weight, used by the first stage's embedding and the last stage's
LM head (``model.tie_embeddings`` with ``parallel.pp > 1``), as Megatron-LM's embedding group does.

Where the two stages are on different pipeline ranks, both ranks hold the weight under its single-device name,
``tok_embeddings.weight`` (the last stage's rank keeps the embedding module for that, and never runs it), and both
initialise, load and update it from the same values. Each computes only its own use's gradient, so the true
gradient is their sum: after the data-parallel sync, each rank adds the other's over the "pp_ends" group
(``sync_grads``). Both then hold the same gradient and, with AdamW on the same values, take the same step; nothing
else needs to travel. The sum is taken on what the optimizer updates (the whole tensor, or the ZeRO-1 shard: the
embedding is a sharding unit of its own on both ranks, so their shards coincide), in ``parallel.reduce_dtype``.

The global gradient norm would count the weight twice: the last stage's rank leaves it out (``counted_twice``).
A checkpoint writes it once (the lowest rank holding a box writes it). Where one rank holds both stages (V-shaped
placements), the weight is simply one parameter used twice, and nothing here runs.
"""

from __future__ import annotations

import torch

from meshtrain.mesh import AxisGroup, Mesh
from meshtrain.parallel.grad_sync import all_reduce_as, replica_weighted_norm_sq
from meshtrain.parallel.pieces import OptimParam
from meshtrain.plan.schedules import PipelineSchedule

TIED = "tok_embeddings.weight"  # the name the single-device model stores the tied weight under


def tied_across_ranks(schedule: PipelineSchedule) -> bool:
    """Whether the first and the last stage are on different pipeline ranks (so a tied weight needs syncing)."""
    return schedule.placement[0] != schedule.placement[-1]


class TiedEmbedding:
    """The tied weight's gradient sum between the first and the last stage's ranks (see the module doc)."""

    def __init__(self, mesh: Mesh, schedule: PipelineSchedule, reduce_dtype: torch.dtype) -> None:
        pp, first, last = mesh.coord("pp"), schedule.placement[0], schedule.placement[-1]
        if (first, last) != (0, mesh.size("pp") - 1):  # the "pp_ends" group pairs exactly these
            raise ValueError(f"tied embeddings across stages need the first stage on pipeline rank 0 and the last on "
                             f"rank {mesh.size('pp') - 1}; {schedule.name} places them on {first} and {last}.")
        self.holds = pp in (first, last)
        self.secondary = pp == last  # the last stage's rank: its copy is not counted in norms
        self.group: AxisGroup = mesh.group("pp_ends")
        self.reduce_dtype = reduce_dtype

    def pieces(self, ops: list[OptimParam]) -> list[OptimParam]:
        """This rank's pieces of the tied weight (none on middle stages)."""
        return [op for op in ops if op.name == TIED] if self.holds else []

    def sync_grads(self, ops: list[OptimParam]) -> None:
        """Add the other stage's gradient to each piece of the tied weight (after the data-parallel sync)."""
        for op in self.pieces(ops):
            if op.tensor.grad is not None and op.tensor.numel():
                all_reduce_as(op.tensor.grad, self.group, self.reduce_dtype)

    def counted_twice(self, ops: list[OptimParam], norm_group: AxisGroup | None,
                      device: torch.device) -> torch.Tensor:
        """What the tied weight adds to this rank's part of the squared gradient norm when another rank counts it
        too (the last stage's rank), summed over ``norm_group`` as the data-parallel member sums its part; else 0."""
        if not self.secondary:
            return torch.zeros((), dtype=torch.float64, device=device)
        return replica_weighted_norm_sq(self.pieces(ops), [norm_group], device)
