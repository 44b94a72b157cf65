"""HuggingFace weights in and out (model/hf.py, ``meshtrain convert``), against transformers itself.

Tiny random Llamas are built here and saved with ``save_pretrained`` (nothing comes from a hub). Every parameter is
drawn at a scale where attention is far from uniform and every norm differs from one, so a wrong name, a skipped
q/k permutation or a swapped norm moves the logits by orders of magnitude more than the tolerance.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from meshtrain.config import Config, ModelConfig, update_from_dict
from meshtrain.model import hf as hf_mod
from meshtrain.model.hf import HFSource, export_hf, halves_to_interleaved, hf_model_config, interleaved_to_halves
from meshtrain.model.llama import Llama, build_model
from meshtrain.model.source import DictSource, load_full, relative, state_source
from meshtrain.temp_folders import temp_folder_for
from meshtrain.train.checkpoint import CheckpointReader, latest_checkpoint, read_checkpoint_meta
from meshtrain.train.tokenizer import HFTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

LOGIT_ATOL = 1e-5  # fp32, max abs logit difference against transformers (issue 12); logits here are O(1)
VOCAB, SEQ = 67, 64  # SEQ = max_position_embeddings: every RoPE position is exercised


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights ~ N(0, 0.2) (attention scores O(1)), norm scales 1 + N(0, 0.2) (each norm distinguishable)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.2
            p.copy_(1 + noise if "norm" in name else noise)


# Llama 3.1's RoPE scaling, shrunk so that the tiny model's four frequencies (head_dim 8, theta 5000: wavelengths
# 6.3, 53, 444 and 3737 positions) fall in all three of its bands against original_max_position_embeddings 64:
# under 64 / 4 (kept), between 16 and 64 / 1 (blended), beyond (divided by the factor).
LLAMA3 = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def hf_llama(folder: Path, *, tie: bool = False, kv_heads: int = 2, shard: str | None = None,
             seed: int = 0, rope: dict | None = None) -> LlamaForCausalLM:
    """A tiny random LlamaForCausalLM saved to ``folder`` (sharded into files of at most ``shard``; ``rope``: its
    ``rope_parameters``, e.g. ``LLAMA3``)."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=SEQ,
                      rope_theta=5000.0, rms_norm_eps=1e-5, tie_word_embeddings=tie,
                      **({"rope_parameters": rope} if rope else {}))
    model = LlamaForCausalLM(cfg).eval()
    _randomise(model, seed)
    if shard:
        model.save_pretrained(folder, max_shard_size=shard)
    else:
        model.save_pretrained(folder)
    return model


def our_model(cfg: ModelConfig, seed: int = 0) -> Llama:
    model = build_model(cfg, seed).eval()
    _randomise(model, seed)
    return model


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logit_diff(ours: torch.nn.Module, hf: LlamaForCausalLM, x: torch.Tensor) -> float:
    return (ours(x) - hf(x).logits).abs().max().item()


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


LAYOUTS = {  # name: (tie, kv_heads, shard)
    "gqa-single": (False, 2, None),
    "gqa-tied-sharded": (True, 2, "20KB"),
    "mha-tied-single": (True, 4, None),
    "gqa-sharded": (False, 1, "20KB"),
}


# ----------------------------------------------------------------------------- import


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_import_gives_transformers_logits(tmp_path, layout):
    tie, kv_heads, shard = LAYOUTS[layout]
    hf = hf_llama(tmp_path, tie=tie, kv_heads=kv_heads, shard=shard)
    assert (tmp_path / "model.safetensors.index.json").is_file() == bool(shard)
    if shard:
        assert len(list(tmp_path.glob("*.safetensors"))) > 2
    src = HFSource(tmp_path)
    assert (src.cfg.n_kv_heads, src.cfg.tie_embeddings, src.cfg.ffn_hidden, src.cfg.rope_theta) == \
           (kv_heads, tie, 48, 5000.0)
    model = Llama(src.cfg).eval()
    load_full(model, src)
    assert logit_diff(model, hf, tokens()) <= LOGIT_ATOL


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_heads_wider_than_hidden_over_heads_import_and_export_with_transformers_logits(tmp_path, arch):
    """A config.json whose ``head_dim`` is not hidden_size / num_attention_heads (16 against 32 / 4, as Qwen3-0.6B's
    128 against 1024 / 16, or Mistral-Nemo's 128 against 5120 / 32): imported as ``model.head_size``, our logits are
    transformers' within LOGIT_ATOL, and exported (as a Llama), transformers reads the same heads back."""
    config, model = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM)}[arch]
    cfg = config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=SEQ, rope_theta=5000.0,
                 rms_norm_eps=1e-5, **({"sliding_window": None} if arch == "mistral" else {}))
    hf = model(cfg).eval()
    _randomise(hf, 0)
    hf.save_pretrained(tmp_path / "in")
    src = HFSource(tmp_path / "in")
    assert (src.cfg.head_size, src.cfg.head_dim, src.cfg.d_model) == (16, 16, 32)
    model = Llama(src.cfg).eval()
    load_full(model, src)
    assert logit_diff(model, hf, tokens()) <= LOGIT_ATOL
    out = export_hf(state_source(model), src.cfg, tmp_path / "out")
    again = LlamaForCausalLM.from_pretrained(out).eval()
    assert again.config.head_dim == 16 and logit_diff(model, again, tokens()) <= LOGIT_ATOL
    assert hf_model_config(out) == src.cfg


def test_llama3_rope_scaling_imports_and_exports_with_transformers_logits(tmp_path):
    """Llama 3.1+'s ``rope_type: llama3`` (every Llama 3.1, 3.2 and 3.3 checkpoint): imported, our logits are
    transformers' within LOGIT_ATOL; without the scaling (the same weights, rope_scaling none) they are not, so the
    scaling is what makes them equal; exported again, transformers reads the same rope parameters back and gives
    the same logits. Both config layouts: transformers 5's ``rope_parameters`` and 4's ``rope_scaling``."""
    import dataclasses

    hf = hf_llama(tmp_path / "in", rope=LLAMA3)
    src = HFSource(tmp_path / "in")
    assert (src.cfg.rope_scaling, src.cfg.rope_factor, src.cfg.rope_low_freq_factor, src.cfg.rope_high_freq_factor,
            src.cfg.rope_original_max_len, src.cfg.rope_theta) == ("llama3", 8.0, 1.0, 4.0, 64, 5000.0)
    model = Llama(src.cfg).eval()
    load_full(model, src)
    assert logit_diff(model, hf, tokens()) <= LOGIT_ATOL
    plain = Llama(dataclasses.replace(src.cfg, rope_scaling="none")).eval()
    load_full(plain, src)
    assert logit_diff(plain, hf, tokens()) > 1e-2

    out = export_hf(state_source(model), src.cfg, tmp_path / "out")
    again = LlamaForCausalLM.from_pretrained(out).eval()
    assert {k: again.config.rope_parameters[k] for k in LLAMA3} == LLAMA3
    assert logit_diff(model, again, tokens()) <= LOGIT_ATOL
    c = json.loads((out / "config.json").read_text())  # transformers 4 reads rope_scaling, with rope_theta beside it
    c.pop("rope_parameters")
    (out / "config.json").write_text(json.dumps(c))
    assert c["rope_scaling"]["rope_type"] == "llama3" and hf_model_config(out) == src.cfg


def test_a_mistral_without_a_sliding_window_imports_as_a_llama(tmp_path):
    """MistralForCausalLM (v0.2 and later: no sliding window) names its tensors as Llama does: imported, our
    logits are transformers' within LOGIT_ATOL."""
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, rope_theta=5000.0,
                        rms_norm_eps=1e-5, sliding_window=None)
    hf = MistralForCausalLM(cfg).eval()
    _randomise(hf, 0)
    hf.save_pretrained(tmp_path)
    src = HFSource(tmp_path)
    model = Llama(src.cfg).eval()
    load_full(model, src)
    assert logit_diff(model, hf, tokens()) <= LOGIT_ATOL


def test_a_mistral_with_a_sliding_window_imports_generates_and_exports_with_transformers_logits(tmp_path):
    """Mistral 7B v0.1's kind of config: a sliding window (here 16 of 64 positions) on every layer. It imports as
    ``model.sliding_window``, and over all 64 positions our logits are transformers' (LOGIT_ATOL); the same weights
    without the window are not (the control). Greedy generation from a 10-token prompt for 30 tokens (the KV cache
    masking keys further back than the window) gives transformers' tokens. Exported, it is a MistralForCausalLM with
    the window and the same logits."""
    import dataclasses

    from meshtrain.generate import generate
    from meshtrain.parallel.next_token import VocabSlice

    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, rope_theta=5000.0,
                        rms_norm_eps=1e-5, sliding_window=16)
    hf = MistralForCausalLM(cfg).eval()
    _randomise(hf, 0)
    hf.save_pretrained(tmp_path / "in")
    src = HFSource(tmp_path / "in")
    assert src.cfg.sliding_window == 16
    model = Llama(src.cfg).eval()
    load_full(model, src)
    x = tokens()
    assert logit_diff(model, hf, x) <= LOGIT_ATOL
    full = Llama(dataclasses.replace(src.cfg, sliding_window=0)).eval()
    load_full(full, src)
    assert logit_diff(full, hf, x) > 1e-2
    prompt = x[0, :10].tolist()
    with torch.no_grad():
        theirs = hf.generate(x[:1, :10], max_new_tokens=30, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, 10:].tolist()
    assert generate(model, [prompt], 30, VocabSlice.whole(VOCAB)).tokens == [theirs]
    export_hf(state_source(model), src.cfg, tmp_path / "out")
    again = MistralForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(again).__name__ == "MistralForCausalLM" and again.config.sliding_window == 16
    assert HFSource(tmp_path / "out").cfg.sliding_window == 16
    assert logit_diff(model, again, x) <= LOGIT_ATOL


def hf_gemma(folder: Path, seed: int = 0, **fields) -> GemmaForCausalLM:
    """A tiny random GemmaForCausalLM saved to ``folder``, shaped as Gemma 2B: one kv head, heads wider than hidden /
    heads (16 over 32 / 4, as 256 over 2048 / 8), tied embeddings; norm weights N(0, 0.2) around Gemma's 1 + 0."""
    cfg = GemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=SEQ,
                      rope_theta=5000.0, rms_norm_eps=1e-6, **fields)
    model = _random_gemma(GemmaForCausalLM(cfg), seed)
    model.save_pretrained(folder)
    return model


def _random_gemma(model: GemmaForCausalLM, seed: int = 0) -> GemmaForCausalLM:
    """``_randomise``'s weights for a Gemma: every tensor N(0, 0.2), so that its norms, which scale by 1 + weight,
    scale by 1 + N(0, 0.2) as the other architectures' do here."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


@pytest.mark.parametrize("legacy", [False, True])
def test_gemma_imports_generates_and_exports_with_transformers_logits(tmp_path, legacy):
    """A Gemma folder imports as our model with a scaled embedding, GeGLU and norms scaled by 1 + weight: our logits
    are transformers' (LOGIT_ATOL) over 64 positions, and greedy generation of 30 tokens gives its tokens. Each of
    the three (the embedding's sqrt(hidden) scale, the tanh GELU, the norms' offset of one) moves the logits when
    left out. Exported again it is a GemmaForCausalLM that transformers loads with the same logits, its norm weights
    HF's own. ``legacy``: the config.json of Gemma's first releases, hidden_act "gelu" meaning the tanh GELU."""
    import dataclasses

    from meshtrain.generate import generate
    from meshtrain.parallel.next_token import VocabSlice

    hf = hf_gemma(tmp_path / "in")
    if legacy:
        _edit_config(tmp_path / "in", hidden_act="gelu", hidden_activation=None)
    src = HFSource(tmp_path / "in")
    c = src.cfg
    assert (c.embed_scale, c.mlp_activation, c.tie_embeddings, c.kv_heads, c.head_size) == \
        (True, "gelu_tanh", True, 1, 16)
    model = Llama(c).eval()
    load_full(model, src)
    x = tokens()
    assert logit_diff(model, hf, x) <= LOGIT_ATOL
    for control in (dict(embed_scale=False), dict(mlp_activation="silu")):
        other = Llama(dataclasses.replace(c, **control)).eval()
        load_full(other, src)
        assert logit_diff(other, hf, x) > 1e-2, control
    with torch.no_grad():
        norm = model.layers["1"].ffn_norm.weight
        norm.sub_(1.0)  # HF's stored weight, without the offset
        assert logit_diff(model, hf, x) > 1e-2
        norm.add_(1.0)
    prompt = x[0, :10].tolist()
    with torch.no_grad():
        theirs = hf.generate(x[:1, :10], max_new_tokens=30, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, 10:].tolist()
    assert generate(model, [prompt], 30, VocabSlice.whole(VOCAB)).tokens == [theirs]

    out = export_hf(state_source(model), c, tmp_path / "out")
    again = GemmaForCausalLM.from_pretrained(out).eval()
    assert (again.config.model_type, again.config.hidden_act, again.config.tie_word_embeddings) == \
        ("gemma", "gelu_pytorch_tanh", True)
    assert logit_diff(model, again, x) <= LOGIT_ATOL
    assert hf_model_config(out) == c
    stored = hf_tensors(out)["model.layers.1.post_attention_layernorm.weight"]
    assert torch.allclose(stored, hf.model.layers[1].post_attention_layernorm.weight, atol=1e-7)


def hf_mixtral(folder: Path, seed: int = 0, window: int | None = None) -> MixtralForCausalLM:
    """A tiny random MixtralForCausalLM (4 experts, 2 per token; a sliding ``window`` if given) saved to ``folder``,
    in the hub's per-expert layout (transformers 5 fuses the experts in memory and writes them back apart)."""
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=SEQ, rope_theta=5000.0, rms_norm_eps=1e-5, router_aux_loss_coef=0.02,
                        sliding_window=window)
    model = MixtralForCausalLM(cfg).eval()
    _randomise(model, seed)
    model.save_pretrained(folder)
    return model


def test_a_mixtral_with_a_sliding_window_imports_and_exports_with_transformers_logits(tmp_path):
    """Mixtral's first release set Mistral 7B v0.1's window: a Mixtral with a window of 16 over 64 positions imports
    with it over our mixture of experts, gives transformers' logits over all 64 (without the window: not), and exports
    it back."""
    import dataclasses

    hf = hf_mixtral(tmp_path / "in", window=16)
    src = HFSource(tmp_path / "in")
    assert (src.cfg.sliding_window, src.cfg.moe_experts) == (16, 4)
    model, full = Llama(src.cfg).eval(), Llama(dataclasses.replace(src.cfg, sliding_window=0)).eval()
    load_full(model, src)
    load_full(full, src)
    assert logit_diff(model, hf, tokens()) <= LOGIT_ATOL < 1e-2 < logit_diff(full, hf, tokens())
    export_hf(state_source(model), src.cfg, tmp_path / "out")
    again = MixtralForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert again.config.sliding_window == 16 and logit_diff(model, again, tokens()) <= LOGIT_ATOL


def test_mixtral_imports_and_exports_with_transformers_logits(tmp_path):
    """A Mixtral folder imports as our MoE with renormalised gates (``model.moe_renormalize``): our logits are
    transformers' within LOGIT_ATOL, and with Switch's gates (the same weights, not renormalised) they are not.
    Exported again it is a MixtralForCausalLM that transformers loads with the same logits and the same
    config (the load-balancing coefficient back in Mixtral's scale)."""
    import dataclasses

    hf = hf_mixtral(tmp_path / "in")
    src = HFSource(tmp_path / "in")
    c = src.cfg
    assert (c.moe_experts, c.moe_top_k, c.moe_renormalize, c.expert_hidden, c.moe_shared_experts,
            c.moe_capacity_factor) == (4, 2, True, 48, 0, 0.0)
    assert c.moe_aux_loss_coef == pytest.approx(0.04)  # 0.02 over the k = 2 choices: ours sums to 1, theirs to k
    assert "layers.1.feed_forward.experts.3.w2.weight" in src.tensors
    model = Llama(c).eval()
    load_full(model, src)
    assert logit_diff(model, hf, tokens()) <= LOGIT_ATOL
    switch = Llama(dataclasses.replace(c, moe_renormalize=False)).eval()
    load_full(switch, src)
    assert logit_diff(switch, hf, tokens()) > 1e-2

    out = export_hf(state_source(model), c, tmp_path / "out")
    again = MixtralForCausalLM.from_pretrained(out).eval()
    assert (again.config.num_local_experts, again.config.num_experts_per_tok) == (4, 2)
    assert again.config.router_aux_loss_coef == pytest.approx(0.02)
    assert logit_diff(model, again, tokens()) <= LOGIT_ATOL
    assert hf_model_config(out) == c


def hf_qwen2(folder: Path, seed: int = 0, **fields) -> Qwen2ForCausalLM:
    """A tiny random Qwen2ForCausalLM (tied, as Qwen2.5's smaller models; its q, k, v biases random too) saved to
    ``folder``, its config as the hub's: a sliding window set and switched off."""
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, rope_theta=5000.0,
                      rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False, sliding_window=16,
                      **fields)
    model = Qwen2ForCausalLM(cfg).eval()
    _randomise(model, seed)
    model.save_pretrained(folder)
    return model


def test_qwen2_imports_and_exports_with_transformers_logits(tmp_path):
    """A Qwen2 folder imports as our model with ``model.qkv_bias``: our logits are transformers' within LOGIT_ATOL.
    The q and k biases are permuted as their weights' rows (RoPE's layouts): left in HF's order, or dropped, the
    logits differ. Exported again it is a Qwen2ForCausalLM that transformers loads with the same logits."""
    hf = hf_qwen2(tmp_path / "in")
    src = HFSource(tmp_path / "in")
    c = src.cfg
    assert (c.qkv_bias, c.tie_embeddings, c.n_kv_heads, c.norm_eps) == (True, True, 2, 1e-6)
    model = Llama(c).eval()
    load_full(model, src)
    assert logit_diff(model, hf, tokens()) <= LOGIT_ATOL
    with torch.no_grad():  # the controls: each must move the logits
        attn = model.layers["1"].attention
        q_bias = attn.wq.bias.clone()
        attn.wq.bias.copy_(interleaved_to_halves(q_bias, c.n_heads))  # HF's row order, not ours
        assert logit_diff(model, hf, tokens()) > 1e-2
        attn.wq.bias.zero_()
        assert logit_diff(model, hf, tokens()) > 1e-2
        attn.wq.bias.copy_(q_bias)
    assert logit_diff(model, hf, tokens()) <= LOGIT_ATOL

    out = export_hf(state_source(model), c, tmp_path / "out")
    again = Qwen2ForCausalLM.from_pretrained(out).eval()
    assert again.config.model_type == "qwen2" and again.config.use_sliding_window is False
    assert logit_diff(model, again, tokens()) <= LOGIT_ATOL
    assert hf_model_config(out) == c
    assert torch.equal(hf_tensors(out)["model.layers.0.self_attn.k_proj.bias"],
                       hf.model.layers[0].self_attn.k_proj.bias.detach())


def hf_qwen3(folder: Path, seed: int = 0, **fields) -> Qwen3ForCausalLM:
    """A tiny random Qwen3ForCausalLM saved to ``folder``: tied, heads 16 wide over hidden 32 / 4 heads (as
    Qwen3-0.6B's 128 over 1024 / 16), its q and k norms' scales random too; the hub's window set and off."""
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=SEQ,
                      rope_theta=5000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                      sliding_window=16, **fields)
    model = Qwen3ForCausalLM(cfg).eval()
    _randomise(model, seed)
    model.save_pretrained(folder)
    return model


def test_qwen3_imports_and_exports_with_transformers_logits(tmp_path):
    """A Qwen3 folder imports as our model with ``model.qk_norm`` and ``model.head_size``: our logits are
    transformers' within LOGIT_ATOL. The q and k norms' scales are permuted as a head's rows (RoPE's layouts): left in
    HF's order, or reset to one, the logits differ. Exported again it is a Qwen3ForCausalLM that transformers loads
    with the same logits."""
    hf = hf_qwen3(tmp_path / "in")
    src = HFSource(tmp_path / "in")
    c = src.cfg
    assert (c.qk_norm, c.qkv_bias, c.head_size, c.tie_embeddings, c.norm_eps) == (True, False, 16, True, 1e-6)
    model = Llama(c).eval()
    load_full(model, src)
    assert logit_diff(model, hf, tokens()) <= LOGIT_ATOL
    with torch.no_grad():  # the controls: each must move the logits
        norm = model.layers["0"].attention.k_norm.weight
        scale = norm.clone()
        norm.copy_(interleaved_to_halves(scale, 1))  # HF's order, not ours
        assert logit_diff(model, hf, tokens()) > 1e-2
        norm.fill_(1.0)
        assert logit_diff(model, hf, tokens()) > 1e-2
        norm.copy_(scale)
    assert logit_diff(model, hf, tokens()) <= LOGIT_ATOL

    out = export_hf(state_source(model), c, tmp_path / "out")
    again = Qwen3ForCausalLM.from_pretrained(out).eval()
    assert (again.config.model_type, again.config.head_dim, again.config.attention_bias) == ("qwen3", 16, False)
    assert logit_diff(model, again, tokens()) <= LOGIT_ATOL
    assert hf_model_config(out) == c


@pytest.mark.parametrize("renormalize", [True, False])
def test_qwen3_moe_imports_and_exports_with_transformers_logits(tmp_path, renormalize):
    """A Qwen3-MoE folder imports as our mixture of experts with Qwen3's attention: the top-k gates renormalised
    where its ``norm_topk_prob`` says (the released models; transformers' default does not), the experts' hidden
    size its ``moe_intermediate_size``. Our logits are transformers' within LOGIT_ATOL; with the other gating (the
    same weights) they are not. Exported again it is a Qwen3MoeForCausalLM with the same logits and config."""
    import dataclasses

    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=renormalize, max_position_embeddings=SEQ,
                         rope_theta=5000.0, rms_norm_eps=1e-6, router_aux_loss_coef=0.02)
    hf = Qwen3MoeForCausalLM(cfg).eval()
    _randomise(hf, 0)
    hf.save_pretrained(tmp_path / "in")
    src = HFSource(tmp_path / "in")
    c = src.cfg
    assert (c.moe_experts, c.moe_top_k, c.moe_renormalize, c.expert_hidden, c.qk_norm, c.head_size) == \
           (4, 2, renormalize, 24, True, 16)
    assert c.moe_aux_loss_coef == pytest.approx(0.04)  # 0.02 over the k = 2 choices, as Mixtral's
    assert "layers.1.feed_forward.experts.3.w2.weight" in src.tensors
    model = Llama(c).eval()
    load_full(model, src)
    assert logit_diff(model, hf, tokens()) <= LOGIT_ATOL
    other = Llama(dataclasses.replace(c, moe_renormalize=not renormalize)).eval()
    load_full(other, src)
    assert logit_diff(other, hf, tokens()) > 1e-2

    out = export_hf(state_source(model), c, tmp_path / "out")
    again = Qwen3MoeForCausalLM.from_pretrained(out).eval()
    assert (again.config.num_experts, again.config.norm_topk_prob) == (4, renormalize)
    assert again.config.router_aux_loss_coef == pytest.approx(0.02)
    assert logit_diff(model, again, tokens()) <= LOGIT_ATOL
    assert hf_model_config(out) == c


@pytest.mark.parametrize("options, says", [
    (dict(qkv_bias=True, moe_experts=4, moe_renormalize=True),
     "model.qkv_bias=true with model.moe_experts: this model has no HuggingFace form"),
    (dict(qk_norm=True, moe_experts=4, moe_shared_experts=1),
     "model.moe_shared_experts=1: this mixture of experts has no HuggingFace form (Qwen3-MoE"),
    (dict(qkv_bias=True, qk_norm=True), "model.qkv_bias=true with model.qk_norm=true: this model has no HuggingFace"),
    (dict(embed_scale=True, sliding_window=8), "model.embed_scale=true with model.sliding_window=8: this model has no "
                                               "HuggingFace form (Gemma"),
])
def test_attention_options_no_hf_architecture_computes_are_refused_on_export(tmp_path, options, says):
    cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_heads=4, **options)
    with pytest.raises(ValueError, match=re.escape(says)):
        export_hf(state_source(build_model(cfg, 0)), cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # CLI subprocess runs
def test_the_layout_is_checked_against_the_init_from_model_not_the_presets(tmp_path):
    """``train.init_from``'s config.json replaces the model section, so ``parallel.ep=2`` is checked against the
    Mixtral's 4 experts (the tiny preset has none, which was refused before any process started); a layout that
    model cannot take is still refused there, in one line."""
    hf_mixtral(tmp_path / "hf")
    args = ["train", "--config", "tiny", f"train.init_from={tmp_path / 'hf'}", "data.source=synthetic",
            "--nproc", "2", "--dry-run", "--out", str(tmp_path / "run")]
    ok = _meshtrain(*args, "parallel.ep=2")
    assert ok.returncode == 0 and "torch.distributed.run" in ok.stdout and "parallel.ep=2" in ok.stdout, ok.stderr
    bad = _meshtrain(*args, "parallel.ep=3")
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 1 and "parallel.ep=3 must divide model.moe_experts=4" in lines[0], \
        bad.stderr


@pytest.mark.parametrize("option, says", [
    ({"moe_renormalize": False}, "model.moe_renormalize=false: this mixture of experts has no HuggingFace form"),
    ({"moe_shared_experts": 1}, "model.moe_shared_experts=1: this mixture of experts has no HuggingFace form"),
    ({"moe_bias_update_rate": 0.01}, "Mixtral selects experts by probability alone"),
])
def test_an_moe_mixtral_cannot_compute_is_refused_before_any_file_is_written(tmp_path, option, says):
    fields = {"moe_renormalize": True, **option}
    cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=SEQ,
                      moe_experts=4, **fields)
    with pytest.raises(ValueError, match=says):
        export_hf(state_source(our_model(cfg)), cfg, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_without_the_rope_permutation_the_logits_differ(tmp_path):
    """The test above can fail: HF's q/k rows loaded as they are (no permutation) give other logits."""
    hf = hf_llama(tmp_path)
    src = HFSource(tmp_path)
    raw = hf_tensors(tmp_path)
    model = Llama(src.cfg).eval()
    load_full(model, DictSource({ours: raw[t.hf_name] for ours, t in src.tensors.items()}))
    assert logit_diff(model, hf, tokens()) > 1e-2


def test_rope_permutations_are_inverse_and_match_hf_conversion():
    w = torch.randn(4 * 8, 5)
    assert torch.equal(halves_to_interleaved(interleaved_to_halves(w, 4), 4), w)
    # HF's convert_llama_weights_to_hf permute(), written out: Meta (interleaved) -> HF (halves).
    hf = w.view(4, 8 // 2, 2, 5).transpose(1, 2).reshape(32, 5)
    assert torch.equal(interleaved_to_halves(w, 4), hf)
    # Our row 2j+p of head h is HF's row p*4+j of that head.
    h, j, p = 2, 3, 1
    assert torch.equal(interleaved_to_halves(w, 4)[h * 8 + p * 4 + j], w[h * 8 + 2 * j + p])


def test_box_reads_equal_the_full_read(tmp_path):
    hf_llama(tmp_path, shard="20KB")
    src = HFSource(tmp_path)
    g = torch.Generator().manual_seed(0)
    for key in src.tensors:
        shape = src.shape(key)
        full = src.read(key, tuple((0, n) for n in shape))
        for _ in range(6):
            box = []
            for n in shape:
                a, b = sorted(torch.randint(0, n + 1, (2,), generator=g).tolist())
                box.append((a, max(b, a + 1)) if a < n else (n - 1, n))
            box = tuple(box)
            got = src.read(key, box)
            assert torch.equal(got, full[relative(box, tuple((0, n) for n in shape))]), (key, box)
    with pytest.raises(ValueError, match="outside"):
        src.read("norm.weight", ((0, 33),))


def test_box_reads_touch_only_the_heads_they_need(tmp_path, monkeypatch):
    hf_llama(tmp_path)  # head_dim 8
    src = HFSource(tmp_path)
    asked = []
    inner = HFSource._slice
    monkeypatch.setattr(HFSource, "_slice", lambda self, t, box: asked.append(box) or inner(self, t, box))
    src.read("layers.0.attention.wq.weight", ((5, 7), (3, 9)))
    src.read("layers.0.attention.wk.weight", ((6, 10), (0, 32)))
    src.read("layers.1.feed_forward.w2.weight", ((1, 2), (4, 6)))
    assert asked == [((0, 8), (3, 9)), ((0, 16), (0, 32)), ((1, 2), (4, 6))]


def test_hf_model_config_maps_the_fields(tmp_path):
    hf_llama(tmp_path, tie=True)
    cfg = hf_model_config(tmp_path)
    assert (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.hidden_dim, cfg.norm_eps,
            cfg.rope_theta, cfg.max_seq_len, cfg.tie_embeddings, cfg.moe_experts) == \
           (VOCAB, 32, 2, 4, 2, 48, 1e-5, 5000.0, SEQ, True, 0)
    # The transformers 4 layout of the same fields.
    c = json.loads((tmp_path / "config.json").read_text())
    c.pop("rope_parameters")
    c.update(rope_theta=123.0, rope_scaling=None, torch_dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(c))
    assert hf_model_config(tmp_path).rope_theta == 123.0


def test_each_familys_defaults_are_transformers_for_the_fields_config_json_leaves_out(tmp_path):
    """A config.json may leave a field out; transformers then takes its config class's default, which is not
    LlamaConfig's for every family (a Mixtral's RoPE base 1e6 and eps 1e-5, a Mistral's window 4096). Our table
    equals transformers' own, and a trimmed Mixtral or Mistral config imports with them."""
    from transformers import AutoConfig

    for model_type, ours in hf_mod.FAMILY_DEFAULTS.items():
        theirs = AutoConfig.for_model(model_type)
        rope = getattr(theirs, "rope_parameters", None) or {"rope_theta": theirs.rope_theta}
        got = {k: rope["rope_theta"] if k == "rope_theta" else getattr(theirs, k) for k in ours}
        assert got == ours, (model_type, got, ours)
    trimmed = ("rope_theta", "rope_parameters", "rope_scaling", "rms_norm_eps", "sliding_window",
               "max_position_embeddings")
    for model_type, arch in (("mixtral", "MixtralForCausalLM"), ("mistral", "MistralForCausalLM")):
        hf_llama(tmp_path / model_type)
        c = json.loads((tmp_path / model_type / "config.json").read_text())
        c = {k: v for k, v in c.items() if k not in trimmed}
        c.update(model_type=model_type, architectures=[arch])
        if model_type == "mixtral":
            c.update(num_local_experts=2, num_experts_per_tok=1)
        (tmp_path / model_type / "config.json").write_text(json.dumps(c))
        cfg = hf_model_config(tmp_path / model_type)
        if model_type == "mixtral":
            assert (cfg.rope_theta, cfg.norm_eps, cfg.sliding_window) == (1e6, 1e-5, 0)
        else:
            assert (cfg.rope_theta, cfg.norm_eps, cfg.sliding_window) == (10000.0, 1e-6, 4096)


# ----------------------------------------------------------------------------- export


@pytest.mark.parametrize("tie,max_bytes", [(False, 5 * 10**9), (True, 5 * 10**9), (False, 20_000)])
def test_export_loads_in_transformers_with_our_logits(tmp_path, tie, max_bytes):
    cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ,
                      rope_theta=5000.0, tie_embeddings=tie)
    model = our_model(cfg)
    out = export_hf(state_source(model), cfg, tmp_path / "hf", max_shard_bytes=max_bytes)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    if max_bytes > 10**6:
        assert files == ["model.safetensors"] and not (out / "model.safetensors.index.json").exists()
    else:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
        for f in files:
            assert (out / f).stat().st_size <= 20_000 + 4096  # header included
    c = json.loads((out / "config.json").read_text())
    assert (c["torch_dtype"], c["vocab_size"], c["tie_word_embeddings"]) == ("float32", VOCAB, tie)
    assert ("lm_head.weight" in hf_tensors(out)) == (not tie)
    hf = LlamaForCausalLM.from_pretrained(out).eval()
    assert hf.dtype == torch.float32
    assert logit_diff(model, hf, tokens()) <= LOGIT_ATOL


@pytest.mark.parametrize("dtype, torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_export_in_half_precision_is_each_weight_rounded_once_in_half_the_bytes(tmp_path, dtype, torch_dtype):
    """``convert --dtype bf16`` (what released models ship): every stored tensor is the fp32 export's rounded once
    to the dtype, the files are half the bytes, config.json names the dtype, transformers loads it in that dtype,
    and it imports back (a half-precision folder is no quantized one)."""
    cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)
    model = our_model(cfg)
    full = export_hf(state_source(model), cfg, tmp_path / "fp32")
    half = export_hf(state_source(model), cfg, tmp_path / dtype, dtype=dtype)
    want, got = hf_tensors(full), hf_tensors(half)
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert got[name].dtype == torch_dtype and torch.equal(got[name], w.to(torch_dtype)), name
    size = (half / "model.safetensors").stat().st_size
    assert abs(2 * size - (full / "model.safetensors").stat().st_size) < 8192  # the headers differ a little
    assert json.loads((half / "config.json").read_text())["torch_dtype"] == str(torch_dtype).removeprefix("torch.")
    assert LlamaForCausalLM.from_pretrained(half).dtype == torch_dtype
    back = Llama(cfg)
    load_full(back, HFSource(half))
    for (n, p), (_, q) in zip(back.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(p, q.to(torch_dtype).float()), n


def test_an_fp16_export_refuses_a_weight_beyond_its_range(tmp_path):
    cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=4, max_seq_len=SEQ)
    tensors = dict(state_source(our_model(cfg)).tensors)
    tensors["norm.weight"] = torch.full((32,), 7e4)
    with pytest.raises(ValueError, match="norm.weight holds values up to 7e\\+04, beyond fp16's 65504"):
        export_hf(DictSource(tensors), cfg, tmp_path / "hf", dtype="fp16")
    assert not any(tmp_path.iterdir())
    export_hf(DictSource(tensors), cfg, tmp_path / "hf", dtype="bf16")  # bf16 has fp32's range


def test_an_export_killed_midway_leaves_a_folder_the_next_export_removes(tmp_path):
    """A killed export runs no cleanup: its hidden temporary folder (full-size) stays. The next export to that
    folder removes those of this host's processes that are gone, and leaves a live one's and another host's."""
    cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=SEQ)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    host = temp_folder_for(tmp_path / "hf").name.split("-", 2)[2]  # .hf.tmp-PID-HOST
    for name in (f".hf.tmp-{dead}-{host}", f".hf.tmp-{os.getppid()}-{host}", f".hf.tmp-{dead}-otherhost"):
        (tmp_path / name).mkdir()
    export_hf(state_source(our_model(cfg)), cfg, tmp_path / "hf")
    # a live process's and another host's (whose processes cannot be seen from here) stay
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f".hf.tmp-{os.getppid()}-{host}", f".hf.tmp-{dead}-otherhost", "hf"])


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_round_trip_hf_ours_hf_is_exact(tmp_path, shard, monkeypatch):
    hf_llama(tmp_path / "a", shard=shard)
    original = hf_tensors(tmp_path / "a")
    opened = []
    real_open = hf_mod.safe_open
    monkeypatch.setattr(hf_mod, "safe_open", lambda f, **kw: opened.append(f) or real_open(f, **kw))
    src = HFSource(tmp_path / "a")
    # its checks read each file's header once (a 70B folder on a shared filesystem: ~30 opens a rank, not ~720)
    files = sorted(str(f) for f in (tmp_path / "a").glob("*.safetensors"))
    assert sorted(opened) == files and (len(files) > 2) == bool(shard), opened
    opened.clear()
    model = Llama(src.cfg)
    load_full(model, src)
    # reads keep the file they are in open: a few switches between files, not one open per tensor
    assert len(opened) <= 2 * len(files) < len(src.tensors), (len(opened), len(files), len(src.tensors))
    monkeypatch.undo()
    export_hf(state_source(model), src.cfg, tmp_path / "b")  # through our model
    export_hf(src, src.cfg, tmp_path / "c", max_shard_bytes=30_000)  # straight from the folder, lazily
    for name in ("b", "c"):
        again = hf_tensors(tmp_path / name)
        assert set(again) == set(original)
        for key, t in original.items():
            assert torch.equal(again[key], t), (name, key)


def test_export_refuses_a_padded_vocabulary(tmp_path):
    cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=4, max_seq_len=SEQ)
    tensors = dict(state_source(our_model(cfg)).tensors)
    tensors["tok_embeddings.weight"] = torch.cat([tensors["tok_embeddings.weight"], torch.zeros(1, 32)])
    with pytest.raises(ValueError, match=r"tok_embeddings.weight has shape \(68, 32\).*padded for tensor"):
        export_hf(DictSource(tensors), cfg, tmp_path / "pad")
    assert not any(tmp_path.iterdir())


def test_export_is_atomic(tmp_path):
    cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=SEQ)
    good = state_source(our_model(cfg))

    class Failing:
        shape = good.shape

        def read(self, key, box):
            if key.startswith("layers.1"):
                raise OSError("disk gone")
            return good.read(key, box)

    with pytest.raises(OSError, match="disk gone"):
        export_hf(Failing(), cfg, tmp_path / "hf", max_shard_bytes=20_000)
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its temporary sibling
    (tmp_path / "hf").mkdir()  # an empty folder is fine; a non-empty one is refused
    export_hf(good, cfg, tmp_path / "hf")
    with pytest.raises(ValueError, match="already exists and is not empty"):
        export_hf(good, cfg, tmp_path / "hf")
    (tmp_path / "file").write_text("")  # an empty file is no folder, not a "non-empty" one
    with pytest.raises(ValueError, match=f"--out {tmp_path / 'file'} is a file: choose a new folder"):
        export_hf(good, cfg, tmp_path / "file")


# ----------------------------------------------------------------------------- bad folders


def _edit_config(folder: Path, **changes) -> None:
    c = json.loads((folder / "config.json").read_text())
    c.update(changes)
    (folder / "config.json").write_text(json.dumps(c))


def _drop_tensor(folder: Path) -> None:
    tensors = hf_tensors(folder)
    del tensors["model.norm.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _mixtral(folder: Path, **fields) -> None:
    """A Mixtral config.json over the folder's Llama weights (the config is read, and refused, first)."""
    fields = {"num_local_experts": 4, "num_experts_per_tok": 2, **fields}
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                        architectures=["MixtralForCausalLM"], **fields)
    cfg.save_pretrained(folder)


def _cast_tensor(folder: Path, name: str, dtype: torch.dtype) -> None:
    tensors = hf_tensors(folder)
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _edit_index(folder: Path, weight_map) -> None:
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "weight_map": weight_map}))


def _first_shard_outside(folder: Path) -> None:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    _edit_index(folder, {k: f"../{f}" for k, f in index["weight_map"].items()})


BAD = {  # name: (shard, how to break the folder, error type, what the one line must say)
    "quantized": (None, lambda f: _edit_config(f, quantization_config={"quant_method": "fp8", "weight_block_size":
                                                                       [128, 128]}),
                  ValueError, ["config.json: quantization_config is set (quant_method 'fp8')",
                               "unquantized release"]),
    "fp8-tensor": (None, lambda f: _cast_tensor(f, "model.layers.0.mlp.up_proj.weight", torch.float8_e4m3fn),
                   ValueError, ["model.safetensors: model.layers.0.mlp.up_proj.weight is stored as F8_E4M3",
                                "F32, BF16, F16 weights only"]),
    "integer-tensor": (None, lambda f: _cast_tensor(f, "model.norm.weight", torch.int64),
                       ValueError, ["model.safetensors: model.norm.weight is stored as I64"]),
    "weight-map-list": ("20KB", lambda f: _edit_index(f, []),
                        ValueError, ["model.safetensors.index.json: weight_map must map each tensor name to a file"]),
    "weight-map-outside": ("20KB", _first_shard_outside,
                           ValueError, ["model.safetensors.index.json: weight_map must map", "(no folders)"]),
    "architecture": (None, lambda f: _edit_config(f, architectures=["Gemma2ForCausalLM"], model_type="gemma2"),
                     ValueError, ["config.json: architectures is ['Gemma2ForCausalLM']", "LlamaForCausalLM",
                                  "Qwen2ForCausalLM", "GemmaForCausalLM (model_type gemma)"]),
    "activation": (None, lambda f: _edit_config(f, hidden_act="relu"),
                   ValueError, ["config.json: hidden_act is 'relu'", "silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)"]),
    "gemma-activation": (None, lambda f: _edit_config(f, architectures=["GemmaForCausalLM"], model_type="gemma",
                                                      hidden_act="gelu", hidden_activation="gelu_new"),
                         ValueError, ["config.json: hidden_activation is 'gelu_new'", "or gelu_pytorch_tanh"]),
    "gemma-bidirectional": (None, lambda f: _edit_config(f, architectures=["GemmaForCausalLM"], model_type="gemma",
                                                         use_bidirectional_attention=True),
                            ValueError, ["config.json: use_bidirectional_attention is True", "causal attention"]),
    "qwen2-without-biases": (None, lambda f: _edit_config(f, architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
                             ValueError, ["model.safetensors: tensor model.layers.0.self_attn.q_proj.bias",
                                          "(meshtrain layers.0.attention.wq.bias) is absent"]),
    "qwen2-window": (None, lambda f: _edit_config(f, architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                                                  use_sliding_window=True, sliding_window=32),
                     ValueError, ["config.json: sliding_window is 32", "at least max_position_embeddings=64"]),
    "qwen3-window": (None, lambda f: _edit_config(f, architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                                                  use_sliding_window=True, sliding_window=48),
                     ValueError, ["config.json: sliding_window is 48", "at least max_position_embeddings=64"]),
    "qwen3-without-norms": (None, lambda f: _edit_config(f, architectures=["Qwen3ForCausalLM"], model_type="qwen3"),
                            ValueError, ["model.safetensors: tensor model.layers.0.self_attn.q_norm.weight",
                                         "(meshtrain layers.0.attention.q_norm.weight) is absent"]),
    "layer-types": (None, lambda f: _edit_config(f, architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                                                 layer_types=["full_attention", "sliding_attention"]),
                    ValueError, ["config.json: layer_types is ['full_attention', 'sliding_attention']",
                                 "full_attention layers only"]),
    "mistral-window": (None, lambda f: _edit_config(f, architectures=["MistralForCausalLM"], model_type="mistral",
                                                    sliding_window=-32),
                       ValueError, ["config.json: sliding_window is -32", "null or a positive number of positions"]),
    "mistral-window-layers": (None, lambda f: _edit_config(f, architectures=["MistralForCausalLM"],
                                                           model_type="mistral", sliding_window=32,
                                                           layer_types=["full_attention", "sliding_attention"]),
                              ValueError, ["config.json: layer_types is ['full_attention', 'sliding_attention']",
                                           "the sliding window on every layer"]),
    "mixtral-top-k": (None, lambda f: _mixtral(f, num_experts_per_tok=5), ValueError,
                      ["config.json: num_experts_per_tok is 5", "at most num_local_experts=4"]),
    "mixtral-as-llama": (None, lambda f: _edit_config(f, architectures=["MixtralForCausalLM"]), ValueError,
                         ["config.json: model_type is 'llama'", "MixtralForCausalLM (model_type mixtral)"]),
    "rope-scaling": (None, lambda f: _edit_config(f, rope_parameters={"rope_type": "yarn", "rope_theta": 5e5,
                                                                      "factor": 8.0}),
                     ValueError, ["config.json: rope_parameters.rope_type is 'yarn'", "rope_type default",
                                  "or llama3"]),
    "llama3-incomplete": (None, lambda f: _edit_config(f, rope_parameters={**LLAMA3, "low_freq_factor": None}),
                          ValueError, ["config.json: rope_parameters.low_freq_factor is None",
                                       "a positive number (rope_type llama3)"]),
    "rope-scaling-v4": (None, lambda f: _edit_config(f, rope_scaling={"type": "linear", "factor": 2.0}),
                        ValueError, ["config.json: rope_scaling.rope_type is 'linear'"]),
    "attention-bias": (None, lambda f: _edit_config(f, attention_bias=True),
                       ValueError, ["config.json: attention_bias is True", "false only"]),
    "head-dim": (None, lambda f: _edit_config(f, head_dim=16),  # accepted (model.head_size), but not these weights
                 ValueError, ["q_proj.weight has shape (32, 32) but", "config.json implies (64, 32)"]),
    "odd-head-dim": (None, lambda f: _edit_config(f, head_dim=7),
                     ValueError, ["config.json: head_dim is 7", "a positive even head_dim"]),
    "missing-shard": ("20KB", lambda f: sorted(f.glob("model-*.safetensors"))[1].unlink(),
                      FileNotFoundError, ["model.safetensors.index.json names shard model-00002-of-", "missing"]),
    "absent-tensor": (None, _drop_tensor, ValueError, ["model.safetensors: tensor model.norm.weight",
                                                       "(meshtrain norm.weight) is absent"]),
    "shape-mismatch": (None, lambda f: _edit_config(f, intermediate_size=64),
                       ValueError, ["gate_proj.weight has shape (48, 32) but", "config.json implies (64, 32)"]),
    "pickle-only": (None, lambda f: (f / "model.safetensors").rename(f / "pytorch_model.bin"),
                    FileNotFoundError, ["has neither model.safetensors nor", "never pickled"]),
    "no-config": (None, lambda f: (f / "config.json").unlink(), FileNotFoundError, ["has no config.json"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_folders_get_one_line_errors(tmp_path, case):
    shard, breaks, error, says = BAD[case]
    hf_llama(tmp_path, shard=shard)
    breaks(tmp_path)
    with pytest.raises(error) as e:
        HFSource(tmp_path)
    message = str(e.value)
    assert "\n" not in message
    for part in says:
        assert part in message, (part, message)


# ----------------------------------------------------------------------------- the command line


def _meshtrain(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m meshtrain ARGS`` as a user runs it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    return subprocess.run([sys.executable, "-m", "meshtrain", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.slow
def test_python_dash_m_meshtrain_is_the_cli(tmp_path):
    r = _meshtrain("--help")
    assert r.returncode == 0 and "meshtrain convert --ckpt" in r.stdout
    r = _meshtrain("convert", "--ckpt", str(tmp_path / "nothing"), "--out", str(tmp_path / "hf"))
    assert r.returncode == 2 and r.stderr.strip() == f"error: --ckpt {tmp_path / 'nothing'} does not exist."


def _tokenizer_json(path: Path, texts: list[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=90, special_tokens=["<unk>", "</s>"]))
    tok.save(str(path))


@pytest.mark.slow
def test_convert_a_trained_checkpoint(tmp_path):
    """prepare-data with a tokenizer.json, 3 training steps and convert, all through ``python -m meshtrain``;
    transformers loads the export and gives the checkpoint's logits."""
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bad jugglers".split()
    src = tmp_path / "src"
    src.mkdir()
    texts = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(300)) for i in range(6)]
    for i, text in enumerate(texts):
        (src / f"doc{i}.txt").write_text(text)
    _tokenizer_json(tmp_path / "tokenizer.json", texts)
    r = _meshtrain("prepare-data", "--src", str(src), "--out", str(tmp_path / "data"), "--tokenizer",
                   str(tmp_path / "tokenizer.json"), "--ext", ".txt", "--val-fraction", "0.3")
    assert r.returncode == 0, r.stderr
    r = _meshtrain("train", "--config", "tiny", "--out", str(tmp_path / "run"), f"data.path={tmp_path / 'data'}",
                   "train.steps=3", "train.progress=false", "train.tensorboard=false")
    assert r.returncode == 0, r.stderr[-2000:]
    r = _meshtrain("convert", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "hf"),
                   "--max-shard-size", "30KB")
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout

    ckpt = latest_checkpoint(tmp_path / "run" / "checkpoints")
    cfg = update_from_dict(Config(), read_checkpoint_meta(ckpt)["config"]).model
    ours = Llama(cfg).eval()
    load_full(ours, CheckpointReader(ckpt))
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len), generator=torch.Generator().manual_seed(0))
    assert logit_diff(ours, hf, x) <= LOGIT_ATOL
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()
    c = json.loads((tmp_path / "hf" / "config.json").read_text())
    tok = HFTokenizer(tmp_path / "tokenizer.json")
    assert (c["vocab_size"], c["eos_token_id"]) == (tok.vocab_size, tok.eos_id) == (cfg.vocab_size, 1)  # "</s>"

    # Had it been a fine-tune (train.init_from, edited into the checkpoint's config), the model's bos/eos ids and
    # generation settings come along only where its tokenizer is the one the data spoke.
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 2]}))
    (model / "generation_config.json").write_text("{}")
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["config"]["train"]["init_from"] = str(model)
    (ckpt / "meta.json").write_text(json.dumps(meta))
    for tokenizer, copied in ((b"another tokenizer", False), ((tmp_path / "tokenizer.json").read_bytes(), True)):
        (model / "tokenizer.json").write_bytes(tokenizer)
        out = tmp_path / f"hf-{copied}"
        r = _meshtrain("convert", "--ckpt", str(ckpt), "--out", str(out))
        assert r.returncode == 0, r.stderr
        c = json.loads((out / "config.json").read_text())
        assert ((c["bos_token_id"], c["eos_token_id"]) == (0, [1, 2])) == copied, c
        assert (out / "generation_config.json").is_file() == copied
        assert ("has another tokenizer than the data this run trained on" in r.stdout) == (not copied), r.stdout


def _fine_tune(rank: int, world_size: int, out: str, overrides: list[str]) -> list[float]:
    from meshtrain.config import load_config
    from meshtrain.train.trainer import Trainer

    cfg = load_config("tiny", ["data.source=synthetic", "train.steps=3", "train.seq_len=32", "train.global_batch=8",
                               "train.warmup_steps=1", "train.sample_tokens=0", "train.progress=false",
                               "train.tensorboard=false", "train.peak_flops=1e11", *overrides],
                      check=False)  # the Trainer takes the HF model, then checks the layout against it
    return [r["loss"] for r in Trainer(cfg, out).train()]


def _one_process_starts_at_transformers_loss(hf: torch.nn.Module, init: list[str],
                                             tmp_path: Path) -> tuple[list[float], torch.Tensor]:
    """``_fine_tune`` on one process from the HF folder: its losses, after checking the first is transformers'
    loss on the same batch (1e-5 relative); and that batch's inputs."""
    from meshtrain.train.data import SyntheticDataset

    one = _fine_tune(0, 1, str(tmp_path / "one"), init)
    x, y = SyntheticDataset(257, "train").batch(0, 0, 8, 32)
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    assert one[0] == pytest.approx(want, rel=1e-5)
    return one, x


def _fine_tune_and_export(tmp_path: Path, hf: torch.nn.Module, world: int, layout: list[str],
                          shard: str | None = None) -> tuple[Llama, torch.nn.Module, torch.Tensor]:
    """The HF model ``hf`` saved (sharded into files of at most ``shard``) -> ``train.init_from`` on one process,
    whose first loss must be transformers' on the same batch (``_one_process_starts_at_transformers_loss``); then
    ``layout`` on ``world`` ranks, whose every rank's losses must be that process's (1e-5 relative); then ``meshtrain
    convert`` of that run, loaded by transformers as ``hf``'s class, whose logits must be the checkpoint's
    (LOGIT_ATOL), and differ from ``hf``'s (it trained). Returns (ours from the checkpoint, the export, the batch)."""
    from meshtrain.testing.spawn import spawn

    folder = tmp_path / "hf"
    hf.config.bos_token_id, hf.config.eos_token_id = 3, [4, 5]  # an instruct model: two ids end a turn
    hf.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    init = [f"train.init_from={folder}"]
    one, x = _one_process_starts_at_transformers_loss(hf, init, tmp_path)
    for losses in spawn(_fine_tune, world, args=(str(tmp_path / "run"), [*init, *layout]), timeout=300):
        assert losses == pytest.approx(one, rel=1e-5)

    r = _meshtrain("convert", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "export"))
    assert r.returncode == 0 and f" ({type(hf).__name__}, " in r.stdout, (r.stdout, r.stderr)  # it says what it wrote
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (3, [4, 5])  # the fine-tuned model's, kept
    for name in ("generation_config.json", "tokenizer_config.json"):  # its generation and chat settings too
        assert (tmp_path / "export" / name).read_bytes() == (folder / name).read_bytes(), name
    tuned = type(hf).from_pretrained(tmp_path / "export").eval()
    ckpt = latest_checkpoint(tmp_path / "run" / "checkpoints")
    ours = Llama(update_from_dict(Config(), read_checkpoint_meta(ckpt)["config"]).model).eval()
    load_full(ours, CheckpointReader(ckpt))
    assert logit_diff(ours, tuned, x) <= LOGIT_ATOL
    assert logit_diff(ours, hf, x) > 1e-3  # it did train
    return ours, tuned, x


def _random(model: torch.nn.Module) -> torch.nn.Module:
    _randomise(model, 0)
    return model.eval()


@pytest.mark.slow
def test_import_fine_tune_in_parallel_and_export(tmp_path):
    """An HF Llama folder (sharded) fine-tuned on tp2 x dp2 ZeRO-1 (4 ranks, each reading only its pieces; the
    257-token vocabulary padded to 258 for tp) and exported (``_fine_tune_and_export``): transformers loads 257 rows
    (no padding leaks)."""
    cfg = LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5)
    _, tuned, _ = _fine_tune_and_export(tmp_path, _random(LlamaForCausalLM(cfg)), 4,
                                        ["parallel.tp=2", "parallel.zero=1"], shard="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert tuned.model.embed_tokens.weight.shape[0] == 257 and tuned.lm_head.weight.shape[0] == 257


@pytest.mark.slow
def test_a_mixtral_fine_tunes_with_expert_parallelism_and_exports(tmp_path):
    """A Mixtral folder fine-tuned at ep=2 over dp=2 (each rank reading only its two experts) and exported as a
    MixtralForCausalLM (``_fine_tune_and_export``)."""
    cfg = MixtralConfig(vocab_size=257, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5)
    ours, _, _ = _fine_tune_and_export(tmp_path, _random(MixtralForCausalLM(cfg)), 2, ["parallel.ep=2"])
    assert ours.cfg.moe_renormalize


@pytest.mark.slow
def test_a_qwen3_fine_tunes_with_tensor_parallelism_and_exports(tmp_path):
    """A Qwen3 folder (q and k norms, heads 16 wide over hidden 32 / 4) fine-tuned at tp=2 x dp=2 with SP and ZeRO-1
    (each rank holding the norms' scales whole, their gradients summed over tp) and exported as a Qwen3ForCausalLM
    (``_fine_tune_and_export``)."""
    cfg = Qwen3Config(vocab_size=257, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rope_theta=5000.0,
                      rms_norm_eps=1e-6, tie_word_embeddings=True)
    ours, _, _ = _fine_tune_and_export(tmp_path, _random(Qwen3ForCausalLM(cfg)), 4,
                                       ["parallel.tp=2", "parallel.sp=true", "parallel.zero=1"])
    assert ours.cfg.qk_norm and ours.cfg.head_size == 16


@pytest.mark.slow
def test_a_gemma_fine_tunes_with_tensor_and_context_parallelism_and_exports(tmp_path):
    """A Gemma folder (scaled embedding, GeGLU, norms of 1 + weight, one kv head 16 wide shared by both tp ranks, tied
    embeddings) fine-tuned at tp2 x cp2 with SP (the embedding scaled on each rank's sequence shard) and exported as
    a GemmaForCausalLM (``_fine_tune_and_export``). Gemma ties its embeddings, which pipelines refuse."""
    cfg = GemmaConfig(vocab_size=257, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=64, rope_theta=5000.0,
                      rms_norm_eps=1e-6)
    ours, _, _ = _fine_tune_and_export(tmp_path, _random_gemma(GemmaForCausalLM(cfg)), 4,
                                       ["parallel.tp=2", "parallel.sp=true", "parallel.cp=2"])
    assert ours.cfg.embed_scale and ours.cfg.mlp_activation == "gelu_tanh" and ours.cfg.tie_embeddings


@pytest.mark.slow
def test_a_qwen3_moe_fine_tunes_with_tensor_and_expert_parallelism_and_exports(tmp_path):
    """A Qwen3-MoE folder (q and k norms, 4 experts, top-2 renormalised) fine-tuned at tp2 x ep2 (4 ranks: the
    attention split over tp, each ep rank reading its two experts) and exported as a Qwen3MoeForCausalLM
    (``_fine_tune_and_export``)."""
    cfg = Qwen3MoeConfig(vocab_size=257, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                         num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64, rope_theta=5000.0,
                         rms_norm_eps=1e-6)
    ours, _, _ = _fine_tune_and_export(tmp_path, _random(Qwen3MoeForCausalLM(cfg)), 4,
                                       ["parallel.tp=2", "parallel.ep=2"])
    assert ours.cfg.qk_norm and ours.cfg.moe_renormalize


@pytest.mark.slow
def test_a_qwen2_fine_tunes_with_tensor_parallelism_and_exports(tmp_path):
    """A Qwen2 folder (random q, k, v biases) fine-tuned at tp=4 with its 2 kv heads (each rank reads its query
    heads' bias rows, and a kv head's bias is shared by two ranks, its gradient summed over them) and exported as a
    Qwen2ForCausalLM (``_fine_tune_and_export``); the biases trained too."""
    cfg = Qwen2Config(vocab_size=257, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, use_sliding_window=False, sliding_window=64)
    hf = _random(Qwen2ForCausalLM(cfg))
    ours, _, _ = _fine_tune_and_export(tmp_path, hf, 4, ["parallel.tp=4"])
    biases = (ours.layers["0"].attention.wv.bias, hf.model.layers[0].self_attn.v_proj.bias)  # v: not permuted
    assert ours.cfg.qkv_bias and (biases[0] - biases[1]).abs().max() > 1e-4


def _greedy_case(tmp_path: Path, arch: str = "llama") -> tuple[Path, str, str]:
    """An HF Llama folder (a Qwen2 one with its q, k, v biases, or a Qwen3 one with its q and k norms and heads 16
    wide over hidden 32 / 4, for ``arch``) with its tokenizer.json, a
    prompt, and what ``meshtrain generate --greedy --tokens 12`` must print: the prompt and the tokens transformers'
    own greedy ``generate`` gives, decoded. The folder's
    config.json lists two end tokens, as Llama 3.1's instruct models do: an id greedy decoding never makes, and
    the one it makes fourth or later (first time), so the row must end just before it (theirs ends with it)."""
    from tokenizers import Tokenizer, processors

    from meshtrain.train.tokenizer import HFTokenizer

    folder = tmp_path / "hf"
    folder.mkdir()
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bad jugglers".split()
    _tokenizer_json(folder / "tokenizer.json", [" ".join(words[i:] + words[:i]) for i in range(len(words))])
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))  # Llama's way: a beginning-of-text token first
    raw.post_processor = processors.TemplateProcessing(single="<unk> $A", special_tokens=[("<unk>", 0)])
    raw.save(str(folder / "tokenizer.json"))
    tok = HFTokenizer(folder / "tokenizer.json")
    config, model = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                     "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    cfg = config(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, rope_theta=5000.0,
                 rms_norm_eps=1e-5, **({"head_dim": 16} if arch == "qwen3" else {}))
    hf = model(cfg).eval()
    _randomise(hf, 0)
    prompt = "the quick brown fox"
    ids = tok.encode_prompt(prompt)
    assert ids[0] == 0 and ids[1:] == tok.encode(prompt)  # as transformers' tokenizer(prompt) gives them
    x = torch.tensor([ids])
    run = {"max_new_tokens": 12, "do_sample": False, "attention_mask": torch.ones_like(x),  # no padding to infer
           "pad_token_id": tok.eos_id}
    with torch.no_grad():  # no end token: the whole greedy path
        path = hf.generate(x, eos_token_id=None, **run)[0, len(ids):].tolist()
    cut = next(i for i in range(3, len(path)) if path[i] not in path[:i])
    unused = next(t for t in range(2, tok.vocab_size) if t not in path)  # not <unk> (the BOS here) nor </s>
    hf.config.eos_token_id = hf.generation_config.eos_token_id = [unused, path[cut]]
    hf.save_pretrained(folder)
    with torch.no_grad():  # transformers, reading the folder's end tokens, stops there too
        again = hf.generate(x, **run)[0, len(ids):].tolist()
    assert again == path[:cut + 1], (again, path)
    return folder, prompt, prompt + tok.decode(path[:cut]) + "\n"


@pytest.mark.slow  # CLI subprocess runs
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_generate_reads_a_huggingface_folder_with_transformers_greedy_tokens(tmp_path, arch):
    """``meshtrain generate --ckpt HF_DIR``: the folder's config.json is the model, its weights are read through
    HFSource and its tokenizer.json encodes the prompt; greedy decoding gives transformers' tokens and ends where
    transformers' does, at the folder's end tokens; a malformed end token and a folder without a tokenizer.json
    are each refused in one line."""
    folder, prompt, want = _greedy_case(tmp_path, arch)
    r = _meshtrain("generate", "--ckpt", str(folder), "--prompt", prompt, "--tokens", "12", "--greedy")
    assert r.returncode == 0 and r.stdout == want, (r.stdout, want, r.stderr)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, "x"]}))
    bad = _meshtrain("generate", "--ckpt", str(folder), "--prompt", prompt)
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 1 and "generation_config.json: eos_token_id is [3, 'x']" in lines[0]
    (folder / "tokenizer.json").unlink()
    bad = _meshtrain("generate", "--ckpt", str(folder), "--prompt", prompt)
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 1 and "without a tokenizer.json" in lines[0], bad.stderr


@pytest.mark.slow
@pytest.mark.parametrize("arch, layout", [("llama", "parallel.tp=2"), ("qwen2", "parallel.tp=2"),
                                          ("qwen3", "parallel.tp=2"), ("llama", "parallel.pp=2")])
def test_generate_from_a_huggingface_folder_on_two_ranks(tmp_path, arch, layout):
    """The same on tp=2: each rank reads only its slices of the HF folder (a Qwen2's biases too: each rank adds its
    heads' rows; a Qwen3's norms whole); and on pp=2, a stage per rank. The tokens are transformers'."""
    folder, prompt, want = _greedy_case(tmp_path, arch)
    r = _meshtrain("generate", "--ckpt", str(folder), "--prompt", prompt, "--tokens", "12", "--greedy",
                   "--nproc", "2", layout)
    assert r.returncode == 0 and r.stdout == want, (r.stdout, want, r.stderr)
