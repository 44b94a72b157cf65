"""Gemma's computation (``model.embed_scale``: the embedding's output times sqrt(d_model); ``model.mlp_activation=
gelu_tanh``: GeGLU) trained from scratch on every kind of layout. That it is transformers' Gemma (logits,
generation, export, a fine-tune at tp2 x cp2) is in ``tests/test_hf.py``.

Gemma 2B's shape shrunk: one kv head shared by every tp rank, heads wider than d_model / n_heads, tied embeddings.
Every layout against the single-device run of the same seed, on real gloo processes, 5 steps, fp32, with the
tolerances of every equivalence file (losses, grad norms and step-1 gradients 1e-5, final parameters 1e-5
relative, on every rank). The run's losses differ from Llama's (SiLU, no scale) on the same seed, so both options
are at work.
"""

import pytest

from meshtrain.config import load_config
from meshtrain.plan.costs import tp_forward_saved_bytes
from meshtrain.testing.equivalence import check_layouts, layouts_worker, prepared_stdlib, reference_runs, run_layout
from meshtrain.testing.spawn import spawn

pytestmark = pytest.mark.slow

GEMMA = ["model.embed_scale=true", "model.mlp_activation=gelu_tanh", "model.tie_embeddings=true",
         "model.n_kv_heads=1", "model.head_size=16", "model.init_std=0.2"]
BASE = ["train.progress=false", "train.tensorboard=false", "train.peak_flops=1e11", "train.steps=5",
        "train.sample_tokens=0", "train.seq_len=32", "train.global_batch=8", "train.warmup_steps=2", *GEMMA]
LAYOUTS_4 = [
    ("dp2 x tp2 sp", ["parallel.tp=2", "parallel.sp=true"]),  # the scale on sequence shards, GeGLU's fused gate/up
    ("cp2 ring x dp2 zero3", ["parallel.cp=2", "parallel.zero=3"]),
    # The scale on the first stage alone; the tied weight on the first and the last (parallel/tied.py).
    ("pp2 1f1b x dp2", ["parallel.pp=2", "parallel.microbatches=2"]),
    ("dp2 x ep2 moe", ["parallel.ep=2", "model.moe_experts=4"]),  # GeGLU experts behind the all-to-all
]
MEASURED = ("dp2 x tp2 sp",)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_stdlib(tmp_path_factory, "gemmadata")


@pytest.fixture(scope="module")
def world4(data):
    return spawn(layouts_worker, 4, args=(data, BASE, LAYOUTS_4, MEASURED), timeout=900)


def test_gemma_on_every_layout_equals_one_device(data, world4):
    reference = reference_runs(data, BASE)
    gemma = reference([])["losses"]
    for llama in ("model.embed_scale=false", "model.mlp_activation=silu"):
        other = run_layout(data, [*BASE, llama])["losses"]
        assert all(abs(a / b - 1) > 1e-4 for a, b in zip(gemma[1:], other[1:], strict=True)), (llama, gemma, other)
    check_layouts(data, 4, LAYOUTS_4, world4, reference)


def test_the_planner_predicts_gemmas_memory(world4):
    """GeGLU keeps what SwiGLU keeps (the gate's and up's outputs: the tanh GELU's backward reads its input alone)
    and the embedding's scale keeps nothing: one forward on a tp2 + SP rank keeps the planner's figure (fp32)."""
    cfg = load_config("tiny", [o for o in BASE if o.startswith("model.")]).model
    cfg.vocab_size = 257
    want = tp_forward_saved_bytes(cfg, 8 // 2 * 32, 2, True, seq_len=32)
    for rank, runs in enumerate(world4):
        assert runs["dp2 x tp2 sp"]["extra"] == want, (rank, runs["dp2 x tp2 sp"]["extra"], want)
