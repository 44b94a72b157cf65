"""Options a run does not read: set away from their defaults in a mode that ignores them.

A YAML shared between ablations sets options on purpose that only some of its runs read (``train.decay_steps`` for
the wsd runs, ``train.muon_lr`` for the Muon ones), so refusing them would be wrong; saying nothing hides the slip
of a run that meant to read them (``train.lr_schedule`` left at cosine beside ``train.decay_steps=500``). The
trainer's log says each one first, a line per option on rank 0, as Megatron's argument check warns. Options that
can never make sense together are refused by ``config.validate`` instead (``parallel.microbatches`` with
``parallel.pp=1``, ``parallel.dp_shard`` without ZeRO, ``train.resume_required`` without ``train.resume``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from meshtrain.config import Config, ModelConfig

# (options, when the run does not read them, why): one rule per mode switch.
Rule = tuple[tuple[str, ...], Callable[[Config], bool], str]

_MOE = ("moe_top_k", "moe_renormalize", "moe_shared_experts", "moe_hidden", "moe_capacity_factor", "moe_aux_loss_coef",
        "moe_z_loss_coef", "moe_bias_update_rate")
_ROPE = ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len")

RULES: tuple[Rule, ...] = (
    (("train.decay_fraction", "train.decay_steps", "train.decay_shape"), lambda c: c.train.lr_schedule != "wsd",
     "only train.lr_schedule=wsd has a decay phase"),
    (("train.decay_fraction",), lambda c: c.train.lr_schedule == "wsd" and c.train.decay_steps > 0,
     "train.decay_steps sets the decay's length"),
    (("train.min_lr_ratio",), lambda c: c.train.lr_schedule == "constant",
     "train.lr_schedule=constant holds train.lr after the warm-up"),
    (("train.muon_lr", "train.muon_momentum"), lambda c: c.train.optimizer != "muon",
     "only train.optimizer=muon reads it"),
    (("train.profile_start",), lambda c: c.train.profile_steps == 0, "train.profile_steps=0 traces nothing"),
    (("train.wandb_project",), lambda c: not c.train.wandb, "train.wandb is off"),
    (("train.sample_prompt",), lambda c: c.train.sample_tokens == 0, "train.sample_tokens=0 generates nothing"),
    (tuple(f"model.{k}" for k in _ROPE), lambda c: c.model.rope_scaling != "llama3",
     "only model.rope_scaling=llama3 reads it"),
    (("model.multiple_of",), lambda c: c.model.ffn_hidden > 0, "model.ffn_hidden sets the MLP's width"),
    (tuple(f"model.{k}" for k in _MOE), lambda c: c.model.moe_experts == 0,
     "the MLP is dense (model.moe_experts=0)"),
    (("parallel.zero_layout",), lambda c: c.parallel.zero == 0, "only ZeRO (parallel.zero >= 1) shards"),
    (("parallel.reshard_after_forward",), lambda c: c.parallel.zero != 3,
     "only parallel.zero=3 gathers parameters for the forward"),
    (("parallel.bucket_mb",), lambda c: c.parallel.zero > 0 and c.parallel.ep == 1,
     "ZeRO reduces a sharding unit at a time; buckets are plain DP's (parallel.zero=0)"),
    (("parallel.sp_regather",), lambda c: not c.parallel.sp, "only sequence parallelism (parallel.sp=true) gathers"),
    (("parallel.cp_layout", "parallel.cp_attention"), lambda c: c.parallel.cp == 1,
     "parallel.cp=1 splits no sequence"),
    (("parallel.schedule", "parallel.virtual_stages", "parallel.p2p_posting"), lambda c: c.parallel.pp == 1,
     "parallel.pp=1 runs no pipeline"),
    (("data.path", "data.tokenizer", "data.val_fraction"), lambda c: c.data.source == "synthetic",
     "data.source=synthetic reads no files"),
    (("data.val_fraction",), lambda c: c.data.source == "files" and bool(c.data.path),
     "data.path's folders were split when prepared (meshtrain prepare-data --val-fraction)"),
)


def _value(cfg: Config, option: str) -> object:
    section, name = option.split(".")
    return getattr(getattr(cfg, section), name)


def unread_options(cfg: Config) -> list[str]:
    """One line per option set away from its default that this run does not read, saying why."""
    default = Config()
    out = []
    for options, unread, why in RULES:
        if not unread(cfg):
            continue
        out += [f"{o}={_value(cfg, o)} is not read: {why}." for o in options if _value(cfg, o) != _value(default, o)]
    return out


def replaced_model_options(given: ModelConfig, loaded: ModelConfig, folder: str) -> list[str]:
    """One line per model option set away from its default that ``train.init_from``'s config.json replaces by
    another value (the folder's model is what runs)."""
    out = []
    for f in dataclasses.fields(ModelConfig):
        mine, theirs = getattr(given, f.name), getattr(loaded, f.name)
        if mine != f.default and mine != theirs:
            out.append(f"model.{f.name}={mine} is not read: train.init_from={folder} gives {theirs}.")
    return out
