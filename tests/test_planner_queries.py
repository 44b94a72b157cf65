"""The book's analyses as planner queries (``meshtrain plan <query>``), each against a figure its source prints:
seed 000 / 003 (/work/shared/seeds, the chapter "How to Parallelize a Transformer for Training"), the same
book's chapter 4 ("Gradient checkpointing"), chapter 1/7 (rooflines) and chapter 12 ("How to Think About
GPUs", jax-ml/scaling-book gpus.md, "Rooflines for LLM Scaling on GPUs" and Quiz 5), and the Megatron-LM
paper (Narayanan et al. 2021, Table 1 and Section 5.1)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from meshtrain import cli
from meshtrain.config import load_config
from meshtrain.plan import planner, queries
from meshtrain.plan.book import book_layer_comm, mixed_min_batch_per_device
from meshtrain.plan.book_batch import (
    dcn_critical_batch,
    dp_critical_batch,
    pipeline_comm_time,
    pipeline_critical_batch,
)
from meshtrain.plan.book_memory import checkpoint_bytes, largest_model, min_devices, remat_flops_per_token
from meshtrain.plan.book_roofline import decode_roofline, hbm_critical_batch, matmul_roofline
from meshtrain.plan.explain import book_summary, why_best
from meshtrain.plan.flops import param_count
from meshtrain.plan.hardware import get_hardware
from meshtrain.plan.megatron import megatron_flops_per_iteration, megatron_params, megatron_training_days
from meshtrain.plan.problem import plan_config

V5P, H100 = get_hardware("v5p"), get_hardware("h100")
C, W = V5P.bf16_flops, V5P.intra_bw  # 4.59e14, 1.8e11 per ICI axis (seed 000)


def _setting(model: str, hw: str, devices: int, batch: float, seq_len: int = 0) -> queries.Setting:
    cfg = load_config(model)
    return queries.Setting(cfg.model, model, get_hardware(hw), devices, int(batch), seq_len or cfg.train.seq_len)


# ----------------------------------------------------------------------------- issue 15.2: the mixed bound


def test_explanation_prints_the_chapters_mixed_bound_for_llama2_13b_on_v5p_4096():
    # Seed 000, Question 3 (c): "2 x 2550^2 / F = 940"; seed 003's revision (overlapped axes): 2550^2 / (2F) = 235.
    # The explanation used to divide by all three axes' bandwidth in a formula that already assumes two: 105.
    problem = planner.Problem(load_config("llama2-13b").model, 32768, 96, V5P, 1024)
    text = "\n".join(book_summary(problem))
    bounds = {rev: float(m.replace(",", "")) for rev, m in
              re.findall(r"revision (\d{3})[^:]*: B/N > ([\d,]+) tokens", text)}
    assert bounds["000"] == pytest.approx(940, rel=0.01)
    assert bounds["003"] == pytest.approx(235, rel=0.01)
    assert "X (FSDP) 1024 x Y (TP) 4" in text  # seed 003, Question 3: sqrt(2 B N / F) = 1333 -> 1024 x 4


def test_mixed_bound_general_form_reduces_to_the_books():
    # The book's layout (FSDP on two axes, TP on one) is fsdp_bw = 2W, tp_bw = W in k C^2 / (F W_X W_Y).
    for rev, fig in (("000", 940), ("003", 235)):
        assert mixed_min_batch_per_device(13824, C, W, rev, fsdp_bw=2 * W, tp_bw=W) == pytest.approx(fig, rel=0.01)
    # LLaMA-3 70B, F ~ 30k: "2 x 2550^2 / 30,000 = 432" (seed 000); the query prints both revisions.
    out = queries.critical_batch_query(_setting("llama2-13b", "v5p", 4096, 3e6, 32768))
    assert out["mixed_000"]["book"] == pytest.approx(940, rel=0.01)
    assert out["mixed_003"]["this_cluster"] == pytest.approx(235, rel=0.01)


# ----------------------------------------------------------------------------- critical batches, general forms


def test_dp_critical_batch_axes_ring_factor_and_moe():
    # Seed 000: 4.59e14 / 1.8e11 = 2550 on one v5p axis, 850 on three.
    assert dp_critical_batch(C, W) == pytest.approx(2550)
    assert dp_critical_batch(C, W, n_axes=3) == pytest.approx(850)
    # Ch. 12: 990e12 / 450e9 = 2200 in an H100 node; 990e12 / 400e9 = 2475 across nodes (node egress).
    node = H100.inter_bw * H100.devices_per_node
    assert dp_critical_batch(H100.bf16_flops, H100.intra_bw) == pytest.approx(2200, rel=0.01)
    assert dp_critical_batch(H100.bf16_flops, node) == pytest.approx(2475, rel=0.01)
    # Ch. 12: 2-node data parallelism, alpha (X-1)/X: "B / N > 1237, half the above value".
    assert dp_critical_batch(H100.bf16_flops, node, degree=2) == pytest.approx(1237, rel=0.01)
    # Ch. 12: MoE with k = 4, E = 128 across nodes: "32 * 2475 = 79,200".
    assert dp_critical_batch(H100.bf16_flops, node, experts=128, top_k=4) == pytest.approx(79200, rel=0.01)
    with pytest.raises(ValueError):
        dp_critical_batch(C, W, experts=2, top_k=4)


def test_dcn_and_pipeline_critical_batches():
    # Seed 003: 4.46e14 / 6.25e9 = 71,360 tokens per pod.
    dcn = dcn_critical_batch(4.46e14, 6.25e9, pods=10)
    assert dcn["per_pod"] == pytest.approx(71360) and dcn["global"] == pytest.approx(713600)
    # Ch. 12, Quiz 5 Question 2: 8-way pipelining spans 8 nodes, "990e12 / 3200e9 = 309".
    assert pipeline_critical_batch(990e12, 400e9, stages=8) == pytest.approx(309, rel=0.01)
    # ... "Pipelining usually makes ZeRO-3 impossible": it gathers again for every microbatch.
    assert pipeline_critical_batch(990e12, 400e9, 8, microbatches=16, zero3=True) == pytest.approx(16 * 309.4, rel=0.01)
    # Ch. 12: (N_MB + N_stages - 2) hops of 2BD / (W N_MB): about 1.5 x 2BD / W per layer-sized chunk.
    t = pipeline_comm_time(4e6, 8192, 400e9, stages=16, microbatches=32)
    assert t == pytest.approx(2 * 4e6 * 8192 / (400e9 * 32) * 46)


def test_critical_batch_query_on_gpus_adds_moe_and_pipeline_lines():
    out = queries.critical_batch_query(_setting("mixtral-8x7b", "h100", 1024, 16 * 2**20), stages=8)
    assert out["dp"] == pytest.approx(2475 * 127 / 128, rel=0.01)  # 128 nodes
    assert out["moe"] == pytest.approx(out["dp"] * 8 / 2)  # E / k = 8 / 2
    assert out["pipeline"] == pytest.approx(309, rel=0.01)
    text = "\n".join(out["lines"])
    assert "E/k = 8/2" in text and "pipeline stages" in text and "dcn" not in out


# ----------------------------------------------------------------------------- HBM roofline


def test_hbm_roofline_240_tokens_on_v5e():
    # Ch. 1 and 7 (seed 000 quotes it: "> 240 tokens, so as to be compute-bound"): 1.97e14 / 8.2e11 = 240;
    # int8 weights with bf16 FLOPs halve it: 120.
    assert hbm_critical_batch(1.97e14, 8.2e11) == pytest.approx(240, rel=0.01)
    assert hbm_critical_batch(1.97e14, 8.2e11, weight_bytes=1) == pytest.approx(120, rel=0.01)
    v5e = get_hardware("v5e")
    assert hbm_critical_batch(v5e.bf16_flops, v5e.hbm_bw) == pytest.approx(240, rel=0.02)
    # A big-D, big-F matmul changes bound where the batch crosses it.
    assert matmul_roofline(200, 8192, 32768, 1.97e14, 8.2e11)["bound"] == "memory"
    assert matmul_roofline(300, 8192, 32768, 1.97e14, 8.2e11)["bound"] == "compute"
    # Decode: one sequence is memory-bound; without a cache it turns compute-bound past the same batch.
    assert decode_roofline(8e9, 1, 0.0, 1.97e14, 8.2e11)["bound"] == "memory"
    assert decode_roofline(8e9, 256, 0.0, 1.97e14, 8.2e11)["bound"] == "compute"
    assert decode_roofline(8e9, 256, 1e9, 1.97e14, 8.2e11)["bound"] == "memory"  # the KV caches dominate


# ----------------------------------------------------------------------------- per-axis layer communication


def test_layer_comm_per_axis_at_the_figures_crossings():
    # Seed 000's 16x16x16 figure (F = 4D = 32768): compute meets mixed FSDP+TP at B = 1.6e6 (summed axes);
    # seed 003's at about 4e5 (overlapped). At the optimal X the two axes carry equal time, so at 000's crossing
    # each is half the matmul time and at 003's each equals it.
    n, d, f = 4096, 8192, 32768
    for rev, share in (("000", 0.5), ("003", 1.0)):
        b = n * mixed_min_batch_per_device(f, C, W, rev)
        t = book_layer_comm("fsdp+tp", b, n, d, f, C, 2 * W, W)
        assert t["x"] == pytest.approx(t["y"]) == pytest.approx(share * t["math"])
    assert n * mixed_min_batch_per_device(f, C, W, "000") == pytest.approx(1.6e6, rel=0.02)
    out = queries.layer_comm_query(_setting("llama2-13b", "v5p", 4096, 3e6, 32768))
    mixed = out["layers"]["fsdp+tp"]
    assert out["fsdp_tp_split"] == [1024, 4]
    assert mixed["sum_000"] == pytest.approx(mixed["x"] + mixed["y"]) and mixed["overlap_003"] == max(mixed["x"],
                                                                                                        mixed["y"])
    assert out["layers"]["tp"]["x"] == 0 and out["layers"]["fsdp"]["y"] == 0


# ----------------------------------------------------------------------------- memory


def test_checkpoint_memory_in_c_times_bd_form():
    # Ch. 4 'Gradient checkpointing': B T = 4M, L = 64, D = 8192: no remat "2 * 20 * B * T * D * L = 84TB",
    # block remat 1 per layer "4.2TB", at 8ND instead of 6ND FLOPs.
    assert checkpoint_bytes("none", 4e6, 8192, 28672, 64) == pytest.approx(84e12, rel=0.01)
    assert checkpoint_bytes("block", 4e6, 8192, 28672, 64) == pytest.approx(4.2e12, rel=0.01)
    assert remat_flops_per_token(1.0, "block") == 8 and remat_flops_per_token(1.0, "none") == 6
    # Seed 000, Question 2: LLaMA-2 13B at 16M tokens, checkpoints after the three FFW matmuls: ~4.2e13 = 42 TB.
    assert checkpoint_bytes("ffw", 16e6, 5120, 13824, 40) == pytest.approx(4.2e13, rel=0.01)
    out = queries.activations_query(_setting("llama2-13b", "v5p", 4096, 16e6))
    assert out["policies"]["ffw"]["bytes"] == pytest.approx(4.2e13, rel=0.01)
    assert out["policies"]["ffw"]["c"] == pytest.approx(1 + 2 * 2.7, rel=0.01)  # 1 + 2 F / D


def test_min_devices_and_largest_model():
    # Ch. 12, Quiz 5 Question 2.1: LLaMA-3 70B, 2 + 8 bytes per parameter = 700 GB: "at least 9 GPUs" of 80 GB.
    assert min_devices(70e9, 0.0, 80e9)["any"] == 9
    # Seed 000, Question 3: LLaMA-2 13B at 3M tokens on v5p: pure DP cannot (130 GB > 96 GB); everything
    # sharded needs ~8 TB (7.86e12 of checkpoints + 1.3e11), far under the slice's 393 TB.
    out = queries.min_devices_query(_setting("llama2-13b", "v5p", 4096, 3e6, 32768))
    assert out["devices"]["dp"] is None
    assert out["checkpoint_bytes"] == pytest.approx(7.86e12, rel=0.01)
    assert out["devices"]["fsdp"] == out["devices"]["any"] == -(-(out["state_bytes"] + 7.864e12) // 96e9)
    assert out["devices"]["tp"] is None  # 84 devices > a 16-wide axis
    # Seed 000 (pure DP): "the largest model ... HBM per device / 10": about 9B on a 96 GB v5p chip.
    assert largest_model(96e9, 4096)["dp"] == pytest.approx(9.6e9)
    assert largest_model(96e9, 4096)["fsdp"] == pytest.approx(4096 * 9.6e9)
    assert queries.max_model_query(_setting("llama2-13b", "v5p", 4096, 3e6))["fsdp_min_batch"] == \
        pytest.approx(4096 * 850)  # seed 000 Q3 (b): 850 x 4096 = 3.48M


# ----------------------------------------------------------------------------- time to train, Megatron-LM


def test_train_time():
    # Seed 000: LLaMA-3 70B on 15e12 tokens, 18,823 v5p at 50% MFU: about 17 days.
    out = queries.train_time_query(_setting("llama3-70b", "v5p", 18823, 16e6), 15e12, 0.5)
    assert out["days"]["book_6PT"] == pytest.approx(17, abs=0.3)
    # Ch. 12, Quiz 5 Question 2.2: 4096 H100 at 45% MFU: 3.5e6 s, "or 40 days".
    out = queries.train_time_query(_setting("llama3-70b", "h100", 4096, 4e6), 15e12, 0.45)
    assert out["days"]["book_6PT"] == pytest.approx(40, rel=0.03)
    assert out["days"]["remat_8PT"] == pytest.approx(out["days"]["book_6PT"] * 8 / 6)


def test_megatron_closed_forms():
    # Table 1 (V = 51,200, s = 2048): parameters of four of its GPT configurations, in billions.
    for layers, hidden, billions in ((80, 12288, 145.6), (96, 16384, 310.1), (105, 20480, 529.6),
                                     (128, 25600, 1008.0)):
        assert megatron_params(layers, hidden, 51200, 2048) / 1e9 == pytest.approx(billions, abs=0.06)
    # Section 5.1: GPT-3 175B on 300B tokens with 1024 A100s at 140 TFLOP/s: about 34 days; 1T parameters on
    # 3072 GPUs at 163 TFLOP/s for 450B tokens: about 84 days.
    assert megatron_training_days(300e9, 175e9, 1024, 140e12) == pytest.approx(34, abs=0.5)
    assert megatron_training_days(450e9, 1e12, 3072, 163e12) == pytest.approx(84, rel=0.015)
    # The time formula rests on F ~ 8 B s P per iteration, dropping s / 6h (2.8% for GPT-3 175B) and smaller terms.
    f = megatron_flops_per_iteration(1536, 2048, 96, 12288, 51200)
    assert f == pytest.approx(8 * 1536 * 2048 * megatron_params(96, 12288, 51200, 2048), rel=2048 / (6 * 12288))
    assert megatron_flops_per_iteration(1, 2048, 96, 12288, 51200, recompute=False) == pytest.approx(
        0.75 * megatron_flops_per_iteration(1, 2048, 96, 12288, 51200), rel=0.01)
    out = queries.megatron_query(_setting("llama2-13b", "a100", 1024, 4e6, 4096), 300e9, 140)
    assert out["params"]["meshtrain"] == pytest.approx(13.0e9, rel=0.01)
    assert out["params"]["megatron"] < out["params"]["meshtrain"]  # a GPT block: 4h MLP, no gate (LLaMA: 2.7h x 3)


def test_generation_layouts_for_405b_on_one_and_two_h100_nodes(capsys):
    """Llama-3 405B in bf16 (810 GB) with 8 sequences of 8,192 positions: on one node of 80 GB H100s nothing fits,
    and the answer names the leanest layout and how far over it is; on two nodes tp=8 x pp=2 is the fastest, each
    rank holding a sixteenth of the weights. Its step is at least the weights one rank of each stage reads from
    HBM, stage after stage (the whole model over tp), and within 50% of it: the rest (29%) is the cache and the
    253 small all-reduces in all, each mostly latency."""
    argv = ["plan", "generate", "--model", "llama3-405b", "--hardware", "h100", "--decode-batch", "8",
            "--context", "8192", "--json"]
    assert cli.main(argv) == 0
    one = json.loads(capsys.readouterr().out)
    assert not one["fits"] and all(r["bytes_per_device"] > one["budget_bytes"] for r in one["layouts"])
    assert cli.main([*argv[:-1]]) == 0
    assert "nothing fits on 8 devices: the leanest, tp=" in capsys.readouterr().out
    assert cli.main([*argv, "--nodes", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    best = two["layouts"][0]
    assert two["fits"] and (best["tp"], best["pp"]) == (8, 2)
    weights = param_count(plan_config("llama3-405b").model).total * 2
    assert best["weights_bytes"] == pytest.approx(weights / 16, rel=0.01)
    floor = weights / 8 / get_hardware("h100").hbm_bw
    assert floor <= best["step_s"] <= 1.5 * floor
    fitting = [r for r in two["layouts"] if r["fits"]]
    assert [r["step_s"] for r in fitting] == sorted(r["step_s"] for r in fitting)


# ----------------------------------------------------------------------------- CLI and the why-sentence


@pytest.mark.parametrize("argv", [
    ["min-devices", "--model", "llama2-13b", "--hardware", "v5p", "--batch-tokens", "3e6"],
    ["max-model", "--hardware", "v5p", "--devices", "4096"],
    ["train-time", "--model", "llama3-70b", "--hardware", "v5p", "--devices", "18823", "--mfu", "0.5"],
    ["critical-batch", "--model", "llama2-13b", "--hardware", "v5p", "--devices", "4096", "--batch-tokens", "3e6"],
    ["roofline", "--model", "llama3-8b", "--hardware", "v5e", "--decode-batch", "64"],
    ["layer-comm", "--model", "llama2-13b", "--hardware", "v5p", "--devices", "4096", "--batch-tokens", "3e6"],
    ["activations", "--model", "llama2-13b", "--batch-tokens", "16e6", "--devices", "4096"],
    ["megatron", "--model", "llama2-13b", "--hardware", "a100", "--nodes", "128", "--tflops", "140"],
    ["generate", "--model", "llama3-8b", "--hardware", "h100", "--decode-batch", "32"],
])
def test_every_query_prints_text_and_json(argv, capsys):
    assert cli.main(["plan", *argv]) == 0
    assert capsys.readouterr().out.strip()
    assert cli.main(["plan", *argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["query"] == argv[0]


@pytest.mark.parametrize("argv, names", [
    (["train-time", "--mfu", "3"], "--mfu"),
    (["train-time", "--train-tokens", "inf"], "--train-tokens must be a positive, finite number"),
    (["critical-batch", "--devices", "x"], "--devices"),
    (["roofline", "--no-such-option"], "--no-such-option"),
    (["min-devices", "--hardware", "nope"], "--hardware"),
    (["layer-comm", "--devices", "8", "--nodes", "1"], "--nodes"),
    # each of these was accepted: a size min-devices ignored, 400 GB of an 80 GB device, a negative sequence,
    # nan and inf printed (inf as JSON's invalid Infinity)
    (["min-devices", "--devices", "8"], "unrecognized arguments: --devices 8"),
    (["min-devices", "--memory-fraction", "5"], "--memory-fraction must be in (0, 1], got 5"),
    (["activations", "--seq-len", "-5"], "--seq-len must be >= 0"),
    (["critical-batch", "--pp", "8", "--microbatches", "4"], "--microbatches 4 counts ZeRO-3's regathers"),
    (["roofline", "--tokens-per-chip", "nan"], "--tokens-per-chip must be a positive, finite number, got nan"),
    (["roofline", "--tokens-per-chip", "inf", "--json"], "--tokens-per-chip must be a positive, finite number"),
    (["generate", "--decode-batch", "0"], "--decode-batch and --top must be >= 1 and --context >= 0"),
    (["generate", "--context", "-1"], "--context >= 0"),
    (["generate", "--memory-fraction", "1.5"], "--memory-fraction must be in (0, 1], got 1.5"),
    (["generate", "--dtype", "int8"], "--dtype"),
    (["generate", "--tokens-per-chip", "4"], "unrecognized arguments: --tokens-per-chip 4"),
    # a training batch generation does not read; a cache generate never allocates (its RoPE tables end there)
    (["generate", "--batch-tokens", "4M"], "unrecognized arguments: --batch-tokens 4M"),
    (["generate", "--model", "llama3-8b", "--context", "100000"], "--context 100000 is more than llama3-8b's "
                                                                  "model.max_seq_len=8192"),
])
def test_query_bad_input_is_one_error_line(argv, names, capsys):
    assert cli.main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and names in err[0]


@pytest.mark.parametrize("argv, names", [
    (["--tp", "0"], "--tp takes sizes >= 1"), (["--cp", "0"], "--cp takes sizes >= 1"), (["--tp", ","], "got none"),
    (["--zero", "7"], "--zero takes ZeRO stages from 0 to 3"), (["--schedules", "nosuch"], "got nosuch"),
    (["--devices", "0"], "--devices must be >= 1, got 0."), (["--devices", "-8"], "--devices must be >= 1"),
    (["--seq-len", "-5"], "--seq-len must be >= 0"), (["--top", "0"], "--top and --max-pp must be >= 1"),
    (["--train-tokens", "nan"], "--train-tokens must be"),
    (["--zero", "2,3", "--pp", "2,4"], "ZeRO-2/3 do not combine with pipeline parallelism"),
    # each of these was ignored without a word: --max-pp under an explicit --pp, options beside a mode
    (["--pp", "8", "--max-pp", "2"], "--pp 8 goes above --max-pp 2"),
    (["--list-hardware", "--nodes", "128", "--json"], "--nodes, --json: leave them out, or plan without"),
    (["--list-hardware", "--check-run", "x"], "--check-run and --list-hardware are separate modes"),
])
def test_search_bad_flags_are_one_error_line(argv, names, capsys):
    """Each crashed (a ZeroDivisionError, an IndexError, a KeyError) or was taken for another value (--devices 0
    planned 8 devices) before a fuzz of the plan flags."""
    assert cli.main(["plan", "--model", "tiny", "--hardware", "h100", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and names in err[0], err


def test_zero_3_alone_plans_without_a_pipeline(capsys):
    """``--zero 3`` (or 2) searches pp = 1 only, as the config refuses ZeRO-2/3 with pp > 1; it raised an IndexError
    (no ZeRO stage left for pp > 1) before a second fuzz of the plan flags."""
    assert cli.main(["plan", "--model", "tiny", "--hardware", "h100", "--zero", "3", "--top", "1000", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    layouts = [row["layout"] for row in answer["top"]]
    assert len(layouts) == answer["fitting"] > 0 and all(lay["zero"] == 3 and lay["pp"] == 1 for lay in layouts)


@pytest.mark.parametrize("argv, rule", [
    (["--pp", "4"], "pp 4 needs 4 layers or more (8 for interleaved and dualpipev); the model has 2"),
    (["--cp", "3"], "cp 3 needs a sequence length divisible by 2 x cp = 6 (its zigzag chunks); it is 32"),
    (["--devices", "3", "--tp", "2"], "tp x pp x cp must divide the 3 devices"),
    (["--devices", "64", "--batch-tokens", "96"], "dp (the devices over tp x pp x cp) must divide the 3 sequences"),
])
def test_a_search_with_no_layout_names_the_rule_that_turned_the_sizes_away(argv, rule, capsys, tmp_path):
    """Each said "dp must divide the sequence count", whatever ruled the layouts out, before the search collected
    its reasons (tiny: 2 layers, 32-token sequences)."""
    assert cli.main(["plan", "--model", "tiny", "--hardware", "h100", *argv]) == 0
    out = capsys.readouterr().out
    assert "0 layouts tried" in out and f"over {argv[1] if argv[0] == '--devices' else 8} devices: {rule}" in out
    assert cli.main(["plan", "--model", "tiny", "--hardware", "h100", *argv, "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["tried"] == 0 and rule in answer["explanation"] and any(rule in r for r in answer["rejected"])
    assert cli.main(["plan", "--model", "tiny", "--hardware", "h100", *argv, "--emit", str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: nothing to --emit: No layout") and rule in err[0]
    assert not (tmp_path / "run.yaml").exists()


def test_a_hardware_file_that_is_not_a_profile_is_one_error_line(tmp_path, capsys):
    for text, names in [("{}", "lacks bf16_flops"), ("x", "not JSON"), ("[]", "not a JSON object")]:
        (tmp_path / "hw.json").write_text(text)
        assert cli.main(["plan", "--model", "tiny", "--hardware", str(tmp_path / "hw.json")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is not a hardware profile" in err[0] and names in err[0], err


def test_the_answer_starts_with_why_the_best_layout_wins(capsys):
    args = ["plan", "--model", "llama2-7b", "--hardware", "a100", "--nodes", "1", "--batch-tokens", "256K",
            "--top", "2", "--max-pp", "2"]
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert text.count("Why #1:") == 1 and text.index("Why #1:") < text.index(" #  layout")
    problem = planner.Problem(load_config("llama2-7b").model, 4096, 64, get_hardware("a100"), 1)
    result = planner.search(problem, planner.SearchOptions(max_pp=2))
    a, b = result.ranked[:2]
    sentence = why_best(problem, result)
    assert b.layout.describe() in sentence and sentence.count(".") >= 1
    if round(a.step_s, 9) < round(b.step_s, 9):  # names the part of the step where #2 loses the most
        assert "faster than #2" in sentence
    elif a.memory_total < b.memory_total:
        assert "ties #2" in sentence and "less memory" in sentence
    else:  # on one A100 node, cp 2 hides its ring entirely: dp8 and dp4 x cp2 are predicted the same
        assert "predicted the same" in sentence
    # a crafted runner-up that is slower in one part only is named by that part
    slower = replace(b, step=replace(a.step, tp=a.step.tp + 0.5))
    result.ranked[1] = slower
    assert "faster than #2" in why_best(problem, result) and "TP/SP collectives" in why_best(problem, result)
    result.ranked[1] = b
    assert cli.main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["why"] == sentence
