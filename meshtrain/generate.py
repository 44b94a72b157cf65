"""Text generation from a trained model (single device)."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def sample(model: nn.Module, prompt: list[int], max_new_tokens: int, max_len: int, temperature: float = 0.8,
           top_k: int = 40, seed: int = 0, stop_id: int | None = None, logits_fn=None,
           pad_multiple: int = 1) -> list[int]:
    """Autoregressive sampling; the context is cropped to the last ``max_len`` tokens.

    ``temperature`` 0 is greedy. ``top_k`` 0 samples from the whole vocabulary. ``logits_fn`` turns the
    model's output into full logits (tensor parallelism gathers the vocabulary shards). The context is
    right-padded to a multiple of ``pad_multiple`` (sequence parallelism splits it evenly); with a
    causal model the padding cannot change the logits of the real positions.
    """
    was_training = model.training
    model.eval()
    device = next(iter(model.buffers())).device  # buffers stay whole under every sharding
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tokens = list(prompt) or [0]
    out: list[int] = []
    for _ in range(max_new_tokens):
        window = tokens[-max_len:]
        n = len(window)
        padded = window + [0] * (-n % pad_multiple)
        ctx = torch.tensor([padded], device=device)
        last = model(ctx)[:, n - 1: n]
        logits = (logits_fn(last) if logits_fn is not None else last)[0, -1].float().cpu()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        if stop_id is not None and nxt == stop_id:
            break
        tokens.append(nxt)
        out.append(nxt)
    model.train(was_training)
    return out
