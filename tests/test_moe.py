"""The mixture-of-experts block on one process: routing, capacity, the aux loss and its injected
gradient, aux-loss-free bias balancing, shared experts, parameter counts, and a tiny MoE model that learns."""

import math

import pytest
import torch

from meshtrain.config import ModelConfig
from meshtrain.model.init import init_weights
from meshtrain.model.llama import Llama, build_model, cross_entropy_sum
from meshtrain.model.moe import MoEFeedForward, expert_index
from meshtrain.parallel.recompute import apply_recompute
from meshtrain.parallel.units import model_units
from meshtrain.plan.costs import flops_per_token, moe_param_count, param_count, unit_numels

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


CFG = ModelConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                  moe_experts=8, moe_top_k=2)


def _moe(**kw) -> MoEFeedForward:
    cfg = ModelConfig(**{**CFG.__dict__, **kw})
    layer = MoEFeedForward(cfg)
    init_weights(layer, cfg, seed=0)
    return layer


def _x(b=2, t=16, d=32, seed=1) -> torch.Tensor:
    return torch.randn(b, t, d, generator=torch.Generator().manual_seed(seed))


def _by_hand(layer: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """out[t] = sum over t's top-k experts e of probs[t, e] x expert_e(x[t]), one token at a time."""
    flat = x.reshape(-1, x.shape[-1])
    probs = (flat @ layer.router.weight.t()).softmax(-1)
    out = torch.zeros_like(flat)
    for i in range(flat.shape[0]):
        for e in probs[i].argsort(descending=True)[: layer.top_k].tolist():
            out[i] += probs[i, e] * layer.experts[str(e)](flat[i: i + 1])[0]
    return out.view_as(x)


def test_router_picks_the_k_largest_and_gates_are_the_probabilities():
    layer = _moe()
    flat = _x().reshape(-1, 32)
    probs, choice, gates = layer.route(flat)
    want = (flat @ layer.router.weight.t()).softmax(-1)
    torch.testing.assert_close(probs, want)
    assert torch.equal(choice.sort(1).values, want.topk(2, dim=-1).indices.sort(1).values)
    torch.testing.assert_close(gates, want.gather(1, choice))  # not renormalised over the top k
    assert (gates.sum(1) < 1).all()


def test_dropless_processes_every_token_like_the_hand_computation():
    layer = _moe()
    seen = []
    run = layer.run_experts
    layer.run_experts = lambda rows, counts: seen.append(rows.shape[0]) or run(rows, counts)
    x = _x()
    out = layer(x)
    assert seen == [2 * 16 * 2]  # every token's two assignments
    torch.testing.assert_close(out, _by_hand(layer, x), rtol=1e-5, atol=1e-6)
    assert int(layer.load.sum()) == 64 and layer.dropped == 0


def test_capacity_drops_exactly_the_overflow_in_token_order():
    layer = _moe(moe_top_k=1, moe_capacity_factor=1.0, moe_experts=4, moe_aux_loss_coef=0.0)
    with torch.no_grad():  # every token prefers expert 0
        layer.router.weight.zero_()
        layer.router.weight[0] = 1.0
    x = _x(1, 16).abs()
    out = layer(x)
    cap = math.ceil(1.0 * 16 * 1 / 4)
    assert layer.dropped == 16 - cap and layer.load.tolist() == [16, 0, 0, 0]
    full = _by_hand(layer, x)
    torch.testing.assert_close(out[0, :cap], full[0, :cap], rtol=1e-5, atol=1e-6)  # the first come are served
    assert out[0, cap:].abs().max() == 0  # the rest only keep their residual (added by the block)
    # Top-2 with the same skew: expert 0 serves the first 4 tokens, the second choices spread.
    layer2 = _moe(moe_top_k=2, moe_capacity_factor=1.0, moe_experts=4, moe_aux_loss_coef=0.0)
    layer2.load_state_dict(layer.state_dict())
    layer2(x)
    cap2 = math.ceil(16 * 2 / 4)
    kept = layer2.load.clamp(max=cap2).sum()
    assert layer2.dropped == int(layer2.load.sum() - kept) and layer2.load[0] == 16


def _explicit_aux(layer: MoEFeedForward, x: torch.Tensor, coef: float) -> torch.Tensor:
    """coef x mean over sequences of E x sum_e f_se x P_se, written out (f counts are not differentiated)."""
    b, t, _ = x.shape
    probs = (x.reshape(-1, 32) @ layer.router.weight.t()).softmax(-1).view(b, t, -1)
    choice = probs.detach().topk(layer.top_k, dim=-1).indices
    f = torch.zeros(b, layer.n_experts).scatter_add_(1, choice.reshape(b, -1), torch.ones(b, t * layer.top_k))
    f = f / (t * layer.top_k)
    per_seq = layer.n_experts * (f * probs.mean(1)).sum(1)
    return coef * per_seq.mean()


def test_aux_loss_value_and_its_injected_gradient_match_an_explicit_loss():
    coef = 0.05
    layer = _moe(moe_aux_loss_coef=coef)
    x = _x(3, 16).requires_grad_(True)
    layer(x).square().sum().backward()
    injected = layer.router.weight.grad.clone(), x.grad.clone()
    want_value = _explicit_aux(layer, x.detach(), coef).detach()
    assert layer.aux_sum.item() == pytest.approx(float(want_value), rel=1e-5)

    plain = _moe(moe_aux_loss_coef=0.0)
    plain.load_state_dict(layer.state_dict())
    x2 = x.detach().clone().requires_grad_(True)
    (plain(x2).square().sum() + _explicit_aux(plain, x2, coef)).backward()
    torch.testing.assert_close(injected[0], plain.router.weight.grad, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(injected[1], x2.grad, rtol=1e-5, atol=1e-8)
    assert (injected[0] - _router_grad_without_aux(layer, x.detach())).abs().max() > 1e-6  # it did something


def _router_grad_without_aux(layer: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    plain = _moe(moe_aux_loss_coef=0.0)
    plain.load_state_dict(layer.state_dict())
    plain(x).square().sum().backward()
    return plain.router.weight.grad


def test_router_z_loss_value_and_its_injected_gradient_match_an_explicit_loss():
    """The router z-loss, coef x mean over tokens of logsumexp(logits)^2: its value (``z_sum``) and its injected
    gradient on the router and the input equal those of the loss written out and differentiated by autograd; the
    halves of a batch, with ``global_tokens`` set, add up to the whole; and it moves the router's gradient."""
    coef = 0.1
    layer = _moe(moe_aux_loss_coef=0.0, moe_z_loss_coef=coef)
    x = _x(3, 16).requires_grad_(True)
    layer(x).square().sum().backward()
    logits = x.detach().reshape(-1, 32) @ layer.router.weight.detach().t()
    assert layer.z_sum.item() == pytest.approx(coef * float(torch.logsumexp(logits, -1).square().mean()), rel=1e-5)

    plain = _moe(moe_aux_loss_coef=0.0)
    plain.load_state_dict(layer.state_dict())
    x2 = x.detach().clone().requires_grad_(True)
    explicit = coef * torch.logsumexp(x2.reshape(-1, 32) @ plain.router.weight.t(), -1).square().mean()
    (plain(x2).square().sum() + explicit).backward()
    torch.testing.assert_close(layer.router.weight.grad, plain.router.weight.grad, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-8)
    assert (layer.router.weight.grad - _router_grad_without_aux(layer, x.detach())).abs().max() > 1e-4

    halves = _moe(moe_aux_loss_coef=0.0, moe_z_loss_coef=coef)
    halves.load_state_dict(layer.state_dict())
    halves.global_tokens = 3 * 16
    halves(x.detach()[:1]).square().sum().backward()
    halves(x.detach()[1:]).square().sum().backward()
    assert float(halves.z_sum) == pytest.approx(float(layer.z_sum), rel=1e-6)
    torch.testing.assert_close(halves.router.weight.grad, layer.router.weight.grad, rtol=1e-5, atol=1e-8)


def test_aux_loss_is_a_sum_over_sequences_so_batch_splits_do_not_change_it():
    layer = _moe()
    x = _x(4, 16)
    layer.global_sequences = 4
    layer(x[:2]).sum().backward()
    layer(x[2:]).sum().backward()
    halves, grad = float(layer.aux_sum), layer.router.weight.grad.clone()
    whole = _moe()
    whole(x).sum().backward()
    assert halves == pytest.approx(float(whole.aux_sum), rel=1e-6)
    torch.testing.assert_close(grad, whole.router.weight.grad, rtol=1e-5, atol=1e-8)


def test_bias_changes_selection_not_gates_and_balances_a_skewed_router():
    layer = _moe(moe_bias_update_rate=0.01, moe_aux_loss_coef=0.0)
    flat = _x().reshape(-1, 32)
    probs, choice, gates = layer.route(flat)
    with torch.no_grad():
        layer.expert_bias[5] = 10.0  # expert 5 now wins every selection ...
    probs2, choice2, gates2 = layer.route(flat)
    assert (choice2 == 5).any(1).all() and not (choice == 5).any(1).all()
    torch.testing.assert_close(probs2, probs)
    torch.testing.assert_close(gates2, probs.gather(1, choice2))  # ... but its gate is still its probability
    # A skewed router: tokens share a direction u that expert 0's row favours, so every token picks
    # expert 0 (4x the mean load). A few updates bring the load toward the mean.
    layer = _moe(moe_bias_update_rate=0.002, moe_aux_loss_coef=0.0)
    u = torch.ones(32) / 32**0.5
    with torch.no_grad():
        layer.router.weight[0] += 0.3 * u
    x = 0.5 * _x(4, 32, seed=2) + 2 * u

    def imbalance() -> float:
        layer.reset_stats()
        with torch.no_grad():
            layer(x)
        load = layer.load.float()
        return float(load.max() / load.mean()), load

    start, load = imbalance()
    seen = []
    for _ in range(60):
        layer.update_bias(load)
        now, load = imbalance()
        seen.append(now)
    assert start == 4.0 and max(seen[-10:]) < 1.5, (start, seen)  # measured: 1.16 from step 36 on


def test_shared_experts_are_added_to_the_routed_output():
    layer = _moe(moe_shared_experts=2)
    assert layer.shared_experts.w1.weight.shape == (2 * CFG.hidden_dim, 32)
    x = _x()
    out = layer(x)
    shared, layer.shared_experts = layer.shared_experts, None
    torch.testing.assert_close(out, layer(x) + shared(x), rtol=1e-6, atol=1e-7)


def test_statistics_are_counted_once_under_recompute_and_not_in_eval():
    model = build_model(CFG, seed=0)
    apply_recompute(model, "full")
    x = torch.randint(0, 257, (2, 16))
    model(x).sum().backward()
    assert [int(b.feed_forward.load.sum()) for b in model.layers.values()] == [64, 64]
    model.eval()
    with torch.no_grad():
        model(x)
    assert [int(b.feed_forward.load.sum()) for b in model.layers.values()] == [64, 64]


def test_names_init_and_counts():
    model = build_model(CFG, seed=3)
    assert expert_index("layers.1.feed_forward.experts.7.w2.weight") == 7
    assert expert_index("layers.1.feed_forward.router.weight") is None
    # A model holding only some experts (as an expert-parallel rank does) gets the same values for them.
    partial = Llama(CFG)
    for key in ("0", "1", "2", "3"):
        del partial.layers["0"].feed_forward.experts[key]
    init_weights(partial, CFG, seed=3)
    torch.testing.assert_close(partial.layers["0"].feed_forward.experts["5"].w2.weight,
                               model.layers["0"].feed_forward.experts["5"].w2.weight, rtol=0, atol=0)
    for shared in (0, 1):
        cfg = ModelConfig(**{**CFG.__dict__, "moe_shared_experts": shared, "moe_hidden": 48})
        n = sum(p.numel() for p in Llama(cfg).parameters())
        assert param_count(cfg).total == n
        dense = ModelConfig(**{**cfg.__dict__, "moe_experts": 0})
        assert moe_param_count(dense, 8, 2, shared, 48) == (n, param_count(cfg).total
                                                               - 2 * (8 - 2) * 3 * 32 * 48)
    assert [u.numel for u in model_units(model)] == unit_numels(CFG)  # the planner's ZeRO units at ep=1
    # FLOPs count the active experts (top_k + shared), memory all of them.
    dense = ModelConfig(**{**CFG.__dict__, "moe_experts": 0})
    per_expert_flops = 6 * 2 * 3 * 32 * CFG.hidden_dim
    assert flops_per_token(CFG, 32) - flops_per_token(dense, 32) == pytest.approx(
        per_expert_flops * (2 - 1) + 6 * 2 * 32 * 8)


def test_a_tiny_moe_model_learns_on_one_process():
    cfg = ModelConfig(**{**CFG.__dict__, "moe_experts": 4, "moe_shared_experts": 1, "moe_bias_update_rate": 1e-3})
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 257, (4, 33), generator=g)
    losses = []
    for _ in range(40):
        loss = cross_entropy_sum(model(x[:, :-1]), x[:, 1:]) / x[:, 1:].numel()
        loss.backward()
        opt.step()
        opt.zero_grad()
        for block in model.layers.values():
            block.feed_forward.update_bias(block.feed_forward.load)
            block.feed_forward.reset_stats()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::10]
