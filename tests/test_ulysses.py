"""Ulysses context parallelism (``parallel.cp_attention=ulysses``, ``parallel/ulysses.py``): an all-to-all trades
each rank's tokens for a group of heads, the plain core attends over whole sequences, and a second all-to-all
trades back.

Every layout against the single-device run of the same seed, on real gloo processes, 5 steps of 64-token rows,
fp32, with the tolerances of every equivalence file (losses, grad norms and step-1 gradients 1e-5, final parameters
1e-5 relative, on every rank): zigzag and contiguous chunks (the tokens arrive out of order, or in order), cp2 and
cp4, with tp (each tp rank's heads split again), with ZeRO-3, inside a pipeline, under recompute; causal, and then
with documents and a sliding window, whose masks the core builds over the whole sequence. Each run's comm meter
equals the planner's prediction (two all-to-alls per block each way).
"""

import pytest
import torch

from meshtrain.testing.equivalence import (
    assert_planner_predicts_runs,
    check_layouts,
    layouts_worker,
    prepared_short_documents,
    prepared_stdlib,
    reference_runs,
    run_layout,
    run_overrides,
)
from meshtrain.testing.spawn import spawn

pytestmark = pytest.mark.slow

MHA = "model.n_kv_heads=4"  # 4 heads of 8: cp4, or tp2 x cp2, splits them
BASE = [*run_overrides(5), "train.seq_len=64", "parallel.cp_attention=ulysses"]
CAUSAL = [
    ("cp2 zigzag x dp2", ["parallel.cp=2"]),
    ("cp2 contiguous x tp2 sp", ["parallel.cp=2", "parallel.cp_layout=contiguous", "parallel.tp=2",
                                 "parallel.sp=true", MHA]),
    ("cp4 zigzag full recompute", ["parallel.cp=4", "train.recompute=full", MHA]),
    ("cp2 x dp2 zero3", ["parallel.cp=2", "parallel.zero=3"]),
    ("pp2 1f1b x cp2", ["parallel.pp=2", "parallel.cp=2", "parallel.microbatches=2", "model.n_layers=4"]),
]
MASKED = [  # train.attention_mask=document throughout
    ("cp2 zigzag x dp2 documents", ["parallel.cp=2"]),
    ("cp4 zigzag documents window", ["parallel.cp=4", MHA, "model.sliding_window=12"]),
    ("cp2 contiguous x tp2 window", ["parallel.cp=2", "parallel.cp_layout=contiguous", "parallel.tp=2", MHA,
                                     "model.sliding_window=12"]),
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_stdlib(tmp_path_factory, "ulyssesdata")


def test_ulysses_equals_one_device(data):
    results = spawn(layouts_worker, 4, args=(data, BASE, CAUSAL), timeout=900)
    check_layouts(data, 4, CAUSAL, results, reference_runs(data, BASE))


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    return prepared_short_documents(tmp_path_factory, "ulyssesdocs")


def test_ulysses_with_documents_and_a_window_equals_one_device(short_documents):
    base = [*BASE, "train.attention_mask=document"]
    results = spawn(layouts_worker, 4, args=(short_documents, base, MASKED), timeout=900)
    reference = reference_runs(short_documents, base)
    causal = run_layout(short_documents, [*BASE, "train.attention_mask=causal"])["losses"]
    steps = list(zip(reference([])["losses"][1:], causal[1:], strict=True))
    assert all(abs(a / b - 1) > 1e-4 for a, b in steps), steps  # the documents are at work
    check_layouts(short_documents, 4, MASKED, results, reference)


def test_the_planner_predicts_ulysses_bytes(data, short_documents):
    assert_planner_predicts_runs(data)
    assert_planner_predicts_runs(short_documents)


def _masks_kept(trainer) -> int:
    """How many [.., T, T] tensors (the documents' masks) one forward of this rank's first rows keeps for backward."""
    t = trainer.cfg.train.seq_len
    kept: set[int] = set()

    def pack(x: torch.Tensor) -> torch.Tensor:
        if x.dim() >= 2 and tuple(x.shape[-2:]) == (t, t):
            kept.add(x.untyped_storage().data_ptr())
        return x

    batch = trainer.local_batch(trainer.train_data, 0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        trainer.model(batch.inputs, docs=batch.docs)
    return len(kept)


def _masks_worker(rank: int, world_size: int, data: str, overrides: list[str]) -> int:
    return run_layout(data, overrides, extra=_masks_kept)["extra"]


def test_a_forward_keeps_one_mask_of_its_documents(short_documents):
    """The whole-sequence mask of the documents is built once per forward and shared by the blocks, as on one
    device, not once per layer (``ulysses.WholeSequenceMasks``): 4 layers, cp2, one mask kept for backward on
    each rank. The single-device model keeps one too."""
    over = [*BASE, "train.attention_mask=document", "train.steps=1", "model.n_layers=4", "parallel.cp=2",
            "model.sliding_window=12"]
    assert spawn(_masks_worker, 2, args=(short_documents, over), timeout=300) == [1, 1]
    assert _masks_worker(0, 1, short_documents, [o for o in over if o != "parallel.cp=2"]) == 1
