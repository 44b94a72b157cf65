"""Every parallelism on one mesh: pipeline, tensor (+ sequence), context, expert and data parallelism
together, against the single-device run of the same MoE model.

On 8 processes at most three of the four grid axes (pp, dp, cp, tp) can exceed 1, so the 8-rank layouts
are pp=2 x cp=2 x tp=2 (dp=1) with ep=2 carved out of dp x cp (the two cp ranks exchange tokens for the
experts), and pp=2 x dp=2 x cp=2 with ep=4 over dp x cp. Both run through the trainer; the first also
through the CLI. A 16-process run puts every axis above 1 at once: dp=2 x cp=2 x tp=2 x pp=2 with ep=2
and ZeRO-1 (so the experts' optimizer state is also sharded, over edp=2). Same rules as every
equivalence test: 5 steps of a tiny
model on real stdlib text, fp32, losses within 1e-5 relative, every parameter within 1e-5 relative, every
step's grad_norm and the step-1 gradient of every tensor within 1e-5 relative, on every rank; each rank built
the mesh asked for, moved bytes on each of its axes and executed its schedule's pipeline actions.
"""


import pytest

from meshtrain.testing.equivalence import (
    assert_planner_predicts_runs,
    assert_same_cli_run,
    check_layouts,
    cli_train,
    layouts_worker,
    prepared_stdlib,
    reference_runs,
    run_overrides,
)
from meshtrain.testing.spawn import spawn

pytestmark = pytest.mark.slow

STEPS = 5
BASE = [*run_overrides(STEPS), "model.n_layers=4", "model.moe_experts=4", "model.moe_top_k=2"]
PP_CP_TP_EP = ["parallel.pp=2", "parallel.cp=2", "parallel.tp=2", "parallel.ep=2", "parallel.sp=true",
               "parallel.microbatches=2", "parallel.zero=1"]
LAYOUTS_8 = [
    ("pp2 cp2 tp2 sp ep2 zero1 1f1b", PP_CP_TP_EP),
    ("pp2 dp2 cp2 ep4 interleaved contiguous-cp", ["parallel.pp=2", "parallel.dp=2", "parallel.cp=2",
                                                    "parallel.ep=4", "parallel.microbatches=2",
                                                    "parallel.schedule=interleaved", "parallel.virtual_stages=2",
                                                    "parallel.cp_layout=contiguous"]),
]
LAYOUTS_16 = [
    ("dp2 cp2 tp2 pp2 ep2 zero1", ["parallel.pp=2", "parallel.dp=2", "parallel.cp=2", "parallel.tp=2",
                                   "parallel.ep=2", "parallel.microbatches=2", "parallel.zero=1"]),
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_stdlib(tmp_path_factory, "fivedata")


@pytest.fixture(scope="module")
def reference(data):
    return reference_runs(data, BASE)


def test_five_parallelisms_on_8_ranks_equal_one_device(data, reference):
    results = spawn(layouts_worker, 8, args=(data, BASE, LAYOUTS_8), timeout=900)
    check_layouts(data, 8, LAYOUTS_8, results, reference)


def test_every_axis_above_one_on_16_ranks(data, reference):
    results = spawn(layouts_worker, 16, args=(data, BASE, LAYOUTS_16), timeout=900)
    check_layouts(data, 16, LAYOUTS_16, results, reference)


def test_planner_predicts_the_five_axis_runs(data):
    """The 8- and 16-rank runs above: every rank's bytes on pp, tp, cp, dp_cp/dp_shard_cp, edp (and ep per
    group) equal the planner's prediction, and its state bytes are within 5%."""
    assert_planner_predicts_runs(data)


def test_cli_five_axis_layout_matches_one_process(data, tmp_path):
    def run(out, *extra):
        return cli_train(data, out, [*BASE, *extra], timeout=600)

    one, _ = run(tmp_path / "one")
    eight, out = run(tmp_path / "eight", "--nproc", "8", *PP_CP_TP_EP)
    assert [r["loss"] for r in eight] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert "pp=2 dp=1 cp=2 tp=2 ep=2" in out  # the mesh the run reports
    # grad norms, the final checkpoint's parameters and bytes on every axis, against the one-process run.
    assert_same_cli_run("cli pp2 cp2 tp2 ep2", tmp_path / "eight", eight, tmp_path / "one", one, PP_CP_TP_EP, nproc=8)
