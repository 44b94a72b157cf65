"""Typed configuration: model, parallel, train, data.

A config is built from a preset or YAML file plus dotted command-line overrides
(``train.steps=200 parallel.tp=2``). Every value is checked before anything starts:
unknown keys get the closest valid key, wrong types and shapes that do not divide
get a message that names the option and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

PRESET_DIR = Path(__file__).parent / "presets"

# The choices of the string options, defined once here (the bottom layer) for everything that checks them.
SCHEDULES = ("afab", "1f1b", "interleaved", "zb-h1", "dualpipev")  # parallel.schedule (meshtrain/plan/schedules.py)
ATTENTION_MASKS = ("causal", "document")  # train.attention_mask
RECOMPUTE_MODES = ("none", "full", "selective")  # train.recompute (meshtrain/parallel/recompute.py)
LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")  # train.lr_schedule (meshtrain/train/optim.py lr_at)
DECAY_SHAPES = ("sqrt", "linear", "cosine")  # train.decay_shape, wsd's decay
MLP_ACTIVATIONS = ("silu", "gelu_tanh")  # model.mlp_activation (meshtrain/model/layers.py gated)
CP_LAYOUTS = ("zigzag", "contiguous")  # parallel.cp_layout (meshtrain/parallel/context.py)
CP_ATTENTIONS = ("ring", "allgather", "ulysses")  # parallel.cp_attention
ROPE_SCALINGS = ("none", "llama3")  # model.rope_scaling
REDUCE_DTYPES = ("fp32", "bf16")  # parallel.reduce_dtype (meshtrain/parallel/grad_sync.py)


class ConfigError(ValueError):
    """A configuration mistake, with a message that names the option and the fix."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse for every ``meshtrain`` command: a bad argument is a ``ConfigError`` (one ``error:`` line from the
    command's error path, exit 2) instead of argparse's usage block followed by its own error line."""

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(f"{self.prog}: {message} (see {self.prog} --help)")


BYTE_VOCAB = 257  # the byte tokenizer's vocabulary (256 bytes and end of text): a model without data's tokenizer


@dataclass
class ModelConfig:
    """Shape of the Llama-style decoder."""

    vocab_size: int = 0  # 0: taken from the tokenizer of the data
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 0  # 0: same as n_heads (multi-head attention)
    head_size: int = 0  # width of each q, k, v head; 0: d_model / n_heads (Qwen3 0.6B and 4B set 128 apart from it)
    ffn_hidden: int = 0  # 0: Llama's rule, 2/3 * 4 * d_model rounded up to multiple_of
    multiple_of: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # RoPE scaling: none, or llama3 (Llama 3.1+): wavelengths beyond rope_original_max_len / rope_low_freq_factor
    # are stretched by rope_factor, those under rope_original_max_len / rope_high_freq_factor kept, those between
    # blended (model/layers.rope_frequencies)
    rope_scaling: str = "none"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    max_seq_len: int = 256
    tie_embeddings: bool = False
    qkv_bias: bool = False  # True: wq, wk and wv add a bias (Qwen2's attention; the biases start at zero)
    qk_norm: bool = False  # True: each q and k head passes an RMSNorm over head_dim (one scale for all heads) before
    # RoPE (Qwen3's attention)
    # Sliding-window attention (Mistral 7B v0.1: 4096): each token attends to itself and the sliding_window - 1
    # tokens before it; 0: full causal attention.
    sliding_window: int = 0
    mlp_activation: str = "silu"  # the MLP's gate: silu (SwiGLU, Llama) | gelu_tanh (GeGLU, Gemma)
    embed_scale: bool = False  # True: the embedding's output is multiplied by sqrt(d_model) (Gemma)
    init_std: float = 0.02
    # Mixture of experts (every block's MLP becomes an MoE layer when moe_experts > 0).
    moe_experts: int = 0  # routed experts per layer; 0: dense SwiGLU MLP
    moe_top_k: int = 2  # experts per token (softmax router, top-k)
    moe_renormalize: bool = False  # True: each token's top-k gate weights divided by their sum (Mixtral)
    moe_shared_experts: int = 0  # always-on experts added to the routed output (DeepSeek-style)
    moe_hidden: int = 0  # hidden size of each expert's SwiGLU; 0: the dense rule (hidden_dim)
    moe_capacity_factor: float = 0.0  # 0: dropless; > 0: each expert takes at most cf * tokens * k / E
    moe_aux_loss_coef: float = 0.01  # load-balancing loss weight (0 disables it)
    moe_z_loss_coef: float = 0.0  # router z-loss weight (ST-MoE: mean of logsumexp(router logits)^2); 0: off
    moe_bias_update_rate: float = 0.0  # > 0: aux-loss-free balancing, router bias nudged by this per step

    @property
    def expert_hidden(self) -> int:
        return self.moe_hidden or self.hidden_dim

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        h = int(2 * 4 * self.d_model / 3)
        return self.multiple_of * ((h + self.multiple_of - 1) // self.multiple_of)


@dataclass
class ParallelConfig:
    """Sizes of the mesh axes and how each parallelism is applied."""

    dp: int = 0  # 0: whatever the world size leaves after pp * cp * tp
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0  # 0: plain DP (all-reduce); 1: shard optimizer state; 2: + gradients; 3: + parameters (FSDP)
    zero_layout: str = "flat"  # flat (balanced by elements) | per_tensor (whole tensors per rank; Muon needs it)
    dp_shard: int = 0  # HSDP: shard within groups of this many dp ranks, replicate across them; 0: all of dp
    bucket_mb: float = 25.0  # DP gradient bucket size
    reshard_after_forward: bool = True  # ZeRO-3: free gathered parameters after forward, re-gather for backward
    reduce_dtype: str = "fp32"  # dtype the DP family's gradient collectives send: fp32 | bf16 (halves their bytes)
    sp: bool = False
    sp_regather: bool = True  # SP: column-parallel layers save the sequence shard and all-gather it again in backward
    cp_layout: str = "zigzag"  # zigzag (2*cp chunks, rank i holds i and 2cp-1-i: balanced causal work) | contiguous
    # ring (K/V passed around the cp ranks) | allgather (K/V all-gathered once) | ulysses (all-to-all: heads for tokens)
    cp_attention: str = "ring"
    schedule: str = "1f1b"  # afab | 1f1b | interleaved | zb-h1 | dualpipev
    microbatches: int = 1  # pipeline microbatches per optimizer step (each rank's rows are split into them)
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved >= 2; dualpipev uses 2)
    p2p_posting: str = "auto"  # pipeline send/recv order: auto (by backend) | ahead (gloo's) | ordered (NCCL-safe)


@dataclass
class TrainConfig:
    """Optimisation, schedule, logging and checkpointing."""

    steps: int = 100
    seed: int = 0
    global_batch: int = 8  # sequences per optimizer step, over all data-parallel ranks
    grad_accum: int = 1  # microbatches accumulated per optimizer step
    seq_len: int = 128
    optimizer: str = "adamw"  # adamw | muon (Newton-Schulz on 2-D hidden weights, AdamW for the rest)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    # after warmup: cosine | linear (both to lr * min_lr_ratio at train.steps) | constant | wsd (warmup-stable-decay:
    # lr held, then the last decay_fraction of train.steps decay to lr * min_lr_ratio, so a run can be extended)
    lr_schedule: str = "cosine"
    decay_fraction: float = 0.2  # wsd: the share of train.steps that decays (0.2: Hägele et al. 2024, MiniCPM)
    decay_steps: int = 0  # wsd: the decay's length in steps, in place of decay_fraction; 0: from decay_fraction
    decay_shape: str = "sqrt"  # wsd: the decay's shape, sqrt (1 - sqrt, Hägele et al.'s best) | linear | cosine
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    muon_lr: float = 0.0  # 0: train.lr (Muon's update is scaled to AdamW's RMS, so one lr fits both)
    muon_momentum: float = 0.95
    recompute: str = "none"  # activation checkpointing per block: none | full | selective
    compile: bool = False  # torch.compile each transformer block (docs/compile.md)
    # causal | document (a token attends only to its own document's tokens, each ending with the eos id)
    attention_mask: str = "causal"
    grad_clip: float = 1.0  # 0 disables clipping
    max_bad_steps: int = 3  # consecutive steps with a non-finite loss or grad norm (skipped) before the run stops
    # compute dtype: fp32, bf16 (autocast; parameters stay fp32) or auto (bf16 where the device computes it natively,
    # else fp32: a CPU without AVX-512 or AMX runs bf16 matmuls ~100x slower than fp32; train/trainer.py resolve_dtype)
    dtype: str = "fp32"
    device: str = "auto"  # auto: cuda when available, else cpu
    eval_every: int = 0  # 0: only at the end
    eval_batches: int = 4
    log_every: int = 1
    ckpt_every: int = 0  # 0: only at the end
    ckpt_keep: int = 2  # newest checkpoints kept; 0: all
    ckpt_async: bool = False  # write checkpoints in the background while training goes on
    resume: bool = False  # resume from the latest checkpoint in --out; none there: start fresh (and say so)
    resume_required: bool = False  # with resume: no checkpoint in --out is an error, not a fresh start
    init_from: str = ""  # a HuggingFace Llama folder to start from; its config.json replaces the model section
    sample_tokens: int = 200  # tokens generated at the end of training (0: none)
    sample_prompt: str = "def "
    peak_flops: float = 0.0  # per device, for MFU; 0: from the hardware table or a quick calibration
    threads: int = 0  # CPU threads for torch; 0: torch's default
    collective_timeout_s: float = 300.0  # a collective waiting longer for its peers ends the run, naming them
    check_collective_order: bool = False  # debug: compare each collective across its group before it runs
    gc_every: int = 50  # Python's garbage collector: off but every N steps, same step on every rank; 0: automatic
    profile_steps: int = 0  # > 0: trace this many steps with torch.profiler into --out/profile/ (docs/training.md)
    profile_start: int = 5  # the first traced step, as logged (from 1): after compilation and the allocator warm up
    progress: bool = True
    tensorboard: bool = True
    wandb: bool = False  # also log to Weights & Biases (pip install 'meshtrain[wandb]'); offline without WANDB_API_KEY
    wandb_project: str = "meshtrain"

    def wsd_decay_steps(self) -> int:
        """wsd's decay length: decay_steps, or else round(decay_fraction * steps), at least one step."""
        return self.decay_steps or max(1, round(self.decay_fraction * self.steps))


@dataclass
class DataConfig:
    """Where tokens come from."""

    path: str = ""  # a prepared folder (meshtrain prepare-data), or a blend "W1 DIR1 W2 DIR2 ..."; empty: the stdlib
    source: str = "files"  # files | synthetic
    tokenizer: str = "byte"  # byte | path to a HuggingFace tokenizer.json
    val_fraction: float = 0.02
    # a prepared folder whose val split validates the run instead of data.path's (another corpus's held-out part;
    # meshtrain prepare-data --val-fraction 1 holds out all of a folder); empty: data.path's own
    val_path: str = ""


@dataclass
class Config:
    """The whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SECTION_TYPES = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig, "data": DataConfig}


# ----------------------------------------------------------------------------- parsing


def refuse_empty(args: Any, flags: dict[str, str]) -> None:
    """One line for an option given as an empty string (an unset shell variable), which would otherwise mean its
    default or the current folder silently: ``flags`` maps each option's name on ``args`` to what to give."""
    for name, what in flags.items():
        value = getattr(args, name)
        if value is not None and not value.strip():
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} is empty: give {what}, or leave {flag} out.")


def check_output_file(flag: str, path: str | Path, suffix: str | None = None) -> Path:
    """``path`` as a file a command may write (``--emit``, ``--png``): refused in one line naming ``flag``, before
    the command's work, when it is empty, a folder, lacks ``suffix`` (a library would append one and write
    elsewhere), its folder does not exist or it cannot be written (tried by opening it to append: a file this
    makes is removed again)."""
    if not str(path).strip():
        raise ConfigError(f"{flag} is empty: name a file, e.g. {flag} out{suffix or '.yaml'}.")
    p = Path(path).expanduser()
    if p.is_dir():
        raise ConfigError(f"{flag} {path} is a folder: name a file in it, e.g. {p / ('out' + (suffix or ''))}.")
    if suffix and p.suffix.lower() != suffix:
        raise ConfigError(f"{flag} {path} must end in {suffix}, e.g. {p.with_suffix(suffix)}.")
    if not p.parent.is_dir():
        raise ConfigError(f"{flag} {path}: the folder {p.parent} does not exist: create it first.")
    made = not p.exists()  # (through a link: its target)
    try:
        with open(p, "a"):
            pass
    except OSError as e:
        raise ConfigError(f"{flag} {path} cannot be written ({e.strerror}): name a file in a folder you can "
                          f"write.") from None
    if made:  # the file the probe made, not a link of the user's that points to it
        Path(os.path.realpath(p)).unlink()
    return p


def _closest(name: object, options: list[str]) -> str:
    match = difflib.get_close_matches(str(name), options, n=1, cutoff=0.5)
    return f" Did you mean '{match[0]}'?" if match else f" Valid keys: {', '.join(sorted(options))}."


def _all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, t in _SECTION_TYPES.items() for f in fields(t)]


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Convert ``value`` (from YAML or a CLI string) to the declared type, or explain why not."""
    if isinstance(typ, str):  # postponed annotations
        typ = {"int": int, "float": float, "bool": bool, "str": str}[typ]
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        typ = [a for a in typing.get_args(typ) if a is not type(None)][0]
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        if isinstance(value, int) and value in (0, 1):  # YAML reads a bare 1 or 0 as an integer
            return bool(value)
        raise ConfigError(f"{key} must be true or false, got {value!r}.")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be an integer, got {value!r}.")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                f = float(value)
            except ValueError:
                f = None
            if f is not None and f.is_integer():
                return int(f)
        raise ConfigError(f"{key} must be an integer, got {value!r}.")
    if typ is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be a number, got {value!r}.")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} must be a number, got {value!r}.") from None
    if typ is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key} must be a string, got {value!r}.")
        return "" if value is None else str(value)
    raise ConfigError(f"{key}: unsupported type {typ}")


def _apply(cfg: Config, section: str, key: str, value: Any) -> None:
    if section not in _SECTION_TYPES:
        raise ConfigError(f"Unknown config section '{section}'." + _closest(section, list(_SECTION_TYPES)))
    sub = getattr(cfg, section)
    names = {f.name: f for f in fields(sub)}
    if key not in names:
        full = f"{section}.{key}"
        raise ConfigError(f"Unknown config key '{full}'." + _closest(full, _all_keys()))
    setattr(sub, key, _coerce(f"{section}.{key}", value, names[key].type))


def update_from_dict(cfg: Config, data: dict[str, Any], origin: str = "config") -> Config:
    """Overlay a nested dict (as read from YAML) onto ``cfg``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping of sections (model, parallel, train, data).")
    for section, values in data.items():
        if section == "preset":
            continue
        if section not in _SECTION_TYPES:
            raise ConfigError(
                f"{origin}: unknown config section '{section}'." + _closest(section, list(_SECTION_TYPES))
            )
        if not isinstance(values, dict):
            raise ConfigError(f"{origin}: section '{section}' must be a mapping of keys to values.")
        for key, value in values.items():
            try:
                _apply(cfg, section, str(key), value)
            except ConfigError as e:
                raise ConfigError(f"{origin}: {e}") from None
    return cfg


def parse_override(text: str) -> tuple[str, str, Any]:
    """Split ``section.key=value``; the value is parsed as YAML so 1e-3, true, [..] work."""
    if "=" not in text:
        raise ConfigError(f"Override '{text}' must look like section.key=value, e.g. train.steps=100.")
    dotted, raw = text.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(
            f"Override '{text}': the key must be section.key (e.g. train.steps), got '{dotted}'."
            + _closest(dotted, _all_keys())
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts[0], parts[1], value


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _read_yaml(path: Path, option: str = "--config") -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:  # PyYAML's message spans lines: the problem and where, on one
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"Config file {path} is not valid YAML: {problem}{where}.") from None
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else "not UTF-8 text"
        raise ConfigError(f"Config file {path} cannot be read ({reason}): pass a YAML file or a preset name "
                          f"to {option}.") from None
    return data or {}


def load_config(source: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                check: bool = True, option: str = "--config") -> Config:
    """Build a validated config from a preset name or YAML file and dotted overrides.

    A YAML file may start from a preset with a top-level ``preset: NAME`` key. ``check=False`` leaves the
    validation to the caller: with ``train.init_from`` the model section is replaced by the HF folder's first
    (``train/preflight.resolve_init_from``), and the layout must be checked against that model, not the preset's.
    ``option`` is the command-line option that named ``source``, for the errors.
    """
    cfg = Config()
    if source:
        path = Path(source)
        if not path.exists() and not str(source).endswith((".yaml", ".yml")):
            path = PRESET_DIR / f"{source}.yaml"
            if not path.exists():
                raise ConfigError(
                    f"No config file or preset named '{source}'. Presets: {', '.join(preset_names())}."
                )
        if not path.exists():
            raise ConfigError(f"Config file {source} does not exist (option {option}).")
        data = _read_yaml(path, option)
        if isinstance(data, dict) and data.get("preset"):
            base = PRESET_DIR / f"{data['preset']}.yaml"
            if not base.exists():
                raise ConfigError(
                    f"{path}: unknown preset '{data['preset']}'. Presets: {', '.join(preset_names())}."
                )
            update_from_dict(cfg, _read_yaml(base), str(base))
        update_from_dict(cfg, data, str(path))
    for item in overrides:
        section, key, value = parse_override(item)
        _apply(cfg, section, key, value)
    if check:
        validate(cfg)
    return cfg


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


# ----------------------------------------------------------------------------- validation


def data_blend(path: str) -> list[tuple[float, str]] | None:
    """``data.path`` as a weighted blend of prepared folders, Megatron's ``--data-path`` form
    ``"W1 DIR1 W2 DIR2 ..."``: the (weight, folder) pairs, weights normalised to sum to 1. None for one folder (or
    the default corpus). A folder that exists under the whole string is one folder, spaces and all."""
    parts = path.split()
    if len(parts) < 2 or Path(path).expanduser().exists():
        return None
    form = "a blend is 'W1 DIR1 W2 DIR2 ...' with weights > 0, e.g. data.path='0.7 data/code 0.3 data/prose'"
    try:
        float(parts[0])
    except ValueError:
        return None  # one folder whose name has spaces (checked, with its fix, where it is read)
    _need(len(parts) % 2 == 0, f"data.path {path!r} has {len(parts)} words: {form}.")
    pairs = []
    for word, folder in zip(parts[0::2], parts[1::2], strict=True):
        try:
            weight = float(word)
        except ValueError:
            raise ConfigError(f"data.path {path!r}: {word!r} (before {folder}) is not a weight: {form}.") from None
        _need(math.isfinite(weight) and weight > 0, f"data.path {path!r}: weight {word} of {folder} must be a "
              f"finite number > 0: {form}.")
        pairs.append((weight, folder))
    folders = [f for _, f in pairs]
    _need(len(set(folders)) == len(folders), f"data.path {path!r} names a folder twice: give each folder once, "
          f"with the sum of its weights.")
    total = sum(w for w, _ in pairs)
    return [(w / total, f) for w, f in pairs]


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _head_counts(d_model: int) -> list[int]:
    """Head counts that divide d_model into an even head dimension (RoPE rotates pairs)."""
    return [h for h in range(1, min(d_model, 128) + 1) if d_model % h == 0 and (d_model // h) % 2 == 0]


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Check every value that can be checked without data or devices; raise ConfigError."""
    m, p, t, d = cfg.model, cfg.parallel, cfg.train, cfg.data
    for name in ("d_model", "n_layers", "n_heads", "max_seq_len", "multiple_of"):
        _need(getattr(m, name) > 0, f"model.{name} must be positive, got {getattr(m, name)}.")
    _need(m.vocab_size >= 0, "model.vocab_size must be >= 0 (0 takes it from the tokenizer).")
    _need(m.head_size >= 0, f"model.head_size must be >= 0 (0: d_model / n_heads), got {m.head_size}.")
    if m.head_size:
        _need(m.head_size % 2 == 0, f"model.head_size={m.head_size} must be even (RoPE rotates pairs).")
    else:
        heads = _head_counts(m.d_model)
        _need(
            m.d_model % m.n_heads == 0,
            f"model.n_heads={m.n_heads} must divide model.d_model={m.d_model}: pick n_heads from {heads} (or set "
            f"model.head_size)." if heads
            else f"model.d_model={m.d_model} has no head count with an even head dimension (RoPE rotates pairs): "
                 f"pick an even model.d_model, e.g. {m.d_model + 1}.",
        )
        _need(m.head_dim % 2 == 0, f"head dimension d_model/n_heads = {m.head_dim} must be even for RoPE.")
    _need(m.n_kv_heads >= 0, "model.n_kv_heads must be >= 0 (0 means n_heads).")
    _need(
        m.n_heads % m.kv_heads == 0,
        f"model.n_kv_heads={m.kv_heads} must divide model.n_heads={m.n_heads} (grouped-query attention).",
    )
    _need(m.ffn_hidden >= 0, "model.ffn_hidden must be >= 0 (0 uses the Llama rule).")
    _need(math.isfinite(m.norm_eps) and m.norm_eps > 0, f"model.norm_eps must be a positive number (Llama: 1e-5), "
          f"got {m.norm_eps}.")
    _need(math.isfinite(m.init_std) and m.init_std > 0, f"model.init_std must be a positive number, got {m.init_std}.")
    _need(math.isfinite(m.rope_theta) and m.rope_theta > 0,
          f"model.rope_theta must be a positive number (Llama: 10000, Llama 3: 500000), got {m.rope_theta}.")
    _need(m.rope_scaling in ROPE_SCALINGS,
          f"model.rope_scaling must be one of {', '.join(ROPE_SCALINGS)} (llama3: Llama 3.1 and later), got "
          f"{m.rope_scaling!r}.")
    if m.rope_scaling == "llama3":
        _need(math.isfinite(m.rope_factor) and m.rope_factor > 0,
              f"model.rope_factor must be a positive number (Llama 3.1: 8, Llama 3.2: 32), got {m.rope_factor}.")
        _need(math.isfinite(m.rope_low_freq_factor) and 0 < m.rope_low_freq_factor < m.rope_high_freq_factor
              and math.isfinite(m.rope_high_freq_factor),
              f"model.rope_low_freq_factor={m.rope_low_freq_factor} and model.rope_high_freq_factor="
              f"{m.rope_high_freq_factor} must be positive with low < high (Llama 3.1: 1 and 4).")
        _need(m.rope_original_max_len > 0,
              f"model.rope_original_max_len must be positive (Llama 3.1: 8192), got {m.rope_original_max_len}.")
    _need(m.vocab_size != 1, "model.vocab_size must be 0 (from the tokenizer) or at least 2, got 1.")
    _check_moe(m)

    for name in ("steps", "global_batch", "grad_accum", "seq_len", "log_every", "eval_batches", "max_bad_steps"):
        _need(getattr(t, name) > 0, f"train.{name} must be positive, got {getattr(t, name)}.")
    for name in ("eval_every", "ckpt_every", "ckpt_keep", "warmup_steps", "sample_tokens", "threads", "profile_steps",
                 "gc_every"):
        _need(getattr(t, name) >= 0, f"train.{name} must be >= 0, got {getattr(t, name)}.")
    cpus = os.cpu_count() or 1  # torch.set_num_threads far above the CPUs kills the process without a word
    _need(t.threads <= cpus, f"train.threads={t.threads} is more than this machine's {cpus} CPUs: set at most {cpus} "
          f"(0: torch's default).")
    _need(t.profile_steps == 0 or 1 <= t.profile_start <= t.steps - t.profile_steps + 1,
          f"train.profile_start={t.profile_start} with train.profile_steps={t.profile_steps} must trace steps 1 to "
          f"train.steps={t.steps}: set train.profile_start between 1 and {max(t.steps - t.profile_steps + 1, 1)}"
          + (" (or lower train.profile_steps)." if t.profile_steps > t.steps else "."))
    _need(
        t.seq_len <= m.max_seq_len,
        f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}: "
        f"raise model.max_seq_len or lower train.seq_len.",
    )
    _need(m.sliding_window >= 0, f"model.sliding_window must be >= 0 (0: none), got {m.sliding_window}.")
    _need(m.mlp_activation in MLP_ACTIVATIONS,
          f"model.mlp_activation must be silu (SwiGLU) or gelu_tanh (GeGLU), got '{m.mlp_activation}'.")
    _need(t.seed >= 0, f"train.seed must be >= 0, got {t.seed}.")
    _need(math.isfinite(t.lr) and t.lr > 0, f"train.lr must be a positive number, got {t.lr}.")
    _need(math.isfinite(t.eps) and t.eps > 0, f"train.eps (AdamW's epsilon) must be a positive number, got {t.eps}.")
    _need(math.isfinite(t.weight_decay) and t.weight_decay >= 0,
          f"train.weight_decay must be a number >= 0, got {t.weight_decay}.")
    _need(math.isfinite(t.peak_flops) and t.peak_flops >= 0,
          f"train.peak_flops must be >= 0 FLOP/s (0: the chip table or a measurement), got {t.peak_flops}.")
    _need(0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio must be in [0, 1].")
    _check_lr_schedule(t)
    _need(0 <= t.beta1 < 1 and 0 <= t.beta2 < 1, "train.beta1 and train.beta2 must be in [0, 1).")
    _need(math.isfinite(t.grad_clip) and t.grad_clip >= 0, "train.grad_clip must be >= 0 (0 disables clipping).")
    _need(t.optimizer in ("adamw", "muon"), f"train.optimizer must be 'adamw' or 'muon', got '{t.optimizer}'.")
    _need(t.attention_mask in ATTENTION_MASKS, f"train.attention_mask must be causal or document, got "
                                                f"'{t.attention_mask}'.")
    _need(t.recompute in RECOMPUTE_MODES,
          f"train.recompute must be none, full or selective, got '{t.recompute}'.")
    _need(math.isfinite(t.muon_lr) and t.muon_lr >= 0 and 0 <= t.muon_momentum < 1,
          "train.muon_lr must be >= 0 (0: train.lr) and train.muon_momentum in [0, 1).")
    _need(math.isfinite(t.collective_timeout_s) and t.collective_timeout_s > 0,
          f"train.collective_timeout_s must be a positive number of seconds (how long a collective waits for its "
          f"peers before the run ends naming them), got {t.collective_timeout_s}.")
    _need(t.dtype in ("fp32", "bf16", "auto"), f"train.dtype must be fp32, bf16 or auto, got '{t.dtype}'.")
    _need(t.device in ("auto", "cpu", "cuda"), f"train.device must be auto, cpu or cuda, got '{t.device}'.")
    _need(t.resume or not t.resume_required, "train.resume_required=true makes a missing checkpoint an error when "
          "resuming: pass it with train.resume=true.")
    _need(not t.wandb or bool(t.wandb_project.strip()), "train.wandb=true needs a train.wandb_project name.")
    _need(d.source in ("files", "synthetic"), f"data.source must be 'files' or 'synthetic', got '{d.source}'.")
    _need(d.source == "files" or t.attention_mask == "causal",
          "train.attention_mask=document needs documents: data.source=synthetic is one endless stream; use "
          "data.source=files or train.attention_mask=causal.")
    _need(0 <= d.val_fraction <= 0.5, f"data.val_fraction must be in [0, 0.5], got {d.val_fraction}.")
    _need(not d.val_path or d.source == "files", "data.val_path validates on a prepared folder: it needs "
          "data.source=files (a synthetic stream validates on its own held-out stream).")
    data_blend(d.path)  # a blend's form (the folders themselves are checked before launch: preflight.check_data)

    for name in ("dp", "tp", "pp", "cp", "ep", "microbatches"):
        lo = 0 if name == "dp" else 1
        _need(getattr(p, name) >= lo, f"parallel.{name} must be >= {lo}, got {getattr(p, name)}.")
    _need(p.zero in (0, 1, 2, 3), f"parallel.zero must be 0, 1, 2 or 3, got {p.zero}.")
    _need(p.zero_layout in ("flat", "per_tensor"),
          f"parallel.zero_layout must be flat or per_tensor, got '{p.zero_layout}'.")
    _need(not (p.zero == 3 and p.zero_layout == "per_tensor"),
          "parallel.zero=3 shards flat units; parallel.zero_layout=per_tensor applies to zero=1 or 2.")
    _need(not (t.optimizer == "muon" and p.zero in (1, 2) and p.zero_layout == "flat"),
          "train.optimizer=muon orthogonalises whole matrices: with parallel.zero=1 or 2 set "
          "parallel.zero_layout=per_tensor.")
    _need(not (t.optimizer == "muon" and p.zero == 3),
          "train.optimizer=muon needs whole matrices: use parallel.zero=1 or 2 with zero_layout=per_tensor.")
    _need(p.reduce_dtype in REDUCE_DTYPES, f"parallel.reduce_dtype must be fp32 or bf16 (the dtype gradients are "
          f"reduced in), got '{p.reduce_dtype}'.")
    _need(math.isfinite(p.bucket_mb) and p.bucket_mb > 0, f"parallel.bucket_mb must be a positive number of MB, "
          f"got {p.bucket_mb}.")
    _need(p.schedule in SCHEDULES, f"parallel.schedule must be one of {', '.join(SCHEDULES)}, got '{p.schedule}'.")
    _need(p.virtual_stages >= 1, f"parallel.virtual_stages must be >= 1, got {p.virtual_stages}.")
    _need(p.pp > 1 or p.microbatches == 1, f"parallel.microbatches={p.microbatches} splits each step into pipeline "
          f"microbatches, but parallel.pp=1: accumulate with train.grad_accum={p.microbatches} instead, or set "
          f"parallel.pp > 1.")
    _need(p.p2p_posting in ("auto", "ahead", "ordered"), f"parallel.p2p_posting must be auto, ahead or ordered, "
          f"got '{p.p2p_posting}': set parallel.p2p_posting=auto (ordered on NCCL, ahead on gloo).")
    _need(p.dp_shard >= 0, f"parallel.dp_shard must be >= 0 (0: shard over all of dp), got {p.dp_shard}.")
    _need(p.dp_shard == 0 or p.zero > 0, f"parallel.dp_shard={p.dp_shard} sets HSDP's shard groups, but "
          f"parallel.zero=0 shards nothing (plain DP keeps whole replicas): set parallel.zero=1, 2 or 3, or drop "
          f"parallel.dp_shard.")
    _need(not (p.sp and p.tp == 1), "parallel.sp=true needs parallel.tp > 1 (it shards the sequence over tp).")
    _need(not (p.sp and t.seq_len % p.tp), f"parallel.sp=true splits train.seq_len={t.seq_len} over "
          f"parallel.tp={p.tp}: choose a seq_len divisible by tp.")
    _need(not (t.optimizer == "muon" and p.tp > 1),
          "train.optimizer=muon orthogonalises whole matrices; with parallel.tp > 1 each rank holds only a "
          "slice. Use adamw with tensor parallelism.")
    if p.tp > 1:
        _need(m.n_heads % p.tp == 0, f"parallel.tp={p.tp} must divide model.n_heads={m.n_heads} "
              f"(attention is split by heads).")
        # tp > kv heads: each kv head is replicated on the tp / n_kv_heads ranks whose query heads use it.
        _need(m.kv_heads % p.tp == 0 or p.tp % m.kv_heads == 0,
              f"parallel.tp={p.tp} must divide model.n_kv_heads={m.kv_heads} or be a multiple of it (a rank keeps "
              f"whole key/value heads, or one kv head shared by tp / n_kv_heads ranks): choose such a tp.")
        _need(m.hidden_dim % p.tp == 0, f"parallel.tp={p.tp} must divide the MLP hidden size {m.hidden_dim} "
              f"(model.ffn_hidden).")
    dp = resolve_dp(cfg, world_size)
    _check_context_and_experts(cfg, dp, known=world_size is not None or p.dp > 0)
    if p.pp > 1:
        _check_pipeline(cfg, dp)
    _need(p.dp_shard == 0 or dp % p.dp_shard == 0 or world_size is None,
          f"parallel.dp_shard={p.dp_shard} must divide the data-parallel size {dp} (HSDP shard groups).")
    _need(
        t.global_batch % (dp * t.grad_accum) == 0,
        f"train.global_batch={t.global_batch} must be divisible by data-parallel size {dp} x "
        f"train.grad_accum={t.grad_accum}: each microbatch needs a whole number of sequences per rank.",
    )


def _check_pipeline(cfg: Config, dp: int) -> None:
    """What pipeline parallelism needs from the rest of the config (before any process starts). Whether the
    schedule itself can be built (name, virtual stages, microbatches, enough layers for its stages) is the plan
    layer's check: ``meshtrain.plan.validate.validate_layout``."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    _need(p.zero in (0, 1), f"parallel.zero={p.zero} does not combine with parallel.pp > 1: ZeRO-2 would "
          f"reduce-scatter gradients after every one of the {p.microbatches} pipeline microbatches and ZeRO-3 would "
          f"also re-gather every weight for each of them. Use parallel.zero=0 or 1 with pipelines.")
    _need(not (m.tie_embeddings and p.schedule == "dualpipev"),
          "model.tie_embeddings=true with parallel.schedule=dualpipev: the V-shaped schedule runs the first and the "
          "last stage on one rank, where the tied weight would be synchronised after its first stage's last "
          "microbatch, before the other's; choose another schedule or untie the embeddings.")
    _need(not (m.tie_embeddings and p.zero == 1 and p.zero_layout == "per_tensor"),
          "model.tie_embeddings=true with parallel.pp > 1 and parallel.zero_layout=per_tensor: the first and the "
          "last stage's ranks must hold the same shard of the tied weight, which only the flat layout guarantees; "
          "use parallel.zero_layout=flat.")
    _need(t.grad_accum == 1, "with parallel.pp > 1 the pipeline microbatches are the accumulation: set "
          "train.grad_accum=1 and use parallel.microbatches.")
    rows = t.global_batch // dp
    _need(rows % p.microbatches == 0, f"each data-parallel rank's {rows} sequences (train.global_batch / dp) must "
          f"split evenly into parallel.microbatches={p.microbatches}.")


def resolve_dp(cfg: Config, world_size: int | None = None) -> int:
    """The data-parallel size: explicit, or what the world leaves after the other axes."""
    p = cfg.parallel
    others = p.pp * p.cp * p.tp
    if world_size is None:
        return p.dp or 1
    if p.dp:
        _need(
            p.dp * others == world_size,
            f"World size {world_size} does not match the layout pp*dp*cp*tp = "
            f"{p.pp}*{p.dp}*{p.cp}*{p.tp} = {p.dp * others}: launch {p.dp * others} processes (--nproc "
            f"{p.dp * others} on one node; --nproc x --nnodes = {p.dp * others} on several) or change parallel.dp.",
        )
        return p.dp
    _need(
        world_size % others == 0,
        f"World size {world_size} is not divisible by pp*cp*tp = {others}: launch a multiple of {others} "
        f"processes or change parallel.pp/cp/tp.",
    )
    return world_size // others


def _check_lr_schedule(t: TrainConfig) -> None:
    _need(t.lr_schedule in LR_SCHEDULES,
          f"train.lr_schedule must be cosine, linear, constant or wsd, got '{t.lr_schedule}'.")
    _need(t.decay_shape in DECAY_SHAPES, f"train.decay_shape must be sqrt, linear or cosine, got '{t.decay_shape}'.")
    _need(math.isfinite(t.decay_fraction) and 0 < t.decay_fraction <= 1,
          f"train.decay_fraction must be in (0, 1] (the share of train.steps that wsd decays), got {t.decay_fraction}.")
    _need(t.decay_steps >= 0, f"train.decay_steps must be >= 0 (0: from train.decay_fraction), got {t.decay_steps}.")
    if t.lr_schedule == "wsd":
        d = t.wsd_decay_steps()
        length = (f"train.decay_steps={d}" if t.decay_steps else
                  f"{d} steps (train.decay_fraction={t.decay_fraction} of train.steps={t.steps})")
        _need(t.warmup_steps + d <= t.steps,
              f"train.lr_schedule=wsd warms up for train.warmup_steps={t.warmup_steps} and decays for {length}, "
              f"more than train.steps={t.steps}: lower the warmup or the decay, or raise train.steps.")


def _check_moe(m: ModelConfig) -> None:
    _need(m.moe_experts >= 0, f"model.moe_experts must be >= 0 (0: dense MLP), got {m.moe_experts}.")
    if not m.moe_experts:
        return
    _need(1 <= m.moe_top_k <= m.moe_experts, f"model.moe_top_k={m.moe_top_k} must be between 1 and "
          f"model.moe_experts={m.moe_experts}.")
    _need(m.moe_shared_experts >= 0, "model.moe_shared_experts must be >= 0.")
    _need(m.moe_hidden >= 0, "model.moe_hidden must be >= 0 (0: the dense MLP's hidden size).")
    # isfinite too: an inf weight or rate is no setting, and it makes every step's loss or bias non-finite
    _need(math.isfinite(m.moe_capacity_factor) and m.moe_capacity_factor >= 0,
          "model.moe_capacity_factor must be a number >= 0 (0: dropless).")
    _need(math.isfinite(m.moe_aux_loss_coef) and m.moe_aux_loss_coef >= 0,
          "model.moe_aux_loss_coef must be a number >= 0 (0 disables the balancing loss).")
    _need(math.isfinite(m.moe_z_loss_coef) and m.moe_z_loss_coef >= 0,
          "model.moe_z_loss_coef must be a number >= 0 (0 disables the router z-loss; ST-MoE uses 0.001).")
    _need(math.isfinite(m.moe_bias_update_rate) and m.moe_bias_update_rate >= 0,
          "model.moe_bias_update_rate must be a number >= 0 (0 disables bias balancing).")


def _check_context_and_experts(cfg: Config, dp: int, known: bool) -> None:
    """What context and expert parallelism need from the shapes (before any process starts)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    _need(p.cp_layout in CP_LAYOUTS,
          f"parallel.cp_layout must be zigzag or contiguous, got '{p.cp_layout}'.")
    _need(p.cp_attention in CP_ATTENTIONS,
          f"parallel.cp_attention must be ring, allgather or ulysses, got '{p.cp_attention}'.")
    if p.cp > 1 and p.cp_attention == "ulysses":  # each rank's heads, after tp, split over cp
        hq, hkv = m.n_heads // p.tp, max(m.kv_heads // p.tp, 1)
        _need(hq % p.cp == 0 and hkv % p.cp == 0,
              f"parallel.cp_attention=ulysses splits each rank's heads over parallel.cp={p.cp}, but a tp rank holds "
              f"{hq} query and {hkv} key/value heads (model.n_heads={m.n_heads}, model.n_kv_heads={m.kv_heads}, "
              f"parallel.tp={p.tp}): choose a cp dividing both, or cp_attention=ring.")
    if p.cp > 1:
        chunks = 2 * p.cp if p.cp_layout == "zigzag" else p.cp
        _need(t.seq_len % chunks == 0, f"parallel.cp={p.cp} with cp_layout={p.cp_layout} cuts train.seq_len="
              f"{t.seq_len} into {chunks} equal chunks: choose a seq_len divisible by {chunks}.")
        _need(not (p.sp and (t.seq_len // p.cp) % p.tp), f"parallel.sp=true splits each context-parallel rank's "
              f"{t.seq_len // p.cp} tokens (train.seq_len / cp) over parallel.tp={p.tp}: choose a seq_len "
              f"divisible by cp*tp = {p.cp * p.tp}.")
    if p.ep > 1:
        _need(m.moe_experts > 0, f"parallel.ep={p.ep} shards experts, but the model has none: set "
              f"model.moe_experts (a multiple of {p.ep}) or parallel.ep=1.")
        _need(m.moe_experts % p.ep == 0, f"parallel.ep={p.ep} must divide model.moe_experts={m.moe_experts} "
              f"(each expert-parallel rank holds moe_experts/ep whole experts).")
        _need(not known or (dp * p.cp) % p.ep == 0, f"parallel.ep={p.ep} must divide dp*cp = {dp}*{p.cp} = "
              f"{dp * p.cp}: the expert-parallel group is carved out of the data- and context-parallel ranks.")
