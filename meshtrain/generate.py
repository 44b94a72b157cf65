"""Text generation from a trained model.

``generate``: batched prompts, a KV cache (``model/kv_cache.py``), the next token chosen from the model's
(possibly vocabulary-sharded) logits by ``parallel/next_token.py``. The same loop runs on one device and on each
tensor-parallel rank: every rank feeds the same tokens, its attention caches only its kv heads, and the
next-token choice is agreed over tp. See docs/generation.md.

``sample``: the earlier one-prompt loop that recomputes the whole context for every token (no cache): the
trainer's end-of-run sample (it also works under sequence parallelism) and the reference the cache is tested
and benchmarked against (benchmarks/generate_kv.py).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import nn

from meshtrain.model.kv_cache import KVCache
from meshtrain.parallel.next_token import VocabSlice, greedy
from meshtrain.parallel.next_token import sample as sample_next


@dataclass
class Generated:
    """What ``generate`` returns: each prompt's new tokens (stopping before any of ``stop_ids``), the bytes of the
    KV cache this process held, and how many forward passes ran (one prefill + decode steps)."""

    tokens: list[list[int]]
    kv_bytes: int
    forwards: int


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] tokens with each prompt right-aligned (T = the longest), and [B] padding counts. An empty prompt
    becomes [pad_id] (a model needs one position to predict from), as in ``sample``."""
    rows = [list(p) or [pad_id] for p in prompts]
    t = max(len(r) for r in rows)
    tokens = torch.tensor([[pad_id] * (t - len(r)) + r for r in rows], dtype=torch.long)
    return tokens, torch.tensor([t - len(r) for r in rows], dtype=torch.long)


@torch.no_grad()
def generate(model: nn.Module, prompts: list[list[int]], max_new_tokens: int, vocab: VocabSlice,
             temperature: float = 0.0, top_k: int = 40, seed: int = 0, stop_ids: Collection[int] = ()) -> Generated:
    """Continue every prompt by up to ``max_new_tokens`` tokens with a KV cache: one forward over the left-padded
    prompts (prefill), then one position per step (decode).

    ``vocab`` says which vocabulary columns ``model``'s logits hold (``VocabSlice.whole`` on one device, the
    head's slice and tp group under tensor parallelism). ``temperature`` 0 is greedy; else sampling from the
    top ``top_k`` (0: whole vocabulary) with a generator seeded by ``seed``.

    The context is at most the model's ``max_seq_len`` positions (its RoPE tables): a longer prompt keeps its
    last ``max_seq_len`` tokens, and when the cache is full the context restarts from each row's last
    ``max_seq_len // 2`` tokens (a new prefill), since cached keys carry their positions' rotation and cannot
    slide. Within ``max_seq_len`` the tokens are those of ``sample``'s recompute loop. A model with a sliding window
    (``model.sliding_window``) attends within it in both: the cache masks older keys. A row ends before the first
    of ``stop_ids`` it produces (a model may have several end tokens: Llama 3.1's instruct models have three).
    """
    was_training = model.training
    model.eval()
    device = next(iter(model.buffers())).device  # buffers stay whole under every sharding
    limit = model.rope_cos.shape[0]
    history = [list(p) or [0] for p in prompts]  # an empty prompt predicts from token 0, as in ``sample``
    b = len(history)

    def window(keep: int, remaining: int) -> tuple[KVCache, torch.Tensor]:
        tokens, pad = left_pad([h[-keep:] for h in history])
        # the last new token is never fed back: the cache holds the prompt and remaining - 1 tokens
        return KVCache(b, min(limit, tokens.shape[1] + remaining - 1), pad, device,
                       model.cfg.sliding_window), tokens.to(device)

    cache, step_in = window(limit, max_new_tokens)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out: list[list[int]] = [[] for _ in range(b)]
    done = [False] * b
    forwards, kv_bytes = 0, 0
    for step in range(max_new_tokens):
        if cache.length + step_in.shape[1] > cache.capacity:  # full: restart from the recent half
            kv_bytes = max(kv_bytes, cache.nbytes())
            cache, step_in = window(max(1, limit // 2), max_new_tokens - step)
        logits = model(step_in, cache=cache, last_only=True)[:, -1]
        forwards += 1
        nxt = greedy(logits, vocab) if temperature <= 0 else sample_next(logits, vocab, temperature, top_k, gen)
        for i, token in enumerate(nxt.tolist()):
            history[i].append(token)
            if done[i] or token in stop_ids:
                done[i] = True
                continue
            out[i].append(token)
        if all(done):
            break
        step_in = nxt.view(b, 1).to(device)
    model.train(was_training)
    return Generated(out, max(kv_bytes, cache.nbytes()), forwards)


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
