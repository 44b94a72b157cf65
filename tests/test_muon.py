"""Muon: Newton-Schulz, the Muon update, the Muon/AdamW hybrid and its place in the trainer's plumbing."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from meshtrain.config import ModelConfig, TrainConfig
from meshtrain.model.llama import build_model, cross_entropy_sum
from meshtrain.train.checkpoint import load_checkpoint, save_checkpoint
from meshtrain.train.muon import ZERO_LAYOUT_MESSAGE, HybridOptimizer, Muon, build_muon, newton_schulz
from meshtrain.train.optim import OptimParam, build_optimizer, model_params, set_lr

TINY = ModelConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=4, max_seq_len=64)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are tiny: one intra-op thread is as fast, and on a busy 2-core machine it avoids
    OpenMP threads spinning against each other (which made this file ~15x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _reference_ns(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Newton-Schulz written out directly (no transpose trick, fp64) as an independent check."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double() / (g.double().norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + b * gram @ x + c * gram @ gram @ x
    return x.to(g.dtype)


@pytest.mark.parametrize("shape", [(96, 32), (32, 80), (48, 48)])
def test_newton_schulz_orthogonalises(shape: tuple[int, int]) -> None:
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    o = newton_schulz(g)
    assert o.shape == g.shape and o.dtype == g.dtype
    s = torch.linalg.svdvals(o)
    if shape[0] != shape[1]:  # a random square matrix has singular values near 0 that 5 steps cannot lift
        assert s.min() > 0.5 and s.max() < 1.5, s
    else:
        assert s.max() < 1.5 and s.median() > 0.5, s
    torch.testing.assert_close(o, _reference_ns(g), rtol=1e-4, atol=1e-5)


def test_newton_schulz_keeps_dtype_and_rejects_vectors() -> None:
    g = torch.randn(8, 4, dtype=torch.float64)
    assert newton_schulz(g).dtype == torch.float64
    with pytest.raises(ValueError, match="2-D"):
        newton_schulz(torch.randn(8))


def test_muon_rejects_non_matrices() -> None:
    with pytest.raises(ValueError, match="2-D weight matrices only"):
        Muon([torch.nn.Parameter(torch.randn(8))], lr=0.02)
    with pytest.raises(ValueError, match="2-D weight matrices only"):
        HybridOptimizer([{"params": [torch.nn.Parameter(torch.randn(2, 2, 2))], "kind": "muon"}])


@pytest.mark.parametrize("make", ["muon", "hybrid"])
def test_muon_first_step_matches_hand_computation(make: str) -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.nn.Parameter(torch.randn(24, 40, generator=gen))
    grad = torch.randn(24, 40, generator=gen)
    w0 = w.detach().clone()
    lr, momentum, wd = 0.05, 0.9, 0.1
    if make == "muon":
        opt = Muon([w], lr=lr, momentum=momentum, weight_decay=wd)
    else:
        opt = HybridOptimizer([{"params": [w], "kind": "muon", "lr": lr}], lr=1.0, momentum=momentum, weight_decay=wd)
    w.grad = grad.clone()
    opt.step()
    # First step: buffer = grad; Nesterov looks ahead: grad + momentum * buffer.
    torch.testing.assert_close(opt.state[w]["momentum_buffer"], grad, rtol=0, atol=0)
    update = _reference_ns(grad + momentum * grad) * 0.2 * math.sqrt(40)
    expected = w0 * (1 - lr * wd) - lr * update
    torch.testing.assert_close(w.detach(), expected, rtol=1e-5, atol=1e-6)


def test_muon_plain_momentum() -> None:
    w = torch.nn.Parameter(torch.zeros(6, 4))
    opt = Muon([w], lr=0.1, momentum=0.5, nesterov=False)
    grads = [torch.randn(6, 4, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    for g in grads:
        w.grad = g.clone()
        opt.step()
    torch.testing.assert_close(opt.state[w]["momentum_buffer"], 0.5 * grads[0] + grads[1])


@pytest.mark.parametrize("fused", [False, True])  # fused is what CUDA uses; torch has a fused CPU kernel too
def test_adamw_part_matches_torch_adamw(fused: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    emb = torch.nn.Parameter(torch.randn(17, 8, generator=gen))
    norm = torch.nn.Parameter(torch.randn(8, generator=gen))
    hidden = torch.nn.Parameter(torch.randn(8, 8, generator=gen))
    ref_emb, ref_norm = (torch.nn.Parameter(t.detach().clone()) for t in (emb, norm))
    kw = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}
    hybrid = HybridOptimizer([
        {"params": [hidden], "kind": "muon", "lr": 0.02},
        {"params": [emb], "kind": "adamw", "weight_decay": 0.1},
        {"params": [norm], "kind": "adamw", "weight_decay": 0.0},
    ], fused=fused, **kw)
    ref = torch.optim.AdamW([{"params": [ref_emb], "weight_decay": 0.1}, {"params": [ref_norm], "weight_decay": 0.0}],
                            foreach=not fused, fused=fused, **kw)
    for _ in range(3):
        for p, r in ((emb, ref_emb), (norm, ref_norm)):
            g = torch.randn(p.shape, generator=gen)
            p.grad, r.grad = g.clone(), g.clone()
        hidden.grad = torch.randn(hidden.shape, generator=gen)
        hybrid.step()
        ref.step()
        hybrid.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    for p, r in ((emb, ref_emb), (norm, ref_norm)):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=0)
        assert hybrid.state[p].keys() == ref.state[r].keys()
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(hybrid.state[p][key], ref.state[r][key], rtol=1e-6, atol=0)
        assert hybrid.state[p]["step"].device == ref.state[r]["step"].device
    assert emb.grad is None and hidden.grad is None


def test_build_muon_splits_parameters() -> None:
    model = build_model(ModelConfig(**{**TINY.__dict__, "tie_embeddings": True}), seed=0)
    cfg = TrainConfig(optimizer="muon", lr=1e-3, muon_lr=0.02)
    opt = build_optimizer(model_params(model), cfg)
    assert isinstance(opt, HybridOptimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    by_kind: dict[str, set[str]] = {"muon": set(), "adamw": set()}
    for g in opt.param_groups:
        by_kind[g["kind"]].update(names[id(p)] for p in g["params"])
    assert "tok_embeddings.weight" in by_kind["adamw"] and "norm.weight" in by_kind["adamw"]
    assert "layers.0.attention.wq.weight" in by_kind["muon"] and "layers.1.feed_forward.w2.weight" in by_kind["muon"]
    assert all(n.endswith("norm.weight") or n == "tok_embeddings.weight" for n in by_kind["adamw"])
    assert not by_kind["muon"] & by_kind["adamw"]
    assert len(by_kind["muon"]) + len(by_kind["adamw"]) == len(list(model.parameters()))
    assert opt.defaults.get("fused") is True  # the AdamW kernel that takes the clip and the skip (CPU has one too)


def test_build_muon_rejects_flat_pieces() -> None:
    cfg = TrainConfig(optimizer="muon")
    whole = OptimParam("layers.0.attention.wq.weight", torch.zeros(4, 4), (4, 4))
    piece = OptimParam("layers.0.attention.wk.weight", torch.zeros(6), (4, 4))
    with pytest.raises(ValueError) as err:
        build_muon([whole, piece], cfg)
    assert str(err.value) == ZERO_LAYOUT_MESSAGE
    assert "zero_layout=per_tensor" in ZERO_LAYOUT_MESSAGE
    # A flat piece of an AdamW matrix (embedding) is fine: AdamW is element-wise.
    build_muon([whole, OptimParam("tok_embeddings.weight", torch.zeros(6), (4, 4))], cfg)


def test_set_lr_drives_muon_groups() -> None:
    cfg = TrainConfig(optimizer="muon", lr=2e-3, muon_lr=0.03, warmup_steps=4, steps=20)
    opt = build_muon(model_params(build_model(TINY, seed=0)), cfg)
    for step in (0, 3, 10):
        lr = set_lr(opt, step, cfg)
        for g in opt.param_groups:
            want = lr * cfg.muon_lr / cfg.lr if g["kind"] == "muon" else lr
            assert g["lr"] == pytest.approx(want, rel=1e-12)


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, TINY.vocab_size, (4, 33), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, cfg: TrainConfig, step: int) -> float:
    x, y = _batch()
    loss = cross_entropy_sum(model(x), y) / y.numel()
    loss.backward()
    set_lr(opt, step, cfg)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def test_tiny_model_learns_with_muon() -> None:
    torch.manual_seed(0)
    cfg = TrainConfig(optimizer="muon", steps=30, warmup_steps=0)
    model = build_model(TINY, seed=0)
    opt = build_optimizer(model_params(model), cfg)
    losses = [_train_step(model, opt, cfg, step) for step in range(cfg.steps)]
    assert all(math.isfinite(v) for v in losses)
    assert losses[0] - losses[-1] > 1.0, losses


def test_muon_part_alone_learns() -> None:
    """With AdamW's lr ~0 (embedding, head and norms frozen) the loss still falls: Muon's updates do work."""
    cfg = TrainConfig(optimizer="muon", steps=30, warmup_steps=0, lr=1e-6, muon_lr=0.02)
    model = build_model(TINY, seed=0)
    frozen = model.tok_embeddings.weight.detach().clone()
    opt = build_optimizer(model_params(model), cfg)
    losses = [_train_step(model, opt, cfg, step) for step in range(cfg.steps)]
    assert losses[0] - losses[-1] > 0.3, losses
    torch.testing.assert_close(model.tok_embeddings.weight.detach(), frozen, rtol=0, atol=1e-4)


def _params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_state_copy_reproduces_next_step() -> None:
    cfg = TrainConfig(optimizer="muon", steps=10, warmup_steps=2)
    model = build_model(TINY, seed=0)
    opt = build_optimizer(model_params(model), cfg)
    for step in range(3):
        _train_step(model, opt, cfg, step)
    fresh = copy.deepcopy(model)
    fresh_opt = build_optimizer(model_params(fresh), cfg)
    # What the checkpoint loader does: clear, then assign each parameter's tensors.
    fresh_opt.state.clear()
    src = dict(model.named_parameters())
    for name, p in fresh.named_parameters():
        fresh_opt.state[p] = {k: v.clone() for k, v in opt.state[src[name]].items()}
    kinds = {k for st in opt.state.values() for k in st}
    assert kinds == {"momentum_buffer", "step", "exp_avg", "exp_avg_sq"}
    assert all(torch.is_tensor(v) for st in opt.state.values() for v in st.values())
    _train_step(model, opt, cfg, 3)
    _train_step(fresh, fresh_opt, cfg, 3)
    assert _params_equal(model, fresh)


def test_checkpoint_round_trip(tmp_path) -> None:
    cfg = TrainConfig(optimizer="muon", steps=10, warmup_steps=2)
    model = build_model(TINY, seed=0)
    opt = build_optimizer(model_params(model), cfg)
    for step in range(2):
        _train_step(model, opt, cfg, step)
    path = save_checkpoint(tmp_path, 2, model, opt, {})
    restored = build_model(TINY, seed=1)
    restored_opt = build_optimizer(model_params(restored), cfg)
    load_checkpoint(path, restored, restored_opt)
    _train_step(model, opt, cfg, 2)
    _train_step(restored, restored_opt, cfg, 2)
    assert _params_equal(model, restored)


def test_the_clip_and_the_skip_are_applied_inside_the_step() -> None:
    """``optimizer_step``: a divisor d gives exactly the step on gradients / d (both kinds of group), and a
    non-finite flag changes nothing, parameters, moments and step counters included, though the gradients hold
    NaN (AdamW's fused kernel skips on the device; Muon reads the flag)."""
    from meshtrain.train.optim import optimizer_step

    def make():
        model = build_model(ModelConfig(**{**TINY.__dict__, "tie_embeddings": True}), seed=0)
        cfg = TrainConfig(optimizer="muon", lr=1e-3, muon_lr=0.02, weight_decay=0.1)
        return model, build_optimizer(model_params(model), cfg)

    torch.manual_seed(0)
    grads = [torch.randn_like(p) for p in make()[0].parameters()]
    a, opt_a = make()
    b, opt_b = make()
    for _ in range(3):
        for p, g in zip(a.parameters(), grads, strict=True):
            p.grad = g / 2.5
        opt_a.step()
        for p, g in zip(b.parameters(), grads, strict=True):
            p.grad = g.clone()
        optimizer_step(opt_b, torch.tensor(2.5), torch.tensor(0.0))
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pb, pa, rtol=1e-6, atol=1e-7)
    assert not hasattr(opt_b, "grad_scale") and not hasattr(opt_b, "found_inf")

    before = {n: p.detach().clone() for n, p in b.named_parameters()}
    state = {id(p): {k: v.clone() for k, v in opt_b.state[p].items()} for p in b.parameters()}
    for p in b.parameters():
        p.grad = torch.full_like(p, float("nan"))
    optimizer_step(opt_b, torch.tensor(float("nan")), torch.tensor(1.0))
    for n, p in b.named_parameters():
        assert torch.equal(p, before[n]), n
        for k, v in opt_b.state[p].items():
            assert torch.equal(v, state[id(p)][k]), (n, k)
    assert opt_b.state[next(b.parameters())]["step"].item() == 3
