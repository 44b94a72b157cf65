"""Tied embeddings across pipeline stages (``model.tie_embeddings`` with ``parallel.pp > 1``; ``parallel/tied.py``):
the first stage's embedding and the last stage's head share one weight, held by both ranks and summed between them.

Every layout against the single-device run of the same seed, on real gloo processes, 5 steps, fp32, with the
tolerances of every equivalence file (losses, grad norms and step-1 gradients 1e-5, final parameters 1e-5
relative, on every rank): the gradient sum (a missing one leaves each end with half the gradient), the norm counting
the weight once, the ZeRO-1 shards of both ends coinciding, four stages with the weight on the outer two only, the
vocabulary-parallel embedding and head under tp with the head's weight gradient deferred (ZB-H1). Each layout's
comm meter equals the planner's prediction, the tied gradient's all-reduce included.
"""

import pytest

from meshtrain.testing.equivalence import (
    PARAM_RTOL,
    assert_planner_predicts_runs,
    assert_same_tensors,
    check_layouts,
    checkpoint_params,
    layouts_worker,
    prepared_stdlib,
    reference_runs,
    run_dir,
    run_overrides,
)
from meshtrain.testing.spawn import spawn

pytestmark = pytest.mark.slow

BASE = [*run_overrides(5), "model.tie_embeddings=true", "model.n_layers=4"]
LAYOUTS_4 = [
    ("pp2 1f1b x dp2", ["parallel.pp=2", "parallel.microbatches=2"]),
    ("pp2 1f1b x dp2 zero1", ["parallel.pp=2", "parallel.microbatches=2", "parallel.zero=1"]),
    ("pp2 interleaved x dp2 zero1", ["parallel.pp=2", "parallel.microbatches=2", "parallel.schedule=interleaved",
                                     "parallel.virtual_stages=2", "parallel.zero=1"]),
    ("pp2 zb-h1 x tp2 sp", ["parallel.pp=2", "parallel.microbatches=2", "parallel.schedule=zb-h1", "parallel.tp=2",
                            "parallel.sp=true"]),
    ("pp4 1f1b", ["parallel.pp=4", "parallel.microbatches=4"]),
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_stdlib(tmp_path_factory, "tieddata")


@pytest.fixture(scope="module")
def world4(data):
    return spawn(layouts_worker, 4, args=(data, BASE, LAYOUTS_4), timeout=900)


def test_tied_embeddings_across_stages_equal_one_device(data, world4):
    check_layouts(data, 4, LAYOUTS_4, world4, reference_runs(data, BASE))


def test_the_planner_predicts_the_tied_pipelines_bytes(data, world4):
    assert_planner_predicts_runs(data)


def test_a_tied_pipelines_checkpoint_is_the_single_device_models(data, world4):
    """Both ends hold the weight; the checkpoint has it once, by its single-device name (and the head as its alias),
    equal to the single-device run's final parameters."""
    want = reference_runs(data, BASE)([])["params"]
    for name, _ in LAYOUTS_4:
        saved = checkpoint_params(run_dir(data, 4, name))
        assert "tok_embeddings.weight" in saved and saved["output.weight"] is not None
        assert_same_tensors(name, "checkpoint tensor", {k: saved[k] for k in want}, want, PARAM_RTOL)
