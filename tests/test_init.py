"""The counter-based init (``meshtrain/model/init.py``): any region of any parameter, drawn alone, equals that
region of the whole tensor bit for bit, draws only its own elements, and is N(0, std) with independent elements.
That every layout draws exactly the boxes it holds is asserted for every equivalence layout
(``testing/equivalence.assert_layout_ran``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from meshtrain.config import ModelConfig
from meshtrain.model import init
from meshtrain.model.init import init_box, init_std, standard_normals
from meshtrain.model.source import box_numel, full_box
from meshtrain.testing.equivalence import counting_init_draws

CFG = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, init_std=0.02)


@pytest.mark.parametrize("threads", [1, 2])
def test_any_range_equals_that_slice_of_the_whole_stream(monkeypatch, threads):
    """Every start offset (mod 4 within a Philox block, mod 16 within a vector) and pieces of 5 elements: the
    values do not depend on where a range starts, where the pieces are cut, or how many threads draw them."""
    whole = standard_normals(7, "w", 0, 200)
    monkeypatch.setattr(init, "CHUNK", 5)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    for start in range(0, 40):
        for stop in (start + 1, start + 3, start + 17, 200):
            assert np.array_equal(standard_normals(7, "w", start, stop), whole[start:stop]), (start, stop)


def test_a_box_equals_that_region_of_the_whole_tensor_and_draws_only_its_elements(monkeypatch):
    """A tensor-parallel column slice, a ZeRO-3 shard's partial rows, one expert of a 3-D tensor: each box draws
    its own elements (no whole rows) and gets the whole tensor's values there."""
    monkeypatch.setattr(init, "CHUNK", 64)  # several pieces per box, and rows split across pieces
    name, shape = "layers.1.feed_forward.w2.weight", (24, 40)
    whole = init_box(CFG, 3, name, shape, full_box(shape))
    boxes = [((0, 24), (10, 20)), ((3, 9), (5, 17)), ((5, 6), (0, 40)), ((7, 19), (0, 40)), ((0, 24), (39, 40))]
    for box in boxes:
        with counting_init_draws() as drawn:
            part = init_box(CFG, 3, name, shape, box)
        assert drawn[0] == box_numel(box), (box, drawn[0])
        assert torch.equal(part, whole[tuple(slice(a, b) for a, b in box)]), box
    shape3 = (4, 6, 10)
    whole3 = init_box(CFG, 3, "experts.w1.weight", shape3, full_box(shape3))
    for box in [((1, 3), (0, 6), (0, 10)), ((1, 3), (2, 4), (0, 10)), ((0, 4), (2, 4), (3, 7)),
                ((2, 3), (5, 6), (9, 10))]:
        with counting_init_draws() as drawn:
            part = init_box(CFG, 3, "experts.w1.weight", shape3, box)
        assert drawn[0] == box_numel(box)
        assert torch.equal(part, whole3[tuple(slice(a, b) for a, b in box)]), box


def test_values_are_independent_normals_scaled_by_the_parameter_rule():
    """Moments and two quantiles of 2^20 draws within ~5 standard errors, no correlation between neighbours
    (nor between their magnitudes), and unrelated streams per seed and per name."""
    n = 1 << 20
    z = standard_normals(0, "layers.0.attention.wq.weight", 0, n).astype(np.float64)
    se = 1 / math.sqrt(n)
    assert abs(z.mean()) < 5 * se and abs(z.std() - 1) < 5 * se / math.sqrt(2)
    assert abs((np.abs(z) < 1).mean() - 0.682689) < 5 * math.sqrt(0.6827 * 0.3173 / n)
    assert abs((np.abs(z) > 3).mean() - 0.0026998) < 5 * math.sqrt(0.0027 / n)
    assert abs(np.corrcoef(z[:-1], z[1:])[0, 1]) < 5 * se
    assert abs(np.corrcoef(z ** 2, np.roll(z, 1) ** 2)[0, 1]) < 5 * se * 2
    other_seed = standard_normals(1, "layers.0.attention.wq.weight", 0, 1000)
    other_name = standard_normals(0, "layers.0.attention.wk.weight", 0, 1000)
    assert abs(np.corrcoef(z[:1000], other_seed)[0, 1]) < 0.2 and abs(np.corrcoef(z[:1000], other_name)[0, 1]) < 0.2
    # the residual branches' outputs scaled by 1/sqrt(2 n_layers) (GPT-2); norms one, biases zero
    wo = init_box(CFG, 0, "layers.0.attention.wo.weight", (32, 32), full_box((32, 32)))
    wq = init_box(CFG, 0, "layers.0.attention.wq.weight", (32, 32), full_box((32, 32)))
    assert init_std(CFG, "layers.0.attention.wo.weight") == 0.02 / 2
    assert 0.015 < wq.std() < 0.025 and 0.0075 < wo.std() < 0.0125
    assert torch.equal(init_box(CFG, 0, "norm.weight", (32,), ((0, 32),)), torch.ones(32))
