"""The planner: the book's published figures (seeds 000 and 003), the ZeRO paper's memory example, the
pipeline bubble, the cost model's agreement with the runtime's byte model, the layout search for LLaMA-3 70B
on 1,024 H100s, and the CLI (--json, --emit round trip, --plot, cpu-local profile)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from meshtrain import cli
from meshtrain.config import ModelConfig, load_config
from meshtrain.plan import costs, planner
from meshtrain.plan.costs import (
    Link,
    book_checkpoint_bytes,
    book_layer_times,
    book_param_count,
    book_step_time,
    bubble_fraction,
    chips_for_batch,
    collective_time,
    critical_batch_per_device,
    days_to_train,
    dcn_min_batch_per_pod,
    dp_comm_bytes,
    dp_family_bytes,
    dp_state_bytes,
    mixed_min_batch_per_device,
    optimal_fsdp,
    param_count,
    split_fsdp_tp,
    state_bytes,
    tp_comm_bytes,
    tp_layer_collectives,
    tp_limit,
    tp_min_ffw,
    training_flops,
    unit_numels,
)
from meshtrain.plan.hardware import HARDWARE, Hardware, get_hardware, save_profile

V5P = get_hardware("v5p")
C, W = V5P.bf16_flops, V5P.intra_bw  # 4.59e14 FLOP/s, 1.8e11 B/s per ICI axis (seed 000)


# ----------------------------------------------------------------------------- seed 000 / 003 figures


def test_hardware_presets_have_sources_and_the_books_tpu_numbers():
    for key in ("h100", "h200", "b200", "a100", "tpu-v4p", "tpu-v5e", "tpu-v5p"):
        hw = HARDWARE[key]
        assert hw.source and hw.bf16_flops > 0 and hw.hbm_bytes > 0 and hw.intra_bw > hw.inter_bw > 0
    assert (C, W, V5P.inter_bw, V5P.hbm_bytes) == (4.59e14, 1.8e11, 6.25e9, 96e9)
    assert len(V5P.mesh_axes) == 3 and HARDWARE["h100"].devices_per_node == 8


def test_llama2_13b_parameter_count():
    # Question 1: 3LDF + 4DNHL + 2VD; the book adds its rounded parts, 8.5e9 + 4.2e9 + 0.39e9 = 13.1e9.
    parts = book_param_count(40, 5120, 13824, 40, 128, 32000)
    assert parts["ffw"] == pytest.approx(8.5e9, rel=0.01)
    assert parts["attention"] == pytest.approx(4.2e9, rel=0.01)
    assert round(parts["ffw"] / 1e9, 1) + round(parts["attention"] / 1e9, 1) + 0.39 == pytest.approx(13.1, abs=0.01)
    assert parts["total"] == pytest.approx(13.1e9, rel=0.01)
    ours = param_count(load_config("llama2-13b").model).total  # + norms, exactly what the model holds
    assert ours == pytest.approx(13.1e9, rel=0.02)
    assert ours == pytest.approx(parts["total"], rel=1e-4)


def test_critical_batch_per_chip_v5p():
    assert critical_batch_per_device(C, W) == pytest.approx(2550)
    assert critical_batch_per_device(C, W, n_axes=3) == pytest.approx(850)
    # "if we wanted to train with BS=2M, we'd at most be able to use ~2400 chips"
    assert chips_for_batch(2e6, critical_batch_per_device(C, W, 3)) == pytest.approx(2400, rel=0.03)


def test_llama3_70b_flops_chips_and_days():
    flops = training_flops(70e9, 15e12)
    assert flops == pytest.approx(6.3e24)
    chips = chips_for_batch(16e6, critical_batch_per_device(C, W, 3))
    assert int(chips) == 18823
    assert days_to_train(flops, int(chips), C, 0.5) == pytest.approx(17, abs=0.2)


def test_tensor_parallel_limit():
    # Gemma 7B, F = 2 x 24576 ~ 50k: communication-bound near 19-way model parallelism.
    assert 19 <= tp_limit(49152, C, W) < 20
    assert tp_limit(50e3, C, W) == pytest.approx(19.6, abs=0.05)
    # LLaMA-3 70B, F ~ 30k: 8-way is fine, 16-way is communication-bound; 8-way needs F of about 20k.
    assert 8 < tp_limit(30e3, C, W) < 16
    assert tp_min_ffw(8, C, W) == pytest.approx(20e3, rel=0.03)


def test_mixed_fsdp_tp_bound_both_revisions():
    assert costs.DEFAULT_REVISION == "003"
    # Seed 000 (summed comms): 2 (C/W)^2 / F; LLaMA-3 70B "2 x 2550^2 / 30,000 = 432", LLaMA-2 13B "940".
    assert mixed_min_batch_per_device(30e3, C, W, "000") == pytest.approx(432, rel=0.01)
    assert mixed_min_batch_per_device(13824, C, W, "000") == pytest.approx(940, rel=0.01)
    # Seed 003 (overlapped comms): (C/W)^2 / (2F), four times lower: the 4x4x4 figure's range starts ~100.
    assert mixed_min_batch_per_device(30e3, C, W, "003") == pytest.approx(108, rel=0.01)
    # The 16x16x16 figure (F = 4D = 32768, N = 4096): compute meets the mixed curve at 1.6e6 tokens in seed 000
    # (its caption prints 1.6e10, the same arithmetic) and at about 4e5 in seed 003.
    assert 4096 * mixed_min_batch_per_device(32768, C, W, "000") == pytest.approx(1.6e6, rel=0.02)
    assert 4096 * mixed_min_batch_per_device(32768, C, W, "003") == pytest.approx(4e5, rel=0.02)
    # The per-layer algebra crosses compute exactly there (FSDP on two axes, TP on one, optimal X).
    for rev in ("000", "003"):
        b = 4096 * mixed_min_batch_per_device(32768, C, W, rev)
        t_math, t_comm = book_layer_times("fsdp+tp", b, 4096, 8192, 32768, C, 2 * W, W, revision=rev)
        assert t_math == pytest.approx(t_comm, rel=1e-9)
    # Pure FSDP crosses at N C / W.
    t_math, t_comm = book_layer_times("fsdp", 4096 * 2550, 4096, 8192, 32768, C, W)
    assert t_math == pytest.approx(t_comm)


def test_optimal_split_and_dcn_limit():
    # LLaMA-3 70B on a pod at BS = 3.5M: X (FSDP) = 1024, Y (TP) = 8 (seed 000).
    assert split_fsdp_tp(3.5e6, 8192, 28672) == (1024, 8)
    # Seed 003: DCN arithmetic intensity 4.46e14 / 6.25e9 = 71,360 tokens per pod; seed 000's ~75,000 is
    # the pod-level ratio 3.8e18 / 5e13.
    assert dcn_min_batch_per_pod(4.46e14, 6.25e9) == pytest.approx(71360)
    assert dcn_min_batch_per_pod(3.8e18, 5e13) == pytest.approx(75e3, rel=0.02)
    assert dcn_min_batch_per_pod(C, V5P.inter_bw) == pytest.approx(73440)


def test_question_2_memory():
    # bf16 parameters + two fp32 Adam moments: (2 + 4 + 4) x 13e9 ~ 130 GB; checkpoints 2 L B (D + 2F) ~ 42 TB.
    st = state_bytes(13e9, 0, 1, param_bytes=2, grad_bytes=0, optim_bytes=8)
    assert st["params"] + st["optim"] == pytest.approx(130e9)
    assert book_checkpoint_bytes(40, 16e6, 5120, 13824) == pytest.approx(4.2e13, rel=0.01)


def test_question_3_answers():
    n, batch = 4096, 3e6  # v5p 16x16x16, 32k sequences, 3M tokens
    # (a) pure DP: the 130 GB of parameters + optimizer do not fit in a chip's 96 GB.
    assert (2 + 4 + 4) * 13e9 > V5P.hbm_bytes
    # (b) pure FSDP fits (~8 TB of 393 TB) but needs 850 x 4096 = 3.48M tokens: communication-bound at 3M.
    total = book_checkpoint_bytes(40, batch, 5120, 13824) + 1.3e11
    assert total == pytest.approx(8e12, rel=0.01) and total / n == pytest.approx(1.95e9, rel=0.01)
    fsdp_min = n * critical_batch_per_device(C, W, 3)
    assert fsdp_min == pytest.approx(3.48e6, rel=0.01) and fsdp_min > batch
    # (c) seed 000: mixed needs 2 x 2550^2 / F = 940 per chip, slightly worse than pure FSDP's 850.
    assert mixed_min_batch_per_device(13824, C, W, "000") > critical_batch_per_device(C, W, 3)
    # seed 003: sqrt(3e6 x 2 x 4096 / 13824) = 1333 -> 1024-way FSDP x 4-way TP, ~300 ms per step at 40% MFU.
    assert optimal_fsdp(batch, n, 13824) == pytest.approx(1333, abs=1)
    assert split_fsdp_tp(batch, n, 13824) == (1024, 4)
    assert book_step_time(13e9, batch, n, 4.6e14, 0.4) == pytest.approx(0.3, rel=0.05)
    # and seed 003's bound says the mixed layout is compute-bound at this batch
    assert batch / n > mixed_min_batch_per_device(13824, C, W, "003")


def test_zero_paper_memory_example():
    # Rajbhandari et al.: 7.5B parameters, N_d = 64, 2 + 2 + K(=12) bytes: 120 / 31.4 / 16.6 / 1.9 GB.
    totals = [sum(state_bytes(7.5e9, z, 64, 2, 2, 12).values()) / 1e9 for z in range(4)]
    assert totals == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.05)
    # meshtrain's own dtypes (4 + 4 + 8) agree with the runtime's model up to shard padding.
    cfg = load_config("small").model
    cfg.vocab_size = 257
    for z in range(4):
        ours = state_bytes(param_count(cfg).total, z, 4, 4, 4, 8)
        runtime = dp_state_bytes(cfg, z, 4)
        for k in ours:
            assert ours[k] == pytest.approx(runtime[k], rel=1e-3)


def test_pipeline_bubble_fraction():
    for pp, m in ((2, 4), (4, 8), (4, 16), (8, 8)):
        for sched in ("afab", "1f1b"):
            makespan, idle, _ = costs.pipeline_sim(sched, pp, m, 1, 1.0, 2.0)
            assert idle / makespan == pytest.approx(bubble_fraction(pp, m))
        assert bubble_fraction(pp, m) == pytest.approx((pp - 1) / (m + pp - 1))
        # interleaving (v = 2) cuts the bubble
        if m % pp == 0:
            span, idle, _ = costs.pipeline_sim("interleaved", pp, m, 2, 0.5, 1.0)
            assert idle / span < bubble_fraction(pp, m)


def test_long_schedules_extend_linearly():
    for sched, pp, v in (("1f1b", 4, 1), ("interleaved", 4, 2), ("zb-h1", 4, 1), ("dualpipev", 4, 2)):
        for p2p in (0.0, 0.3):
            full = costs.pipeline_sim(sched, pp, 8 * pp, v, 1.0, 2.2, p2p)
            fast = planner.pipeline_sim_fast(sched, pp, 8 * pp, v, 1.0, 2.2, p2p)
            assert fast[0] == pytest.approx(full[0], rel=0.03)
            assert max(fast[2]) == max(full[2])


# ----------------------------------------------------------------------------- the cost model and the runtime's


def _small() -> ModelConfig:
    cfg = load_config("small").model
    cfg.vocab_size = 257
    return cfg


def test_dp_family_bytes_equals_runtime_model():
    cfg = _small()
    units = unit_numels(cfg)
    for zero in range(4):
        for dp, shard in ((4, 0), (8, 2), (8, 4)):
            for accum in (1, 3):
                for cb, rb in ((2, 4), (4, 4), (2, 2), (4, 2)):  # train.dtype x parallel.reduce_dtype
                    want = dp_comm_bytes(cfg, zero, dp, accum, dp_shard=shard, compute_bytes=cb, reduce_bytes=rb)
                    got = dp_family_bytes(units, zero, dp, accum, shard, rb, 4, cb)
                    assert got == want, (zero, dp, shard, accum, cb, rb)


def test_tp_layer_collectives_sum_to_runtime_model():
    """Per block, the planner's tp collectives add up to the runtime's bytes, in fp32 and in bf16 (where the
    residual stream, the norms' outputs and every tp activation are bf16: model/layers.py)."""
    cfg = _small()
    tokens, tp, accum = 512, 4, 2
    for act in (2, 4):
        s_in = tokens * cfg.d_model * act
        extra = accum * (2 * s_in)  # the embedding output and the head input gradient
        for sp, regather in ((False, True), (True, False), (True, True)):
            per_layer: dict[str, int] = {}
            for _, op, nbytes, _ in tp_layer_collectives(tokens, cfg.d_model, tp, sp, act, regather):
                per_layer[op] = per_layer.get(op, 0) + nbytes
            runtime = tp_comm_bytes(cfg, tp, sp, tokens, accum, act, sp_regather=regather)
            loss_norms = accum * 12 * tokens + (2 * cfg.n_layers + 1) * cfg.d_model * 4
            if sp:
                head = accum * tokens * cfg.d_model * act if regather else 0  # the head's input gathered again
                assert runtime[("tp", "all_gather")] == accum * cfg.n_layers * per_layer["all_gather"] + extra + head
                assert runtime[("tp", "reduce_scatter")] == accum * cfg.n_layers * per_layer["reduce_scatter"] + extra
            else:
                assert runtime[("tp", "all_reduce")] == \
                    accum * cfg.n_layers * per_layer["all_reduce"] + extra + loss_norms


def test_collective_time_ring_and_hierarchy():
    v = 1e9
    inside = Link(8, 8, 400e9, 50e9)
    assert collective_time("all_reduce", v, inside) == pytest.approx(2 * 7 / 8 * v / 400e9)
    across = Link(16, 1, 400e9, 50e9)
    assert collective_time("all_gather", v, across) == pytest.approx(15 / 16 * v / 50e9)
    # 2 per node x 8 nodes: each device's share of the inter-node traffic is 1/2
    both = Link(16, 2, 400e9, 50e9)
    assert collective_time("reduce_scatter", v, both) == pytest.approx(0.5 * v / 400e9 + 7 / 8 * v / 2 / 50e9)
    assert collective_time("all_reduce", v, Link(1, 1, 1.0, 1.0)) == 0.0


def test_moe_param_counts():
    cfg = _small()
    dense = param_count(cfg).total
    assert costs.moe_param_count(cfg, 1, 1) == (dense + cfg.n_layers * cfg.d_model,) * 2
    total, active = costs.moe_param_count(cfg, 8, 2)
    expert = 3 * cfg.d_model * cfg.hidden_dim
    assert total - active == 6 * expert * cfg.n_layers


def test_activation_memory_by_recompute_and_sp():
    cfg = load_config("llama3-70b").model
    none, sel, full = (costs.activation_elems_per_token(cfg, r, 8) for r in ("none", "selective", "full"))
    assert none > sel > full == cfg.d_model
    assert costs.activation_elems_per_token(cfg, "none", 8, sp=True) < none
    # Re-gathering the column-parallel inputs in backward keeps D/8 of each instead of D (two per block).
    kept = costs.activation_elems_per_token(cfg, "none", 8, sp=True, sp_regather=False)
    assert kept - costs.activation_elems_per_token(cfg, "none", 8, sp=True) == 2 * cfg.d_model * (1 - 1 / 8)
    assert costs.activation_elems_per_token(cfg, "full", 8, sp=True) == cfg.d_model / 8


# ----------------------------------------------------------------------------- the search


@pytest.fixture(scope="module")
def llama70b():
    cfg = load_config("llama3-70b")
    problem = planner.Problem(cfg.model, 8192, planner.parse_tokens("4M") // 8192, get_hardware("h100"), 128,
                              model_name="llama3-70b")
    return problem, planner.search(problem)


def test_llama3_70b_on_1024_h100(llama70b):
    problem, result = llama70b
    assert problem.devices == 1024 and problem.batch_tokens == 4 * 2**20
    best = result.best
    assert best is not None and best.fits and best.memory_total <= 0.9 * 80e9
    assert best is result.ranked[0]
    assert all(best.step_s <= e.step_s for e in result.ranked)
    assert all(e.fits for e in result.ranked)
    assert planner.check_runnable(problem, best).runnable
    assert 0.3 < best.mfu < 0.75  # below the 0.75 matmul ceiling, above a communication-bound layout
    text = planner.explain(problem, result)
    for needed in ("Best layout", "Sharding", "W", "critical path", "Bound by", "Memory per device",
                   "revision 003 (this plan's, the default)"):
        assert needed in text
    # what memory rules out is named: the fastest layout overall does not fit
    assert not result.fastest_any.fits and "Memory binds" in text
    # pure data parallelism cannot hold 70B parameters with fp32 AdamW state on an 80 GB device
    dp_only = planner.evaluate(problem, planner.Layout(dp=512, tp=2, microbatches=1, zero=0))
    assert not dp_only.fits


def test_emit_round_trips_through_load_config(llama70b, tmp_path):
    problem, result = llama70b
    path = planner.emit_yaml(problem, result.best, tmp_path / "run.yaml")
    cfg = load_config(path)
    lay = result.best.layout
    p = cfg.parallel
    assert (p.dp, p.tp, p.pp, p.cp, p.zero, p.dp_shard, p.sp) == (lay.dp, lay.tp, lay.pp, lay.cp, lay.zero,
                                                                   lay.dp_shard, lay.sp)
    assert cfg.train.global_batch * cfg.train.seq_len == problem.batch_tokens
    assert cfg.train.recompute == lay.recompute and cfg.train.dtype == "bf16"
    # a pipeline layout validates too (zero <= 1, grad_accum 1, microbatches dividing the rows)
    pipe = planner.Layout(dp=64, tp=4, pp=4, zero=1, sp=True, schedule="interleaved", virtual=2, microbatches=8,
                          recompute="selective")
    est = planner.evaluate(problem, pipe)
    cfg2 = load_config(planner.emit_yaml(problem, est, tmp_path / "pipe.yaml"))
    assert (cfg2.parallel.pp, cfg2.parallel.schedule, cfg2.parallel.microbatches, cfg2.train.grad_accum) == (
        4, "interleaved", 8, 1)


def test_bf16_reduce_halves_the_planned_gradient_bytes_only(llama70b, tmp_path):
    """parallel.reduce_dtype=bf16 as the planner sees it: every gradient collective of the DP family carries half
    the bytes, ZeRO-1's parameter all-gather and ZeRO-3's (compute-dtype) gathers do not change, the exposed
    DP time does not grow, and the emitted config asks for the bf16 reduce."""
    problem, _ = llama70b
    assert costs.run_precision("bf16", "fp32") == costs.MESHTRAIN_BF16 == problem.precision
    low = replace(problem, precision=costs.run_precision("bf16", "bf16"))
    assert costs.run_precision("fp32", "bf16").gather == 4  # an fp32 run gathers fp32 whatever it reduces in
    for lay in (planner.Layout(dp=128, tp=8, zero=1, microbatches=2),
                planner.Layout(dp=128, tp=8, zero=3, dp_shard=8, microbatches=2)):
        full, half = planner.evaluate(problem, lay, True), planner.evaluate(low, lay, True)
        dp_ops = {(c.axis, c.op): c.bytes for c in full.collectives if c.axis.startswith("dp")}
        dp_half = {(c.axis, c.op): c.bytes for c in half.collectives if c.axis.startswith("dp")}
        assert set(dp_half) == set(dp_ops) and len(dp_ops) >= 2
        for key, b in dp_ops.items():
            assert dp_half[key] == pytest.approx(b if key[1] == "all_gather" else b / 2, rel=1e-12), (lay, key)
        assert half.step.dp <= full.step.dp
        assert load_config(planner.emit_yaml(low, half, tmp_path / "low.yaml")).parallel.reduce_dtype == "bf16"
        assert load_config(planner.emit_yaml(problem, full, tmp_path / "full.yaml")).parallel.reduce_dtype == "fp32"


def test_context_parallel_layouts_are_searched_and_emitted(llama70b, tmp_path):
    problem, _ = llama70b
    with_cp = planner.Layout(dp=128, tp=4, cp=2, zero=3, microbatches=4)
    est = planner.check_runnable(problem, planner.evaluate(problem, with_cp))
    assert est.runnable, est.not_runnable_reason
    cfg = load_config(planner.emit_yaml(problem, est, tmp_path / "cp.yaml"))
    assert cfg.parallel.cp == 2 and cfg.parallel.cp_layout == "zigzag"
    assert planner.runtime_supports("cp") and planner.runtime_supports("ep")
    assert any(lay.cp > 1 for lay in planner.candidate_layouts(problem))  # the search follows the runtime
    # a layout the runtime refuses is not emitted: expert parallelism on a dense model
    bad = planner.check_runnable(problem, planner.evaluate(problem, planner.Layout(dp=128, tp=4, cp=2, ep=2, zero=3,
                                                                                  microbatches=4)))
    assert bad.runnable is False and "the model has none" in bad.not_runnable_reason
    with pytest.raises(ValueError, match="the model has none"):
        planner.emit_yaml(problem, bad, tmp_path / "bad.yaml")


def test_cli_plan_json_emit_and_plot(tmp_path, capsys):
    out = tmp_path / "run.yaml"
    png = tmp_path / "fig.png"
    rc = cli.main(["plan", "--model", "llama3-8b", "--hardware", "h100", "--nodes", "2", "--batch-tokens", "1M",
                   "--top", "3", "--json", "--emit", str(out), "--plot", str(png), "--max-pp", "4",
                   "--reduce-dtype", "bf16"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["problem"]["devices"] == 16 and len(data["top"]) == 3
    assert data["problem"]["reduce_bytes"] == 2 and load_config(out).parallel.reduce_dtype == "bf16"
    assert data["top"][0]["fits"] and data["top"][0]["step_s"] <= data["top"][1]["step_s"]
    assert data["emitted"] == str(out) and "Sharding" in data["explanation"]
    cfg = load_config(out)
    assert cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp == 16
    assert png.stat().st_size > 10_000
    # a refused --emit leaves no figure behind (it was drawn before the search)
    rc = cli.main(["plan", "--model", "llama3-70b", "--devices", "8", "--emit", str(tmp_path / "no.yaml"),
                   "--plot", str(tmp_path / "no.png")])
    assert rc == 2 and "nothing to --emit" in capsys.readouterr().err
    assert not (tmp_path / "no.png").exists() and not (tmp_path / "no.yaml").exists()


def test_plan_a_huggingface_folder(tmp_path, capsys):
    """``--model`` a HuggingFace folder: its config.json is the model (Llama 3.1 8B's published one: 8,030,261,248
    parameters, RoPE scaled, a 131,072-token context planned at 8,192), and the emitted config names the folder
    for ``train.init_from``; a folder of another architecture is one line."""
    folder = tmp_path / "Llama-3.1-8B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 131072, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": False, "vocab_size": 128256}))
    out = tmp_path / "run.yaml"
    assert cli.main(["plan", "--model", str(folder), "--devices", "8", "--top", "1", "--json", "--emit",
                     str(out), "--max-pp", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["problem"]["seq_len"] == 8192
    cfg = load_config(out)
    assert param_count(cfg.model).total == 8_030_261_248
    assert (cfg.model.d_model, cfg.model.rope_scaling, cfg.model.max_seq_len, cfg.train.seq_len) == \
        (4096, "llama3", 131072, 8192)
    assert f"train.init_from={folder}" in out.read_text()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}))
    assert cli.main(["plan", "--model", str(folder), "--devices", "8"]) == 2
    err = capsys.readouterr().err
    assert "architectures is ['Gemma2ForCausalLM']" in err and len(err.strip().splitlines()) == 1


def test_when_nothing_fits_the_answer_names_the_leanest_layout_and_how_far_it_is_over():
    """70B with AdamW on one 8-GPU node cannot fit; the answer says by how much, from the layout needing least
    memory (it named the fastest's, which is the fattest: pure TP/DP layouts holding everything)."""
    cfg = load_config("llama3-70b")
    problem = planner.Problem(cfg.model, 8192, 512, get_hardware("h100"), 1, model_name="llama3-70b")
    result = planner.search(problem)
    assert result.best is None and result.leanest is not None
    lean = result.leanest
    assert problem.memory_budget < lean.memory_total <= result.fastest_any.memory_total
    fsdp8 = planner.evaluate(problem, planner.Layout(dp=8, tp=1, microbatches=512 // 8, zero=3, recompute="full"))
    assert lean.memory_total <= fsdp8.memory_total
    text = planner.explain(problem, result)
    assert lean.layout.describe() in text and f"{lean.memory_total / problem.memory_budget:.2f}x the budget" in text


def test_a_model_that_is_no_config_is_refused_naming_model(tmp_path, capsys):
    """--model's mistakes name --model (they said --config, an option plan does not have)."""
    for model, said in [(tmp_path, f"--model {tmp_path} is a folder without a config.json"),
                        (tmp_path / "nope.yaml", "does not exist (option --model)")]:
        assert cli.main(["plan", "--model", str(model)]) == 2
        err = capsys.readouterr().err
        assert said in err and "--config" not in err and len(err.strip().splitlines()) == 1, err


def test_the_revision_asked_for_is_not_labelled_the_default(capsys):
    assert cli.main(["plan", "--model", "llama3-8b", "--devices", "8", "--revision", "000", "--top", "1"]) == 0
    text = capsys.readouterr().out
    assert "revision 000 (this plan's):" in text and "revision 003 (the default):" in text


def test_nodes_and_devices_together_are_refused_in_one_line(capsys):
    """Both size the slice; taking one silently planned 8 devices for `--nodes 128 --devices 8`."""
    assert cli.main(["plan", "--model", "llama3-70b", "--nodes", "128", "--devices", "8"]) == 2
    err = capsys.readouterr().err
    assert "--nodes 128 and --devices 8" in err and "give one" in err and len(err.strip().splitlines()) == 1
    assert cli.main(["plan", "--model", "llama3-70b", "--nodes", "2", "--top", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["problem"]["nodes"] == 2


def test_cli_table_output(capsys):
    rc = cli.main(["plan", "--model", "llama2-7b", "--hardware", "a100", "--nodes", "1", "--batch-tokens", "256K",
                   "--top", "2", "--max-pp", "2"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "layouts tried" in text and "Best layout" in text and " 1  dp" in text


@pytest.mark.parametrize("field, value, said", [
    ("devices_per_node", "eight", "devices_per_node is 'eight', not a finite number"),
    ("devices_per_node", 0, "devices_per_node is 0, not positive"),
    ("bf16_flops", float("nan"), "bf16_flops is nan, not a finite number"),
    ("domain", 2.5, "domain is 2.5, not a whole number"),
    ("mesh_axes", [4, 0], "mesh_axes is [4, 0], not a list of positive whole numbers"),
    ("elem_s", -1, "elem_s is -1, negative"),
    ("axis_block_s", [], "axis_block_s is [], not a JSON object"),
])
def test_a_hardware_profile_with_a_bad_value_is_refused_in_one_line(tmp_path, capsys, field, value, said):
    """Each of these ended in a traceback deep in the search (ZeroDivisionError, TypeError) or an unnamed
    'cannot convert float NaN to integer'."""
    path = tmp_path / "hw.json"
    save_profile(get_hardware("h100"), path)
    path.write_text(json.dumps({**json.loads(path.read_text()), field: value}))
    assert cli.main(["plan", "--model", "tiny", "--hardware", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--hardware {path}: {said}; pass a file written by" in err and len(err.strip().splitlines()) == 1, err


def test_a_hardware_profile_that_cannot_be_read_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "dir.json").mkdir()
    assert cli.main(["plan", "--model", "tiny", "--hardware", str(tmp_path / "dir.json")]) == 2
    err = capsys.readouterr().err
    assert "dir.json cannot be read (Is a directory): pass a file" in err and len(err.strip().splitlines()) == 1
    path = tmp_path / "whole.json"  # counts written as 8.0 are counts
    save_profile(get_hardware("h100"), path)
    path.write_text(json.dumps({**json.loads(path.read_text()), "devices_per_node": 8.0}))
    assert get_hardware(str(path)).devices_per_node == 8 and isinstance(get_hardware(str(path)).devices_per_node, int)


def test_cpu_local_profile(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MESHTRAIN_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="--calibrate"):
        get_hardware("cpu-local")
    assert cli.main(["plan", "--hardware", "cpu-local", "--model", "tiny"]) == 2
    assert "--calibrate" in capsys.readouterr().err
    hw = Hardware("cpu-local", "test", 1e11, 8e9, 2e10, 1e9, 1e9, 2, 2, tp_max=2, source="test")
    save_profile(hw, tmp_path / "hardware" / "cpu-local.json")
    assert get_hardware("cpu-local") == hw
    assert cli.main(["plan", "--hardware", "cpu-local", "--model", "tiny", "--batch-tokens", "256"]) == 0


def test_tokens_parsing_and_days():
    assert planner.parse_tokens("4M") == 4 * 2**20 and planner.parse_tokens("4e6") == 4_000_000
    with pytest.raises(ValueError):
        planner.parse_tokens("lots")
    assert costs.days_for_tokens(15e12, 4 * 2**20, 3.0) == pytest.approx(15e12 / 4 / 2**20 * 3 / 86400)
    assert math.isclose(costs.step_mfu(1e15, 10, 1e14, 2.0), 0.5)


def test_expert_parallel_layouts_for_a_mixture_of_experts():
    """Mixtral-8x7B on 64 H100s: the search tries ep over dp x cp; ep shards the experts' state and adds the
    dispatch/combine all-to-alls to the critical path; dense models never get ep."""
    cfg = load_config("mixtral-8x7b")
    problem = planner.Problem(cfg.model, 4096, planner.parse_tokens("4M") // 4096, get_hardware("h100"), 8,
                              model_name="mixtral-8x7b")
    eps = {lay.ep for lay in planner.candidate_layouts(problem)}
    assert eps == {1, 2, 4, 8}
    base = planner.Layout(dp=64, zero=1, microbatches=16, recompute="full")
    one, two, eight = (planner.evaluate(problem, replace(base, ep=e), with_collectives=True) for e in (1, 2, 8))
    assert one.step.ep == 0 and "experts" not in one.memory
    prec = problem.precision
    for est, ep in ((two, 2), (eight, 8)):  # E/ep whole experts per rank, optimizer state ZeRO-1 over edp
        held = 32 * (8 // ep) * 3 * 4096 * 14336
        assert est.memory["experts"] == pytest.approx(held * (prec.param + prec.grad + prec.optim / (64 // ep)))
    assert eight.memory["params"] < one.memory["params"] / 5  # the dense rest is small: experts dominate
    assert eight.step.ep > 0 and any(c.axis == "ep" and c.op == "all_to_all" for c in eight.collectives)
    assert any("E_EP" in line for line in planner.sharding(replace(base, ep=8), cfg.model, 4096))
    dense = planner.Problem(load_config("llama3-8b").model, 8192, 512, get_hardware("h100"), 8)
    assert {lay.ep for lay in planner.candidate_layouts(dense)} == {1}


def test_plan_units_are_the_runtime_units():
    """plan/units.py (from the config) names and sizes each sharding unit as parallel/units.py builds it from the
    module: dense, tied embeddings, and a mixture of experts (with expert parallelism the routed experts leave
    the block units)."""
    from meshtrain.model.llama import build_model
    from meshtrain.parallel.units import model_units
    from meshtrain.plan.units import expert_params_per_rank, unit_layouts

    for overrides in ([], ["model.tie_embeddings=true"], ["model.moe_experts=4", "model.moe_shared_experts=1"]):
        cfg = load_config("tiny", overrides).model
        cfg.vocab_size = 257
        runtime = [(u.name, u.numel) for u in model_units(build_model(cfg, 0))]
        assert [(name, sum(n for n, _ in params)) for name, params in unit_layouts(cfg)] == runtime
        if cfg.tie_embeddings:  # across pipeline stages the last stage's rank holds it as its own unit, as the first
            staged = [(u.name, u.numel) for u in model_units(build_model(cfg, 0), merge_tied=False)]
            assert [(name, sum(n for n, _ in params)) for name, params in unit_layouts(cfg, first=False)] == staged
            assert staged[0][0] == "embedding" and staged[-1] == ("head", cfg.d_model)
    model = build_model(cfg, 0)
    experts = {id(p) for n, p in model.named_parameters() if ".experts." in n and "shared" not in n}
    assert experts and sum(u.numel for u in model_units(model, frozenset(experts))) == sum(unit_numels(cfg, ep=2))
    assert sum(p.numel() for p in model.parameters() if id(p) in experts) == 2 * expert_params_per_rank(
        cfg, 2, cfg.n_layers)


def test_kv_heads_fewer_than_tp_are_planned():
    """Llama-3 70B (8 kv heads) on TPU v5p (tensor parallelism up to 16): the search offers tp=16, the layout
    validates as a config, and its step time and bytes count the shared kv heads' gradient all-reduce."""
    cfg = load_config("llama3-70b").model
    problem = planner.Problem(cfg, 8192, 512, get_hardware("v5p"), 256, model_name="llama3-70b")
    tps = {lay.tp for lay in planner.candidate_layouts(problem)}
    assert 16 in tps and max(tps) > cfg.kv_heads
    lay = planner.Layout(dp=64, tp=16, zero=3, sp=True, microbatches=4)
    est = planner.check_runnable(problem, planner.evaluate(problem, lay, with_collectives=True))
    assert est.runnable, est.not_runnable_reason
    kv = [c for c in est.collectives if c.axis == "tp_kv"]
    # one kv head's wk and wv per layer, fp32, ZeRO-3-sharded over dp 64, once per step over 16 / 8 = 2 ranks
    assert [(c.group, c.bytes, c.calls) for c in kv] == [(2, 2 * 128 * 8192 * 80 * 4 / 64, 1)]
    assert tp_comm_bytes(cfg, 16, True, 8192)[("tp_kv", "all_reduce")] == 2 * 128 * 8192 * 80 * 4
    assert ("tp_kv", "all_reduce") not in tp_comm_bytes(cfg, 8, True, 8192)
    # per-rank weights and activations hold one whole kv head, not half of one
    assert unit_numels(cfg, tp=16)[1] == unit_numels(cfg, tp=8)[1] - (cfg.n_heads * 128 * 8192 * 2 // 16
                                                                       + 3 * 8192 * cfg.hidden_dim // 16)
