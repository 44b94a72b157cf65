"""Sliding-window attention (``model.sliding_window``, Mistral 7B v0.1's): each token attends to itself and the
window - 1 tokens before it. That it is transformers' attention (logits over 64 positions with a window of 16,
greedy generation past the window through the KV cache) is in ``tests/test_hf.py``; the block plans of context
parallelism against masked SDPA in ``tests/test_context_parallel.py``.

Here every layout against the single-device run of the same seed, on real gloo processes, 5 steps of 64-token rows
with a window of 12, fp32, with the tolerances of every equivalence file (losses, grad norms and step-1 gradients
1e-5, final parameters 1e-5 relative, on every rank). Under context parallelism a window of 12 cuts 16-token
(cp2 zigzag) and 8-token (cp4) chunks, so some blocks are skipped, some masked and some whole. The windowed run's
losses differ from the full causal run's, so the window is at work; and one forward keeps what the planner says.
"""

import pytest

from meshtrain.config import load_config
from meshtrain.plan.costs import tp_forward_saved_bytes
from meshtrain.testing.equivalence import (
    check_layouts,
    layouts_worker,
    prepared_stdlib,
    reference_runs,
    run_layout,
    run_overrides,
)
from meshtrain.testing.spawn import spawn

pytestmark = pytest.mark.slow

BASE = [*run_overrides(5), "train.seq_len=64", "model.sliding_window=12"]
LAYOUTS_4 = [
    ("dp2 x tp2 sp", ["parallel.tp=2", "parallel.sp=true"]),
    ("cp2 ring x tp2", ["parallel.cp=2", "parallel.tp=2"]),
    ("cp4 allgather", ["parallel.cp=4", "parallel.cp_attention=allgather"]),
    ("cp2 contiguous x dp2 zero3", ["parallel.cp=2", "parallel.cp_layout=contiguous", "parallel.zero=3"]),
    ("pp2 1f1b x dp2", ["parallel.pp=2", "parallel.microbatches=2"]),
    ("dp2 x tp2 documents", ["parallel.tp=2", "train.attention_mask=document"]),
]
MEASURED = ("dp2 x tp2 sp",)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_stdlib(tmp_path_factory, "swdata")


@pytest.fixture(scope="module")
def world4(data):
    return spawn(layouts_worker, 4, args=(data, BASE, LAYOUTS_4, MEASURED), timeout=900)


def test_a_sliding_window_on_every_layout_equals_one_device(data, world4):
    reference = reference_runs(data, BASE)
    full = run_layout(data, [*BASE, "model.sliding_window=0"])
    steps = list(zip(reference([])["losses"][1:], full["losses"][1:], strict=True))
    assert all(abs(a / b - 1) > 1e-4 for a, b in steps), steps  # the window is at work
    check_layouts(data, 4, LAYOUTS_4, world4, reference)


def test_the_planner_predicts_the_windows_memory(world4):
    """The window's mask is kept once per forward (the trainer hands the layers one document, so it is built once),
    and GQA's k and v are repeated for the masked kernel: exactly the planner's figure (fp32)."""
    cfg = load_config("tiny", ["train.seq_len=64", "model.sliding_window=12"]).model
    cfg.vocab_size = 257
    want = tp_forward_saved_bytes(cfg, 8 // 2 * 64, 2, True, masked=True, seq_len=64)
    for rank, runs in enumerate(world4):
        assert runs["dp2 x tp2 sp"]["extra"] == want, (rank, runs["dp2 x tp2 sp"]["extra"], want)
