"""Expert parallelism on real gloo processes, against the single-device run of the same MoE model.

The tiny model with 4 experts per layer, top-2 routing, dropless, trained 5 steps on real stdlib text.
Every layout must give the single-device run's routing (the tokens per expert of every layer and step,
compared exactly), losses within 1e-5 relative and every parameter within 1e-5 relative (Frobenius),
fp32; with the aux loss on (the default coefficient 0.01) and with aux-loss-free bias balancing on. Every
step's grad_norm and the step-1 gradient of every tensor agree within 1e-5 relative too, on every rank, and
each layout built the mesh it asked for and moved bytes on ep (and its other axes); ep2 also runs with
clipping off (train.grad_clip=0). One spawned group per world size runs every layout in turn.
"""


import pytest

from meshtrain.config import ConfigError, load_config
from meshtrain.testing.equivalence import (
    assert_layout_ran,
    assert_planner_predicts_runs,
    assert_same_checkpoint,
    assert_same_cli_run,
    assert_same_run,
    cli_train,
    prepared_stdlib,
    reference_key,
    run_dir,
    run_layout,
    run_overrides,
)
from meshtrain.testing.spawn import spawn
from meshtrain.train.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # tests/conftest.py

STEPS = 5
BASE = [*run_overrides(STEPS), "model.moe_experts=4", "model.moe_top_k=2"]
AUX: list[str] = []  # the default: moe_aux_loss_coef=0.01
BIAS = ["model.moe_aux_loss_coef=0", "model.moe_bias_update_rate=0.01"]
# The router z-loss (ST-MoE's weight) beside the aux loss. At 0.01 one embedding entry of 8,224 (a token absent from
# step 1, whose first gradients are near AdamW's eps) differs by 2.4e-5 after 5 steps, in dp4 and in cp2 x dp2
# alike, with every loss, grad norm and step-1 gradient within 3e-7: the rounding sensitivity the fuzz notes.
Z = ["model.moe_z_loss_coef=0.001"]

LAYOUTS_2 = [
    ("ep2", ["parallel.ep=2", *AUX]),
    ("ep2 bias", ["parallel.ep=2", *BIAS]),
    ("ep2 accum full", ["parallel.ep=2", "train.grad_accum=2", "train.recompute=full", *AUX]),
    ("ep2 zero3 selective", ["parallel.ep=2", "parallel.zero=3", "train.recompute=selective", *AUX]),
    # ep=1: the experts are ordinary parameters of the data-parallel member, and replicated over tp.
    ("ep1 dp2 zero3", ["parallel.zero=3", *AUX]),
    ("ep1 tp2 sp", ["parallel.tp=2", "parallel.sp=true", *AUX]),
    ("ep2 no clipping", ["parallel.ep=2", "train.grad_clip=0", *AUX]),
    ("ep2 renormalised gates", ["parallel.ep=2", "model.moe_renormalize=true", *AUX]),  # Mixtral's router
    ("ep2 accum z-loss", ["parallel.ep=2", "train.grad_accum=2", *Z]),
]
# A capacity is per local token group, so it depends on the layout: ep=2 must drop exactly what plain
# data parallelism over the same two token groups drops.
CAPACITY = ["model.moe_capacity_factor=1.0"]
CAPACITY_2 = [("dp2 capacity", CAPACITY), ("ep2 capacity", ["parallel.ep=2", *CAPACITY])]
LAYOUTS_4 = [
    ("ep4 dp4", ["parallel.ep=4", *AUX]),
    ("ep2 dp4 edp2", ["parallel.ep=2", *AUX]),
    # ZeRO over edp=2 for the experts too: stage 1; stage 2 with accumulation; ZeRO-3 (experts at stage 2).
    ("ep2 dp4 edp2 zero1 bias", ["parallel.ep=2", "parallel.zero=1", *BIAS]),
    ("ep2 dp4 edp2 zero2 accum", ["parallel.ep=2", "parallel.zero=2", "train.grad_accum=2", *AUX]),
    ("ep2 dp4 edp2 zero3", ["parallel.ep=2", "parallel.zero=3", *AUX]),
    ("ep2 x tp2", ["parallel.ep=2", "parallel.tp=2", *AUX]),
    ("ep2 x tp2 sp bias", ["parallel.ep=2", "parallel.tp=2", "parallel.sp=true", *BIAS]),
    ("ep2 x tp2 sp", ["parallel.ep=2", "parallel.tp=2", "parallel.sp=true", *AUX]),
    ("ep2 x pp2 1f1b", ["parallel.ep=2", "parallel.pp=2", "parallel.microbatches=2", *AUX]),
    ("ep2 x pp2 zb-h1", ["parallel.ep=2", "parallel.pp=2", "parallel.microbatches=2", "parallel.schedule=zb-h1",
                         *AUX]),
    ("ep2 x tp2 sp z-loss", ["parallel.ep=2", "parallel.tp=2", "parallel.sp=true", *Z]),
    ("ep2 x cp2 z-loss", ["parallel.ep=2", "parallel.cp=2", *Z]),
]


def _run(data, overrides, out=None):
    res = run_layout(data, [*BASE, *overrides], out)
    records = res.pop("records")
    res.update(loads=[r["expert_load"] for r in records], aux=[r["aux_loss"] for r in records],
               z=[r.get("z_loss") for r in records], dropped=[r.get("moe_dropped") for r in records])
    return res


def _worker(rank, world_size, data, layouts):
    return {name: _run(data, overrides, run_dir(data, world_size, name)) for name, overrides in layouts}


def _assert_equal(name, got, ref):
    assert got["loads"] == ref["loads"], f"{name}: routing differs: {got['loads']} vs {ref['loads']}"
    assert got["aux"] == pytest.approx(ref["aux"], rel=1e-5), name
    assert (got["z"][0] is None) == (ref["z"][0] is None) and (got["z"][0] is None or got["z"] == pytest.approx(
        ref["z"], rel=1e-5)), (name, got["z"], ref["z"])
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5), name  # experts counted once
    assert_same_run(name, got, ref)


def _check(data, world_size, layouts, world, reference):
    """Each layout ran as asked, and every rank's results equal the single-device run's."""
    for name, overrides in layouts:
        per_rank = [w[name] for w in world]
        assert_layout_ran(name, overrides, world_size, per_rank, run_dir(data, world_size, name))
        for rank, got in enumerate(per_rank):
            _assert_equal(f"{name} (rank {rank})", got, reference(overrides))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_stdlib(tmp_path_factory, "epdata")


@pytest.fixture(scope="module")
def reference(data):
    """The single-device run for a layout's overrides (aux loss or bias balancing, clipping or not)."""
    cache = {}

    def get(overrides):
        key = reference_key(overrides)
        if key not in cache:
            cache[key] = _run(data, list(key))
        return cache[key]

    return get


def test_reference_runs_route_and_balance(reference):
    aux, bias = reference(AUX), reference(BIAS)
    tokens = 8 * 32 * 2  # global batch x seq_len x top_k assignments per layer and step
    assert all(sum(layer) == tokens for step in aux["loads"] for layer in step)
    assert aux["aux"][0] == pytest.approx(2 * 0.01, rel=0.05)  # two layers, aux_s close to 1 near balance
    assert bias["aux"] == [0.0] * STEPS
    assert bias["loads"][0] == aux["loads"][0]  # the bias starts at zero ...
    assert bias["loads"][1:] != aux["loads"][1:]  # ... then changes which experts are chosen
    z = reference(Z)  # the z-loss: reported per step, absent without it, and it changes the training
    assert aux["z"] == [None] * STEPS and all(v > 0 for v in z["z"])
    later = zip(z["losses"][1:], aux["losses"][1:], strict=True)
    assert z["losses"][0] == aux["losses"][0] and all(a != b for a, b in later)
    # Mixtral's gates: another model from step 1. The first MoE layer routes the same tokens (the gates are not
    # in the choice); later layers see another residual stream, so their loads may move.
    renormalised = reference(["model.moe_renormalize=true", *AUX])
    assert renormalised["loads"][0][0] == aux["loads"][0][0]
    assert abs(renormalised["losses"][0] - aux["losses"][0]) > 1e-4


def test_expert_parallel_on_2_ranks_equals_one_device(data, reference):
    world = spawn(_worker, 2, args=(data, LAYOUTS_2 + CAPACITY_2), timeout=600)
    _check(data, 2, LAYOUTS_2, world, reference)
    for name, overrides in CAPACITY_2:
        assert_layout_ran(name, overrides, 2, [w[name] for w in world], run_dir(data, 2, name))
    for rank, results in enumerate(world):
        ep, dp = results["ep2 capacity"], results["dp2 capacity"]
        assert all(d > 0 for d in dp["dropped"]) and ep["dropped"] == dp["dropped"], (ep["dropped"], dp["dropped"])
        _assert_equal(f"ep2 capacity vs dp2 capacity (rank {rank})", ep, dp)


def test_expert_parallel_on_4_ranks_equals_one_device(data, reference):
    world = spawn(_worker, 4, args=(data, LAYOUTS_4), timeout=900)
    _check(data, 4, LAYOUTS_4, world, reference)


def test_bad_expert_options_are_refused():
    with pytest.raises(ConfigError, match="the model has none"):
        load_config("tiny", ["parallel.ep=2"])
    with pytest.raises(ConfigError, match="parallel.ep=3 must divide model.moe_experts=4"):
        load_config("tiny", ["parallel.ep=3", "model.moe_experts=4"])


def _train_until(rank, world_size, data, out, overrides, until):
    cfg = load_config("tiny", [f"data.path={data}", *BASE, "train.steps=6", "train.ckpt_every=3", *overrides])
    return [r["loss"] for r in Trainer(cfg, out).train(until=until)]


def test_checkpoints_move_between_sharded_experts_and_one_device(data, tmp_path):
    """ep=2 over 4 ranks with ZeRO-1 (each expert's optimizer state split over its edp=2 holders) writes
    logical tensors (every expert, their AdamW moments, the aux-free bias); one process resumes them, and
    the other way round: the losses and the final checkpoint's tensors (parameters and the bias) are those of
    the uninterrupted single-device run."""
    both = ["model.moe_bias_update_rate=0.01"]  # aux loss and bias balancing together
    sharded = ["parallel.ep=2", "parallel.zero=1", *both]
    full = _train_until(0, 1, data, str(tmp_path / "full"), both, None)
    out = str(tmp_path / "ep2-then-one")
    first = spawn(_train_until, 4, args=(data, out, sharded, 4), timeout=300)
    rest = _train_until(0, 1, data, out, [*both, "train.resume=true"], None)
    for losses in first:  # every rank's copy
        assert losses == pytest.approx(full[:4], rel=1e-5)
    assert rest == pytest.approx(full[3:], rel=1e-5)  # resumed from the step-3 checkpoint
    assert_same_checkpoint("ep2 zero1 x4 -> one process resumed", out, tmp_path / "full")
    out = str(tmp_path / "one-then-ep2")
    _train_until(0, 1, data, out, both, 4)
    rest = spawn(_train_until, 4, args=(data, out, [*sharded, "train.resume=true"], None), timeout=300)
    for losses in rest:  # every rank's copy
        assert losses == pytest.approx(full[3:], rel=1e-5)
    assert_same_checkpoint("one process -> ep2 zero1 x4 resumed", out, tmp_path / "full")


def test_cli_ep2_matches_one_process(data, tmp_path):
    def run(out, *extra):
        return cli_train(data, out, [*BASE, *extra])

    one, _ = run(tmp_path / "one")
    two, out = run(tmp_path / "two", "--nproc", "2", "parallel.ep=2")
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert [r["expert_load"] for r in two] == [r["expert_load"] for r in one]
    assert "ep=2" in out
    # grad norms, the final checkpoint's tensors and bytes on ep and dp, against the one-process run.
    assert_same_cli_run("cli ep2", tmp_path / "two", two, tmp_path / "one", one, ["parallel.ep=2"], nproc=2)


def test_planner_predicts_every_expert_parallel_run(data):
    """Each run folder above: the planner's bytes per rank (ep all-to-alls summed per ep group, since what a
    rank's experts receive depends on routing) and state per rank match what the run measured."""
    assert_planner_predicts_runs(data)
