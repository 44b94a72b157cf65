"""Document masking (``train.attention_mask=document``): a token attends only to the tokens of its own document
before it, a document ending with its eos id, as Llama 3 was pre-trained and torchtitan's ``block_causal`` mask
and Megatron's ``--reset-attention-mask`` do.

What it means is checked first on the plain model: a row packed with several documents gives every document the
logits it gets alone (RoPE scores depend only on relative positions, so resetting positions would change nothing),
where the causal mask lets the later documents read the earlier ones.

Then every layout against the single-device run of the same seed, on real gloo processes, 5 steps, fp32, with the
tolerances of every equivalence file (losses, grad norms and step-1 gradients 1e-5, final parameters 1e-5 relative,
on every rank), on a corpus of short documents (4 to 60 bytes against 64-token rows: most rows hold several), where
the masked run's losses differ from the causal run's. Context parallelism reads the document ids of the whole
sequence (each rank's queries meet every rank's keys); the pipeline hands every stage its microbatch's ids.
"""


import pytest
import torch

from meshtrain.config import ConfigError, ModelConfig, load_config
from meshtrain.model.layers import document_ids, document_mask
from meshtrain.model.llama import build_model
from meshtrain.plan.costs import tp_forward_saved_bytes
from meshtrain.testing.equivalence import (
    check_layouts,
    layouts_worker,
    prepared_short_documents,
    reference_runs,
    run_layout,
    run_overrides,
)
from meshtrain.testing.spawn import spawn

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
EOS = 63


def test_document_ids_count_the_eos_ids_before_each_token():
    tokens = torch.tensor([[5, 63, 7, 8, 63, 63, 9], [63, 1, 2, 3, 4, 5, 6]])
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]
    mask = document_mask(document_ids(tokens, EOS))
    assert mask.shape == (2, 1, 7, 7)
    assert mask[0, 0, 3].tolist() == [False, False, True, True, False, False, False]  # its document, up to itself
    assert mask[0, 0, 5].tolist() == [False] * 5 + [True, False]  # an empty document: its eos alone


def test_a_packed_row_gives_every_document_its_own_logits():
    model = build_model(CFG, seed=0)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, EOS, (n,), generator=g) for n in (7, 12, 5)]
    docs = [torch.cat([d, torch.tensor([EOS])]) for d in docs]  # each document ends with its eos
    row = torch.cat(docs)[None]
    with torch.no_grad():
        packed = model(row, docs=document_ids(row, EOS))[0]
        causal = model(row)[0]
        start = 0
        for i, d in enumerate(docs):
            alone = model(d[None])[0]
            span = slice(start, start + len(d))
            # Measured: 6.0e-8 max abs difference (logits ~0.4): only the rounding of RoPE at other positions.
            assert (packed[span] - alone).abs().max() < 1e-5, f"document {i}"
            if i > 0:  # the control: the causal mask lets a document read the ones before it
                assert (causal[span] - alone).abs().max() > 1e-3, f"document {i}"
            start += len(d)


def test_document_masking_needs_documents_and_a_known_value():
    with pytest.raises(ConfigError, match="train.attention_mask=document needs documents"):
        load_config("tiny", ["data.source=synthetic", "train.attention_mask=document"])
    with pytest.raises(ConfigError, match="train.attention_mask must be causal or document"):
        load_config("tiny", ["train.attention_mask=block"])


def test_the_planner_plans_with_the_document_mask():
    """A config with the document mask plans with it (its activations include the mask and GQA's repeated k and
    v, except under context parallelism, whose blocks keep no mask) and emits it back."""
    from meshtrain.plan.check import layout_of
    from meshtrain.plan.hardware import get_hardware
    from meshtrain.plan.problem import Problem
    from meshtrain.plan.search import to_config
    from meshtrain.plan.steptime import evaluate

    cfg = load_config("llama3-8b", ["train.attention_mask=document"])
    problem = Problem(cfg.model, 8192, 64, get_hardware("h100"), 1, documents=True)
    causal = Problem(cfg.model, 8192, 64, get_hardware("h100"), 1)
    for tp, cp in ((8, 1), (4, 2)):
        cfg.parallel.tp, cfg.parallel.cp = tp, cp
        lay = layout_of(cfg, 8)
        mine, theirs = evaluate(problem, lay).memory["activations"], evaluate(causal, lay).memory["activations"]
        assert (mine > theirs) if cp == 1 else (mine == theirs), (tp, cp, mine, theirs)
    assert to_config(problem, lay).train.attention_mask == "document"
    assert to_config(causal, lay).train.attention_mask == "causal"


# ----------------------------------------------------------------------------- layouts against one device

STEPS = 5
BASE = [*run_overrides(STEPS), "train.seq_len=64", "train.attention_mask=document"]
LAYOUTS_4 = [
    ("dp2 x tp2 sp", ["parallel.tp=2", "parallel.sp=true"]),
    ("dp2 x tp2 mha", ["parallel.tp=2", "model.n_kv_heads=4"]),
    ("dp2 x tp2 qk norm", ["parallel.tp=2", "model.qk_norm=true"]),
    ("cp2 ring x tp2 kv1", ["parallel.cp=2", "parallel.tp=2", "model.n_kv_heads=1"]),
    ("cp4 allgather", ["parallel.cp=4", "parallel.cp_attention=allgather"]),
    ("cp2 contiguous x dp2 zero3", ["parallel.cp=2", "parallel.cp_layout=contiguous", "parallel.zero=3"]),
    ("pp2 1f1b x dp2", ["parallel.pp=2", "parallel.microbatches=2"]),
    ("pp2 zb-h1 x tp2", ["parallel.pp=2", "parallel.tp=2", "parallel.microbatches=2", "parallel.schedule=zb-h1"]),
    ("dp2 x ep2 moe", ["parallel.ep=2", "model.moe_experts=4"]),
    ("dp4 selective recompute", ["train.recompute=selective"]),
]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return prepared_short_documents(tmp_path_factory, "docdata")


MEASURED = ("dp2 x tp2 sp", "dp2 x tp2 mha", "dp2 x tp2 qk norm")  # what one forward keeps for backward


@pytest.fixture(scope="module")
def world4(data):
    return spawn(layouts_worker, 4, args=(data, BASE, LAYOUTS_4, MEASURED), timeout=900)


@pytest.mark.slow
def test_document_masking_on_every_layout_equals_one_device(data, world4):
    reference = reference_runs(data, BASE)
    causal = run_layout(data, [*BASE, "train.attention_mask=causal"])
    # The mask is at work: the causal run of the same seed and batches is another run.
    steps = list(zip(reference([])["losses"][1:], causal["losses"][1:], strict=True))
    assert all(abs(a / b - 1) > 1e-4 for a, b in steps), steps
    check_layouts(data, 4, LAYOUTS_4, world4, reference)


@pytest.mark.slow
def test_the_planner_predicts_the_masks_memory(world4):
    """One forward keeps the mask once ([rows, 1, T, T], shared by the blocks) and, for GQA, each block's k and v
    repeated to the query heads in place of the QKV output and the rotated k: exactly the planner's activation
    model (fp32), with SP, MHA and Qwen3's q/k norms (which keep the QKV output)."""
    tokens = 8 // 2 * 64  # dp2: four 64-token rows a rank
    for name, sp, extra in (("dp2 x tp2 sp", True, []), ("dp2 x tp2 mha", False, ["model.n_kv_heads=4"]),
                            ("dp2 x tp2 qk norm", False, ["model.qk_norm=true"])):
        cfg = load_config("tiny", ["train.seq_len=64", *extra]).model
        cfg.vocab_size = 257
        want = tp_forward_saved_bytes(cfg, tokens, 2, sp, masked=True, seq_len=64)
        causal = tp_forward_saved_bytes(cfg, tokens, 2, sp)
        for rank, runs in enumerate(world4):
            assert runs[name]["extra"] == want, (name, rank, runs[name]["extra"], want)
        if name == "dp2 x tp2 mha":  # nothing repeated: the mask alone, 4 x 64 x 64 fp32
            assert want - causal == tokens * 64 * 4
