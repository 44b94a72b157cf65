"""Random valid layouts on 4 ranks against one device (meshtrain/testing/fuzz.py): a fixed sample of the option
combinations that no hand-written equivalence layout names. Each must run as asked, give every step's loss and
grad norm, the step-1 gradient of every tensor and the last validation loss within the equivalence tolerances (fp32,
1e-5 relative), and move the bytes the planner predicts."""

import pytest

from meshtrain.testing.equivalence import prepared_stdlib
from meshtrain.testing.fuzz import check_random_layouts, random_layouts

pytestmark = pytest.mark.slow

SEED, LAYOUTS, WORLD = 0, 16, 4


def test_the_sample_spans_the_options():
    """The sample is not a handful of near-identical layouts: it has every axis above 1, ZeRO levels, a pipeline
    schedule that splits backward, recompute, MoE with expert parallelism, kv heads fewer than tp, Ulysses attention,
    Gemma's GeGLU, and embeddings tied across pipeline stages."""
    layouts = random_layouts(SEED, LAYOUTS, WORLD)
    drawn = " ".join(o for _, overrides in layouts for o in overrides)
    for want in ("parallel.pp=2", "parallel.tp=2", "parallel.cp=2", "parallel.ep=2", "parallel.zero=3",
                 "parallel.sp=true", "train.recompute=full", "train.recompute=selective", "model.moe_experts=4",
                 "model.n_kv_heads=1", "parallel.cp_attention=ulysses", "model.mlp_activation=gelu_tanh"):
        assert want in drawn, want
    assert "zb-h1" in drawn or "dualpipev" in drawn
    assert any({"parallel.pp=2", "model.tie_embeddings=true"} <= set(overrides) for _, overrides in layouts)


def test_random_layouts_equal_one_device(tmp_path_factory):
    rows = check_random_layouts(prepared_stdlib(tmp_path_factory, "fuzzdata"), SEED, LAYOUTS, WORLD)
    assert len(rows) == LAYOUTS
    problems = [f"{r['name']} {' '.join(r['overrides'])}: {r['problem']}" for r in rows if r["problem"]]
    assert not problems, "\n".join(problems)
    # Most also checked the planner's bytes (per-tensor ZeRO with tp or HSDP is not modelled: recorded, not failed).
    assert sum(r["planner"].startswith("bytes exact") for r in rows) >= LAYOUTS // 2, [r["planner"] for r in rows]
