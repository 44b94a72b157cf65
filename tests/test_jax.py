"""The JAX executor (meshtrain/jax/, docs/jax.md): the same rules table placed by GSPMD gives the PyTorch model's
logits and training losses, and the seed's sharded-matmul cases compile to the collectives the planner predicts.

JAX runs on 8 CPU devices: tests/conftest.py sets XLA_FLAGS before any module imports JAX.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshtrain.jax import use_host_devices

use_host_devices(8)

import jax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from meshtrain.config import load_config  # noqa: E402
from meshtrain.jax import model as jm  # noqa: E402
from meshtrain.jax import train as jt  # noqa: E402
from meshtrain.jax.hlo import collectives, replica_groups, seed_cases  # noqa: E402
from meshtrain.jax.sharding import JaxLayout, Shardings, partition_spec  # noqa: E402
from meshtrain.model.axes import param_axes  # noqa: E402
from meshtrain.plan.sharded_matmul import ffn_2d_collectives, matmul_collectives  # noqa: E402
from meshtrain.rules import tp_dim  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# d_model 64, 8 query heads sharing 4 kv heads, a 256-token vocabulary (divides over 8 devices).
OVERRIDES = ["model.d_model=64", "model.n_heads=8", "model.n_kv_heads=4", "model.vocab_size=256",
             "data.source=synthetic", "train.global_batch=8", "train.seq_len=16", "train.steps=5",
             "train.warmup_steps=2", "train.sample_tokens=0", "train.eval_batches=1"]
LAYOUTS = {"dp": JaxLayout(dp=8), "fsdp": JaxLayout(dp=8, zero=3), "tp": JaxLayout(tp=8),
           "fsdp x tp": JaxLayout(dp=2, tp=4, zero=3), "dp x tp + sp": JaxLayout(dp=2, tp=4, sp=True),
           "2-D (seed 002)": JaxLayout(dp=2, tp=4, zero=3, embed_over_tp=True)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A meshtrain checkpoint of the initial weights, written by the PyTorch trainer."""
    from meshtrain.train.trainer import Trainer

    out = tmp_path_factory.mktemp("jax-ckpt")
    trainer = Trainer(load_config("tiny", OVERRIDES), out)
    return trainer.save(), trainer.cfg


def test_one_table_two_executors():
    """Every weight dimension the PyTorch runtime slices over tp (rules.tp_dim) is the one JAX shards over tp,
    and a device holds the block a runtime rank holds; ZeRO-3 adds the model dimension over dp."""
    cfg = load_config("tiny", OVERRIDES).model
    sh = Shardings(JaxLayout(dp=2, tp=4, zero=3))
    for name, shape in jm.param_shapes(cfg).items():
        spec = partition_spec(param_axes(name), sh.params_rules, shape, sh.mesh)
        dims = [d for d, s in enumerate(spec) if s == "tp"]
        assert dims == ([tp_dim(param_axes(name), sh.rules)] if tp_dim(param_axes(name), sh.rules) is not None
                        else []), name
        assert ("dp" in tuple(spec)) == ("embed" in param_axes(name)), name
    assert partition_spec(param_axes("layers.0.feed_forward.w1.weight"), sh.params_rules) == P("tp", "dp")
    assert partition_spec(("batch", "seq", "embed"), sh.between) == P("dp", None, None)
    placed = jm.place({"layers.0.attention.wq.weight": np.zeros((64, 64), np.float32)}, sh)
    assert placed["layers.0.attention.wq.weight"].addressable_shards[0].data.shape == (16, 32)


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_logits_equal_pytorch(checkpoint, layout):
    """The checkpoint's weights give the PyTorch model's logits under every layout (fp32, max abs <= 1e-5), and
    the compiled program really is partitioned: TP all-reduces (or reduce-scatters) over tp, FSDP gathers over
    dp, pure DP's forward communicates nothing."""
    from meshtrain.model.llama import build_model
    from meshtrain.model.source import load_full
    from meshtrain.train.checkpoint import CheckpointReader

    path, cfg = checkpoint
    model = build_model(cfg.model, 0)
    with torch.no_grad():
        load_full(model, CheckpointReader(path))
        tokens = torch.randint(0, cfg.model.vocab_size, (8, 16), generator=torch.Generator().manual_seed(1))
        expected = model(tokens).numpy()
    params, _, _ = jm.read_checkpoint(path, cfg.model)
    sh = Shardings(LAYOUTS[layout])
    placed = jm.place(params, sh)
    forward = jm.jit_forward(cfg.model, sh, placed)
    got = np.asarray(forward(placed, tokens.numpy()))
    assert np.abs(got - expected).max() <= 1e-5
    ops = {(c.op, c.axis) for c in collectives(forward.lower(placed, tokens.numpy()).compile().as_text(),
                                               dict(sh.mesh.shape))}
    if "tp" in layout:
        assert ops & {("all_reduce", "tp"), ("reduce_scatter", "tp"), ("all_gather", "tp")}, ops
    if "fsdp" in layout:
        assert ("all_gather", "dp") in ops, ops
    if layout == "dp":
        assert not ops, ops


@pytest.mark.slow
def test_training_steps_equal_pytorch(tmp_path):
    """AdamW steps from a checkpoint written mid-run (step 2, moments included) give the PyTorch run's losses and
    gradient norms for the steps after it (fp32, rtol 1e-5), under pure DP, FSDP, TP and FSDP x TP."""
    from meshtrain.train.data import SyntheticDataset
    from meshtrain.train.trainer import Trainer

    cfg = load_config("tiny", [*OVERRIDES, "train.ckpt_every=2", "train.ckpt_keep=5"])
    records = Trainer(cfg, tmp_path).train()
    params, saved, step = jm.read_checkpoint(tmp_path / "checkpoints" / "step_000002", cfg.model)
    assert step == 2 and len(saved) == len(params)
    data, t = SyntheticDataset(cfg.model.vocab_size, "train"), cfg.train
    for layout in ("dp", "fsdp", "tp", "fsdp x tp"):
        sh = Shardings(LAYOUTS[layout])
        placed, state = jm.place(params, sh), jt.init_state(params, sh, saved, step)
        step_fn = jt.make_train_step(cfg.model, t, sh, placed, state)
        for s in range(step, t.steps):
            x, y = data.batch(t.seed, s, t.global_batch, t.seq_len)
            placed, metrics = jt.train_step(step_fn, placed, state, x.numpy(), y.numpy(), s, t)
            np.testing.assert_allclose(metrics["loss"], records[s]["loss"], rtol=1e-5, err_msg=f"{layout} step {s}")
            np.testing.assert_allclose(metrics["grad_norm"], records[s]["grad_norm"], rtol=1e-5)
        # The optimizer's moments stay sharded as the rules say (ZeRO-3: over dp; tp where the weight is).
        assert state.exp_avg["layers.0.feed_forward.w1.weight"].sharding.spec == partition_spec(
            param_axes("layers.0.feed_forward.w1.weight"), sh.optim_rules, (192, 64), sh.mesh)


def test_replica_group_spellings():
    """XLA's three spellings of device groups, read as mesh axes of a 2 x 4 (dp, tp) mesh."""
    from meshtrain.jax.hlo import group_axes

    mesh = {"dp": 2, "tp": 4}
    tp_groups, dp_groups = [[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert replica_groups("replica_groups={{0,1,2,3},{4,5,6,7}}, x") == tp_groups
    assert replica_groups("replica_groups=[2,4]<=[8], dimensions={0}") == tp_groups
    assert replica_groups("replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}") == dp_groups
    assert replica_groups("replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) "
                          "{'axis_1'}, use_global_device_ids=true") == tp_groups
    assert replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}, x") == dp_groups
    assert group_axes(tp_groups, mesh) == "tp" and group_axes(dp_groups, mesh) == "dp"
    assert group_axes([list(range(8))], mesh) == "dp,tp"


def test_seed_rules_predict_by_hand():
    """The seed's rules on its 2-D FFN, against the bytes written out by hand (fp32, per device)."""
    b, s, m, h, mesh = 8, 32, 32, 96, {"dp": 2, "tp": 4}
    got = sorted((c.op, c.axis, c.payload) for c in ffn_2d_collectives(b, s, m, h, mesh))
    x_gathered = b // 2 * s * m * 4  # x [B/X, S, M]: its M gathered over Y
    w_gathered = m * h // 4 * 4  # W [M, H/Y]: M gathered over X (gate, up and down alike)
    assert got == sorted([("all_gather", "tp", x_gathered), *[("all_gather", "dp", w_gathered)] * 3,
                          ("reduce_scatter", "tp", b // 2 * s * m * 4)])
    # Case 1A ends in an all-reduce when the output is replicated, a reduce-scatter when it stays split.
    ar, _ = matmul_collectives((64, 32), (None, "tp"), (32, 16), ("tp", None), (None, None), mesh)
    rs, _ = matmul_collectives((64, 32), (None, "tp"), (32, 16), ("tp", None), (None, "tp"), mesh)
    assert [(c.op, c.payload) for c in ar] == [("all_reduce", 64 * 16 * 4)]
    assert [(c.op, c.payload) for c in rs] == [("reduce_scatter", 64 * 16 * 4)]


def test_seed_cases_compile_to_the_predicted_collectives():
    """Every case's HLO collectives equal a predicted plan: the seed's rule for 1A, 1B, full sharding and the 2-D
    FFN; for Case 2 XLA reshards W onto Y and reduces (no duplicated work) instead of gathering, which the
    planner's second plan predicts byte for byte."""
    cases = {c.name: c for c in seed_cases(8, 32, 32, 96)}
    chosen = {name: c.chosen for name, c in cases.items()}
    assert chosen == {"Case 1A (all-reduce)": "gather", "Case 1A (reduce-scatter)": "gather", "Case 1B": "gather",
                      "Case 2": "reshard", "Case 2 + 1B (full sharding)": "gather", "2-D FFN (SwiGLU)": "gather"}
    assert cases["2-D FFN (SwiGLU)"].measured_share == 8.0  # one copy of the work over 8 devices
    assert cases["Case 1B"].measured_share == 1.0  # every device computes the whole product
    assert jax.device_count() == 8


def test_plan_jax_check_prints_the_table(capsys):
    """``meshtrain plan --jax-check`` prints every case, predicted beside XLA's, and exits 0 when each matches."""
    from meshtrain.plan.cli import main

    assert main(["--jax-check", "--model", "tiny"]) == 0
    out = capsys.readouterr().out
    assert out.count("-> matches the") == 6 and "XLA HLO:" in out and "all_reduce@Y 98,304 B" in out
