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
