"""The residual stream in the compute dtype (model/layers.py): under ``train.dtype=bf16`` the hidden states
between blocks are bf16 on every layout, as Megatron-LM and torchtitan run them, so what pipeline stages send
and what tensor parallelism gathers and reduces is bf16, half the bytes of an fp32 residual.

One process: the embedding's, every block's and every norm's output are bf16 under autocast, fp32 without it.

Four gloo ranks, pipeline and tensor-parallel layouts, each with an fp32 twin trained in the same world:
- the fp32 twins equal the single-device fp32 run to 1e-5 (the layouts are the same computation);
- each bf16 layout agrees with the single-device bf16 run within k·u relative (u = 2^-8, bf16's unit
  roundoff; k counts the bf16 roundings one device does not make, first order, so they add; the module
  docstring of test_mixed_precision.py says the same for the data-parallel family):
    - the batch split (``SPLIT`` = 2): dp = 2 and the pipeline's microbatches each round a partial
      weight-gradient matmul to bf16 where one device rounds the whole batch's once;
    - tensor parallelism (``TP_SUM`` = 2 per row-parallel output, 2L of them): each rank rounds its partial
      product to bf16, and the all-reduce (or reduce-scatter) of two bf16 values rounds their sum once more;
      one device rounds the whole product once;
  a lost or doubled microbatch, a stage that received another's hidden states, or an unreduced shard is off by
  tens of percent;
- the pipeline's p2p bytes of every bf16 layout are exactly half of its fp32 twin's, and the planner
  (plan/check.py) predicts every rank's bytes of every run, tp's bf16 activations included, exactly.
"""

import pytest
import torch

from meshtrain.testing.equivalence import (
    assert_layout_ran,
    assert_planner_predicts_runs,
    assert_same_runs,
    assert_within_bf16_roundings,
    layouts_worker,
    op_bytes,
    prepared_stdlib,
    reference_runs,
    run_dir,
    run_overrides,
)
from meshtrain.testing.spawn import spawn

STEPS = 5
BASE = run_overrides(STEPS)
L = 2  # the tiny preset's blocks
SPLIT, TP_SUM = 2, 2  # roundings (module docstring)
BF16 = ["train.dtype=bf16"]

# (name, fp32 overrides, k of the bf16 twin's tolerance)
LAYOUTS = [
    ("pp2 dp2 1f1b", ["parallel.pp=2", "parallel.microbatches=2"], SPLIT),
    ("pp2 tp2 sp zb-h1", ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true", "parallel.microbatches=2",
                          "parallel.schedule=zb-h1"], SPLIT + TP_SUM * 2 * L),
    ("tp2 sp dp2", ["parallel.tp=2", "parallel.sp=true"], SPLIT + TP_SUM * 2 * L),
]


def _all_layouts() -> list[tuple[str, list[str]]]:
    return [(name, over) for name, over, _ in LAYOUTS] + [(f"{name} bf16", over + BF16) for name, over, _ in LAYOUTS]


def test_the_residual_stream_is_in_the_compute_dtype():
    """Every block's input and output, the embedding's output and every norm's output: bf16 under bf16 autocast
    (the residual adds keep it there), fp32 without autocast."""
    from meshtrain.config import load_config
    from meshtrain.model.llama import build_model

    cfg = load_config("tiny").model
    cfg.vocab_size = 257
    model = build_model(cfg, seed=0)
    seen: list[tuple[str, torch.dtype]] = []
    for name, m in model.named_modules():
        if name.startswith("layers.") and name.count(".") == 1 or name == "tok_embeddings" or name.endswith("norm"):
            m.register_forward_hook(lambda mod, args, out, name=name: seen.append((name, out.dtype)))
    tokens = torch.randint(0, 257, (2, 16))
    for autocast, want in ((True, torch.bfloat16), (False, torch.float32)):
        seen.clear()
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            logits = model(tokens)
        names = {n for n, _ in seen}
        assert {"tok_embeddings", "layers.0", "layers.1", "layers.0.attention_norm", "norm"} <= names, names
        assert all(dtype == want for _, dtype in seen), (autocast, seen)
        assert logits.dtype == want


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_stdlib(tmp_path_factory, "bf16residualdata")


@pytest.fixture(scope="module")
def reference(data):
    return reference_runs(data, BASE)


@pytest.fixture(scope="module")
def per_rank(data):
    return spawn(layouts_worker, 4, args=(data, BASE, _all_layouts()), timeout=600)


@pytest.mark.slow
def test_fp32_twins_equal_one_device_to_1e5(per_rank, reference, data):
    for name, overrides, _ in LAYOUTS:
        results = [r[name] for r in per_rank]
        assert_layout_ran(name, overrides, 4, results, run_dir(data, 4, name))
        assert_same_runs(name, results, reference(overrides))


@pytest.mark.slow
def test_bf16_layouts_agree_with_one_device_bf16_within_k_roundings(per_rank, reference, data):
    for name, overrides, k in LAYOUTS:
        name, overrides = f"{name} bf16", overrides + BF16
        results = [r[name] for r in per_rank]
        assert_layout_ran(name, overrides, 4, results, run_dir(data, 4, name))
        print("4 ranks,", assert_within_bf16_roundings(name, results, reference(overrides), k))


@pytest.mark.slow
def test_pipeline_sends_half_the_bytes_and_the_planner_predicts_every_run(per_rank, data):
    for name, overrides, _ in LAYOUTS:
        if "parallel.pp=2" not in overrides:
            continue
        low, full = op_bytes(run_dir(data, 4, f"{name} bf16")), op_bytes(run_dir(data, 4, name))
        for rank in range(4):
            p2p = {key: b for key, b in full[rank].items() if key.startswith("pp/")}
            assert p2p, (name, rank, full[rank])
            for key, b in p2p.items():
                assert b > 0 and b % 2 == 0 and low[rank][key] == b // 2, (name, rank, key, low[rank][key], b)
    assert_planner_predicts_runs(data)


def _weight_casts_kept(data: str, world_size: int, overrides: list[str]) -> dict[str, int]:
    """What one training step's forwards keep for backward of bf16 copies of weights, on this rank: "casts" (distinct
    copies) and their "bytes"; the "linears" this rank holds, of which "rows" row-parallel; and the planner's bytes
    of the copies ("planned", ``plan/memory.autocast_copy_numel``). A copy is autocast's cast of a parameter, or a
    weight-shaped ([rows, d_model]) bf16 tensor made inside an autograd function (tensor-parallel column layers
    cast there)."""
    from torch import nn

    from meshtrain.config import load_config
    from meshtrain.parallel.tensor import ColumnParallelLinear, RowParallelLinear
    from meshtrain.plan.memory import autocast_copy_numel
    from meshtrain.train.trainer import Trainer

    cfg = load_config("tiny", [f"data.path={data}", *BASE, *BF16, *overrides])
    trainer = Trainer(cfg)
    casts: dict[int, torch.Tensor] = {}  # held, so that no freed cast's address is reused by another

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base
        node = base.grad_fn
        if base.dtype == torch.bfloat16 and type(node).__name__ == "ToCopyBackward0":
            source = node.next_functions[0][0]
            if isinstance(getattr(source, "variable", None), nn.Parameter):  # a parameter's cast, not an activation's
                casts[base.untyped_storage().data_ptr()] = base
        elif (base.dtype == torch.bfloat16 and node is None and not base.requires_grad and base.dim() == 2
              and base.shape[1] == cfg.model.d_model):
            casts[base.untyped_storage().data_ptr()] = base
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.train_step(0)
    modules = dict(trainer.model.named_modules())
    kinds = (nn.Linear, ColumnParallelLinear, RowParallelLinear)
    linears = [m.weight for m in modules.values() if isinstance(m, kinds)]
    blocks = {name for name in modules if name.count(".") == 1 and name.startswith("layers.")}
    planned = autocast_copy_numel(cfg.model, len(blocks), cfg.parallel.tp, last=modules.get("output") is not None)
    return {"casts": len(casts), "bytes": sum(c.nbytes for c in casts.values()), "planned": 2 * planned,
            "linears": len({id(w) for w in linears}),
            "rows": len({id(m.weight) for m in modules.values() if isinstance(m, RowParallelLinear)})}


def _casts_worker(rank: int, world_size: int, data: str) -> dict[str, dict[str, int]]:
    return {"pp2": _weight_casts_kept(data, world_size, ["parallel.pp=2", "parallel.microbatches=4"]),
            "tp2": _weight_casts_kept(data, world_size, ["parallel.tp=2", "train.grad_accum=4"])}


@pytest.mark.slow  # spawns a process group
def test_a_step_casts_each_weight_once_for_all_its_microbatches(data):
    """Autocast's fp32 -> bf16 cast of a weight is kept by every matmul that reads it until that microbatch's
    backward. One cast per weight per step, shared by the step's microbatches (``ForwardLoss.one_cast_per_step``),
    where each forward used to make its own: a pipeline stage under 1F1B holds up to pp microbatches in flight, each
    with a bf16 copy of the stage's weights (2 bytes a parameter each). One process with four microbatches, a
    pp2 1F1B stage with four (stage 0 holds two in flight), and tp2 with four, whose column layers keep no copy."""
    one = _weight_casts_kept(data, 1, ["train.grad_accum=4"])
    assert one["casts"] == one["linears"] > 0 and one["bytes"] == one["planned"], one
    for rank, out in enumerate(spawn(_casts_worker, 2, args=(data,), timeout=300)):
        pp = out["pp2"]
        assert pp["casts"] == pp["linears"] > 0 and pp["bytes"] == pp["planned"], (rank, pp)
        # Tensor-parallel column layers keep their fp32 weights and cast them again in backward (their fused QKV
        # and gate/up weights would be a copy a microbatch otherwise); the row layers share autocast's step cast.
        tp = out["tp2"]
        assert tp["casts"] == tp["rows"] > 0 and tp["linears"] > tp["rows"] and tp["bytes"] == tp["planned"], (rank, tp)
