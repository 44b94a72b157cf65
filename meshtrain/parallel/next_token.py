"""Choosing each row's next token from logits that may be split by vocabulary over tp, without gathering them.

Under tensor parallelism the LM head is vocab-parallel (``tensor.py``): a rank holds logits for its vocabulary
columns [start, start + V/tp) only. Gathering the full logits to pick one token per row would move and hold
B x V values per step (V = 128k for Llama 3); instead:

- **greedy**: each rank takes its local maximum and its global index; one all-gather of (value, index) per row,
  [tp, 2, B], and every rank picks the largest value, the smallest index among equals, which is what
  ``argmax`` over the whole vocabulary returns (its first maximum);
- **top-k sampling** (k > 0): the global top k is inside the union of the ranks' local top k, so one all-gather
  of k candidates per rank and row, [tp, 2, B, k], then every rank samples among them with the same generator
  and gets the same token;
- **top_k = 0** (the whole vocabulary) is the one case that gathers the full logits.

On one device (``VocabSlice.whole``) the same code runs with no collective, so one device and tp ranks apply
the same arithmetic to the same candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshtrain import comm
from meshtrain.mesh import AxisGroup


@dataclass(frozen=True)
class VocabSlice:
    """The vocabulary columns a rank's logits hold: [start, start + valid) of ``vocab``; local columns past
    ``valid`` are the padding of a vocabulary not divisible by tp. ``group``: the tp group (None: one device)."""

    start: int
    valid: int
    vocab: int
    group: AxisGroup | None = None

    @staticmethod
    def whole(vocab: int) -> VocabSlice:
        return VocabSlice(0, vocab, vocab, None)

    @property
    def split(self) -> bool:
        return self.group is not None and self.group.size > 1


def _real(logits: torch.Tensor, vs: VocabSlice) -> torch.Tensor:
    """[B, V_local] logits in fp32 with padding columns at -inf (never chosen)."""
    x = logits.float()
    if vs.valid < x.shape[-1]:
        x = x.clone()
        x[:, vs.valid:] = float("-inf")
    return x


def _gather(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """[tp, *x.shape]: every rank's ``x`` on every rank."""
    out = x.new_empty((group.size, *x.shape))
    comm.all_gather(out, x.unsqueeze(0).contiguous(), group)
    return out


def greedy(logits: torch.Tensor, vs: VocabSlice) -> torch.Tensor:
    """[B] global argmax of [B, V_local] logits (the first maximum, as ``argmax`` over the whole vocabulary)."""
    x = _real(logits, vs)
    if not vs.split:
        return x.argmax(-1)
    value, index = x.max(-1)  # the first maximum of this rank's columns
    # float64 holds every vocabulary index exactly; one message per row and rank
    mine = torch.stack((value.double(), (index + vs.start).double()))  # [2, B]
    allv = _gather(mine, vs.group)  # [tp, 2, B]
    best = allv[:, 0].max(0).values
    index = torch.where(allv[:, 0] == best, allv[:, 1], torch.inf).min(0).values
    return index.long()


def sample(logits: torch.Tensor, vs: VocabSlice, temperature: float, top_k: int,
           gen: torch.Generator) -> torch.Tensor:
    """[B] tokens sampled from softmax(logits / temperature) restricted to the global top ``top_k`` (0: the
    whole vocabulary). ``gen`` is a CPU generator in the same state on every tp rank, so all pick the same."""
    x = _real(logits, vs) / temperature
    if top_k <= 0 or top_k >= vs.vocab:
        if vs.split:  # the whole vocabulary: the one case that gathers the logits
            # [tp, V_local, B]: rank r holds columns r * V_local onwards; padding only ever ends the vocabulary
            x = _gather(x.t().contiguous(), vs.group).flatten(0, 1)[: vs.vocab].t()
        probs = torch.softmax(x.cpu(), -1)
        return torch.multinomial(probs, 1, generator=gen).squeeze(-1).to(logits.device)
    k = min(top_k, x.shape[-1])
    values, index = x.topk(k, -1)
    index = index + vs.start
    if vs.split:
        both = _gather(torch.stack((values.double(), index.double())), vs.group)  # [tp, 2, B, k]
        values, index = both[:, 0].permute(1, 0, 2).flatten(1), both[:, 1].permute(1, 0, 2).flatten(1)
        values, pick = values.topk(min(top_k, values.shape[-1]), -1)
        index = index.gather(-1, pick).long()
        values = values.float()
    probs = torch.softmax(values.cpu(), -1)
    choice = torch.multinomial(probs, 1, generator=gen)  # [B, 1], positions among the candidates
    return index.cpu().gather(-1, choice).squeeze(-1).to(logits.device)
