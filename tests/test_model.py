"""The plain model: causality, deterministic layout-independent init, the shared parameter count."""

import pytest
import torch

from meshtrain.config import ModelConfig
from meshtrain.model.init import init_box, init_weights
from meshtrain.model.llama import Llama, build_model
from meshtrain.plan.costs import flops_per_token, param_count

CFG = ModelConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)


def test_causal_future_tokens_do_not_change_earlier_logits():
    model = build_model(CFG, seed=0)
    x = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(1))
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % 257  # change every token from position 10 on
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])  # and the later ones do change


def test_init_depends_only_on_seed_and_names():
    a, b, c = build_model(CFG, seed=3), build_model(CFG, seed=3), build_model(CFG, seed=4)
    for (n, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters(), strict=True):
        assert torch.equal(p, q), n
        if p.dim() == 2:
            assert not torch.equal(p, r), n
    # A module holding only some layers (as a pipeline stage will) gets the same values for them.
    partial = Llama(CFG)
    del partial.layers["0"]
    init_weights(partial, CFG, seed=3)
    assert torch.equal(partial.layers["1"].attention.wq.weight, a.layers["1"].attention.wq.weight)


def test_param_count_matches_the_module():
    for cfg in (CFG, ModelConfig(vocab_size=257, d_model=64, n_layers=3, n_heads=8, tie_embeddings=True),
                ModelConfig(vocab_size=257, d_model=64, n_layers=3, n_heads=8, n_kv_heads=2, qkv_bias=True),
                ModelConfig(vocab_size=257, d_model=64, n_layers=2, n_heads=3, n_kv_heads=1, head_size=32)):
        model = Llama(cfg)
        assert param_count(cfg).total == sum(p.numel() for p in model.parameters())


def test_qkv_biases_start_at_zero_on_any_layout():
    """``model.qkv_bias``: wq, wk and wv get biases, zero at init (as in transformers), read by rows like any
    parameter (``init_box``), so a rank holding some heads' rows gets zeros too; the other Linears stay bias-free."""
    cfg = ModelConfig(vocab_size=257, d_model=64, n_layers=2, n_heads=8, n_kv_heads=2, qkv_bias=True)
    model = build_model(cfg, seed=3)
    biases = {n: p for n, p in model.named_parameters() if n.endswith(".bias")}
    assert sorted(biases) == sorted(f"layers.{i}.attention.{w}.bias" for i in range(2) for w in ("wq", "wk", "wv"))
    assert all(not p.any() for p in biases.values())
    assert torch.equal(init_box(cfg, 3, "layers.0.attention.wk.bias", (16,), ((8, 16),)), torch.zeros(8))


def test_llama2_13b_has_13_billion_parameters_and_6n_flops():
    from meshtrain.config import load_config

    cfg = load_config("llama2-13b").model
    n = param_count(cfg).total
    assert abs(n - 13.0e9) / 13.0e9 < 0.02  # the published 13.0B (the scaling book uses 13.1e9)
    f = flops_per_token(cfg, seq_len=4096)
    assert 6 * n < f < 6 * n * 1.2  # 6N plus the attention term


def test_flops_per_token_against_torchtitans_count():
    """torchtitan's count, 6 x (parameters less the embedding) + 12 x layers x heads x head_dim x T, does not halve
    causal attention; ours with causal=False is that less the norms' weights (no matmul). The ~1B benchmark model
    (docs/training.md, "MFU"): torchtitan's MFU is ours x 1.079 at T = 2048."""
    cfg = ModelConfig(vocab_size=257, d_model=64, n_layers=3, n_heads=8, n_kv_heads=2, max_seq_len=128)
    model, t = Llama(cfg), 128
    pc = param_count(cfg)
    titan = 6 * (sum(p.numel() for p in model.parameters()) - model.tok_embeddings.weight.numel()) \
        + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * t
    assert flops_per_token(cfg, t, causal=False) == titan - 6 * pc.norms
    assert flops_per_token(cfg, t) < flops_per_token(cfg, t, causal=False)
    bench = ModelConfig(vocab_size=32000, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, multiple_of=256,
                        max_seq_len=2048)
    assert round(flops_per_token(bench, 2048, causal=False) / flops_per_token(bench, 2048), 3) == 1.079


def test_a_sliding_window_counts_only_the_keys_in_it():
    """MFU's FLOPs count the (query, key) pairs a window keeps, brute-forced from the attention mask: with the book's
    continuous average (T/2 causal, not (T+1)/2) the mask's exact count per query is ``keys_per_query`` + w / 2T. A
    window as long as the sequence is causal; the trainer's and the planner's MFU read ``flops_per_token``."""
    from dataclasses import replace

    from meshtrain.model.layers import document_mask
    from meshtrain.plan.flops import attention_flops_per_token, keys_per_query, mfu

    for t, w in ((64, 12), (64, 1), (64, 63), (256, 100), (64, 64), (64, 0)):
        kept = int(document_mask(torch.zeros(1, t, dtype=torch.long), w).sum())
        edge = (w if 0 < w < t else t) / (2 * t)
        assert kept / t == pytest.approx(keys_per_query(t, True, w) + edge, rel=1e-12), (t, w)
    cfg = ModelConfig(vocab_size=257, d_model=64, n_layers=3, n_heads=8, n_kv_heads=2, max_seq_len=256)
    windowed = replace(cfg, sliding_window=16)
    attn = 4 * (16 - 16 * 16 / (2 * 256)) * 8 * 8 * 3  # 4 x keys x heads x head_dim x layers
    assert attention_flops_per_token(cfg, 256, window=16) == attn
    assert flops_per_token(windowed, 256) == flops_per_token(cfg, 256) - 3 * (attention_flops_per_token(cfg, 256)
                                                                              - attn)
    assert mfu(1e3, windowed, 256, 1e12) < mfu(1e3, cfg, 256, 1e12)
    assert flops_per_token(replace(cfg, sliding_window=256), 256) == flops_per_token(cfg, 256)


def test_bf16_autocast_runs_and_is_close():
    model = build_model(CFG, seed=0)
    x = torch.randint(0, 257, (2, 16))
    with torch.no_grad():
        ref = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(x)
    assert low.dtype == torch.bfloat16
    assert (low.float() - ref).abs().max() < 0.05 * ref.abs().max()


def _keep_in(store: list):
    def pack(t: torch.Tensor) -> torch.Tensor:
        store.append(t)
        return t
    return pack


def test_eager_rope_equals_the_real_form_and_saves_only_the_tables():
    """Eager RoPE (one complex multiply each way) against the real form that compiled runs use, forward and
    backward, on the [B, T, H, D] projections the attention passes it; and what backward keeps is only cos and
    sin, the model's tables (the SP memory test's exact activation model counts on that)."""
    from meshtrain.model.layers import apply_rope, rope_real, rope_tables

    cos, sin = rope_tables(16, 32, 10000.0)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        torch.manual_seed(0)
        base = torch.randn(2, 32, 4, 16).to(dtype)  # as wq(x).view(b, t, h, d)
        a, b = base.clone().requires_grad_(), base.clone().requires_grad_()
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(_keep_in(saved), lambda t: t):
            ya = apply_rope(a, cos, sin)
        yb = rope_real(b, cos.unsqueeze(-2), sin.unsqueeze(-2))  # broadcast over heads, as apply_rope does
        assert ya.dtype == dtype and ya.shape == yb.shape
        torch.testing.assert_close(ya.float(), yb.float(), rtol=tol, atol=tol)
        grad = torch.randn_like(ya)
        ya.backward(grad)
        yb.backward(grad)
        torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=tol, atol=tol)
        assert a.grad.dtype == dtype
        assert len(saved) == 2 and all(t.untyped_storage().data_ptr() in
                                       (cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr())
                                       for t in saved), [tuple(t.shape) for t in saved]


@pytest.mark.parametrize("compiled_form", [False, True])
def test_attention_rotates_the_projections_where_they_are_and_hands_the_core_views(monkeypatch, compiled_form):
    """RoPE rotates q and k in the projections' own [B, T, H, D] memory and the attention core gets [B, H, T, D]
    views of them, as of v: no copy on the way in only changes the layout. The eager form (a complex multiply, which
    keeps its input's memory order) already did; the real form that compiled blocks run (here eagerly,
    ``is_compiling`` patched) did not: rotating the transposed views wrote [B, H, T, D] copies of q and k,
    transposing kernels at ~60% of the copy rate on an H100 (docs/benchmarks.md)."""
    if compiled_form:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    model = build_model(CFG, seed=0)
    seen: list[tuple[torch.Tensor, ...]] = []
    for block in model.layers.values():
        block.attention.core.register_forward_pre_hook(lambda m, args: seen.append(args[:3]))
    model(torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(1)))
    assert len(seen) == CFG.n_layers
    for q, k, v in seen:
        assert q.shape == (2, CFG.n_heads, 16, CFG.head_dim)
        assert k.shape == v.shape == (2, CFG.kv_heads, 16, CFG.head_dim)
        assert all(t.transpose(1, 2).is_contiguous() for t in (q, k, v)), [t.stride() for t in (q, k, v)]
