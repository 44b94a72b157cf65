"""The training loss (``meshtrain/parallel/cross_entropy.py``): F.cross_entropy's values and gradients, with the
logits and their gradient as its only large tensors. Vocab-parallel use (tp > 1) is covered by the tensor-parallel
equivalence tests, which run it against the one-device run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import meshtrain.parallel.cross_entropy as ce
from meshtrain.model.llama import cross_entropy_sum
from meshtrain.plan.memory import logits_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 7 * 4 * 1000], ids=["one chunk", "7-row chunks"])
def test_lean_loss_equals_f_cross_entropy(dtype, chunk, monkeypatch):
    if chunk:
        monkeypatch.setattr(ce, "CHUNK_BYTES", chunk)
    torch.manual_seed(0)
    x = (torch.randn(3, 100, 1000) * 3).to(dtype)
    t = torch.randint(0, 1000, (3, 100))
    t[0, :5] = -100  # ignored
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref, ours = cross_entropy_sum(a, t), ce.lean_cross_entropy(b, t)
    ref.backward()
    ours.backward()
    assert ours.dtype == torch.float32 and b.grad.dtype == dtype
    assert float(ours.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
    torch.testing.assert_close(b.grad.float(), a.grad.float(), rtol=1e-5, atol=1e-6)
    assert float(b.grad[0, :5].abs().sum()) == 0  # ignored tokens get no gradient


def test_padding_columns_are_not_classes_and_get_no_gradient():
    """A vocab-parallel rank's logits may end in padding columns (vocabulary padded to a multiple of tp)."""
    torch.manual_seed(1)
    x = torch.randn(40, 60)
    t = torch.randint(0, 50, (40,))
    a, b = x[:, :50].clone().requires_grad_(), x.clone().requires_grad_()
    ref, ours = cross_entropy_sum(a, t), ce.lean_cross_entropy(b, t, valid=50)
    ref.backward()
    ours.backward()
    assert float(ours.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
    torch.testing.assert_close(b.grad[:, :50], a.grad, rtol=1e-5, atol=1e-6)
    assert float(b.grad[:, 50:].abs().sum()) == 0


@pytest.mark.slow
def test_the_loss_holds_the_logits_and_their_gradient_not_fp32_copies():
    """Peak resident memory the loss adds to bf16 logits, forward and backward, each variant in a fresh process
    (benchmarks/loss_memory.py): F.cross_entropy ~10 bytes per logit; ours the gradient (2) and at most two
    chunks, within the planner's ``logits_bytes`` with the logits; inductor's about the gradient."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from loss_memory import main

    tokens, vocab = 4096, 16000
    rows = {r["variant"]: r for r in main(["--tokens", str(tokens), "--vocab", str(vocab), "--rounds", "1",
                                           "--json"])}
    per_logit = {k: r["bytes_per_logit"] for k, r in rows.items()}
    planned = logits_bytes(tokens, vocab, 2) / (tokens * vocab) - 2  # less the logits, which were there before
    assert per_logit["F.cross_entropy"] >= 8, per_logit
    assert per_logit["ours"] <= planned * 1.02, (per_logit, planned)
    assert per_logit["ours"] <= 0.5 * per_logit["F.cross_entropy"], per_logit
    assert per_logit["compiled F.cross_entropy"] <= 2.5, per_logit
