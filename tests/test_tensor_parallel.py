"""Tensor and sequence parallelism on real gloo processes, against the single-device run.

Same rules as tests/test_data_parallel.py: 5 steps of the tiny model on real stdlib text (byte
vocabulary of 257 ids, which tp=2 and tp=4 must pad), losses within 1e-5 relative, every
parameter within 1e-5 relative (Frobenius), fp32; every step's grad_norm and the step-1 gradient of every
tensor within 1e-5 relative, on every rank; each layout built the mesh it asked for and moved bytes on tp (and
dp). TP and TP+SP also run with clipping off (train.grad_clip=0), where a constant factor on a replicated
norm's gradient is not hidden by clipping. SP runs with the column-parallel inputs gathered again in backward
(parallel.sp_regather, the default) and once without.
"""


import pytest
import torch
import torch.nn.functional as F

from meshtrain import comm
from meshtrain.config import ConfigError, load_config
from meshtrain.mesh import Mesh
from meshtrain.parallel.tensor import ColumnParallelLinear
from meshtrain.plan.costs import tp_comm_bytes, tp_forward_saved_bytes
from meshtrain.testing.equivalence import (
    assert_planner_predicts_runs,
    assert_same_cli_run,
    check_layouts,
    cli_train,
    forward_saved_bytes,
    prepared_stdlib,
    reference_runs,
    run_dir,
    run_layout,
    run_overrides,
)
from meshtrain.testing.spawn import spawn
from meshtrain.train.trainer import Trainer

pytestmark = pytest.mark.slow

STEPS = 5
BASE = run_overrides(STEPS)
MHA = ["model.n_kv_heads=4"]  # whole kv heads at tp=4 (fewer, replicated over tp: tests/test_kv_heads.py)
# Heads twice d_model / n_heads wide (model.head_size): q, k, v and wo's input are 64 wide, d_model 32. At RoPE theta
# 100: at 10,000 the slow pairs leave the run ill-conditioned, a change of summation order alone (one process,
# train.grad_accum=4 against 1) moving wv.weight by 2.0e-5 after 5 steps; at theta 100 that control stays at 1.6e-7
# (as QKV_BIAS in test_kv_heads.py).
WIDE = ["model.head_size=16", "model.rope_theta=100"]

LAYOUTS_4 = [
    ("tp4", ["parallel.tp=4", *MHA]),
    ("tp4 sp", ["parallel.tp=4", "parallel.sp=true", *MHA]),
    ("tp4 sp tied", ["parallel.tp=4", "parallel.sp=true", "model.tie_embeddings=true", *MHA]),
    ("tp2 x dp2 zero1", ["parallel.tp=2", "parallel.zero=1"]),
    ("tp2 sp x dp2 zero1 accum", ["parallel.tp=2", "parallel.sp=true", "parallel.zero=1", "train.grad_accum=2"]),
    ("tp2 x dp2 zero3", ["parallel.tp=2", "parallel.zero=3"]),
    ("tp2 sp x dp2 zero3 selective", ["parallel.tp=2", "parallel.sp=true", "parallel.zero=3",
                                      "train.recompute=selective"]),
    ("tp2 x dp2 dp accum full", ["parallel.tp=2", "parallel.zero=0", "train.grad_accum=2", "train.recompute=full"]),
    ("tp4 no clipping", ["parallel.tp=4", "train.grad_clip=0", *MHA]),
    ("tp4 sp no clipping", ["parallel.tp=4", "parallel.sp=true", "train.grad_clip=0", *MHA]),
    ("tp4 sp kept inputs", ["parallel.tp=4", "parallel.sp=true", "parallel.sp_regather=false", *MHA]),
    ("tp4 sp wide heads", ["parallel.tp=4", "parallel.sp=true", *MHA, *WIDE]),
    ("tp2 x dp2 zero3 wide heads", ["parallel.tp=2", "parallel.zero=3", *WIDE]),
    ("tp4 qk norm wide heads", ["parallel.tp=4", "model.qk_norm=true", *MHA, *WIDE]),  # Qwen3's attention
]
LAYOUTS_2 = [
    ("tp2 gqa", ["parallel.tp=2"]),
    ("tp2 sp gqa", ["parallel.tp=2", "parallel.sp=true"]),
    ("tp2 sp accum", ["parallel.tp=2", "parallel.sp=true", "train.grad_accum=2"]),
    ("tp2 sp full", ["parallel.tp=2", "parallel.sp=true", "train.recompute=full"]),
]
# (tp, sp, sp_regather) of the byte and activation-memory measurements on 4 ranks (tp=2: dp=2, half the rows;
# a rank holds two heads there, one at tp=4).
MEASURED = [(4, False, True), (4, True, True), (4, True, False), (2, False, True), (2, True, True)]
# The same for other attentions: (overrides, the measurements) by name. Heads wider than d_model / n_heads; Qwen3's
# q and k norms, with as many kv heads as query heads (MHA) and with fewer (GQA: k, v repeated for the core).
MEASURED_OTHER = {"wide": (WIDE, [(4, True, True), (2, False, True)]),
                  "qk norm": (["model.qk_norm=true"], [(4, False, True)]),
                  "gqa": (["model.n_kv_heads=2"], [(2, True, True)]),
                  "qk norm gqa": (["model.qk_norm=true", "model.n_kv_heads=2"], [(2, True, True)])}


def _tokens(tp: int) -> int:
    """This rank's tokens of the 4 x 64 batch: dp = 4 / tp ranks share the rows."""
    return 4 * 64 * tp // 4


def _measure(data, tp, sp, regather, extra=()):
    """tp-axis bytes of one steady-state step, and activation bytes saved for backward by one forward."""
    cfg = load_config("tiny", [f"data.path={data}", *BASE, f"parallel.tp={tp}", f"parallel.sp={sp}",
                               f"parallel.sp_regather={regather}",
                               "train.global_batch=4", "train.seq_len=64", "model.max_seq_len=64", *MHA, *extra])
    trainer = Trainer(cfg)
    trainer.train_step(0)
    comm.METER.reset()
    trainer.train_step(1)
    snap = comm.METER.snapshot().get("tp", {})
    measured = {("tp", op): v["bytes"] for op, v in snap.items() if op != "metrics"}
    return measured, forward_saved_bytes(trainer)


def _zero3_kept(data, dtype):
    """Under tp2 x dp2 ZeRO-3, the 2-D tensors with d_model columns (weight-shaped) that one forward keeps for
    backward as tensors, not by reference (``FullyShardedDataParallel._pack``)."""
    from meshtrain.parallel.fsdp import FullyShardedDataParallel

    cfg = load_config("tiny", [f"data.path={data}", *BASE, "parallel.tp=2", "parallel.zero=3",
                               f"train.dtype={dtype}", "train.global_batch=4", "train.seq_len=64",
                               "model.max_seq_len=64"])
    trainer = Trainer(cfg)
    trainer.train_step(0)
    kept, pack = [], FullyShardedDataParallel._pack

    def recording(self, t):
        out = pack(self, t)
        if isinstance(out, torch.Tensor) and t.dim() == 2 and t.shape[1] == cfg.model.d_model:
            kept.append(tuple(t.shape))
        return out

    FullyShardedDataParallel._pack = recording
    try:
        trainer.parallel.forward(trainer.model, trainer.local_batch(trainer.train_data, 0).inputs)
    finally:
        FullyShardedDataParallel._pack = pack
    return kept


def _worker(rank, world_size, data, layouts, measure):
    out = {name: run_layout(data, [*BASE, *overrides], run_dir(data, world_size, name))
           for name, overrides in layouts}
    meas = {key: _measure(data, *key) for key in measure}
    for name, (extra, keys) in MEASURED_OTHER.items() if measure else ():
        meas.update({(name, *key): _measure(data, *key, extra) for key in keys})
    if measure:
        meas.update({("zero3 kept", dtype): _zero3_kept(data, dtype) for dtype in ("fp32", "bf16")})
    return out, meas


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_stdlib(tmp_path_factory, "tpdata")


@pytest.fixture(scope="module")
def world4(data):
    return spawn(_worker, 4, args=(data, LAYOUTS_4, MEASURED), timeout=900)


@pytest.fixture(scope="module")
def reference(data):
    return reference_runs(data, BASE)


def test_tp_layouts_on_4_ranks_equal_one_device(world4, data, reference):
    check_layouts(data, 4, LAYOUTS_4, [w[0] for w in world4], reference)


def test_tp2_with_gqa_on_2_ranks_equals_one_device(data, reference):
    world2 = spawn(_worker, 2, args=(data, LAYOUTS_2, []), timeout=300)
    check_layouts(data, 2, LAYOUTS_2, [w[0] for w in world2], reference)


def test_tp_bytes_per_step_equal_the_formula(world4):
    cfg = load_config("tiny", MHA).model
    cfg.vocab_size = 257
    s = 4 * 64 * cfg.d_model * 4  # one fp32 activation of the 4 x 64 tokens
    for rank, (_, meas) in enumerate(world4):
        for tp, sp, regather in MEASURED:
            measured, _ = meas[(tp, sp, regather)]
            want = tp_comm_bytes(cfg, tp=tp, sp=sp, tokens=_tokens(tp), sp_regather=regather)
            assert measured == want, (rank, sp, regather, measured, want)
        # Re-gathering costs one all-gather per column-parallel layer in backward: QKV and gate/up of 2 blocks, head.
        extra = meas[(4, True, True)][0][("tp", "all_gather")] - meas[(4, True, False)][0][("tp", "all_gather")]
        assert extra == 5 * s, (rank, extra)


def test_sequence_parallel_cuts_activation_memory(world4):
    """Activation bytes one forward leaves for backward on each rank equal the planner's model exactly."""
    cfg = load_config("tiny", MHA).model
    cfg.vocab_size, cfg.max_seq_len = 257, 64
    for rank, (_, meas) in enumerate(world4):
        saved = {key: meas[key][1] for key in MEASURED}
        for tp, sp, regather in MEASURED:
            assert saved[(tp, sp, regather)] == tp_forward_saved_bytes(cfg, _tokens(tp), tp, sp, regather), \
                (rank, sp, regather, saved)
        # SP holds the norms and residuals as 1/4 of the sequence; re-gathering also the column-parallel inputs
        # (2 per block and the head's: 5 x 3/4 of 4 x 64 x 32 fp32).
        assert saved[(4, True, False)] - saved[(4, True, True)] == 5 * 4 * 64 * 32 * 4 * 3 // 4, saved
        assert saved[(4, True, True)] < saved[(4, True, False)] < saved[(4, False, True)], saved
    # Heads wider than d_model / n_heads (model.head_size): attention's tensors are n_heads x head_size wide, the
    # residual stream d_model. Qwen3's q and k norms keep their inputs (views of the QKV output) and one rsqrt per
    # head. The planner's model holds exactly for each, and each keeps more than the plain block.
    for name, (extra, keys) in MEASURED_OTHER.items():
        other = load_config("tiny", [*MHA, *extra]).model
        other.vocab_size, other.max_seq_len = 257, 64
        for rank, (_, meas) in enumerate(world4):
            for tp, sp, regather in keys:
                got = meas[(name, tp, sp, regather)][1]
                assert got == tp_forward_saved_bytes(other, _tokens(tp), tp, sp, regather), (name, rank, tp, sp, got)
                if "gqa" not in name:  # the plain block above is measured with MHA only
                    assert got > meas[(tp, sp, regather)][1], (name, rank)


def test_zero3_keeps_no_tensor_parallel_weight_from_forward_to_backward(world4):
    """ZeRO-3 under TP frees every gathered weight after forward and gathers it again for backward: nothing keeps
    one alive in between, the fused QKV and gate/up matmuls included (they keep their parts, by reference). The
    concatenation they read used to be kept: 1/tp of every block's weights on each rank, whatever dp."""
    for rank, (_, meas) in enumerate(world4):
        for dtype in ("fp32", "bf16"):
            assert meas[("zero3 kept", dtype)] == [], (rank, dtype, meas[("zero3 kept", dtype)])


def _gather_linear_worker(rank, world_size):
    """One column-parallel layer under SP against the single-device matmul, fp32 and bf16 autocast, with and
    without re-gathering: output rows, input-gradient shard, weight-gradient rows, and the all-gather bytes."""
    gen = torch.Generator().manual_seed(0)
    x, w, c = (torch.randn(*shape, generator=gen) for shape in ((2, 8, 16), (12, 16), (2, 8, 12)))
    group = Mesh(tp=world_size).group("tp")
    rows, seq = slice(rank * 6, rank * 6 + 6), slice(rank * 4, rank * 4 + 4)
    out = {}
    for bf16 in (False, True):
        ref_x, ref_w = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            ref = F.linear(ref_x, ref_w)
        (ref.float() * c).sum().backward()
        for regather in (False, True):
            xs = x[:, seq].clone().requires_grad_()
            layer = ColumnParallelLinear(w[rows].clone(), group, sp=True, regather=regather)
            comm.METER.reset()
            with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                y = layer(xs)
            (y.float() * c[:, :, rows]).sum().backward()
            gathered = comm.METER.snapshot()["tp"]["all_gather"]["bytes"]
            out[(bf16, regather)] = ((y, ref[..., rows]), (xs.grad, ref_x.grad[:, seq]),
                                     (layer.weight.grad, ref_w.grad[rows]), gathered)
        # Without SP: every rank holds the whole input and gets the whole (all-reduced) input gradient.
        xf = x.clone().requires_grad_()
        layer = ColumnParallelLinear(w[rows].clone(), group, sp=False)
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            y = layer(xf)
        (y.float() * c[:, :, rows]).sum().backward()
        out[("no sp", bf16)] = ((y, ref[..., rows]), (xf.grad, ref_x.grad), (layer.weight.grad, ref_w.grad[rows]))
    out["backward order"] = _backward_order(x[:, seq], w[rows], c[:, :, rows], group, sp=True)
    out["backward order, no sp"] = _backward_order(x, w[rows], c[:, :, rows], group, sp=False)
    return out


def _backward_order(x, w, c, group, sp):
    """What a column-parallel layer's backward does, in order (re-gathering under ``sp``): its collectives'
    launches and waits and its matmuls (by output shape)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    events, handles = [], {}

    class Matmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mm.default:
                events.append(("mm", tuple(result.shape)))
            return result

    def logged(name, fn):
        def call(*args, **kwargs):
            handle = fn(*args, **kwargs)
            handles[id(handle)] = name
            events.append((name, "start" if kwargs.get("async_op") else "blocking"))
            return handle
        return call

    real_wait = comm.Handle.wait
    patched = {"all_gather": comm.all_gather, "reduce_scatter": comm.reduce_scatter, "all_reduce": comm.all_reduce}
    layer = ColumnParallelLinear(w.clone(), group, sp=sp, regather=True)
    xs = x.clone().requires_grad_()
    y = layer(xs)
    try:
        for name, fn in patched.items():
            setattr(comm, name, logged(name, fn))
        comm.Handle.wait = lambda h: (events.append((handles.get(id(h)), "wait")), real_wait(h))[1]
        with Matmuls():
            (y * c).sum().backward()
    finally:
        comm.Handle.wait = real_wait
        for name, fn in patched.items():
            setattr(comm, name, fn)
    return events


def test_column_parallel_regather_equals_one_device():
    results = spawn(_gather_linear_worker, 2, timeout=120)
    full = 2 * 8 * 16  # the gathered input's elements
    for rank, out in enumerate(results):
        # Backward overlaps each collective with a matmul (Megatron's async TP communication): the re-gather
        # with the input-gradient matmul ([B·T, D] = [16, 16]), the input gradient's reduce-scatter with the
        # weight-gradient matmul ([6, 16], this rank's rows).
        assert out.pop("backward order") == [("all_gather", "start"), ("mm", (16, 16)), ("reduce_scatter", "start"),
                                             ("all_gather", "wait"), ("mm", (6, 16)), ("reduce_scatter", "wait")]
        # Without SP, the input gradient's all-reduce with the weight-gradient matmul.
        assert out.pop("backward order, no sp") == [("mm", (16, 16)), ("all_reduce", "start"), ("mm", (6, 16)),
                                                    ("all_reduce", "wait")]
        for bf16 in (False, True):
            rtol = 2e-2 if bf16 else 1e-5
            for what, (got, want) in zip(("output", "input grad", "weight grad"), out.pop(("no sp", bf16)),
                                         strict=True):
                err = (got.float() - want.float()).norm() / want.float().norm()
                assert got.dtype == want.dtype and err <= rtol, (rank, bf16, "no sp", what, float(err))
        for (bf16, regather), (*pairs, gathered) in out.items():
            rtol = 2e-2 if bf16 else 1e-5  # bf16 keeps 8 mantissa bits; fp32 differs by summation order only
            for what, (got, want) in zip(("output", "input grad", "weight grad"), pairs, strict=True):
                err = (got.float() - want.float()).norm() / want.float().norm()
                assert got.dtype == want.dtype and err <= rtol, (rank, bf16, regather, what, float(err))
            # Forward gathers the fp32 input; the re-gather in backward moves the shard saved in the compute dtype.
            assert gathered == full * 4 + (full * (2 if bf16 else 4) if regather else 0), (rank, bf16, regather)


def _fused_matmul_worker(rank, world_size):
    """A fused QKV matmul (three weights, one call) on every column path, against ``F.linear`` over the
    concatenated weights on one device: output, input gradient, each part's gradient; and the weight-shaped tensors
    its backward keeps (by storage: "part i", or the concatenation's shape)."""
    gen = torch.Generator().manual_seed(0)
    x, c = torch.randn(2, 8, 16, generator=gen), torch.randn(2, 8, 14, generator=gen)
    full = [torch.randn(n, 16, generator=gen) for n in (6, 4, 4)]  # q, k, v rows of both ranks
    group = Mesh(tp=world_size).group("tp")
    mine = [w.chunk(world_size)[rank] for w in full]
    cols = torch.cat([torch.arange(o, o + w.shape[0]).chunk(world_size)[rank]
                      for o, w in zip((0, 6, 10), full, strict=True)])
    seq = slice(rank * 4, rank * 4 + 4)
    out = {}
    # fp32; bf16 weights read as they are (ZeRO-3 gathers them in the compute dtype); fp32 weights under autocast
    for dtype, autocast in (("fp32", False), ("bf16 weights", True), ("fp32 weights, autocast", True)):
        wdt = torch.bfloat16 if dtype == "bf16 weights" else torch.float32
        ref_x, ref_w = x.clone().requires_grad_(), [w.to(wdt).clone().requires_grad_() for w in full]
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            ref = F.linear(ref_x, torch.cat(ref_w))
        (ref.float() * c).sum().backward()
        for path, sp, regather in (("no sp", False, True), ("sp regather", True, True), ("sp kept", True, False)):
            parts = [w.to(wdt).clone().requires_grad_() for w in mine]
            layer = ColumnParallelLinear(parts[0].detach().clone(), group, sp, regather)
            xs = (x[:, seq] if sp else x).clone().requires_grad_()
            kept = []

            def pack(t, parts=parts, kept=kept):
                if t.dim() == 2 and t.shape[1] == 16:  # weight-shaped: [rows, d_model]
                    same = [i for i, w in enumerate(parts) if w.untyped_storage().data_ptr()
                            == t.untyped_storage().data_ptr()]
                    kept.append(f"part {same[0]}" if same else (tuple(t.shape), str(t.dtype).removeprefix("torch.")))
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                    torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                y = layer.matmul(xs, *parts)
            (y.float() * c[:, :, cols]).sum().backward()
            want_gx = ref_x.grad[:, seq] if sp else ref_x.grad
            out[(dtype, path)] = ([(y, ref[..., cols]), (xs.grad, want_gx),
                                   *((w.grad, r.grad.chunk(world_size)[rank]) for w, r in zip(parts, ref_w,
                                                                                               strict=True))],
                                  sorted(kept))
    return out


def test_fused_column_matmul_keeps_its_weights_not_their_concatenation():
    """The fused QKV (and gate/up) matmul equals one device on every column path, and keeps for backward the
    weights themselves (fp32, or bf16 as ZeRO-3 gathers them: by reference there), never their concatenation,
    which would be 1/tp of every block's weights held from forward to backward whatever the ZeRO stage, nor,
    under autocast with fp32 weights, their bf16 cast, which would be that again for each microbatch in flight."""
    for rank, out in enumerate(spawn(_fused_matmul_worker, 2, timeout=120)):
        for (dtype, path), (pairs, kept) in out.items():
            rtol = 1e-5 if dtype == "fp32" else 2e-2  # bf16 keeps 8 mantissa bits; fp32 differs by summation order
            for what, (got, want) in zip(("output", "input grad", "q grad", "k grad", "v grad"), pairs, strict=True):
                err = (got.float() - want.float()).norm() / want.float().norm()
                assert got.dtype == want.dtype and err <= rtol, (rank, dtype, path, what, float(err))
            assert kept == ["part 0", "part 1", "part 2"], (rank, dtype, path, kept)


def test_tp_refuses_shapes_it_cannot_split():
    with pytest.raises(ConfigError, match="parallel.tp=3 must divide model.n_kv_heads=2 or be a multiple of it"):
        load_config("tiny", ["model.d_model=48", "model.n_heads=6", "parallel.tp=3"])
    with pytest.raises(ConfigError, match="parallel.tp=3 must divide model.n_heads=4"):
        load_config("tiny", ["parallel.tp=3"])
    with pytest.raises(ConfigError, match="parallel.sp=true splits train.seq_len=30"):
        load_config("tiny", ["parallel.tp=4", *MHA, "parallel.sp=true", "train.seq_len=30"])
    with pytest.raises(ConfigError, match="parallel.sp=true needs parallel.tp > 1"):
        load_config("tiny", ["parallel.sp=true"])


def test_cli_tp2_sp_matches_one_process(data, tmp_path):
    def run(out, *extra):
        return cli_train(data, out, [*BASE, "train.sample_tokens=8", *extra])

    layout = ["parallel.tp=2", "parallel.sp=true"]
    one, out1 = run(tmp_path / "one")
    two, out2 = run(tmp_path / "two", "--nproc", "2", *layout)
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert "sample:" in out2  # generation gathers the vocabulary shards
    # grad norms, the final checkpoint's parameters and bytes on tp, against the one-process run.
    assert_same_cli_run("cli tp2 sp", tmp_path / "two", two, tmp_path / "one", one, layout, nproc=2)


def test_planner_predicts_the_bytes_of_every_layout_above(data):
    """Issue 6: for every layout this file ran, each rank's comm-meter bytes of a steady training step
    equal plan/check.predict_rank's prediction exactly (and state bytes within 5%)."""
    assert_planner_predicts_runs(data)
