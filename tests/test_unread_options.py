"""Options a run does not read are named in its log (meshtrain/train/unread_options.py), and only those."""

from __future__ import annotations

import pytest

from meshtrain.config import load_config, preset_names
from meshtrain.train.preflight import resolve_init_from
from meshtrain.train.trainer import Trainer
from meshtrain.train.unread_options import RULES, unread_options

# (overrides under which the option is not read, the option, overrides appended under which it is read)
CASES = [
    (["train.decay_steps=5"], "train.decay_steps", ["train.lr_schedule=wsd"]),
    (["train.decay_shape=linear"], "train.decay_shape", ["train.lr_schedule=wsd"]),
    (["train.lr_schedule=wsd", "train.decay_steps=5", "train.decay_fraction=0.3"], "train.decay_fraction",
     ["train.decay_steps=0"]),
    (["train.lr_schedule=constant", "train.min_lr_ratio=0.5"], "train.min_lr_ratio", ["train.lr_schedule=cosine"]),
    (["train.muon_lr=0.02"], "train.muon_lr", ["train.optimizer=muon"]),
    (["train.profile_start=2"], "train.profile_start", ["train.profile_steps=1"]),
    (["train.wandb_project=x"], "train.wandb_project", ["train.wandb=true"]),
    (["train.sample_tokens=0", "train.sample_prompt=x"], "train.sample_prompt", ["train.sample_tokens=10"]),
    (["model.rope_factor=32"], "model.rope_factor", ["model.rope_scaling=llama3"]),
    (["model.ffn_hidden=96", "model.multiple_of=64"], "model.multiple_of", ["model.ffn_hidden=0"]),
    (["model.moe_top_k=1"], "model.moe_top_k", ["model.moe_experts=4"]),
    (["parallel.zero_layout=per_tensor"], "parallel.zero_layout", ["parallel.zero=1"]),
    (["parallel.reshard_after_forward=false"], "parallel.reshard_after_forward", ["parallel.zero=3"]),
    (["parallel.zero=1", "parallel.bucket_mb=5"], "parallel.bucket_mb", ["parallel.zero=0"]),
    (["parallel.sp_regather=false"], "parallel.sp_regather", ["parallel.tp=2", "parallel.sp=true"]),
    (["parallel.cp_attention=ulysses"], "parallel.cp_attention", ["parallel.cp=2"]),
    (["parallel.schedule=zb-h1"], "parallel.schedule", ["parallel.pp=2"]),
    (["data.source=synthetic", "data.tokenizer=tok.json"], "data.tokenizer", ["data.source=files"]),
    (["data.path=prepared", "data.val_fraction=0.1"], "data.val_fraction", ["data.path="]),
]


def _naming(notes: list[str], option: str) -> list[str]:
    return [n for n in notes if n.startswith(f"{option}=")]


@pytest.mark.parametrize("unread, option, read", CASES, ids=[c[1] for c in CASES])
def test_an_option_its_mode_ignores_is_named_once_and_only_then(unread, option, read):
    notes = unread_options(load_config("tiny", unread))
    assert len(_naming(notes, option)) == 1, notes
    assert not _naming(unread_options(load_config("tiny", unread + read)), option)


def test_every_rule_is_exercised():
    said = {note for unread, _, _ in CASES for note in unread_options(load_config("tiny", unread))}
    for _, _, why in RULES:
        assert any(why in note for note in said), why


def test_an_option_left_at_its_default_is_not_named():
    # A YAML that spells out the defaults (as `meshtrain plan --emit` and a run's config.yaml do) gets no note.
    assert unread_options(load_config("tiny", ["train.decay_shape=sqrt", "parallel.schedule=1f1b"])) == []


def test_shipped_configs_presets_and_planned_layouts_set_nothing_unread(tmp_path):
    from meshtrain.plan.cli import main as plan

    for source in ["configs/small.yaml", *preset_names()]:
        assert unread_options(load_config(source)) == [], source
    for i, extra in enumerate([[], ["--pp", "2"]]):  # one layout without a pipeline, one with
        emit = tmp_path / f"plan{i}.yaml"
        plan(["--model", "llama3-8b", "--devices", "8", "--emit", str(emit), *extra])
        assert unread_options(load_config(emit)) == [], emit.read_text()


def test_the_run_log_says_what_it_does_not_read(capsys):
    cfg = load_config("tiny", ["data.source=synthetic", "train.steps=1", "train.progress=false",
                               "train.tensorboard=false", "train.peak_flops=1e11", "train.sample_tokens=0",
                               "train.decay_steps=5", "train.muon_lr=0.02"])
    Trainer(cfg).train()
    out = capsys.readouterr().out
    assert "train.decay_steps=5 is not read: only train.lr_schedule=wsd has a decay phase." in out
    assert "train.muon_lr=0.02 is not read: only train.optimizer=muon reads it." in out


def test_model_options_init_from_replaces_are_named(tmp_path, capsys):
    """Directly, and in the log of ``meshtrain train``, which resolves the folder before the trainer does (the
    trainer's own resolve then sees the folder's model and nothing to name: the CLI hands its notes over)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from meshtrain import cli

    hf = LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(hf).save_pretrained(tmp_path / "hf")
    # d_model differs from the folder's, max_seq_len equals it, the rest are at their defaults: only d_model is named
    given = [f"train.init_from={tmp_path / 'hf'}", "model.d_model=48", "model.max_seq_len=64"]
    cfg = load_config("tiny", given)
    notes = resolve_init_from(cfg)
    said = f"model.d_model=48 is not read: train.init_from={tmp_path / 'hf'} gives 32."
    assert notes == [said], notes
    assert cfg.model.d_model == 32
    run = ["train.steps=1", "data.source=synthetic", "train.progress=false", "train.tensorboard=false",
           "train.peak_flops=1e11"]
    assert cli.main(["train", "--config", "tiny", *given, *run]) == 0
    assert said in capsys.readouterr().out
