"""HuggingFace weights in and out (Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, Gemma): a ``TensorSource``
over an HF folder, and an exporter to one.

An HF folder is ``config.json`` plus ``model.safetensors`` (or shards listed in ``model.safetensors.index.json``).
``hf_model_config`` maps its config.json to our ``ModelConfig`` and refuses, in one line that names the file and
the field, anything our model does not compute the same way. ``HFSource`` serves our logical tensors by our names,
reading only the requested box from the safetensors files (``safe_open(...).get_slice``), so a training rank
reads only its pieces. ``export_hf`` writes any ``TensorSource`` of our model as a folder that transformers'
``from_pretrained`` loads as the architecture ``hf_model_type`` names, one tensor at a time.

Names (ours -> HF, ``{i}`` a layer index):

    tok_embeddings.weight                 model.embed_tokens.weight
    layers.{i}.attention_norm.weight      model.layers.{i}.input_layernorm.weight
    layers.{i}.attention.wq.weight        model.layers.{i}.self_attn.q_proj.weight   (rows permuted, see below)
    layers.{i}.attention.wk.weight        model.layers.{i}.self_attn.k_proj.weight   (rows permuted)
    layers.{i}.attention.wv.weight        model.layers.{i}.self_attn.v_proj.weight
    layers.{i}.attention.wo.weight        model.layers.{i}.self_attn.o_proj.weight
    layers.{i}.ffn_norm.weight            model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.feed_forward.w1.weight     model.layers.{i}.mlp.gate_proj.weight
    layers.{i}.feed_forward.w3.weight     model.layers.{i}.mlp.up_proj.weight
    layers.{i}.feed_forward.w2.weight     model.layers.{i}.mlp.down_proj.weight
    norm.weight                           model.norm.weight
    output.weight                         lm_head.weight (model.embed_tokens.weight when tied)

RoPE: ours rotates interleaved pairs (x[2j], x[2j+1]) of each head by angle j (Meta's layout); HF's rotates halves
(x[j], x[j + head_dim/2]). Both give the same attention scores if the rows of wq and wk are reordered within each
head: our row 2j+p is HF's row p*head_dim/2 + j (``interleaved_to_halves``, the permutation HF's own
convert_llama_weights_to_hf applies; ``halves_to_interleaved`` inverts it). Dot products q.k are sums over the
same pairs either way, so the scores, and the logits, are the same. wv, wo and everything else are unchanged.

Mixtral: an MoE model (``model.moe_experts``) maps onto MixtralForCausalLM when its router renormalises each
token's top-k gates as Mixtral's does (``model.moe_renormalize``; our default, Switch's, does not) and it has no
shared experts or selection bias (``check_mixtral``): ``block_sparse_moe.gate`` is our ``feed_forward.router``
and ``block_sparse_moe.experts.{e}.w1/w3/w2`` our ``feed_forward.experts.{e}.w1/w3/w2``.

Qwen: Qwen2 is a Llama with biases on q, k and v (``model.qkv_bias``: ``q_proj.bias`` and ``k_proj.bias`` permuted
as their weights' rows); Qwen3 one whose q and k heads pass an RMSNorm before RoPE (``model.qk_norm``: ``q_norm`` and
``k_norm`` permuted as one head's rows), usually with heads of their own width (``model.head_size``); Qwen3-MoE a
Qwen3 whose MLPs are our mixture of experts (``mlp.gate``, ``mlp.experts.{e}.gate_proj/up_proj/down_proj``), its
gates renormalised or not (``norm_topk_prob``).

Gemma (the first, ``GemmaForCausalLM``): a Llama whose embedding's output is multiplied by sqrt(hidden_size)
(``model.embed_scale``), whose MLP gate is the tanh-approximated GELU (GeGLU, ``model.mlp_activation=gelu_tanh``),
usually with one kv head of 256 dimensions and tied embeddings. Its RMSNorms scale by ``1 + weight``: ours by
``weight``, so the import adds one to each norm's scale (in fp32, as transformers computes ``1.0 +
weight.float()``) and the export takes it away (``HFTensor.offset``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from meshtrain.config import ModelConfig
from meshtrain.model.source import Box, TensorSource, full_box, write_safetensors
from meshtrain.temp_folders import remove_stale_temp_folders, temp_folder_for

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = ("F32", "BF16", "F16")  # the safetensors dtypes read as weights (no fp8/int codes without scales)
SUPPORTED = ("LlamaForCausalLM (model_type llama), MistralForCausalLM (model_type mistral), MixtralForCausalLM "
             "(model_type mixtral), Qwen2ForCausalLM (model_type qwen2), "
             "Qwen3ForCausalLM (model_type qwen3), Qwen3MoeForCausalLM (model_type qwen3_moe), the Qwens without "
             "a sliding window, or GemmaForCausalLM (model_type gemma)")
# architecture -> model_type. A Mistral is a Llama by other names, with a sliding window in v0.1
# (model.sliding_window); a Qwen2
# is a Llama whose q, k and v projections have biases (model.qkv_bias); a Qwen3 one whose q and k heads pass an
# RMSNorm before RoPE (model.qk_norm); a Qwen3-MoE a Qwen3 whose every MLP is a mixture of experts.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "MixtralForCausalLM": "mixtral",
                 "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
                 "GemmaForCausalLM": "gemma"}
# HF's hidden_act -> model.mlp_activation; Gemma's config.json files say "gelu" and mean the tanh approximation
# (transformers reads them so)
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
HF_ACTIVATION = {ours: hf for hf, ours in ACTIVATIONS.items()}
QWENS = ("qwen2", "qwen3", "qwen3_moe")
# What transformers' config class of each family assumes for a field its config.json leaves out (LlamaConfig's
# defaults are not every family's: a Mixtral's RoPE base is 1e6, a Mistral's window 4096). tests/test_hf.py holds
# this table equal to transformers' own.
_LLAMA_DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
                   "tie_word_embeddings": False}
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _LLAMA_DEFAULTS,
    "mistral": {**_LLAMA_DEFAULTS, "max_position_embeddings": 131072, "sliding_window": 4096},
    "mixtral": {**_LLAMA_DEFAULTS, "rope_theta": 1e6, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072},
    **{qwen: {**_LLAMA_DEFAULTS, "max_position_embeddings": 32768} for qwen in QWENS},
    "gemma": {**_LLAMA_DEFAULTS, "max_position_embeddings": 8192, "tie_word_embeddings": True},
}
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")


# ----------------------------------------------------------------------------- RoPE permutation


def interleaved_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of wq/wk from our interleaved-pair RoPE layout to HF's rotate-half layout (per head:
    our row 2j+p -> HF row p*head_dim/2 + j). ``w`` holds ``n_heads`` whole heads of rows."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def halves_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of ``interleaved_to_halves``: HF's wq/wk rows to ours."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# ----------------------------------------------------------------------------- config.json


def _config_error(file: Path, field: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"{file}: {field} is {value!r}; meshtrain supports {supported}.")


def _read_config(folder: Path) -> tuple[Path, dict[str, Any]]:
    file = folder / CONFIG
    if not folder.is_dir():
        raise FileNotFoundError(f"HuggingFace folder {folder} does not exist.")
    if not file.is_file():
        raise FileNotFoundError(f"{folder} has no {CONFIG}: pass a HuggingFace model folder "
                                f"(config.json with model.safetensors or its shards).")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e}).") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object of LlamaConfig fields.")
    return file, data


def _positive_int(file: Path, data: dict[str, Any], key: str, default: int | None = None) -> int:
    value = data.get(key, default)
    if value is None:
        raise ValueError(f"{file}: {key} is missing; a {SUPPORTED} config.json has it.")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _config_error(file, key, value, "a positive integer")
    return value


# HF's llama3 rope parameters -> ours (model.rope_*); each must be a positive number.
LLAMA3_ROPE = {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
               "high_freq_factor": "rope_high_freq_factor", "original_max_position_embeddings": "rope_original_max_len"}


def _rope(file: Path, data: dict[str, Any]) -> dict[str, Any]:
    """Our ``rope_*`` fields from either layout: transformers 4 (``rope_theta``, ``rope_scaling``) or 5
    (``rope_parameters``). The plain rotation and Llama 3.1's ``llama3`` scaling are implemented
    (``layers.rope_frequencies``); any other scaling (linear, dynamic, yarn...) would change the angles, so it is
    refused rather than ignored."""
    theta, out = data["rope_theta"], {}  # FAMILY_DEFAULTS fills it when config.json leaves it out
    for key in ("rope_scaling", "rope_parameters"):
        params = data.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise _config_error(file, key, params, "null or a mapping with rope_type default or llama3")
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise _config_error(file, f"{key}.rope_type", kind,
                                "rope_type default (no RoPE scaling) or llama3 (Llama 3.1+)")
        theta = params.get("rope_theta", theta)
        if kind == "llama3":
            out["rope_scaling"] = "llama3"
            for hf_name, ours in LLAMA3_ROPE.items():
                value = params.get(hf_name)
                if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
                    raise _config_error(file, f"{key}.{hf_name}", value, "a positive number (rope_type llama3)")
                out[ours] = int(value) if ours == "rope_original_max_len" else float(value)
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise _config_error(file, "rope_theta", theta, "a positive number")
    return {"rope_theta": float(theta), **out}


def _sliding_window(file: Path, c: dict[str, Any], max_len: int) -> int:
    """A Mistral's or Mixtral's sliding window shorter than the context, as ``model.sliding_window`` (0: none). A
    Qwen's window is refused: it applies to some layers only (``max_window_layers``); its
    ``sliding_window`` counts only where ``use_sliding_window`` is true (its released models set a window and leave it
    off). transformers 5 also lists each layer's kind in ``layer_types``: full attention only, but for a Mistral's
    window on every layer."""
    window = c.get("sliding_window")
    if c.get("model_type") in ("mistral", "mixtral") and window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise _config_error(file, "sliding_window", window, "null or a positive number of positions")
        kinds = c.get("layer_types")
        if window < max_len and kinds is not None and (
                not isinstance(kinds, list) or any(k != "sliding_attention" for k in kinds)):
            raise _config_error(file, "layer_types", kinds, "the sliding window on every layer")
        return window if window < max_len else 0
    if c.get("model_type") in QWENS:
        use = c.get("use_sliding_window", False)
        if not isinstance(use, bool):
            raise _config_error(file, "use_sliding_window", use, "true or false")
        window = window if use else None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < max_len):
        raise _config_error(file, "sliding_window", window,
                            f"null or at least max_position_embeddings={max_len} (full causal attention only)")
    kinds = c.get("layer_types")
    if window is None and kinds is not None and (
            not isinstance(kinds, list) or any(k != "full_attention" for k in kinds)):
        raise _config_error(file, "layer_types", kinds, "full_attention layers only")
    return 0


def _activation(file: Path, c: dict[str, Any], model_type: str) -> str:
    """``model.mlp_activation`` for config.json's activation: Gemma's ``hidden_activation`` where set (transformers
    4 reads it), else ``hidden_act``, whose ``gelu`` Gemma's releases wrote meaning the tanh approximation."""
    key = "hidden_activation" if model_type == "gemma" and c.get("hidden_activation") is not None else "hidden_act"
    value = c.get(key, "gelu_pytorch_tanh" if model_type == "gemma" else "silu")
    if model_type == "gemma" and value == "gelu":
        value = "gelu_pytorch_tanh"
    if value not in ACTIVATIONS:
        raise _config_error(file, key, value, "silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)")
    if model_type == "gemma" and c.get("use_bidirectional_attention"):
        raise _config_error(file, "use_bidirectional_attention", c["use_bidirectional_attention"],
                            "false or null (causal attention)")
    return ACTIVATIONS[value]


def _routing(file: Path, c: dict[str, Any], experts_key: str) -> dict[str, Any]:
    """The routing fields Mixtral and Qwen3-MoE configs share: ``experts_key`` experts, ``num_experts_per_tok`` of
    them per token, and the load-balancing coefficient. Their loss sums each expert's share of the k choices
    (adding up to k) where ours takes the share of one (adding up to one), so ``router_aux_loss_coef`` becomes
    ``moe_aux_loss_coef`` times k (both configs default it to 0.001)."""
    experts = _positive_int(file, c, experts_key)
    top_k = _positive_int(file, c, "num_experts_per_tok")
    if top_k > experts:
        raise _config_error(file, "num_experts_per_tok", top_k, f"at most {experts_key}={experts}")
    coef = c.get("router_aux_loss_coef", 0.001)
    if isinstance(coef, bool) or not isinstance(coef, int | float) or not 0 <= coef < math.inf:
        raise _config_error(file, "router_aux_loss_coef", coef, "a number >= 0")
    return {"moe_experts": experts, "moe_top_k": top_k, "moe_aux_loss_coef": float(coef) * top_k}


def _mixtral(file: Path, c: dict[str, Any]) -> dict[str, Any]:
    """Our ``moe_*`` fields for a Mixtral config.json: ``num_local_experts`` experts of hidden
    ``intermediate_size``, ``num_experts_per_tok`` of them per token, gates renormalised over those (Mixtral's
    router), dropless; the load-balancing coefficient as ``_routing`` scales it. ``router_jitter_noise`` only
    perturbs training inputs and is not applied."""
    return {**_routing(file, c, "num_local_experts"), "moe_renormalize": True}


def _qwen3_moe(file: Path, c: dict[str, Any]) -> dict[str, Any]:
    """Our ``moe_*`` fields for a Qwen3-MoE config.json: ``num_experts`` experts of hidden ``moe_intermediate_size``,
    ``num_experts_per_tok`` per token, the top-k gates renormalised where ``norm_topk_prob`` says (the released
    models do; transformers' default does not: Switch's gates, ours), dropless; every layer sparse. The
    load-balancing coefficient is scaled as Mixtral's (``_routing``)."""
    key = "num_experts" if "num_experts" in c else "num_local_experts"  # the hub's name; transformers 5 saves the other
    routing = _routing(file, c, key)
    if c.get("decoder_sparse_step", 1) != 1:
        raise _config_error(file, "decoder_sparse_step", c["decoder_sparse_step"], "1 (every layer a mixture of "
                                                                                   "experts)")
    if c.get("mlp_only_layers") not in (None, []):
        raise _config_error(file, "mlp_only_layers", c["mlp_only_layers"], "[] (every layer a mixture of experts)")
    renormalize = c.get("norm_topk_prob", False)  # Qwen3MoeConfig's default
    if not isinstance(renormalize, bool):
        raise _config_error(file, "norm_topk_prob", renormalize, "true or false")
    return {**routing, "moe_renormalize": renormalize, "moe_hidden": _positive_int(file, c, "moe_intermediate_size")}


def hf_model_config(folder: str | Path) -> ModelConfig:
    """Our ``ModelConfig`` for the HF folder's config.json (a LlamaForCausalLM).

    Raises a one-line ``ValueError`` naming the file, the field and what is supported for anything our model
    does not compute the same way: another architecture, RoPE scaling other than Llama 3.1's, a Qwen's sliding
    window (a Mistral's is ``model.sliding_window``), Llama's attention or MLP biases (an o_proj bias; Qwen2's q,
    k, v biases are ``model.qkv_bias``), an activation other than SiLU or tanh-GELU, an odd head_dim. A head_dim
    other than hidden/heads is ``model.head_size``.
    """
    file, c = _read_config(Path(folder))
    arch = c.get("architectures")
    if arch is not None and (not isinstance(arch, list) or len(arch) != 1 or arch[0] not in ARCHITECTURES):
        raise _config_error(file, "architectures", arch, SUPPORTED)
    model_type = c.get("model_type")
    if model_type not in ARCHITECTURES.values() or (arch is not None and ARCHITECTURES[arch[0]] != model_type):
        raise _config_error(file, "model_type", model_type, SUPPORTED)
    c = {**FAMILY_DEFAULTS[model_type], **c}  # the family's defaults for the fields config.json leaves out
    quantized = c.get("quantization_config")
    if quantized is not None:  # the weights would be read as stored (fp8, int4 codes) without their scales
        method = quantized.get("quant_method", quantized) if isinstance(quantized, dict) else quantized
        raise ValueError(f"{file}: quantization_config is set (quant_method {method!r}); meshtrain reads unquantized "
                         f"weights only (fp32, bf16 or fp16): use the model's unquantized release.")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key, False):
            raise _config_error(file, key, c[key], "false only (meshtrain's attention has biases on q, k and v "
                                                 "alone, as Qwen2's)")
    activation = _activation(file, c, model_type)
    d_model = _positive_int(file, c, "hidden_size")
    n_heads = _positive_int(file, c, "num_attention_heads")
    head_dim = c.get("head_dim")
    if head_dim is None and d_model % n_heads:
        raise _config_error(file, "num_attention_heads", n_heads, f"a divisor of hidden_size={d_model} (or a "
                                                                  f"head_dim)")
    if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0
                                 or head_dim % 2):
        raise _config_error(file, "head_dim", head_dim, "a positive even head_dim (RoPE rotates pairs)")
    # model.head_size: 0 where the heads are hidden_size / num_attention_heads wide, as our default computes
    head_size = 0 if head_dim is None or (d_model % n_heads == 0 and head_dim == d_model // n_heads) else head_dim
    kv_heads = _positive_int(file, c, "num_key_value_heads", n_heads)
    if n_heads % kv_heads:
        raise _config_error(file, "num_key_value_heads", kv_heads, f"a divisor of num_attention_heads={n_heads}")
    eps = c["rms_norm_eps"]
    if isinstance(eps, bool) or not isinstance(eps, int | float) or eps <= 0:
        raise _config_error(file, "rms_norm_eps", eps, "a positive number")
    tie = c["tie_word_embeddings"]
    if not isinstance(tie, bool):
        raise _config_error(file, "tie_word_embeddings", tie, "true or false")
    init_std = c.get("initializer_range", 0.02)
    max_len = _positive_int(file, c, "max_position_embeddings")
    window = _sliding_window(file, c, max_len) if model_type != "llama" else 0
    moe = _mixtral(file, c) if model_type == "mixtral" else _qwen3_moe(file, c) if model_type == "qwen3_moe" else {}
    return ModelConfig(
        **moe,
        vocab_size=_positive_int(file, c, "vocab_size"),
        d_model=d_model,
        n_layers=_positive_int(file, c, "num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=kv_heads,
        head_size=head_size,
        ffn_hidden=_positive_int(file, c, "intermediate_size"),
        norm_eps=float(eps),
        **_rope(file, c),
        max_seq_len=max_len,
        tie_embeddings=tie,
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        sliding_window=window,
        mlp_activation=activation,
        embed_scale=model_type == "gemma",
        init_std=float(init_std) if isinstance(init_std, int | float) and init_std > 0 else 0.02,
    )


EXPORT_SIDE_FILES = ("generation_config.json", "tokenizer_config.json", "special_tokens_map.json")


def init_from_extras(folder: str | Path, vocab_size: int) -> tuple[dict[str, Any], list[Path]]:
    """What the export of a fine-tune takes from the HF folder it started from (``train.init_from``): config.json's
    ``bos_token_id`` and ``eos_token_id`` (an instruct model stops at its turn's end, not the tokenizer's one
    end-of-text), and the files transformers reads beside the weights where they exist: the generation settings,
    the tokenizer's config (its chat template), the special tokens."""
    file, c = _read_config(Path(folder))
    ids: dict[str, Any] = {}
    for key in ("bos_token_id", "eos_token_id"):
        value = c.get(key)
        if value is None:
            continue
        items = value if isinstance(value, list) else [value]
        if not items or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size for i in items):
            raise _config_error(file, key, value, f"a token id, or a list of them, below the vocabulary size "
                                                  f"{vocab_size}")
        ids[key] = value
    return ids, [Path(folder) / name for name in EXPORT_SIDE_FILES if (Path(folder) / name).is_file()]


def hf_stop_ids(folder: str | Path, vocab_size: int) -> tuple[int, ...] | None:
    """The token ids that end a generation, as transformers' ``generate`` reads them: ``eos_token_id`` (one id or
    a list) of ``generation_config.json``, else of ``config.json``; None where neither has one."""
    for name in ("generation_config.json", CONFIG):
        file = Path(folder) / name
        if not file.is_file():
            continue
        try:
            value = json.loads(file.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError):
            raise ValueError(f"{file} is not a JSON object of generation settings.") from None
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if not ids or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size for i in ids):
            raise _config_error(file, "eos_token_id", value, f"a token id, or a list of them, below the "
                                                             f"vocabulary size {vocab_size}")
        return tuple(ids)
    return None


# ----------------------------------------------------------------------------- names


@dataclass(frozen=True)
class HFTensor:
    """Where one of our logical tensors lives in an HF folder."""

    hf_name: str
    shape: tuple[int, ...]  # the logical shape (the same in both layouts)
    rope_heads: int | None  # wq/wk (and their biases): heads whose rows are permuted between the RoPE layouts
    offset: float = 0.0  # ours = HF's + offset (Gemma's norms scale by 1 + weight: 1.0)


def check_mixtral(cfg: ModelConfig) -> None:
    """Raise, naming the option, when an MoE model is not one Mixtral computes: gates not renormalised (Switch's,
    our default), shared experts, or the aux-loss-free selection bias (Mixtral selects by probability alone)."""
    if not cfg.moe_experts:
        return
    for bad, option, why in (
            (not cfg.moe_renormalize, "model.moe_renormalize=false",
             "Mixtral divides each token's top-k gates by their sum; set model.moe_renormalize=true to train one"),
            (cfg.moe_shared_experts > 0, f"model.moe_shared_experts={cfg.moe_shared_experts}",
             "Mixtral has no shared experts"),
            (cfg.moe_bias_update_rate > 0, f"model.moe_bias_update_rate={cfg.moe_bias_update_rate}",
             "Mixtral selects experts by probability alone, so the aux-loss-free bias would be lost")):
        if bad:
            raise ValueError(f"{option}: this mixture of experts has no HuggingFace form ({why}).")


def hf_model_type(cfg: ModelConfig) -> str:
    """The HF model_type our model ``cfg`` is (llama, mistral, mixtral, qwen2, qwen3, qwen3_moe or gemma); raises,
    naming the options, for combinations no HF architecture computes. A dense model with a sliding window is a
    Mistral; one whose embedding is scaled, a Gemma."""
    if cfg.embed_scale:
        for bad, option in ((cfg.moe_experts, f"model.moe_experts={cfg.moe_experts}"),
                            (cfg.sliding_window, f"model.sliding_window={cfg.sliding_window}"),
                            (cfg.qkv_bias, "model.qkv_bias=true"), (cfg.qk_norm, "model.qk_norm=true")):
            if bad:
                raise ValueError(f"model.embed_scale=true with {option}: this model has no HuggingFace form (Gemma, "
                                 f"the architecture with a scaled embedding, is dense with Llama's attention).")
        return "gemma"
    if cfg.sliding_window and (cfg.qkv_bias or cfg.qk_norm):
        raise ValueError(f"model.sliding_window={cfg.sliding_window} with Qwen's attention (model.qkv_bias or "
                         f"model.qk_norm): this model has no HuggingFace form (a Qwen's window is per layer).")
    if cfg.qkv_bias and cfg.qk_norm:
        raise ValueError("model.qkv_bias=true with model.qk_norm=true: this model has no HuggingFace form (Qwen2 has "
                         "the biases without the norms; Qwen3's attention_bias would bias o_proj too).")
    if cfg.moe_experts and cfg.qkv_bias:
        raise ValueError("model.qkv_bias=true with model.moe_experts: this model has no HuggingFace form (Mixtral's "
                         "attention is Llama's, Qwen3-MoE's has q and k norms instead).")
    if cfg.moe_experts and cfg.qk_norm:  # Qwen3-MoE: either gate (norm_topk_prob), no shared experts, no bias
        for bad, option in ((cfg.moe_shared_experts > 0, f"model.moe_shared_experts={cfg.moe_shared_experts}"),
                            (cfg.moe_bias_update_rate > 0, f"model.moe_bias_update_rate={cfg.moe_bias_update_rate}")):
            if bad:
                raise ValueError(f"{option}: this mixture of experts has no HuggingFace form (Qwen3-MoE has no "
                                 f"shared experts and selects experts by probability alone).")
        return "qwen3_moe"
    check_mixtral(cfg)
    if cfg.moe_experts:
        return "mixtral"
    return "qwen2" if cfg.qkv_bias else "qwen3" if cfg.qk_norm else "mistral" if cfg.sliding_window else "llama"


def hf_architecture(model_type: str) -> str:
    """The architecture an export of ``model_type`` (``hf_model_type``) names: a Mistral without a sliding window
    exports as a Llama (``hf_model_type`` says llama for it)."""
    return next(arch for arch, t in ARCHITECTURES.items() if t == model_type)


def hf_names(cfg: ModelConfig) -> dict[str, HFTensor]:
    """Our parameter names -> their HF tensors, in HF's order. Tied: ``output.weight`` is the embedding."""
    d, hd, hidden = cfg.d_model, cfg.head_dim, cfg.hidden_dim
    model_type = hf_model_type(cfg)
    norm = 1.0 if model_type == "gemma" else 0.0  # Gemma's norms scale by 1 + weight
    out = {"tok_embeddings.weight": HFTensor("model.embed_tokens.weight", (cfg.vocab_size, d), None)}
    for i in range(cfg.n_layers):
        a, m, ours = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp", f"layers.{i}"
        out.update({
            f"{ours}.attention_norm.weight": HFTensor(f"model.layers.{i}.input_layernorm.weight", (d,), None, norm),
            f"{ours}.attention.wq.weight": HFTensor(f"{a}.q_proj.weight", (cfg.n_heads * hd, d), cfg.n_heads),
            f"{ours}.attention.wk.weight": HFTensor(f"{a}.k_proj.weight", (cfg.kv_heads * hd, d), cfg.kv_heads),
            f"{ours}.attention.wv.weight": HFTensor(f"{a}.v_proj.weight", (cfg.kv_heads * hd, d), None),
            f"{ours}.attention.wo.weight": HFTensor(f"{a}.o_proj.weight", (d, cfg.n_heads * hd), None),
            f"{ours}.ffn_norm.weight": HFTensor(f"model.layers.{i}.post_attention_layernorm.weight", (d,), None,
                                               norm),
        })
        if cfg.qkv_bias:  # Qwen2's: each bias permuted as its weight's rows
            out.update({
                f"{ours}.attention.wq.bias": HFTensor(f"{a}.q_proj.bias", (cfg.n_heads * hd,), cfg.n_heads),
                f"{ours}.attention.wk.bias": HFTensor(f"{a}.k_proj.bias", (cfg.kv_heads * hd,), cfg.kv_heads),
                f"{ours}.attention.wv.bias": HFTensor(f"{a}.v_proj.bias", (cfg.kv_heads * hd,), None),
            })
        if cfg.qk_norm:  # Qwen3's: a scale over one head's dimensions, permuted as a head's rows
            out.update({f"{ours}.attention.{n}.weight": HFTensor(f"{a}.{n}.weight", (hd,), 1)
                        for n in ("q_norm", "k_norm")})
        if cfg.moe_experts:  # Mixtral's names (its experts' w1/w3/w2 are ours: gate, up, down), or Qwen3-MoE's
            qwen, eh = model_type == "qwen3_moe", cfg.expert_hidden
            moe = m if qwen else f"model.layers.{i}.block_sparse_moe"
            names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"} if qwen else {}
            out[f"{ours}.feed_forward.router.weight"] = HFTensor(f"{moe}.gate.weight", (cfg.moe_experts, d), None)
            for e in range(cfg.moe_experts):
                for w, shape in (("w1", (eh, d)), ("w3", (eh, d)), ("w2", (d, eh))):
                    out[f"{ours}.feed_forward.experts.{e}.{w}.weight"] = \
                        HFTensor(f"{moe}.experts.{e}.{names.get(w, w)}.weight", shape, None)
            continue
        out.update({
            f"{ours}.feed_forward.w1.weight": HFTensor(f"{m}.gate_proj.weight", (hidden, d), None),
            f"{ours}.feed_forward.w3.weight": HFTensor(f"{m}.up_proj.weight", (hidden, d), None),
            f"{ours}.feed_forward.w2.weight": HFTensor(f"{m}.down_proj.weight", (d, hidden), None),
        })
    out["norm.weight"] = HFTensor("model.norm.weight", (d,), None, norm)
    head = "model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"
    out["output.weight"] = HFTensor(head, (cfg.vocab_size, d), None)
    return out


# ----------------------------------------------------------------------------- import


class HFSource:
    """An HF folder (of an architecture ``hf_model_config`` accepts) as a ``TensorSource`` of our logical tensors,
    read lazily a box at a time.

    Construction reads config.json and the safetensors headers only, and checks up front (so a bad folder fails
    before any process starts) that every shard the index names exists and that every tensor config.json implies
    is present with its shape. ``read`` then reads just the requested region from the memory-mapped file: for
    wq/wk the whole heads that cover the requested rows (the RoPE permutation stays within a head).
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.cfg = hf_model_config(self.folder)
        self.tensors = hf_names(self.cfg)
        self._headers: dict[Path, dict[str, tuple[tuple[int, ...], str]]] = {}
        self._reading: dict[Path, Any] = {}  # the files reads are in, the last two used, kept open
        self.files = self._weight_map()
        for ours, t in self.tensors.items():
            file = self.files.get(t.hf_name)
            if file is None or t.hf_name not in self._header(file):
                where = self.folder / INDEX if (self.folder / INDEX).is_file() else file or self.folder / SINGLE
                raise ValueError(f"{where}: tensor {t.hf_name} (meshtrain {ours}) is absent: the weights do not "
                                 f"match {self.folder / CONFIG}.")
            stored, dtype = self._header(file)[t.hf_name]
            if stored != t.shape:
                raise ValueError(f"{file}: {t.hf_name} has shape {stored} but {self.folder / CONFIG} implies "
                                 f"{t.shape}: the weights and config.json disagree.")
            if dtype not in FLOAT_DTYPES:  # an fp8 or integer tensor would be cast as stored, without its scale
                raise ValueError(f"{file}: {t.hf_name} is stored as {dtype}; meshtrain reads "
                                 f"{', '.join(FLOAT_DTYPES)} weights only: use the model's unquantized release.")

    def _weight_map(self) -> dict[str, Path]:
        """HF tensor name -> the file holding it (the index's weight_map, or every tensor of the single file)."""
        index = self.folder / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{index} is not a safetensors index (no weight_map: {e!r}).") from None
            plain = isinstance(weight_map, dict) and all(isinstance(k, str) and isinstance(f, str) and f
                                                         and Path(f).name == f for k, f in weight_map.items())
            if not plain:
                raise ValueError(f"{index}: weight_map must map each tensor name to a file name in {self.folder} "
                                 f"(no folders): the index is damaged; download it again.")
            files = {name: self.folder / f for name, f in weight_map.items()}
            for f in sorted(set(files.values())):
                if not f.is_file():
                    raise FileNotFoundError(f"{index} names shard {f.name}, which is missing from {self.folder}: "
                                            f"the download is incomplete.")
            return files
        single = self.folder / SINGLE
        if not single.is_file():
            raise FileNotFoundError(f"{self.folder} has neither {SINGLE} nor {INDEX}: meshtrain reads safetensors "
                                    f"weights only (never pickled .bin files).")
        return {name: single for name in self._header(single)}

    @staticmethod
    def _open(file: Path) -> Any:
        """``file`` opened (memory-mapped). Reads keep two files open, the last two used (``_slice``: our order of a
        block's tensors is not the files', so a block at a shard's edge goes back and forth): every page a
        read touches stays resident while its file is open, so caching every file's handle held a rank's share of
        the weights a second time (measured: +0.28 GB resident after init_from of 72M parameters in one process,
        +72 MB on each rank of dp4 ZeRO-3), and opening a file per read re-parsed its header every time (~1.4 ms
        for 1,152 entries: ~25 s a rank for the ~18k tensors of a Qwen3-30B-A3B)."""
        try:
            return safe_open(str(file), framework="pt")
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{file} is not a readable safetensors file ({e}).") from None

    def _header(self, file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every tensor's (shape, safetensors dtype) in ``file``, from its header, read once (a 70B folder: ~30
        files, ~720 tensors; opening a file per tensor cost every rank ~720 opens of a shared filesystem)."""
        if file not in self._headers:
            with self._open(file) as f:
                self._headers[file] = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype())
                                       for k in f.keys()}
        return self._headers[file]

    def shape(self, key: str) -> tuple[int, ...] | None:
        t = self.tensors.get(key)
        return None if t is None else t.shape

    def read(self, key: str, box: Box) -> torch.Tensor:
        t = self.tensors[key]
        if len(box) != len(t.shape) or any(not 0 <= a <= b <= n for (a, b), n in zip(box, t.shape, strict=True)):
            raise ValueError(f"box {box} is outside {key} of shape {t.shape}.")
        if t.offset:  # in fp32 whatever the file's dtype, as transformers adds it (1.0 + weight.float())
            return self._slice(t, box).float() + t.offset
        if t.rope_heads is None:
            return self._slice(t, box)
        # The permutation moves rows only within a head: read the whole heads that cover the box's rows.
        head_dim = t.shape[0] // t.rope_heads
        (r0, r1), rest = box[0], box[1:]
        h0, h1 = r0 // head_dim, -(-r1 // head_dim)
        block = halves_to_interleaved(self._slice(t, ((h0 * head_dim, h1 * head_dim), *rest)), h1 - h0)
        return block[r0 - h0 * head_dim: r1 - h0 * head_dim]

    def _slice(self, t: HFTensor, box: Box) -> torch.Tensor:
        file = self.files[t.hf_name]
        handle = self._reading.pop(file, None)
        if handle is None:
            if len(self._reading) == 2:  # the least recently used file's mapping goes before another opens
                del self._reading[next(iter(self._reading))]
            handle = self._open(file)
        self._reading[file] = handle  # now the most recently used
        return handle.get_slice(t.hf_name)[tuple(slice(a, b) for a, b in box)]


# ----------------------------------------------------------------------------- export


def hf_config_dict(cfg: ModelConfig, eos_token_id: int | list[int] | None = None, dtype: str = "float32",
                   bos_token_id: int | list[int] | None = None) -> dict[str, Any]:
    """The config.json of the HF architecture ``hf_model_type`` names (a LlamaForCausalLM, MixtralForCausalLM,
    Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM or GemmaForCausalLM) equal to our model ``cfg``,
    readable by transformers 4 (rope_theta) and 5 (rope_parameters)."""
    scaling = {} if cfg.rope_scaling == "none" else {hf: getattr(cfg, ours) for hf, ours in LLAMA3_ROPE.items()}
    model_type = hf_model_type(cfg)
    arch = hf_architecture(model_type)
    window = cfg.sliding_window or None
    extra = {"num_local_experts": cfg.moe_experts, "num_experts_per_tok": cfg.moe_top_k, "sliding_window": window,
             "router_aux_loss_coef": cfg.moe_aux_loss_coef / cfg.moe_top_k, "router_jitter_noise": 0.0,
             "output_router_logits": False} if cfg.moe_experts else {}
    if model_type == "mistral":
        extra = {"sliding_window": window}
    if model_type in QWENS:  # Qwen2's biases on q, k, v and Qwen3's norms are the architecture's; the window off
        extra = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers}
    if model_type == "qwen3_moe":  # every layer sparse
        extra |= {"num_experts": cfg.moe_experts, "num_experts_per_tok": cfg.moe_top_k,
                  "norm_topk_prob": cfg.moe_renormalize, "moe_intermediate_size": cfg.expert_hidden,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": False,
                  "router_aux_loss_coef": cfg.moe_aux_loss_coef / cfg.moe_top_k}
    config = {
        "architectures": [arch],
        "model_type": model_type,
        **extra,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.expert_hidden if model_type == "mixtral" else cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": HF_ACTIVATION[cfg.mlp_activation],
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling == "none" else {"rope_type": cfg.rope_scaling, **scaling},
        "rope_parameters": {"rope_type": "default" if cfg.rope_scaling == "none" else cfg.rope_scaling,
                            "rope_theta": cfg.rope_theta, **scaling},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": dtype,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
    }
    if cfg.qkv_bias:  # Qwen2's projections have their biases by architecture, not by these keys
        del config["attention_bias"], config["mlp_bias"]
    elif cfg.qk_norm:  # Qwen3 reads attention_bias (false here) and has no mlp_bias
        del config["mlp_bias"]
    if model_type == "gemma":  # transformers 4 reads hidden_activation, 5 hidden_act; Gemma has no mlp_bias
        config["hidden_activation"] = config["hidden_act"]
        del config["mlp_bias"], config["pretraining_tp"]
    return config


def _hf_tensor(source: TensorSource, t: HFTensor, ours: str, shape: tuple[int, ...],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Our tensor ``ours`` as HF stores it (q/k rows rotated by halves), in ``dtype``."""
    w = source.read(ours, full_box(shape)).to(torch.float32)
    if t.offset:  # Gemma's norms: HF stores the scale less one (in fp32, then rounded once)
        w = w - t.offset
    w = interleaved_to_halves(w, t.rope_heads) if t.rope_heads is not None else w
    if dtype == torch.float16 and (big := w.abs().max().item()) > torch.finfo(torch.float16).max:
        raise ValueError(f"{ours} holds values up to {big:.4g}, beyond fp16's 65504 (they would be written as inf): "
                         f"export with --dtype bf16 or fp32.")
    return w.to(dtype)


def _plan_shards(names: list[tuple[str, tuple[int, ...]]], max_bytes: int,
                 itemsize: int = 4) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Consecutive tensors grouped into files of at most ``max_bytes`` (a larger tensor gets a file of its own)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in names:
        n = math.prod(shape) * itemsize
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    return shards


EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export_hf(source: TensorSource, cfg: ModelConfig, out_dir: str | Path,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, files: Iterable[str | Path] = (),
              eos_token_id: int | list[int] | None = None, dtype: str = "fp32",
              bos_token_id: int | list[int] | None = None) -> Path:
    """Write our model (``cfg``, tensors from ``source`` by our names) as an HF folder of the architecture
    ``hf_model_type`` names (LlamaForCausalLM; Mixtral, Qwen2, Qwen3, Qwen3-MoE or Gemma where the options say).

    config.json, ``model.safetensors`` (or shards of at most ``max_shard_bytes`` plus
    ``model.safetensors.index.json``) in ``dtype`` (``EXPORT_DTYPES``: fp32, exact, or bf16/fp16, half the bytes, what
    released models ship), and ``files`` copied in (a tokenizer.json). One tensor is in memory
    at a time. The folder is written as a temporary sibling and renamed when complete, so ``out_dir`` either does
    not exist or holds a whole export. Every tensor must have the shape ``cfg`` implies (a vocabulary padded for
    tensor parallelism is refused, never written). Returns ``out_dir``.
    """
    if sys.byteorder != "little":  # safetensors is little-endian and tensors are written as raw bytes
        raise RuntimeError("export_hf writes raw little-endian bytes; this machine is big-endian.")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file: choose a new folder.")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out} already exists and is not empty: choose a new folder or delete it.")
    tensors = hf_names(cfg)
    if cfg.tie_embeddings:
        del tensors["output.weight"]  # HF ties lm_head to the embedding when tie_word_embeddings is set
    for ours, t in tensors.items():
        shape = source.shape(ours)
        if shape is None:
            raise ValueError(f"{ours} is missing from the weights to export: they were written for another model.")
        if tuple(shape) != t.shape:
            hint = " (a vocabulary padded for tensor parallelism must be cut back to model.vocab_size)" \
                if ours in ("tok_embeddings.weight", "output.weight") else ""
            raise ValueError(f"{ours} has shape {tuple(shape)} but the model config implies {t.shape}{hint}.")
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"--dtype {dtype}: export writes {', '.join(EXPORT_DTYPES)}.")
    torch_dtype = EXPORT_DTYPES[dtype]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    names = [(t.hf_name, t.shape) for t in tensors.values()]
    ours_of = {t.hf_name: ours for ours, t in tensors.items()}
    shards = _plan_shards(names, max_shard_bytes, itemsize)
    file_names = [SINGLE] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]

    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_folders(out, "export")
    tmp = temp_folder_for(out)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        (tmp / CONFIG).write_text(json.dumps(hf_config_dict(cfg, eos_token_id, str(torch_dtype).removeprefix(
            "torch."), bos_token_id), indent=2) + "\n")
        weight_map = {}
        for file_name, shard in zip(file_names, shards, strict=True):
            write_safetensors(tmp / file_name, [
                (name, shape, torch_dtype,
                 lambda name=name, shape=shape: _hf_tensor(source, tensors[ours_of[name]], ours_of[name], shape,
                                                           torch_dtype))
                for name, shape in shard])
            weight_map.update({name: file_name for name, _ in shard})
        if len(shards) > 1:
            total = sum(math.prod(shape) * itemsize for _, shape in names)
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        for f in files:
            shutil.copy(f, tmp / Path(f).name)
        if out.exists():  # an empty folder the user made beforehand
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
