"""``train.compile=true``: every block ``torch.compile``d in place (``meshtrain/parallel/compile.py``).

Compiled runs against the single-device eager run from the same seed: losses, grad norms, step-1 gradients and
final parameters on every rank, at the fp32 tolerances of every layout (``meshtrain/testing/equivalence.py``,
1e-5 relative). Inductor fuses element-wise ops and may reorder sums, so compiled is not bit-equal to eager; the
largest difference measured here is 1.1e-6 (final parameters of the tp2 layouts and ep2 after 4 AdamW steps),
within 1e-5.
Each run also shows that it compiled: every block compiled (whole, or inside its checkpoint where a recomputed
block breaks graphs), dynamo made graphs for this layout, and no code object hit dynamo's recompile limit (which
would silently fall back to eager).

Compiling costs ~15-40 s per new graph set on this CPU, so one spawned pair of processes runs every layout in
turn; dynamo starts afresh for each layout (so each shows its own graphs), and inductor's cache of generated
kernels lets the layouts that produce the same graphs skip code generation.
"""

from __future__ import annotations

import pytest
import torch

from meshtrain.config import ConfigError, load_config
from meshtrain.model.llama import cross_entropy_sum
from meshtrain.parallel.compile import compile_loss, is_compiled
from meshtrain.parallel.recompute import recomputed_forward
from meshtrain.testing.equivalence import (
    assert_same_checkpoint,
    check_layouts,
    prepared_stdlib,
    reference_runs,
    run_dir,
    run_layout,
    run_overrides,
)
from meshtrain.testing.spawn import spawn
from meshtrain.train.preflight import check_compile
from meshtrain.train.trainer import Trainer

STEPS = 4
BASE = run_overrides(STEPS)
COMPILE = ["train.compile=true"]

# (name, overrides) on 2 ranks, each with train.compile=true: TP+SP, the DP family with recompute (ZeRO-3 with
# accumulation and full recompute, DP buckets with selective), the pipeline (1F1B, and zero-bubble with its
# DeferredLinear breaks), and recompute of blocks that break graphs (collectives: TP, CP, EP; MoE routing), which
# compile inside their checkpoint (selective there recomputes as full).
LAYOUTS_2 = [
    ("zero3+accum+full", ["parallel.zero=3", "train.grad_accum=2", "train.recompute=full"]),
    ("pp2 1f1b", ["parallel.pp=2", "parallel.microbatches=2"]),
    ("tp2+sp+full", ["parallel.tp=2", "parallel.sp=true", "train.recompute=full"]),
    ("tp2+selective", ["parallel.tp=2", "train.recompute=selective"]),
    ("cp2+full", ["parallel.cp=2", "train.recompute=full"]),
    ("cp2 ulysses", ["parallel.cp=2", "parallel.cp_attention=ulysses"]),
    ("pp2 zb-h1", ["parallel.pp=2", "parallel.microbatches=2", "parallel.schedule=zb-h1"]),
    ("ep2+full (MoE)", ["parallel.ep=2", "model.moe_experts=4", "model.moe_top_k=2", "train.recompute=full"]),
    # TP+SP, and the DP buckets with selective recompute, on Qwen3's and Qwen2's attention: per-head q and k norms
    # with wide heads, and q, k, v biases (rope_theta 100: the conditioning measured for these layouts in
    # test_tensor_parallel.py's WIDE and test_kv_heads.py's QKV_BIAS). (Each layout costs ~20-40 s of compiling on
    # this CPU, so a plain tp2+sp and dp+selective do not run beside them.)
    ("tp2+sp qk norm wide heads", ["parallel.tp=2", "parallel.sp=true", "model.qk_norm=true", "model.head_size=16",
                                   "model.rope_theta=100"]),
    ("dp+selective qkv bias", ["parallel.zero=0", "train.recompute=selective", "model.qkv_bias=true",
                               "model.rope_theta=100"]),
]


def _compile_evidence(trainer: Trainer) -> dict:
    from torch._dynamo.utils import counters

    norm = trainer.model.norm  # the final norm: on the pipeline's last stage only
    return {"compiled": [is_compiled(b) for b in trainer.model.layers.values()],
            "norm": None if norm is None else is_compiled(norm),
            # True: compiled inside its checkpoint (recompute with collectives), False: whole, None: not recomputed
            "inside": [None if (f := recomputed_forward(b)) is None else f.compiled is not None
                       for b in trainer.model.layers.values()],
            "graphs": counters["stats"]["unique_graphs"],
            "limit_hit": any("recompile limit" in k.lower() for k in counters["unimplemented"])}


def _assert_compiled(name: str, overrides: list[str], evidence: dict) -> None:
    assert evidence["compiled"] and all(evidence["compiled"]), f"{name}: blocks compiled {evidence['compiled']}"
    assert evidence["norm"] is not False, f"{name}: the final norm was left eager"
    recompute = any(o.startswith("train.recompute=") for o in overrides)
    # Blocks that break graphs: collectives (tp, cp, ep), or an MoE block's routing.
    breaks = any(o.startswith(("parallel.tp=", "parallel.cp=", "parallel.ep=", "model.moe_experts="))
                 for o in overrides)
    want = breaks if recompute else None
    assert all(inside is want for inside in evidence["inside"]), \
        f"{name}: compiled inside the checkpoint {evidence['inside']}, expected {want}"
    assert evidence["graphs"] > 0, f"{name}: dynamo made no graph"
    assert not evidence["limit_hit"], f"{name}: a code object hit dynamo's recompile limit (ran eager)"


def _compiled_worker(rank: int, world_size: int, data: str, layouts: list[tuple[str, list[str]]]) -> dict:
    from torch._dynamo.utils import counters

    out = {}
    for name, overrides in layouts:
        # This layout's graphs and breaks only: dynamo's caches are per code object and outlive a model, so a
        # layout that ran a code object another layout compiled would reuse its graphs and show none of its own.
        torch._dynamo.reset()
        counters.clear()
        out[name] = run_layout(data, [*BASE, *overrides, *COMPILE], run_dir(data, world_size, name),
                               extra=_compile_evidence)
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_stdlib(tmp_path_factory, "compiledata")


def test_compile_is_off_by_default_and_a_missing_compiler_is_one_line():
    from torch._inductor import config as inductor

    assert load_config("tiny").train.compile is False
    cfg = load_config("tiny", COMPILE)
    check_compile(cfg, torch.device("cpu"))  # this machine has a C++ compiler
    with inductor.patch({"cpp.cxx": ("/nonexistent/c++",)}), \
            pytest.raises(ConfigError, match=r"train\.compile=true but no C\+\+ compiler .* set train\.compile=false"):
        check_compile(cfg, torch.device("cpu"))
    check_compile(load_config("tiny"), torch.device("cpu"))  # not asked for: not checked


def _loss_saved_bytes(loss_fn, logits: torch.Tensor, targets: torch.Tensor) -> tuple[int, float, torch.Tensor]:
    """(bytes the loss saves for backward, each storage once; the loss; the logits' gradient)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = logits.detach().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(x, targets)
    loss.backward()
    return sum(storages.values()), float(loss.detach()), x.grad


def test_compiled_loss_saves_the_bf16_logits_not_an_fp32_copy():
    """train.compile=true compiles the plain cross-entropy too (``compile_loss``). Eager under bf16 autocast it
    saves an fp32 log-softmax of the logits for backward (4 bytes per logit); compiled, the bf16 logits and one
    fp32 value per token (2). Both give the same loss and gradient (fp32: 1e-5)."""
    torch.manual_seed(0)
    n, vocab = 512, 4096
    logits = torch.randn(n, vocab, dtype=torch.bfloat16) * 4
    targets = torch.randint(0, vocab, (n,))
    targets[:7] = -100  # ignored positions, as the data's padding
    compiled = compile_loss(cross_entropy_sum, True)
    assert compile_loss(cross_entropy_sum, False) is cross_entropy_sum
    eager_bytes, eager_loss, eager_grad = _loss_saved_bytes(cross_entropy_sum, logits, targets)
    ours_bytes, ours_loss, ours_grad = _loss_saved_bytes(compiled, logits, targets)
    assert eager_bytes >= 4 * n * vocab
    assert ours_bytes <= 2.1 * n * vocab
    assert ours_loss == pytest.approx(eager_loss, rel=1e-5)
    torch.testing.assert_close(ours_grad.float(), eager_grad.float(), rtol=1e-2, atol=1e-4)  # bf16 gradients
    x = logits.float()  # fp32: the same loss and gradient to rounding
    _, a, ga = _loss_saved_bytes(cross_entropy_sum, x, targets)
    _, b, gb = _loss_saved_bytes(compiled, x, targets)
    assert b == pytest.approx(a, rel=1e-5)
    torch.testing.assert_close(gb, ga, rtol=1e-5, atol=1e-7)


def test_compiled_rmsnorm_gives_the_eager_gradients():
    """RMSNorm's own autograd Function (model/layers._RMSNormFn, which keeps the input and one rsqrt per row)
    under torch.compile: the output and both gradients of the eager Function, in fp32 (1e-6) and bf16 (u, as
    inductor skips the intermediate roundings). torch 2.11 compiled an earlier form of it, whose output was a
    no-op cast, to zero gradients."""
    from meshtrain.model.layers import RMSNorm

    torch.manual_seed(0)
    for dtype, rtol in ((torch.float32, 1e-6), (torch.bfloat16, 2.0 ** -8)):
        norm = RMSNorm(64)
        norm.weight.data.uniform_(0.5, 1.5)
        x0, g = torch.randn(4, 32, 64).to(dtype), torch.randn(4, 32, 64).to(dtype)
        got = []
        for module in (norm, torch.compile(norm)):
            x = x0.clone().requires_grad_()
            norm.weight.grad = None
            y = module(x)
            y.backward(g)
            got.append((y.float(), x.grad.float(), norm.weight.grad.clone()))
        for (a, b), what in zip(zip(*got, strict=True), ("output", "input gradient", "weight gradient"), strict=True):
            assert b.norm() > 0 and (a - b).norm() <= rtol * a.norm(), (dtype, what, float((a - b).norm() / a.norm()))


def _train_until(data: str, out: str, overrides: list[str], until: int | None) -> tuple[list[float], list[str]]:
    cfg = load_config("tiny", [f"data.path={data}", *BASE, "train.steps=6", "train.ckpt_every=3", *overrides])
    trainer = Trainer(cfg, out)
    losses = [r["loss"] for r in trainer.train(until=until)]
    if "train.compile=true" in overrides:
        assert all(is_compiled(b) for b in trainer.model.layers.values()) and is_compiled(trainer.model.norm)
        # tp = 1: the loss is compiled too (compile_loss)
        assert getattr(trainer.parallel.forward.loss_fn, "_torchdynamo_orig_callable", None) is cross_entropy_sum
    return losses, [n for n, _ in trainer.model.named_parameters()]


@pytest.mark.slow
def test_one_process_compiled_equals_eager_and_checkpoints_keep_the_names(data, tmp_path):
    """Compiled on one process: the eager losses; its checkpoint has the eager names and tensors, and a compiled
    run resumes from it to the eager run's end."""
    full, eager_names = _train_until(data, str(tmp_path / "eager"), [], None)
    out = str(tmp_path / "compiled")
    first, names = _train_until(data, out, COMPILE, 4)
    assert names == eager_names  # no `_orig_mod.`: module.compile() keeps the module tree
    assert first == pytest.approx(full[:4], rel=1e-5)
    rest, _ = _train_until(data, out, [*COMPILE, "train.resume=true"], None)
    assert rest == pytest.approx(full[3:], rel=1e-5)  # resumed from the step-3 checkpoint
    assert_same_checkpoint("compiled, resumed compiled", out, tmp_path / "eager")


def check_compiled_layouts(data: str, layouts: list[tuple[str, list[str]]]) -> None:
    """Every layout compiled on 2 ranks, in one spawned pair, equals the one-device eager run."""
    per_rank = spawn(_compiled_worker, 2, args=(data, layouts), timeout=600)
    for name, overrides in layouts:
        for rank, results in enumerate(per_rank):
            _assert_compiled(f"{name} (rank {rank})", overrides, results[name]["extra"])
    check_layouts(data, 2, layouts, per_rank, reference_runs(data, BASE))


@pytest.mark.slow
def test_compiled_layouts_on_2_ranks_equal_one_device_eager(data):
    check_compiled_layouts(data, LAYOUTS_2)
