"""Which layers live on which pipeline stage: contiguous runs of layers, balanced by the FLOP model.

Every stage must hold at least one block. The embedding sits on stage 0 and the final norm, head
and loss on the last stage; their costs are added to the first and last layer, so a vocabulary-heavy
head pushes layers away from the last stage (Nanotron's cost-balanced split, seed 004).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.config import ModelConfig
from meshtrain.plan.flops import stage_part_flops


@dataclass(frozen=True)
class Partition:
    """``layers[s]`` are the block indices of stage s; ``costs[s]`` its forward FLOPs per token."""

    layers: list[list[int]]
    costs: list[float]

    @property
    def n_stages(self) -> int:
        return len(self.layers)

    def table(self, placement: list[int] | None = None) -> str:
        """The assignment as a text table: stage, rank, layers, cost share."""
        total = sum(self.costs) or 1.0
        rows = ["stage  rank  layers                        cost share"]
        for s, (ls, c) in enumerate(zip(self.layers, self.costs, strict=True)):
            extra = (["embedding"] if s == 0 else []) + (["norm+head+loss"] if s == self.n_stages - 1 else [])
            names = f"{ls[0]}-{ls[-1]}" if len(ls) > 1 else f"{ls[0]}"
            what = " + ".join(extra + [f"blocks {names}"])
            rank = placement[s] if placement else s
            rows.append(f"{s:>5}  {rank:>4}  {what:<28}  {c / total:6.1%}")
        return "\n".join(rows)


def partition_layers(costs: list[float], n_stages: int) -> list[list[int]]:
    """Contiguous split of ``costs`` into ``n_stages`` non-empty runs minimising the largest run's sum
    (exact, by dynamic programming; ties go to the earliest split)."""
    return partitions_up_to(costs, n_stages)[n_stages]


def partitions_up_to(costs: list[float], max_stages: int) -> dict[int, list[list[int]]]:
    """``partition_layers(costs, k)`` for every k from 1 to ``max_stages``, from one table: the best split into k
    runs only reads the splits into fewer (what the generation planner asks for every pp at once)."""
    n = len(costs)
    if max_stages > n:
        raise ValueError(f"{max_stages} pipeline stages need at least as many layers, the model has {n}: lower "
                         f"parallel.pp (or parallel.virtual_stages), or use more model.n_layers.")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest max-run cost splitting the first i layers into k runs.
    best = [[inf] * (n + 1) for _ in range(max_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(max_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, max_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i] - 1e-12:
                    best[k][i], cut[k][i] = v, j
    out = {}
    for stages in range(1, max_stages + 1):
        runs, i = [], n
        for k in range(stages, 0, -1):
            j = cut[k][i]
            runs.append(list(range(j, i)))
            i = j
        out[stages] = runs[::-1]
    return out


def layer_costs(cfg: ModelConfig, seq_len: int) -> list[float]:
    """Forward FLOPs per token of each block, the embedding's added to the first and the head's to the last."""
    emb, block, head = stage_part_flops(cfg, seq_len)
    costs = [block] * cfg.n_layers
    costs[0] += emb
    costs[-1] += head
    return costs


def partition_model(cfg: ModelConfig, seq_len: int, n_stages: int) -> Partition:
    """Balance the model's blocks over ``n_stages`` stages by forward FLOPs per token."""
    costs = layer_costs(cfg, seq_len)
    runs = partition_layers(costs, n_stages)
    return Partition(runs, [sum(costs[i] for i in r) for r in runs])
