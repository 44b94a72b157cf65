"""The key/value cache of incremental decoding: each layer's keys and values of the positions seen so far.

Generation without a cache recomputes the whole context for every new token (T tokens of prompt and output:
O(T^2) token-layer passes). With it, the prompt is run once (prefill) and each new token runs one position
through the model, attending over the cached keys and values (decode).

The cache is a model-level object passed through ``Llama.forward(tokens, cache=...)``; it knows nothing of
distribution. Each layer's buffers are allocated on that layer's first write, shaped like the keys it is given:
[batch, kv heads of this module, capacity, head_dim]. A tensor-parallel rank's attention holds only its kv heads
(``parallel/tensor.py``), so the same cache is sharded by kv heads with no code of its own: 1/tp of one device's
bytes per rank when tp divides the kv heads; with fewer kv heads than tp, each rank holds the one kv head its
query heads use (replicated on tp / kv_heads ranks), i.e. 1/kv_heads of one device's bytes.

Batched prompts of different lengths are **left-padded**: row b starts with ``pad[b]`` padding positions, so
every row writes its next token at the same cache index (one write, one length for the batch). Padding keys
are masked out and each row's RoPE positions start at 0 at its first real token, so a row's logits are those
of its prompt alone. (Right-padding would keep positions trivial but make every row write at its own index.)
"""

from __future__ import annotations

import torch


class LayerKV:
    """One layer's view of the cache: ``update`` appends this step's keys/values and returns all of them."""

    def __init__(self, cache: KVCache, key: str) -> None:
        self.cache, self.key = cache, key

    @property
    def mask(self) -> torch.Tensor:
        """[B, 1, t, length + t] bool, True where a query may attend to a key (the step's mask)."""
        return self.cache.step_mask

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, H_kv, t, D] at the cache's current length; return the keys/values [B, H_kv, length + t, D]
        of every position so far."""
        c = self.cache
        if self.key not in c.k:
            b, h, _, d = k.shape
            c.k[self.key] = k.new_zeros((b, h, c.capacity, d))
            c.v[self.key] = v.new_zeros((b, h, c.capacity, d))
        ks, vs = c.k[self.key], c.v[self.key]
        end = c.length + k.shape[2]
        ks[:, :, c.length: end] = k
        vs[:, :, c.length: end] = v
        return ks[:, :, :end], vs[:, :, :end]


class KVCache:
    """Keys and values of every layer for a batch of left-padded sequences (see the module docstring).

    ``capacity``: positions it can hold (prompt plus new tokens, at most the model's ``max_seq_len``);
    ``pad`` [B]: padding positions at the start of each row (None: no padding); ``window``: the model's sliding
    window (``model.sliding_window``; 0: none), keys further back than it are masked out.
    """

    def __init__(self, batch: int, capacity: int, pad: torch.Tensor | None = None,
                 device: torch.device | str = "cpu", window: int = 0) -> None:
        self.batch, self.capacity, self.length, self.window = batch, capacity, 0, window
        self.pad = (pad if pad is not None else torch.zeros(batch, dtype=torch.long)).to(device=device,
                                                                                        dtype=torch.long)
        if self.pad.shape != (batch,):
            raise ValueError(f"pad must have one entry per row ({batch}), got shape {tuple(self.pad.shape)}")
        self.k: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.step_mask = torch.ones(batch, 1, 0, 0, dtype=torch.bool, device=device)

    def begin(self, t: int) -> torch.Tensor:
        """Start a forward over the next ``t`` positions: check room, set the step's attention mask, and return
        each row's RoPE positions [B, t] (the cache index minus the row's padding; 0 on padding)."""
        if self.length + t > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} positions: {self.length} + {t} do not fit.")
        device = self.pad.device
        q = torch.arange(self.length, self.length + t, device=device)  # cache index of each query
        j = torch.arange(self.length + t, device=device)  # and of each key
        causal = j[None, :] <= q[:, None]
        if self.window:  # a row's padding shifts its queries and keys alike: cache indices differ as positions do
            causal &= q[:, None] - j[None, :] < self.window
        real_key = j[None, None, :] >= self.pad[:, None, None]
        # A padding query still sees itself, so no row of the softmax is empty (its output is never used).
        self.step_mask = (causal[None] & (real_key | (j[None, :] == q[:, None])[None])).unsqueeze(1)
        return (q[None, :] - self.pad[:, None]).clamp(min=0)

    def layer(self, key: str) -> LayerKV:
        """The view of layer ``key`` (the layer's key in ``Llama.layers``)."""
        return LayerKV(self, key)

    def advance(self, t: int) -> None:
        """The forward over ``t`` positions is done: they are now part of the context."""
        self.length += t

    def nbytes(self) -> int:
        """Bytes of the keys and values this cache holds (allocated for ``capacity`` positions)."""
        return sum(t.numel() * t.element_size() for d in (self.k, self.v) for t in d.values())
