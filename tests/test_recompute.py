"""Activation checkpointing per block: same numbers as no recompute, less kept memory, names and hooks intact."""

import copy

import pytest
import torch

from meshtrain.config import ModelConfig
from meshtrain.model.llama import build_model, cross_entropy_sum
from meshtrain.parallel.recompute import (
    RECOMPUTE_MODES,
    apply_recompute,
    recompute_mode,
    saved_activation_bytes,
)

CFG = ModelConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(1))


def _loss_and_grads(mode: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = apply_recompute(build_model(CFG, seed=0), mode)
    x = _tokens()
    loss = cross_entropy_sum(model(x), x)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_same_loss_and_gradients_as_no_recompute(mode: str) -> None:
    ref_loss, ref_grads = _loss_and_grads("none")
    loss, grads = _loss_and_grads(mode)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert g is not None, name
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_no_grad_forward_is_unchanged(mode: str) -> None:
    ref = build_model(CFG, seed=0)
    model = apply_recompute(build_model(CFG, seed=0), mode)
    with torch.no_grad():
        assert torch.equal(model(_tokens()), ref(_tokens()))


@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
def test_parameter_and_module_names_unchanged(mode: str) -> None:
    ref = build_model(CFG, seed=0)
    model = apply_recompute(build_model(CFG, seed=0), mode)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert list(model.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in model.named_modules()] == [n for n, _ in ref.named_modules()]
    assert "layers.0.attention.wq.weight" in dict(model.named_parameters())
    assert all(recompute_mode(b) == mode for b in model.layers.values())


def test_saved_activation_bytes_full_lt_selective_lt_none() -> None:
    measured = {}
    for mode in RECOMPUTE_MODES:
        model = apply_recompute(build_model(CFG, seed=0), mode)
        x = _tokens()
        measured[mode] = saved_activation_bytes(lambda m=model, x=x: cross_entropy_sum(m(x), x))
    # Measured (torch 2.13 CPU, B=2, T=16): none 237572, selective 146948, full 55812 bytes.
    # These include 2048 bytes of the shared RoPE tables, which autograd also holds.
    assert measured["full"] < measured["selective"] < measured["none"], measured


def test_saved_activation_bytes_excludes_parameters_and_returned_output() -> None:
    w = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    # x @ w.t() saves x (128 bytes) and a view of w (a parameter, not counted); relu saves its
    # output, which is also what fn returns: counted once. The unsaved intermediate y is freed.
    assert saved_activation_bytes(lambda: torch.relu(x @ w.t())) == 128 + 128
    # An output nothing saves is held by the caller, not autograd: not counted.
    assert saved_activation_bytes(lambda: x + 1) == 0
    assert saved_activation_bytes(lambda: x * 2, exclude=[x]) == 0


def _held_by_a_thread_after_a_collective(rank: int, world_size: int) -> tuple[int, int]:
    import threading

    import torch.distributed as dist

    x = torch.randn(4, 8, requires_grad=True)
    kept: list[torch.Tensor] = []

    def fn(hold_s: float) -> torch.Tensor:
        t = x.detach() * 2  # 128 bytes nothing saves for backward
        dist.all_reduce(t)
        # As gloo's worker thread does: a reference to the collective's tensor dropped a moment later (or never).
        kept.append(t)
        if hold_s > 0:
            threading.Timer(hold_s, kept.clear).start()
        return x + t

    released = saved_activation_bytes(lambda: fn(0.2))
    never = saved_activation_bytes(lambda: fn(0.0), comm_settle_s=0.05)
    return released, never


def test_saved_activation_bytes_waits_for_a_backend_to_drop_a_collective_tensor() -> None:
    from meshtrain.testing.spawn import spawn

    released, never = spawn(_held_by_a_thread_after_a_collective, 1)[0]
    assert released == 0  # the thread let go within the settling time: not an activation
    assert never == 128  # still alive after it: counted


def test_bad_mode_raises() -> None:
    with pytest.raises(ValueError, match=r"train\.recompute.*none, full, selective"):
        apply_recompute(build_model(CFG, seed=0), "everything")


@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
def test_hooks_on_block_fire_once_inner_hooks_refire_in_recompute(mode: str) -> None:
    """Block-level hooks run in ``__call__`` outside the checkpointed region, so recomputation in backward
    (which re-runs only the inner forward) does not fire them again. Hooks on submodules are called by
    that inner forward, so they do fire again in backward; non-reentrant checkpoint stops recomputing
    once it has rebuilt the last tensor backward needs, so the last Linear (w2) gets its pre-hook but not
    its post-hook. A full backward pre-hook on the block fires before the recomputation starts, so that is
    where FSDP-style code must re-gather a block's weights; block-level forward hooks will not run then."""
    model = apply_recompute(build_model(CFG, seed=0), mode)
    block = model.layers["0"]
    events: list[str] = []
    block.register_forward_pre_hook(lambda *_: events.append("block_pre"))
    block.register_forward_hook(lambda *_: events.append("block_post"))
    block.register_full_backward_pre_hook(lambda *_: events.append("block_bwd_pre"))
    block.attention_norm.register_forward_pre_hook(lambda *_: events.append("norm_pre"))
    block.feed_forward.w2.register_forward_pre_hook(lambda *_: events.append("w2_pre"))
    block.feed_forward.w2.register_forward_hook(lambda *_: events.append("w2_post"))
    x = _tokens()
    loss = cross_entropy_sum(model(x), x)
    forward = ["block_pre", "norm_pre", "w2_pre", "w2_post", "block_post"]
    assert events == forward
    loss.backward()
    recomputed = [] if mode == "none" else ["norm_pre", "w2_pre"]
    assert events == forward + ["block_bwd_pre"] + recomputed


def test_reapplying_switches_mode_without_nesting() -> None:
    model = apply_recompute(build_model(CFG, seed=0), "full")
    wrapper = model.layers["0"].forward
    apply_recompute(model, "selective")
    assert model.layers["0"].forward is wrapper  # same wrapper, mode switched
    assert recompute_mode(model.layers["0"]) == "selective"
    apply_recompute(model, "none")  # "none" changes nothing
    assert recompute_mode(model.layers["0"]) == "selective"


def test_deepcopy_runs_the_copy_with_its_own_weights() -> None:
    model = apply_recompute(build_model(CFG, seed=0), "full")
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.layers.parameters():
            p.zero_()  # zero blocks: each block is then the identity
        h = clone.tok_embeddings(_tokens())
        assert torch.equal(clone.layers["0"](h, clone.rope_cos[:16], clone.rope_sin[:16]), h)
        assert not torch.equal(model.layers["0"](h, model.rope_cos[:16], model.rope_sin[:16]), h)


def test_wraps_a_forward_already_patched_on_the_instance() -> None:
    """A parallelism may have replaced a block's forward (or its submodules) first; recompute wraps that."""
    model = build_model(CFG, seed=0)
    block = model.layers["1"]
    calls: list[int] = []
    original = block.forward

    def patched(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return original(x, cos, sin)

    block.forward = patched
    apply_recompute(model, "full")
    x = _tokens()
    cross_entropy_sum(model(x), x).backward()
    assert len(calls) == 2  # forward, then recomputation in backward


def _matmuls(model: torch.nn.Module) -> tuple[int, int]:
    """(matmuls of the forward, matmuls of forward and backward together) of one step of ``model``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    matmuls = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            self.n += func.overloadpacket in matmuls
            return func(*args, **(kwargs or {}))

    x = _tokens()
    with Count() as count:
        loss = cross_entropy_sum(model(x), x)
        forward = count.n
        loss.backward()
    return forward, count.n


@pytest.mark.parametrize("moe", [0, 4])
def test_full_recompute_reruns_each_block_but_a_dense_blocks_mlp_exit(moe: int) -> None:
    """What the planner prices full recompute as (``steptime.full_recompute_time``): backward reruns each block's
    forward, but non-reentrant checkpointing stops once what backward needs is rebuilt, so a dense block's MLP exit
    matmul (whose output nothing keeps) is not rerun, nor the head; a MoE block reruns all of its matmuls (its
    combine's output is kept for the router weights' gradient)."""
    cfg = ModelConfig(**{**CFG.__dict__, "moe_experts": moe, "moe_top_k": 2 if moe else 0})
    fwd, none = _matmuls(build_model(cfg, seed=0))
    fwd_full, full = _matmuls(apply_recompute(build_model(cfg, seed=0), "full"))
    per_block = (fwd - 1) // cfg.n_layers  # the head is one matmul
    assert fwd_full == fwd and per_block == 4 + (1 + 3 * moe if moe else 3)  # q, k, v, o; router + experts, or MLP
    assert full - none == cfg.n_layers * (per_block - (0 if moe else 1))
