"""The planner's three context-parallel attentions (``parallel.cp_attention``: ring, allgather, ulysses): each one's
step time is priced from the same bytes and calls the comm meter counts (``cp_comm_bytes`` / ``cp_calls``, which
``tests/test_ulysses.py`` and ``tests/test_context_parallel.py`` hold equal to the runtime's), the ring alone hides
behind attention, the search tries Ulysses where the heads split and emits it, and a calibrated profile prices each
attention's own runtime work. Planner arithmetic only: no process starts."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from meshtrain import cli
from meshtrain.config import ModelConfig, load_config
from meshtrain.plan.check import layout_of
from meshtrain.plan.comm_bytes import cp_calls, cp_comm_bytes
from meshtrain.plan.hardware import Hardware, get_hardware
from meshtrain.plan.memory import activation_elems_per_token, run_precision
from meshtrain.plan.problem import Layout, Problem
from meshtrain.plan.search import SearchOptions, emit_yaml, search
from meshtrain.plan.steptime import evaluate

MODEL = ModelConfig(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=257, max_seq_len=1024)
BW, CALL = 1e9, 3e-5  # bytes/s on the fast fabric; host seconds per counted call


def _cpu(cores: int = 8, call_s: float = CALL) -> Hardware:
    """A CPU host of 8 processes on ``cores`` cores: no latency (so a collective's time is linear in its bytes plus
    its calls' host work), one fast domain; with 8 cores no core is idle for communication beside compute
    (``steptime.overlaps``) and none is shared (which would slow every term)."""
    return Hardware("cpu-test", "test", 1e11, 8e9, 2e10, BW, BW, 8, 8, tp_max=8, intra_latency=0.0,
                    inter_latency=0.0, cores=cores, call_s=call_s, source="test")


def _problem(hw: Hardware, seq_len: int = 1024, sequences: int = 8, model: ModelConfig = MODEL) -> Problem:
    return Problem(replace(model, max_seq_len=seq_len), seq_len, sequences, hw, 1, precision=run_precision("bf16"))


@pytest.mark.parametrize("attention", ["ring", "allgather", "ulysses"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_each_attention_costs_its_metered_bytes_and_calls(attention, recompute):
    """With no overlap and no latency, the CP part of the step is exactly its bytes on the wire over the bandwidth
    plus its counted calls' host work, where bytes and calls are the comm meter's model of that attention: a send
    moves its payload once, an all-gather, reduce-scatter or all-to-all (cp-1)/cp of it; a receive is the send's
    other end (no bytes of its own, a call of its own). Recompute, full or selective, exchanges the forward's
    again."""
    problem = _problem(_cpu())
    lay = Layout(dp=2, cp=4, microbatches=2, recompute=recompute, cp_attention=attention)
    t = 8 // 2 // 2 * 1024 // 4  # tokens per microbatch per rank
    est = evaluate(problem, lay, with_collectives=True)
    rerun = recompute != "none"
    nbytes = cp_comm_bytes(MODEL, 4, 1, t, attention, MODEL.n_layers, 2, 2, rerun)
    calls = cp_calls(4, attention, MODEL.n_layers, 2, rerun)
    wire = sum(b * (1.0 if op == "send" else 0.0 if op == "recv" else 3 / 4) for (_, op), b in nbytes.items())
    want = wire / BW + sum(calls.values()) * CALL
    assert est.step.cp == pytest.approx(want, rel=1e-9)
    # explain's rows of one block's collectives add up to the same bytes
    rows = [c for c in est.collectives if c.axis == "cp"]
    sent = sum(v for (_, op), v in nbytes.items() if op != "recv")
    assert sum(c.bytes * c.calls for c in rows) == pytest.approx(sent, rel=1e-9)
    assert {c.op for c in rows} == {op for (_, op) in nbytes if op != "recv"}


def test_the_ring_hides_behind_attention_where_the_others_cannot():
    """On GPUs (communication beside compute) the ring's hops run under the attention of the chunk already held: at
    32K tokens all of them; all-gather and Ulysses wait for their exchanges. On a CPU host whose cores are all busy
    nothing hides, and Ulysses' two all-to-alls per direction beat cp4's three hops of sends and receives each."""
    gpu = _problem(get_hardware("h100"), 32768, 8, replace(MODEL, d_model=4096, n_heads=32, n_kv_heads=8))
    parts = {a: evaluate(gpu, Layout(dp=2, cp=4, cp_attention=a)).step.cp for a in ("ring", "allgather", "ulysses")}
    assert parts["ring"] == 0.0 and parts["allgather"] > 0 and parts["ulysses"] > 0
    cpu = _problem(_cpu())
    ring, uly = (evaluate(cpu, Layout(dp=2, cp=4, cp_attention=a)) for a in ("ring", "ulysses"))
    assert uly.step.cp < ring.step.cp and uly.step_s < ring.step_s
    # the same profile with idle cores lets attention hide the ring (the CPU ring at 1e11 FLOP/s hides partly)
    idle = _problem(_cpu(cores=64))
    assert evaluate(idle, Layout(dp=2, cp=4)).step.cp < ring.step.cp


def test_selective_recompute_reruns_the_ring_with_no_attention_to_hide_behind():
    """Where the ring hides wholly behind attention (32K tokens on GPUs), full recompute's rerun hides too (its
    forward computes attention again), but selective keeps attention's outputs, so the rerun's hops are exposed:
    exactly one forward's ring exchanges per block and microbatch, and explain names them as on the critical path."""
    from meshtrain.plan.comm_bytes import cp_ring_bytes
    from meshtrain.plan.network import group_link
    from meshtrain.plan.steptime import op_time

    hw = get_hardware("h100")
    model = replace(MODEL, d_model=4096, n_heads=32, n_kv_heads=8)
    gpu = _problem(hw, 32768, 8, model)
    cp = 4
    t = 8 // 2 * 32768 // cp
    est = {rc: evaluate(gpu, Layout(dp=2, cp=cp, recompute=rc), with_collectives=True)
           for rc in ("none", "selective", "full")}
    assert est["none"].step.cp == 0.0 and est["full"].step.cp == 0.0
    fwd = cp_ring_bytes(t, model, cp, 1, 2)["fwd"]
    hop = op_time(hw, "send", fwd, group_link(hw, cp, 1, 1), cp - 1, 2 * (cp - 1))
    assert est["selective"].step.cp == pytest.approx(model.n_layers * hop, rel=1e-9)
    rows = [c for c in est["selective"].collectives if c.axis == "cp" and c.critical == "yes"]
    assert len(rows) == 1 and rows[0].seconds == pytest.approx(hop) and rows[0].calls == model.n_layers


def test_search_tries_ulysses_where_the_heads_split_and_emits_it(tmp_path):
    """Where Ulysses is faster (the busy CPU host above) the search ranks it first and ``--emit`` writes
    ``parallel.cp_attention: ulysses``, a config that loads and whose layout is the planned one. A model whose tp
    rank's kv heads do not split over cp gets no Ulysses layout, and says why."""
    problem = _problem(_cpu())
    result = search(problem, SearchOptions(cps=(4,), tps=(1,), pps=(1,), zeros=(0,), recomputes=("none",)))
    best = result.best
    assert best.layout.cp == 4 and best.layout.cp_attention == "ulysses"
    assert {e.layout.cp_attention for e in result.ranked} == {"ring", "ulysses"}  # allgather only when asked
    cfg = load_config(emit_yaml(problem, best, tmp_path / "ulysses.yaml"))
    assert cfg.parallel.cp_attention == "ulysses" and layout_of(cfg, 8) == best.layout
    asked = search(problem, SearchOptions(cps=(4,), tps=(1,), pps=(1,), zeros=(0,), recomputes=("none",),
                                          cp_attentions=("ring", "allgather", "ulysses")))
    assert {e.layout.cp_attention for e in asked.ranked} == {"ring", "allgather", "ulysses"}
    mqa = _problem(_cpu(), model=replace(MODEL, n_kv_heads=1))
    result = search(mqa, SearchOptions(cps=(2,), tps=(1,), pps=(1,), zeros=(0,), recomputes=("none",)))
    assert {e.layout.cp_attention for e in result.ranked} == {"ring"}
    assert any("ulysses needs cp to divide" in r for r in result.rejected)


def test_calibrated_axis_work_per_attention():
    """A profile measures the ring's runtime work (``cp``, which all-gather attention shares) and Ulysses'
    (``cp_ulysses``); one calibrated before Ulysses had a run of its own prices it as the ring's. The work can grow
    with the attention scores (the ring's per-chunk attention and merges)."""
    problem = _problem(_cpu())
    lay = Layout(dp=2, cp=4, cp_attention="ulysses")
    plain = evaluate(problem, lay).step.compute
    old = replace(problem, hw=replace(problem.hw, axis_block_s={"cp": 1e-3}))
    new = replace(problem, hw=replace(problem.hw, axis_block_s={"cp": 1e-3, "cp_ulysses": 4e-4}))
    L = MODEL.n_layers
    assert evaluate(old, lay).step.compute - plain == pytest.approx(L * 1e-3, rel=1e-9)
    assert evaluate(new, lay).step.compute - plain == pytest.approx(L * 4e-4, rel=1e-9)
    assert evaluate(new, replace(lay, cp_attention="ring")).step.compute - plain == pytest.approx(L * 1e-3, rel=1e-9)
    assert evaluate(new, replace(lay, cp_attention="allgather")).step.compute - plain == pytest.approx(L * 1e-3,
                                                                                                      rel=1e-9)
    # the fifth term is per causal attention score the rank computes: its tokens x T / 2 per head, per block
    scored = replace(problem, hw=replace(problem.hw, axis_block_s={"cp": [0.0, 0.0, 0.0, 0.0, 2e-9]}))
    t = 8 // 2 * 1024 // 4
    want = L * t * 1024 / 2 * MODEL.n_heads * 2e-9
    assert evaluate(scored, replace(lay, cp_attention="ring")).step.compute - plain == pytest.approx(want, rel=1e-9)


def test_cli_cp_attention_flag(capsys):
    """``--cp-attention`` picks the attentions the search tries; an unknown one is one line naming the flag."""
    assert cli.main(["plan", "--model", "llama3-8b", "--nodes", "1", "--batch-tokens", "256K", "--seq-len", "32768",
                     "--cp", "2", "--tp", "2", "--pp", "1", "--cp-attention", "ulysses", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["top"] and all(e["layout"]["cp_attention"] == "ulysses" for e in out["top"])
    assert cli.main(["plan", "--model", "llama3-8b", "--cp-attention", "ring,zigzag"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cp-attention takes some of ring, allgather, ulysses" in err[0]


def test_ulysses_memory_counts_its_second_output_and_its_whole_sequence_mask():
    """Ulysses keeps its attention output twice (measured in ``tests/test_context_parallel.py``), and with documents
    the mask of its whole sequences, cp x T per local token, once per forward; the ring keeps no mask."""
    problem = _problem(_cpu())
    t = 8 // 2 * 1024 // 4  # tokens per rank and microbatch at dp2 x cp4
    ring, uly = (evaluate(problem, Layout(dp=2, cp=4, cp_attention=a)).memory["activations"]
                 for a in ("ring", "ulysses"))
    assert uly - ring == t * MODEL.n_layers * MODEL.n_heads * MODEL.head_dim * 2
    docs = replace(problem, documents=True)
    ring_d, uly_d = (evaluate(docs, Layout(dp=2, cp=4, cp_attention=a)).memory["activations"]
                     for a in ("ring", "ulysses"))
    per_token = [activation_elems_per_token(MODEL, "none", masked=m) for m in (False, True)]  # SDPA with a mask
    mask = t * 4 * 1024  # t x cp x T elements
    assert ring_d == ring and uly_d - uly == (mask + t * MODEL.n_layers * (per_token[1] - per_token[0])) * 2
    full = [evaluate(problem, Layout(dp=2, cp=4, cp_attention=a, recompute="full")).memory["activations"]
            for a in ("ring", "ulysses")]
    assert full[0] == full[1]
