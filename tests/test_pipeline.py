"""Pipeline parallelism on real gloo processes, against the single-device run.

Every schedule at pp=2 and pp=4 (interleaved with 2 virtual stages per rank, DualPipeV with its V
of 2 stages per rank), every schedule at pp=4 posting in the NCCL order (``plan/p2p_order.py``), 3-D
dp=2 x tp=2 x pp=2 on 8 processes, and the CLI. Same rules as the other
equivalence tests: 5 steps of a tiny 8-layer model on real stdlib text, losses within 1e-5 relative,
every parameter within 1e-5 relative (Frobenius), fp32; every step's grad_norm and the step-1 gradient of
every tensor within 1e-5 relative, on every rank; each rank executed exactly its schedule's actions and moved
bytes on every axis of its layout. One layout per file runs with clipping off (train.grad_clip=0), where a
constant factor on a gradient is not hidden by clipping.
"""


import pytest

from meshtrain.config import ConfigError, load_config
from meshtrain.plan.validate import validate_layout
from meshtrain.testing.equivalence import (
    assert_planner_predicts_runs,
    assert_same_cli_run,
    check_layouts,
    cli_train,
    layouts_worker,
    prepared_stdlib,
    reference_runs,
    run_dir,
    run_layout,
    run_overrides,
)
from meshtrain.testing.spawn import spawn

pytestmark = pytest.mark.slow

STEPS = 5
BASE = [*run_overrides(STEPS), "model.n_layers=8"]
SCHEDULES = [
    ("afab", ["parallel.schedule=afab"]),
    ("1f1b", ["parallel.schedule=1f1b"]),
    ("interleaved v2", ["parallel.schedule=interleaved", "parallel.virtual_stages=2"]),
    ("zb-h1", ["parallel.schedule=zb-h1"]),
    ("dualpipev", ["parallel.schedule=dualpipev", "parallel.virtual_stages=2"]),
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_stdlib(tmp_path_factory, "ppdata")


@pytest.fixture(scope="module")
def reference(data):
    return reference_runs(data, BASE)


@pytest.mark.parametrize("pp", [2, 4])
def test_every_schedule_equals_one_device(pp, data, reference):
    layouts = [(n, [f"parallel.pp={pp}", "parallel.microbatches=4", *o]) for n, o in SCHEDULES]
    if pp == 2:  # the data-parallel family composes: pp=2 x dp=2 with ZeRO-1 needs 4 ranks, run below
        layouts.append(("1f1b accum-free recompute", [f"parallel.pp={pp}", "parallel.microbatches=4",
                                                     "train.recompute=full"]))
        layouts.append(("1f1b no clipping", [f"parallel.pp={pp}", "parallel.microbatches=4",
                                             "parallel.schedule=1f1b", "train.grad_clip=0"]))
        # Zero-bubble W actions under activation checkpointing (they once lost weight gradients there).
        layouts.append(("zb-h1 recompute", [f"parallel.pp={pp}", "parallel.microbatches=4",
                                            "parallel.schedule=zb-h1", "train.recompute=full"]))
        layouts.append(("dualpipev selective recompute", [f"parallel.pp={pp}", "parallel.microbatches=4",
                                                          "parallel.schedule=dualpipev", "parallel.virtual_stages=2",
                                                          "train.recompute=selective"]))
    results = spawn(layouts_worker, pp, args=(data, BASE, layouts), timeout=900)
    check_layouts(data, pp, layouts, results, reference)


def _posted_worker(rank: int, world: int, data: str, base: list[str], layouts: list[tuple[str, list[str]]]) -> dict:
    """``layouts_worker``, plus what the engine posted in its last step against the program for its policy."""
    from meshtrain.plan.p2p_order import Post, p2p_program

    def extra(trainer) -> dict:
        engine = trainer.parallel.micro
        want = [st.ops for st in p2p_program(engine.s, engine.rank, engine.posting) if isinstance(st, Post)]
        return {"posting": engine.posting, "as_program": engine.trace.posts == want, "posts": len(want)}

    return {name: run_layout(data, [*base, *o], run_dir(data, world, name), extra=extra) for name, o in layouts}


def test_every_schedule_in_nccl_order_equals_one_device(data, reference):
    """Issue 14 point 6: the program the engine runs on NCCL (parallel.p2p_posting=auto picks ordered there), run
    here on gloo at pp=4: the same results as one device, and each rank posted exactly that program's batches."""
    layouts = [(f"{n} ordered", ["parallel.pp=4", "parallel.microbatches=4", "parallel.p2p_posting=ordered", *o])
               for n, o in SCHEDULES]
    results = spawn(_posted_worker, 4, args=(data, BASE, layouts), timeout=900)
    check_layouts(data, 4, layouts, results, reference)
    for name, _ in layouts:
        for rank, res in enumerate(r[name] for r in results):
            got = res["extra"]
            assert got["posting"] == "ordered" and got["posts"] > 0, f"{name}: rank {rank} posted {got}"
            assert got["as_program"], f"{name}: rank {rank} did not post its ordered program's batches in order"


def test_pp_with_dp_and_zero1_on_4_ranks(data, reference):
    layouts = [("pp2 x dp2 zero1 1f1b", ["parallel.pp=2", "parallel.microbatches=2", "parallel.zero=1"]),
               ("pp2 x dp2 dp zb-h1", ["parallel.pp=2", "parallel.microbatches=2", "parallel.schedule=zb-h1"]),
               # Qwen2's q, k, v biases: their Linears are not deferred, so I computes all their gradients
               # (rope_theta 100: see QKV_BIAS in test_kv_heads.py)
               ("pp2 x dp2 dp zb-h1 qkv bias", ["parallel.pp=2", "parallel.microbatches=2", "parallel.schedule=zb-h1",
                                                "model.qkv_bias=true", "model.rope_theta=100"])]
    results = spawn(layouts_worker, 4, args=(data, BASE, layouts), timeout=900)
    check_layouts(data, 4, layouts, results, reference)


def _deferring_worker(rank: int, world: int, data: str, base: list[str], layouts: list[tuple[str, list[str]]]) -> dict:
    """``layouts_worker``, plus whether every tensor-parallel linear on this rank left its weight gradient to W, and
    how many weight gradients W computed."""
    from meshtrain.parallel.pipeline.wgrad import immediate_params
    from meshtrain.parallel.tensor import ColumnParallelLinear, RowParallelLinear

    def extra(trainer) -> dict:
        engine = trainer.parallel.micro
        linears = [m for st in engine.stages.values() for m in st.modules()
                   if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
        immediate = {id(p) for st in engine.stages.values() for p in immediate_params(st)}
        return {"linears": len(linears), "deferring": sum(id(m.weight) not in immediate for m in linears),
                "applied": engine.wgrad.applied}

    return {name: run_layout(data, [*base, *o], run_dir(data, world, name), extra=extra) for name, o in layouts}


def test_zero_bubble_defers_tensor_parallel_weight_grads(data, reference):
    """Zero-bubble schedules under tensor parallelism: the column- and row-parallel linears (fused QKV and gate/up,
    the vocabulary-parallel head, with SP's regather or without) leave their weight gradients to W, as the plain
    model's linears do. They once computed them in I, so W had nothing to do and the schedule was 1F1B with empty
    slots, while the planner counted zero bubble. Same results as one device."""
    layouts = [("pp2 tp2 sp zb-h1", ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true", "parallel.microbatches=4",
                                     "parallel.schedule=zb-h1"]),
               ("pp2 tp2 dualpipev recompute", ["parallel.pp=2", "parallel.tp=2", "parallel.microbatches=4",
                                                "parallel.schedule=dualpipev", "parallel.virtual_stages=2",
                                                "train.recompute=full"])]
    results = spawn(_deferring_worker, 4, args=(data, BASE, layouts), timeout=900)
    check_layouts(data, 4, layouts, results, reference)
    for name, _ in layouts:
        for rank, res in enumerate(r[name] for r in results):
            got = res["extra"]
            assert got["linears"] > 0 and got["deferring"] == got["linears"], f"{name}: rank {rank}: {got}"
            assert got["applied"] > 0 and got["applied"] % (STEPS * 4) == 0, f"{name}: rank {rank}: {got}"


def test_3d_dp2_tp2_pp2_on_8_ranks(data, reference):
    layouts = [("dp2 x tp2 x pp2 1f1b", ["parallel.pp=2", "parallel.tp=2", "parallel.microbatches=2"]),
               ("dp2 x tp2 sp x pp2 interleaved zero1", ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true",
                                                          "parallel.microbatches=2", "parallel.schedule=interleaved",
                                                          "parallel.virtual_stages=2", "parallel.zero=1"])]
    results = spawn(layouts_worker, 8, args=(data, BASE, layouts), timeout=900)
    check_layouts(data, 8, layouts, results, reference)


def test_pipeline_refuses_what_it_cannot_run():
    with pytest.raises(ConfigError, match="parallel.zero=3 does not combine with parallel.pp"):
        load_config("tiny", ["parallel.pp=2", "parallel.zero=3"])
    load_config("tiny", ["parallel.pp=2", "model.tie_embeddings=true"])  # tests/test_tied_pipeline.py
    with pytest.raises(ConfigError, match="model.tie_embeddings=true with parallel.schedule=dualpipev"):
        load_config("tiny", ["parallel.pp=2", "model.tie_embeddings=true", "parallel.schedule=dualpipev",
                             "parallel.virtual_stages=2"])
    with pytest.raises(ConfigError, match="use parallel.zero_layout=flat"):
        load_config("tiny", ["parallel.pp=2", "model.tie_embeddings=true", "parallel.zero=1",
                             "parallel.zero_layout=per_tensor"])
    with pytest.raises(ConfigError, match="train.grad_accum=1"):
        load_config("tiny", ["parallel.pp=2", "train.grad_accum=2"])
    with pytest.raises(ConfigError, match="parallel.microbatches"):
        load_config("tiny", ["parallel.pp=2", "parallel.microbatches=3"])
    with pytest.raises(ConfigError, match="need at least as many layers"):
        validate_layout(load_config("tiny", ["parallel.pp=4", "parallel.microbatches=4"]))


def test_cli_pp2_1f1b_matches_one_process(data, tmp_path):
    def run(out, *extra):
        return cli_train(data, out, [*BASE, *extra])

    layout = ["parallel.pp=2", "parallel.schedule=1f1b", "parallel.microbatches=4"]
    one, _ = run(tmp_path / "one")
    two, out = run(tmp_path / "two", "--nproc", "2", *layout)
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert "blocks 0-3" in out  # the partition table
    # grad norms, the final checkpoint's parameters and bytes on pp, against the one-process run.
    assert_same_cli_run("cli pp2 1f1b", tmp_path / "two", two, tmp_path / "one", one, layout, nproc=2)


def test_planner_predicts_the_bytes_of_every_layout_above(data):
    """Issue 6: for every layout this file ran, each rank's comm-meter bytes of a steady training step
    equal plan/check.predict_rank's prediction exactly (and state bytes within 5%)."""
    assert_planner_predicts_runs(data)
