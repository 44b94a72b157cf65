"""The planner's tensor-parallel backward overlap: with SP, a column-parallel layer re-gathers its input under its
input-gradient matmul and reduce-scatters its input gradient under its weight-gradient matmul (``_GatherLinear``);
without SP it all-reduces its input gradient under its weight-gradient matmul (``_CopyLinear``;
``tests/test_tensor_parallel.py`` checks the runtime's order). Where the hardware runs communication beside compute
(``steptime.overlaps``) the step time hides each of them up to that matmul's time; where it cannot, all are on the
critical path. Planner arithmetic only: no process starts."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshtrain.config import ModelConfig
from meshtrain.plan.comm_bytes import TP_BESIDE_MATMUL, tp_comm_bytes, tp_layer_collectives
from meshtrain.plan.hardware import Hardware, get_hardware
from meshtrain.plan.memory import run_precision
from meshtrain.plan.network import group_link
from meshtrain.plan.problem import Layout, Problem
from meshtrain.plan.steptime import evaluate, op_time

MODEL = ModelConfig(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=257, max_seq_len=1024)
BW, CALL, FLOPS = 1e9, 3e-5, 1e11
REGATHERS = ["attention in (seq re-gather)", "attention in grad", "mlp in (seq re-gather)", "mlp in grad"]


def _host(cores: int, bw: float = BW) -> Hardware:
    """8 processes on ``cores`` cores: with 8 no core is idle for communication beside compute, with 16 one is."""
    return Hardware("cpu-test", "test", FLOPS, 8e9, 2e10, bw, bw, 8, 8, tp_max=8, intra_latency=0.0,
                    inter_latency=0.0, cores=cores, call_s=CALL, source="test")


def _problem(hw: Hardware, model: ModelConfig = MODEL, sequences: int = 8, seq_len: int = 1024) -> Problem:
    return Problem(replace(model, max_seq_len=seq_len), seq_len, sequences, hw, 1, precision=run_precision("bf16"))


def _matmul_s(model: ModelConfig, t: int, tp: int, rate: float) -> dict[str, float]:
    """One forward matmul of the fused QKV and of the fused gate/up on a tp rank, written out."""
    qkv_columns = (model.n_heads // tp + 2 * max(model.kv_heads // tp, 1)) * model.head_dim
    return {"attention": 2 * t * model.d_model * qkv_columns / rate,
            "mlp": 2 * t * model.d_model * 2 * model.hidden_dim // tp / rate}


@pytest.mark.parametrize("bw", [BW, BW / 10])
def test_sp_backward_hides_each_collective_up_to_its_matmul(bw):
    """The tp time with an idle core for communication is the busy host's less, per block and microbatch, each of the
    four collectives' time or its matmul's, whichever is less: at 1 GB/s the collectives are the shorter (wholly
    hidden), at 0.1 GB/s the matmuls (partly hidden)."""
    lay = Layout(tp=4, dp=2, sp=True, microbatches=2)
    busy, idle = evaluate(_problem(_host(8, bw)), lay), evaluate(_problem(_host(16, bw)), lay, with_collectives=True)
    t = 8 // 2 // 2 * 1024  # tokens per microbatch on a rank
    problem = _problem(_host(16, bw))
    link = group_link(problem.hw, 4, 1)
    matmul = _matmul_s(MODEL, t, 4, FLOPS * problem.efficiency)
    comm = {what: op_time(problem.hw, op, nbytes, link)
            for what, op, nbytes, _ in tp_layer_collectives(t, MODEL.d_model, 4, True, 2) if what in REGATHERS}
    hidden = {what: min(sec, matmul[TP_BESIDE_MATMUL[what]]) for what, sec in comm.items()}
    assert sorted(hidden) == sorted(REGATHERS)
    assert busy.step.tp - idle.step.tp == pytest.approx(2 * MODEL.n_layers * sum(hidden.values()), rel=1e-9)
    fully = all(hidden[w] == comm[w] for w in REGATHERS)
    assert fully == (bw == BW) and (fully or all(hidden[w] < comm[w] for w in REGATHERS))
    marks = {c.what.removeprefix("bwd: "): c.critical for c in idle.collectives if c.axis == "tp"}
    assert {marks[w] for w in REGATHERS} == {"overlapped" if fully else "partly"}
    assert {m for w, m in marks.items() if w not in REGATHERS} == {"yes"}


@pytest.mark.parametrize("bw", [BW, BW / 10])
def test_without_sp_the_input_gradient_all_reduce_hides_up_to_the_weight_gradient_matmul(bw):
    """Without SP each column layer's input-gradient all-reduce runs beside its weight-gradient matmul: the idle-core
    host's tp time is the busy one's less, per block and microbatch, the all-reduce's time or the matmul's, whichever
    is less (wholly hidden at 1 GB/s, partly at 0.1 GB/s); the forward all-reduces stay on the critical path."""
    lay = Layout(tp=4, dp=2, sp=False, microbatches=2)
    busy, idle = evaluate(_problem(_host(8, bw)), lay), evaluate(_problem(_host(16, bw)), lay, with_collectives=True)
    t = 8 // 2 // 2 * 1024
    problem = _problem(_host(16, bw))
    matmul = _matmul_s(MODEL, t, 4, FLOPS * problem.efficiency)
    grads = {what: op_time(problem.hw, op, nbytes, group_link(problem.hw, 4, 1))
             for what, op, nbytes, phase in tp_layer_collectives(t, MODEL.d_model, 4, False, 2) if phase == "bwd"}
    assert sorted(grads) == ["attention in grad", "mlp in grad"]
    hidden = {what: min(sec, matmul[TP_BESIDE_MATMUL[what]]) for what, sec in grads.items()}
    assert busy.step.tp - idle.step.tp == pytest.approx(2 * MODEL.n_layers * sum(hidden.values()), rel=1e-9)
    fully = all(hidden[w] == grads[w] for w in grads)
    assert fully == (bw == BW) and (fully or all(hidden[w] < grads[w] for w in grads))
    marks = {c.what: c.critical for c in idle.collectives if c.axis == "tp"}
    assert {marks[f"bwd: {w}"] for w in grads} == {"overlapped" if fully else "partly"}
    assert {marks["fwd: attention out"], marks["fwd: mlp out"]} == {"yes"}


def test_nothing_hides_without_an_idle_core():
    """On a host whose cores all compute nothing runs beside the matmuls: every tp collective is on the critical
    path, with SP or without."""
    for sp in (False, True):
        rows = evaluate(_problem(_host(8)), Layout(tp=4, dp=2, sp=sp, microbatches=2), with_collectives=True)
        assert {c.critical for c in rows.collectives if c.axis == "tp"} == {"yes"}, sp


def test_a_moe_block_has_no_mlp_collectives_to_price_or_hide():
    """A MoE block's MLP is not split by tp: its tp collectives are the attention's alone (``tp_comm_bytes``'
    ``mlp_tp=False``), in the step time and in explain's rows."""
    moe = replace(MODEL, moe_experts=4, moe_top_k=2)
    lay = Layout(tp=4, dp=2, sp=True, microbatches=2)
    est = evaluate(_problem(_host(8), moe), lay, with_collectives=True)
    whats = {c.what.split(": ", 1)[1] for c in est.collectives if c.axis == "tp"}
    assert whats and not any(w.startswith("mlp") for w in whats)
    dense = evaluate(_problem(_host(8)), lay)
    t, link = 8 // 2 // 2 * 1024, group_link(_host(8), 4, 1)
    mlp = sum(op_time(_host(8), op, nbytes, link) for what, op, nbytes, _ in
              tp_layer_collectives(t, MODEL.d_model, 4, True, 2) if what.startswith("mlp"))
    assert dense.step.tp - est.step.tp == pytest.approx(2 * MODEL.n_layers * mlp, rel=1e-9)


def test_on_an_h100_node_the_mlp_hides_its_sp_backward_collectives_and_attention_part_of_its_own():
    """Llama-3 8B's shape at tp=8 on one H100 node, an 8K-token microbatch: a 67 MB activation takes NVLink 145 us,
    the rank's gate/up matmul 324 us and its QKV matmul (6 of 48 heads' columns) 69 us: the MLP's two are hidden,
    the attention's partly, and explain says so."""
    llama = ModelConfig(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_hidden=14336,
                        max_seq_len=8192)
    hw = get_hardware("h100")
    problem = Problem(llama, 8192, 8, hw, 1, precision=run_precision("bf16"))
    est = evaluate(problem, Layout(dp=1, tp=8, sp=True, microbatches=8), with_collectives=True)
    marks = {c.what.removeprefix("bwd: "): c.critical for c in est.collectives if c.axis == "tp"}
    assert [marks[w] for w in REGATHERS] == ["partly", "partly", "overlapped", "overlapped"]


@pytest.mark.parametrize("sp", [False, True])
def test_recompute_repeats_the_block_collectives_the_runtime_repeats(sp):
    """Recompute, full or selective, reruns each block's forward in backward up to the input of its last matmul:
    every forward tp collective but the MLP's exit runs again (``comm_bytes.tp_comm_bytes``, which the comm meter
    checks exactly). The step's tp time grows by exactly those, per block and microbatch, and by the same bytes the
    byte model adds; explain counts them twice. The embedding's and the loss's collectives are not rerun."""
    hw = _host(8)
    t = 8 // 2 // 2 * 1024
    link = group_link(hw, 4, 1)
    rows = tp_layer_collectives(t, MODEL.d_model, 4, sp, 2)
    again = [(what, op, nbytes) for what, op, nbytes, phase in rows if phase == "fwd" and what != "mlp out"]
    assert len(again) == (3 if sp else 1)
    base = evaluate(_problem(hw), Layout(tp=4, dp=2, sp=sp, microbatches=2)).step.tp
    extra = 2 * MODEL.n_layers * sum(op_time(hw, op, nbytes, link) for _, op, nbytes in again)
    more = tp_comm_bytes(MODEL, 4, sp, t, grad_accum=2, act_bytes=2, recompute=True)
    less = tp_comm_bytes(MODEL, 4, sp, t, grad_accum=2, act_bytes=2)
    assert sum(more.values()) - sum(less.values()) == 2 * MODEL.n_layers * sum(nbytes for *_, nbytes in again)
    for recompute in ("selective", "full"):
        est = evaluate(_problem(hw), Layout(tp=4, dp=2, sp=sp, microbatches=2, recompute=recompute),
                       with_collectives=True)
        assert est.step.tp - base == pytest.approx(extra, rel=1e-9), recompute
        calls = {c.what: c.calls for c in est.collectives if c.axis == "tp"}
        twice = {f"fwd: {what}" for what, *_ in again}
        assert {w for w, n in calls.items() if n == 2 * calls["fwd: mlp out"]} == twice, (recompute, calls)


def test_recompute_repeats_the_forward_all_to_alls():
    """An MoE block's forward all-to-alls (counts, dispatch, combine) run again under recompute, full or selective
    (``comm_bytes.ep_calls``): the step's ep time is the same under both, and more than without."""
    moe = replace(MODEL, moe_experts=4, moe_top_k=2)
    ep = {rc: evaluate(_problem(_host(8), moe), Layout(dp=4, ep=4, microbatches=2, recompute=rc)).step.ep
          for rc in ("none", "selective", "full")}
    assert ep["selective"] == pytest.approx(ep["full"], rel=1e-12) and ep["selective"] > ep["none"] > 0


def test_sp_without_regather_saves_the_backward_gathers_and_keeps_the_gathered_inputs():
    """``parallel.sp_regather=false`` (the column layers keep their gathered input instead of gathering it again in
    backward) reaches the planner through ``layout_of``: on the busy host each block and microbatch loses exactly
    its two re-gathers and the head's re-gather call, the activations grow by exactly what ``activation_bytes``
    says the kept inputs take, and the emitted config keeps the setting."""
    from meshtrain.config import load_config
    from meshtrain.plan.check import layout_of
    from meshtrain.plan.memory import activation_bytes
    from meshtrain.plan.search import to_config

    problem = _problem(_host(8))
    regather = Layout(tp=4, dp=2, sp=True, microbatches=2)
    kept = replace(regather, sp_regather=False)
    est = {lay.sp_regather: evaluate(problem, lay, with_collectives=True) for lay in (regather, kept)}
    t, mb = 8 // 2 // 2 * 1024, 2
    link = group_link(problem.hw, 4, 1)
    gathers = {what: op_time(problem.hw, op, nbytes, link)
               for what, op, nbytes, _ in tp_layer_collectives(t, MODEL.d_model, 4, True, 2) if "re-gather" in what}
    assert len(gathers) == 2
    saved = mb * (MODEL.n_layers * sum(gathers.values()) + CALL)  # the head's re-gather: one metered call fewer
    assert est[True].step.tp - est[False].step.tp == pytest.approx(saved, rel=1e-9)
    assert not any("re-gather" in c.what for c in est[False].collectives)
    grown = (activation_bytes(MODEL, t, MODEL.n_layers, "none", 4, True, 2, sp_regather=False)
             - activation_bytes(MODEL, t, MODEL.n_layers, "none", 4, True, 2))
    assert grown > 0
    assert est[False].memory["activations"] - est[True].memory["activations"] == pytest.approx(grown, rel=1e-9)
    cfg = load_config(None, ["parallel.tp=4", "parallel.sp=true", "parallel.sp_regather=false"])
    assert layout_of(cfg, 4).sp_regather is False and layout_of(cfg, 4).describe().startswith("dp1 tp4+sp(kept)")
    assert to_config(problem, kept).parallel.sp_regather is False


def test_full_recompute_reruns_each_block_up_to_its_mlp_exit_and_never_the_head():
    """Full recompute reruns each block's forward in backward, stopping before a dense block's MLP exit matmul
    (non-reentrant checkpointing's early stop: nothing needs that matmul's output; ``tests/test_recompute.py`` counts
    the runtime's matmuls) and never rerunning the head, which is outside the blocks: on the roofline the step's
    compute grows by exactly microbatches x layers x (a block's forward less its 2·t·d·F/tp exit matmul). A MoE
    block reruns whole (its combine's output is kept for the router weights' gradient)."""
    from meshtrain.plan.steptime import layer_compute_time, matmul_rate

    for model, tp in ((MODEL, 4), (replace(MODEL, moe_experts=4, moe_top_k=2), 1)):
        problem = _problem(_host(8), model)
        lay = Layout(tp=tp, dp=8 // tp, sp=tp > 1, microbatches=2)
        t = 8 // lay.dp // 2 * 1024
        rate = matmul_rate(problem)
        block = layer_compute_time(model, t, 1024, problem.hw.bf16_flops, problem.hw.hbm_bw, tp,
                                   rate / problem.hw.bf16_flops)
        exit_matmul = 0.0 if model.moe_experts else 2 * t * model.d_model * model.hidden_dim / tp / rate
        assert 0 < exit_matmul < block or model.moe_experts
        none, full = (evaluate(problem, replace(lay, recompute=rc)).step.compute for rc in ("none", "full"))
        assert full - none == pytest.approx(2 * model.n_layers * (block - exit_matmul), rel=1e-9), model.moe_experts
