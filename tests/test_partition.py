"""Cost-balanced pipeline partitioning."""

import itertools

import pytest

from meshtrain.config import load_config
from meshtrain.plan.generation import generation_partition, generation_partitions
from meshtrain.plan.partition import partition_layers, partition_model, partitions_up_to


def _brute(costs, k):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("costs,k", [([1, 1, 1, 1], 2), ([5, 1, 1, 1, 1, 1], 3), ([1, 2, 3, 4, 5, 6, 7], 3),
                                     ([3, 1, 4, 1, 5, 9, 2, 6], 4)])
def test_partition_is_optimal_and_contiguous(costs, k):
    runs = partition_layers(costs, k)
    assert [i for r in runs for i in r] == list(range(len(costs)))
    assert all(runs)
    assert max(sum(costs[i] for i in r) for r in runs) == _brute(costs, k)


def test_one_table_gives_every_stage_count_its_optimal_split():
    """``partitions_up_to`` (the generation planner asks for every pp at once): each k's split is contiguous,
    non-empty, optimal, and the one ``partition_layers`` gives alone; the generation planner's cuts are
    ``meshtrain generate``'s for every pp."""
    for costs in ([1, 1, 1, 1], [5, 1, 1, 1, 1, 1], [1, 2, 3, 4, 5, 6, 7], [3, 1, 4, 1, 5, 9, 2, 6]):
        every = partitions_up_to(costs, len(costs))
        assert sorted(every) == list(range(1, len(costs) + 1))
        for k, runs in every.items():
            assert [i for r in runs for i in r] == list(range(len(costs))) and all(runs) and len(runs) == k
            assert max(sum(costs[i] for i in r) for r in runs) == _brute(costs, k)
            assert runs == partition_layers(costs, k)
    cfg = load_config("llama3-8b").model
    assert generation_partitions(cfg, 12) == {pp: generation_partition(cfg, pp) for pp in range(1, 13)}


def test_head_cost_moves_layers_off_the_last_stage():
    cfg = load_config("llama3-8b").model  # a 128k vocabulary makes the head worth ~2 blocks
    part = partition_model(cfg, 8192, 4)
    assert len(part.layers[0]) > len(part.layers[-1])
    assert max(part.costs) / min(part.costs) < 1.15
    assert "norm+head+loss" in part.table().splitlines()[-1]


def test_too_many_stages_is_a_clear_error():
    with pytest.raises(ValueError, match="need at least as many layers"):
        partition_layers([1.0, 1.0], 3)
