"""The logical-axis rules table is the one place that says how a layout shards each tensor: the runtime's
tensor-parallel placement and the planner's sharding notation both read it (issue 11)."""

import pytest

from meshtrain.config import ParallelConfig, load_config
from meshtrain.mesh import Mesh
from meshtrain.model.axes import param_axes
from meshtrain.model.llama import build_model
from meshtrain.parallel.tensor import apply_tensor_parallel
from meshtrain.plan.explain import sharding
from meshtrain.plan.problem import Layout
from meshtrain.rules import check_executable, notation, rules_for, tp_dim


@pytest.mark.parametrize("moe", [0, 4])
def test_every_parameter_names_its_logical_axes(moe):
    cfg = load_config("tiny", ["model.vocab_size=257", f"model.moe_experts={moe}"]).model
    for name, p in build_model(cfg, 0).named_parameters():
        axes = param_axes(name)
        assert len(axes) == p.dim(), (name, axes, tuple(p.shape))


@pytest.mark.parametrize("sp", [False, True])
def test_runtime_placement_is_the_rules_table(sp):
    """On every tp rank, each parameter is sliced along exactly the dimension whose logical axis the table maps
    to tp, by ceil(n / tp) rows, and replicated when no axis maps to tp."""
    cfg = load_config("tiny", ["model.vocab_size=257", "model.n_kv_heads=4"]).model
    rules = rules_for(ParallelConfig(tp=4, sp=sp))
    for index in range(4):
        model = build_model(cfg, 0)
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        tp = apply_tensor_parallel(model, Mesh(tp=4, rank=index), rules, sp=sp)
        local = dict(model.named_parameters())
        assert set(tp.placements) == set(shapes)
        for name, place in tp.placements.items():
            dim = tp_dim(param_axes(name), rules)
            assert place.shape == shapes[name]
            if dim is None:
                assert place.tp is None and place.replicas == 4, name
                assert tuple(local[name].shape) == shapes[name]
            else:
                per = -(-shapes[name][dim] // 4)
                assert place.tp.dim == dim and place.tp.start == index * per and place.replicas == 1, name
                assert local[name].shape[dim] == per, name


def test_planner_notation_is_the_rules_table():
    """The planner's printed sharding subscripts each tensor's axes exactly as the table maps them."""
    cfg = load_config("tiny", ["model.vocab_size=257"]).model
    for lay in (Layout(dp=4, tp=2), Layout(dp=4, tp=2, sp=True, cp=2), Layout(dp=8, zero=3), Layout(dp=2, pp=2)):
        rules = rules_for(lay)
        text = "\n".join(sharding(lay, cfg, 4096))
        assert "Win,Wgate" + notation(("layers", "embed", "mlp"), rules) in text
        assert "Wq" + notation(("layers", "embed", "heads", "head_dim"), rules) in text
        assert "E" + notation(("vocab", "embed"), rules) in text
        y = "_Y" if lay.tp > 1 else ""
        assert f"F{y}]" in text and (("D_X" in text) == (lay.zero >= 1 and lay.dp > 1))


def test_rules_the_runtime_cannot_execute_are_refused():
    rules = rules_for(ParallelConfig(tp=2))
    check_executable(rules)
    with pytest.raises(ValueError, match=r"embed -> \(tp\) cannot be executed: the model dimension is sharded only"):
        check_executable({**rules, "embed": ("tp",)})
    with pytest.raises(ValueError, match="disagree"):
        check_executable({**rules, "mlp": ()})
    with pytest.raises(ValueError, match="expert_mlp -> \\(tp\\) cannot be executed: experts stay whole"):
        check_executable({**rules, "expert_mlp": ("tp",)})
    with pytest.raises(ValueError, match="unknown logical axis 'hidden'"):
        check_executable({**rules, "hidden": ()})


@pytest.mark.parametrize("kv", [2, 1])
def test_kv_heads_fewer_than_tp_are_replicated_on_the_ranks_that_share_them(kv):
    """tp=4 with 2 kv heads (or 1): each rank holds the whole kv head its query heads use, rows
    [head x head_dim, +head_dim) of wk and wv, with replicas = tp / kv; its units are the planner's; the mesh's
    "tp_kv" group is exactly the consecutive tp ranks sharing that head."""
    from meshtrain.parallel.units import model_units
    from meshtrain.plan.units import unit_layouts

    cfg = load_config("tiny", ["model.vocab_size=257", f"model.n_kv_heads={kv}"]).model
    rules, share, hd = rules_for(ParallelConfig(tp=4)), 4 // kv, cfg.head_dim
    for index in range(4):
        model = build_model(cfg, 0)
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
        mesh = Mesh(tp=4, kv_share=share, rank=index)
        assert mesh.group("tp_kv").ranks == tuple(range(index // share * share, (index // share + 1) * share))
        tp = apply_tensor_parallel(model, mesh, rules)
        local = dict(model.named_parameters())
        head = index // share  # query heads 4/tp per rank; 4/kv query heads per kv head
        assert head == index * (cfg.n_heads // 4) // (cfg.n_heads // kv)
        for name in (n for n in full if n.endswith(("wk.weight", "wv.weight"))):
            place = tp.placements[name]
            assert (place.tp.dim, place.tp.start, place.tp.length, place.replicas) == (0, head * hd, hd, share)
            assert local[name].equal(full[name][head * hd:(head + 1) * hd]), name
        assert [(u.name, u.numel) for u in model_units(model)] == \
               [(name, sum(n for n, _ in params)) for name, params in unit_layouts(cfg, tp=4)]
    with pytest.raises(ValueError, match=f"needs the mesh built with kv_share={share}"):
        apply_tensor_parallel(build_model(cfg, 0), Mesh(tp=4, rank=0), rules)
