"""Config loading and the errors a user sees for bad input."""

import pytest

from meshtrain.config import ConfigError, load_config, preset_names, validate


def test_presets_load_and_overrides_apply():
    assert {"tiny", "small", "llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b",
            "llama3-405b"} <= set(preset_names())
    cfg = load_config("tiny", ["train.steps=7", "train.lr=1e-4", "model.tie_embeddings=true"])
    assert cfg.train.steps == 7 and cfg.train.lr == 1e-4 and cfg.model.tie_embeddings is True
    assert load_config("llama3-70b").model.d_model == 8192
    # Llama 3.2's published shapes (tied, RoPE scaled by 32) against their parameter counts: 1.24B and 3.21B
    from meshtrain.plan.flops import param_count

    for name, billions in (("llama3.2-1b", 1.236), ("llama3.2-3b", 3.213)):
        m = load_config(name).model
        assert m.rope_scaling == "llama3" and m.rope_factor == 32 and m.tie_embeddings
        assert param_count(m).total / 1e9 == pytest.approx(billions, abs=0.001), name
    # Qwen2.5's (biases on q, k, v) against the Qwen2.5 report's totals and non-embedding counts: 0.49B / 0.36B and
    # 7.61B / 6.53B
    for name, billions, body in (("qwen2.5-0.5b", 0.494, 0.358), ("qwen2.5-7b", 7.616, 6.526)):
        pc = param_count(load_config(name).model)
        assert pc.biases > 0 and pc.total / 1e9 == pytest.approx(billions, abs=0.001), name
        assert (pc.total - pc.embedding - pc.head) / 1e9 == pytest.approx(body, abs=0.001), name
    # Qwen3's (per-head q and k norms; 0.6B's heads 128 wide over 1024 / 16) against the Qwen3 report's totals and
    # non-embedding counts: 0.6B / 0.44B and 8.2B / 6.95B
    for name, billions, body in (("qwen3-0.6b", 0.596, 0.440), ("qwen3-8b", 8.191, 6.946)):
        m = load_config(name).model
        pc = param_count(m)
        assert m.qk_norm and m.head_dim == 128 and pc.total / 1e9 == pytest.approx(billions, abs=0.001), name
        assert (pc.total - pc.embedding - pc.head) / 1e9 == pytest.approx(body, abs=0.001), name
    # Gemma's (GeGLU, scaled embedding, 256-wide heads, tied) against the Gemma report's non-embedding counts,
    # 1,981,884,416 and 7,751,248,896, and its totals (2.51B, 8.54B; the report's embeddings count 256,128 rows)
    for name, billions, body in (("gemma-2b", 2.506, 1_981_884_416), ("gemma-7b", 8.538, 7_751_248_896)):
        m = load_config(name).model
        pc = param_count(m)
        assert m.embed_scale and m.mlp_activation == "gelu_tanh" and m.tie_embeddings and m.head_dim == 256
        assert pc.total - pc.embedding - pc.head == body and pc.total / 1e9 == pytest.approx(billions, abs=0.001)
    # Qwen3-30B-A3B: 30.5B parameters, 3.3B of them active per token (128 experts, 8 per token)
    pc = param_count(load_config("qwen3-30b-a3b").model)
    assert pc.total / 1e9 == pytest.approx(30.532, abs=0.001)
    assert (pc.total - pc.mlp + pc.active_mlp) / 1e9 == pytest.approx(3.353, abs=0.001)


def test_heads_wider_than_d_model_over_n_heads():
    """model.head_size sets each head's width apart from d_model / n_heads: n_heads need not divide d_model."""
    m = load_config("tiny", ["model.n_heads=3", "model.n_kv_heads=1", "model.head_size=16"]).model
    assert (m.head_dim, m.d_model) == (16, 32)
    assert load_config("tiny").model.head_dim == 8  # d_model / n_heads


def test_yaml_file_with_preset(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("preset: tiny\ntrain:\n  steps: 3\n")
    cfg = load_config(f)
    assert cfg.train.steps == 3 and cfg.model.d_model == 32


@pytest.mark.parametrize("override, message", [
    ("train.stpes=3", "Unknown config key 'train.stpes'. Did you mean 'train.steps'?"),
    ("modle.d_model=3", "Unknown config section 'modle'. Did you mean 'model'?"),
    ("train.steps=ten", "train.steps must be an integer, got 'ten'."),
    ("train.lr=abc", "train.lr must be a number, got 'abc'."),
    ("model.tie_embeddings=maybe", "model.tie_embeddings must be true or false, got 'maybe'."),
    ("model.n_heads=5", "model.n_heads=5 must divide model.d_model=32"),
    ("model.d_model=65", "model.d_model=65 has no head count with an even head dimension (RoPE rotates pairs): "
                         "pick an even model.d_model, e.g. 66."),
    ("model.n_kv_heads=3", "model.n_kv_heads=3 must divide model.n_heads=4"),
    ("parallel.microbatches=4", "parallel.microbatches=4 splits each step into pipeline microbatches, but "
                                "parallel.pp=1: accumulate with train.grad_accum=4 instead, or set parallel.pp > 1."),
    ("parallel.dp_shard=2", "parallel.dp_shard=2 sets HSDP's shard groups, but parallel.zero=0 shards nothing (plain "
                            "DP keeps whole replicas): set parallel.zero=1, 2 or 3, or drop parallel.dp_shard."),
    ("train.seq_len=100", "train.seq_len=100 exceeds model.max_seq_len=64"),
    ("train.grad_accum=3", "train.global_batch=8 must be divisible by data-parallel size 1 x train.grad_accum=3"),
    ("parallel.zero=4", "parallel.zero must be 0, 1, 2 or 3, got 4."),
    ("train.dtype=fp16", "train.dtype must be fp32, bf16 or auto"),
    ("parallel.reduce_dtype=fp16", "parallel.reduce_dtype must be fp32 or bf16 (the dtype gradients are reduced in), "
                                   "got 'fp16'."),
    ("steps=3", "the key must be section.key"),
    ("train.steps", "must look like section.key=value"),
])
def test_bad_values_get_clear_errors(override, message):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", override.split())  # some need two options
    assert message in str(e.value)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.cp=3", "train.seq_len=32"], "cuts train.seq_len=32 into 6 equal chunks"),
    (["parallel.cp=2", "parallel.cp_layout=contiguous", "train.seq_len=33", "model.max_seq_len=64"],
     "into 2 equal chunks"),
    (["parallel.cp=2", "parallel.cp_layout=spiral"], "parallel.cp_layout must be zigzag or contiguous"),
    (["parallel.cp=2", "parallel.cp_attention=tree"], "parallel.cp_attention must be ring, allgather or ulysses"),
    (["parallel.cp=4", "parallel.cp_attention=ulysses"], "parallel.cp_attention=ulysses splits each rank's heads "
     "over parallel.cp=4, but a tp rank holds 4 query and 2 key/value heads (model.n_heads=4, model.n_kv_heads=2, "
     "parallel.tp=1): choose a cp dividing both, or cp_attention=ring."),
    (["parallel.ep=2"], "parallel.ep=2 shards experts, but the model has none"),
    (["parallel.ep=3", "model.moe_experts=4"], "parallel.ep=3 must divide model.moe_experts=4"),
    (["parallel.dp=2", "parallel.ep=4", "model.moe_experts=4"], "parallel.ep=4 must divide dp*cp = 2*1"),
    (["model.moe_experts=4", "model.moe_top_k=5"], "model.moe_top_k=5 must be between 1 and"),
    (["train.profile_steps=-1"], "train.profile_steps must be >= 0, got -1."),
    (["train.steps=10", "train.profile_steps=2", "train.profile_start=10"],
     "train.profile_start=10 with train.profile_steps=2 must trace steps 1 to train.steps=10: set "
     "train.profile_start between 1 and 9."),
    (["train.steps=10", "train.profile_steps=2", "train.profile_start=0"], "between 1 and 9."),
    (["train.steps=4", "train.profile_steps=5"], "between 1 and 1 (or lower train.profile_steps)."),
])
def test_option_combinations_are_checked(overrides, message):
    """Context and expert shapes against the sequence and the model; the profiler's window against the run."""
    with pytest.raises(ConfigError) as e:
        load_config("tiny", overrides)
    assert message in str(e.value)


def test_world_size_must_match_layout():
    cfg = load_config("tiny")
    cfg.parallel.dp = 2
    with pytest.raises(ConfigError, match=r"World size 4 does not match the layout .*\(--nproc 2 on one node; "
                                          r"--nproc x --nnodes = 2 on several\)"):
        validate(cfg, world_size=4)
    cfg.parallel.dp = 0
    validate(cfg, world_size=4)  # dp fills the world
    with pytest.raises(ConfigError, match=r"global_batch=8 must be divisible by data-parallel size 16"):
        validate(cfg, world_size=16)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="No config file or preset named 'nope'"):
        load_config("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("train:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match="Did you mean 'train.steps'"):
        load_config(wrong)


@pytest.mark.parametrize("value, want", [("1", True), ("0", False), ("yes", True), ("off", False)])
def test_a_bool_takes_1_and_0_as_yaml_reads_them(value, want):
    assert load_config("tiny", [f"train.progress={value}"]).train.progress is want


@pytest.mark.parametrize("override, message", [
    ("model.rope_theta=0", "model.rope_theta must be a positive number"),
    ("model.rope_theta=.nan", "model.rope_theta must be a positive number"),
    ("model.rope_scaling=yarn", "model.rope_scaling must be one of none, llama3 (llama3: Llama 3.1 and later), got "
                                "'yarn'."),
    ("model.rope_scaling=llama3 model.rope_factor=0", "model.rope_factor must be a positive number"),
    ("model.rope_scaling=llama3 model.rope_low_freq_factor=4",
     "model.rope_low_freq_factor=4.0 and model.rope_high_freq_factor=4.0 must be positive with low < high"),
    ("model.rope_scaling=llama3 model.rope_original_max_len=0", "model.rope_original_max_len must be positive"),
    ("model.head_size=7", "model.head_size=7 must be even (RoPE rotates pairs)."),
    ("model.head_size=-2", "model.head_size must be >= 0 (0: d_model / n_heads), got -2."),
    ("model.n_heads=3", "model.n_heads=3 must divide model.d_model=32: pick n_heads from"),
    ("model.init_std=.inf", "model.init_std must be a positive number, got inf."),
    ("model.vocab_size=1", "model.vocab_size must be 0 (from the tokenizer) or at least 2, got 1."),
    ("train.lr=.inf", "train.lr must be a positive number, got inf."),
    ("train.eps=0", "train.eps (AdamW's epsilon) must be a positive number, got 0.0."),
    ("train.weight_decay=-1", "train.weight_decay must be a number >= 0, got -1.0."),
    ("train.weight_decay=.nan", "train.weight_decay must be a number >= 0, got nan."),
    ("train.peak_flops=-1", "train.peak_flops must be >= 0 FLOP/s"),
    ("train.muon_lr=.inf", "train.muon_lr must be >= 0"),
    ("train.grad_clip=.nan", "train.grad_clip must be >= 0"),
    ("train.seed=-1", "train.seed must be >= 0, got -1."),
    ("parallel.bucket_mb=.inf", "parallel.bucket_mb must be a positive number of MB, got inf."),
    ("parallel.schedule=nosuch", "parallel.schedule must be one of afab, 1f1b, interleaved, zb-h1, dualpipev, "
                                 "got 'nosuch'."),
    ("parallel.virtual_stages=0", "parallel.virtual_stages must be >= 1, got 0."),
])
def test_values_that_would_train_to_nan_or_fail_late_are_refused(override, message):
    """Each of these was accepted and then gave a NaN loss, or failed only after launch (a fuzz of every option)."""
    with pytest.raises(ConfigError) as e:
        load_config("tiny", override.split())  # some need two options
    assert message in str(e.value)


def test_no_number_option_takes_infinity():
    """Every float option of every section, set to inf where it is in use (experts on, Llama 3 RoPE scaling), is
    refused: none has a meaning for it (model.norm_eps=inf trained a model whose every output is uniform, an inf
    MoE loss weight made every step non-finite). A new option must be checked as it is added."""
    import dataclasses

    from meshtrain.config import Config

    accepted = []
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(getattr(Config(), section.name)):
            if f.type in ("float", float):
                try:
                    load_config("tiny", ["model.moe_experts=4", "model.rope_scaling=llama3",
                                         f"{section.name}.{f.name}=.inf"])
                    accepted.append(f"{section.name}.{f.name}")
                except ConfigError:
                    pass
    assert accepted == []


def test_more_threads_than_the_machine_has_cpus_are_refused():
    """torch.set_num_threads(100000) ended the process with a segfault and no message."""
    import os

    cpus = os.cpu_count()
    with pytest.raises(ConfigError, match=f"train.threads={cpus + 1} is more than this machine's {cpus} CPUs"):
        load_config("tiny", [f"train.threads={cpus + 1}"])
    assert load_config("tiny", [f"train.threads={cpus}"]).train.threads == cpus


def test_config_files_that_are_not_a_yaml_mapping_of_sections_get_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    for text, message in [("1: 2\n", "unknown config section '1'"),
                          ("train: {1: 2}\n", "Unknown config key 'train.1'"),
                          ("train: {steps: [\n", "is not valid YAML: "),
                          ("- a\n- b\n", "expected a mapping of sections")]:
        bad.write_text(text)
        with pytest.raises(ConfigError) as e:
            load_config(str(bad))
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    bad.write_bytes(b"\x84\xff\x00")
    with pytest.raises(ConfigError, match=r"bad.yaml cannot be read \(not UTF-8 text\)"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match=r"cannot be read \(Is a directory\)"):
        load_config(str(tmp_path))
