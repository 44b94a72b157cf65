"""Zero-bubble's deferred weight gradients (parallel/pipeline/wgrad.py) equal autograd's, in the same dtype path."""

import torch
from torch import nn

from meshtrain.parallel.pipeline.wgrad import WeightGradStore, defer_weight_grads


def _grads(deferred: bool, autocast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.Linear(32, 8, bias=False))
    x = torch.randn(4, 5, 16, requires_grad=True)
    store = WeightGradStore()
    if deferred:
        defer_weight_grads(model, store)
        store.key = (0, 0)  # armed, as during an I action
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    out.float().square().sum().backward()
    if deferred:
        assert model[0].weight.grad is None  # the I action left the weight gradients for W
        store.key = None
        store.apply((0, 0))
    return model[0].weight.grad, x.grad


def test_deferred_weight_grads_equal_autograds_in_fp32_and_under_bf16_autocast():
    """Bitwise: under bf16 autocast the W action's matmul runs in bf16 like autocast's own linear backward (it once
    ran in fp32: ~4x slower on this CPU, and a different rounding), and accumulates into the fp32 weight."""
    for autocast in (False, True):
        want_w, want_x = _grads(deferred=False, autocast=autocast)
        got_w, got_x = _grads(deferred=True, autocast=autocast)
        assert got_w.dtype == torch.float32
        assert torch.equal(got_x, want_x), autocast
        assert torch.equal(got_w, want_w), (autocast, (got_w - want_w).abs().max())


def _stage_grads(recompute: str, order: list[str] | None) -> dict[str, torch.Tensor]:
    """A first pipeline stage (embedding and two blocks) under ``recompute``, two microbatches: one plain backward
    each (``order`` None), or the zero-bubble actions in ``order`` (F: forward, I: input and cheap gradients with the
    store armed, W: the deferred weight gradients)."""
    from meshtrain.config import ModelConfig
    from meshtrain.model.llama import build_model
    from meshtrain.parallel.pipeline.engine import PipelineStage
    from meshtrain.parallel.pipeline.wgrad import immediate_params
    from meshtrain.parallel.recompute import apply_recompute

    cfg = ModelConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    model = build_model(cfg, seed=0)
    stage = PipelineStage(model, [0, 1], first=True, last=False)
    apply_recompute(model, recompute)
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, 257, (2, 16), generator=gen) for _ in range(2)]
    grads_out = [torch.randn(2, 16, 32, generator=gen) for _ in range(2)]
    if order is None:
        for x, g in zip(tokens, grads_out, strict=True):
            stage(x).backward(g)
    else:
        store, outs = WeightGradStore(), {}
        defer_weight_grads(stage, store)
        for kind, mb in ((a[0], int(a[1])) for a in order):
            if kind == "F":
                outs[mb] = stage(tokens[mb])
            elif kind == "I":
                store.key = (mb, 0)
                torch.autograd.backward(outs.pop(mb), grads_out[mb], inputs=immediate_params(stage))
                store.key = None
            else:
                store.apply((mb, 0))
    return {n: p.grad for n, p in stage.named_parameters()}


def test_deferred_weight_grads_reach_the_parameters_under_recompute():
    """Zero-bubble schedules with train.recompute: under activation checkpointing the weight a linear layer saved
    unpacks as another tensor object, and W once accumulated into that alias, so the Parameter lost a microbatch's
    weight gradient or all of them (zb-h1 and dualpipev trained on wrong gradients). Each order is one a zero-bubble
    schedule runs on its first stage; every gradient equals the plain backward's within fp32 rounding."""
    for recompute in ("full", "selective"):
        want = _stage_grads(recompute, None)
        for order in (["F0", "F1", "I0", "I1", "W0", "W1"], ["F0", "I0", "W0", "F1", "I1", "W1"],
                      ["F0", "F1", "I0", "W0", "I1", "W1"]):
            got = _stage_grads(recompute, order)
            for name, w in want.items():
                assert got[name] is not None, (recompute, order, name)
                torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-7, msg=f"{recompute} {order} {name}")
