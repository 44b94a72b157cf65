"""A weighted blend of prepared data folders: ``data.path="0.7 data/code 0.3 data/prose"`` (Megatron's
``--data-path`` form; ``config.data_blend`` parses it).

Each row of a step's global batch comes from folder k with probability w_k. The draw comes from the step's own
generator, and each folder's rows from another generator of the same step, so a blended batch is still a pure
function of ``(seed, step, split)``. That keeps what every batch here has: the data does not depend on the parallel
layout, and a resumed run sees the batches it would have seen without stopping.

Why drawn per row rather than Megatron's exact per-sample schedule (a greedy index over the whole run that keeps
each folder's share within one sample of its weight)? That index is a function of the sample's position in the run,
so step N needs the schedule up to N: state to build, store and resume. A draw per row needs none. Its share
follows the weights to within the binomial spread, sqrt(w(1-w)/rows) after that many rows (±0.5% after 10,000 at
w = 0.3).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshtrain.train.data import Rows, TokenDataset, batch_rng, check_batch_args, row_index, split_index


class BlendedDataset:
    """One split of several prepared folders, mixed by weight; the interface of ``TokenDataset``."""

    def __init__(self, folders: list[tuple[float, Path]], split: str = "train") -> None:
        """``folders``: (weight, prepared folder) pairs, weights summing to 1. Every folder must have been
        prepared with the same tokenizer: one model reads them all."""
        self.split = split
        self._split_id = split_index(split)
        self.weights = np.array([w for w, _ in folders], dtype=np.float64)
        self.parts = [TokenDataset(path, split) for _, path in folders]
        first = self.parts[0]
        for part in self.parts[1:]:
            for key in ("tokenizer", "vocab_size", "eos_id"):
                if part.meta[key] != first.meta[key]:
                    raise ValueError(
                        f"data.path blends {first.path} and {part.path}, prepared with different tokenizers "
                        f"({key} {first.meta[key]!r} against {part.meta[key]!r}): prepare every folder with the same "
                        f"--tokenizer (meshtrain prepare-data), so that one model reads them all")

    @property
    def path(self) -> Path:
        """The first folder: where the tokenizer is read from (all folders share it)."""
        return self.parts[0].path

    @property
    def meta(self) -> dict[str, Any]:
        return self.parts[0].meta

    @property
    def vocab_size(self) -> int:
        return self.parts[0].vocab_size

    @property
    def eos_id(self) -> int:
        return self.parts[0].eos_id

    @property
    def num_tokens(self) -> int:
        """Tokens in this split, over every folder."""
        return sum(part.num_tokens for part in self.parts)

    def can_sample(self, seq_len: int) -> bool:
        """Whether every folder's split holds a window: any row may come from any of them."""
        return all(part.can_sample(seq_len) for part in self.parts)

    def check_fits(self, seq_len: int) -> None:
        """Raise, naming the folder and ``train.seq_len``, when one folder's split cannot give a window."""
        for part in self.parts:
            part.check_fits(seq_len)

    def token_probs(self) -> np.ndarray:
        """The blend's unigram distribution: each folder's, weighted."""
        return sum(w * part.token_probs() for w, part in zip(self.weights, self.parts, strict=True))

    def sources(self, seed: int, step: int, batch_size: int) -> np.ndarray:
        """Which folder each row of ``step``'s global batch comes from (index into the blend)."""
        rng = batch_rng(seed, step, self._split_id, stream=0)
        return rng.choice(len(self.parts), size=batch_size, p=self.weights)

    def batch(self, seed: int, step: int, batch_size: int, seq_len: int,
              rows: Rows = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``rows`` (default all) of the global batch for ``step``, as ``TokenDataset.batch``: each row a
        window of the folder drawn for it, the j-th row drawn for a folder its j-th window of the step."""
        check_batch_args(seed, step, batch_size, seq_len)
        src = self.sources(seed, step, batch_size)
        wanted = np.zeros(batch_size, dtype=bool)
        wanted[row_index(rows, batch_size)] = True
        out = np.flatnonzero(wanted)  # the rows returned, in order
        inputs = torch.empty(len(out), seq_len, dtype=torch.int64)
        targets = torch.empty(len(out), seq_len, dtype=torch.int64)
        for k, part in enumerate(self.parts):
            drawn = np.flatnonzero(src == k)  # the global rows this folder gives, in order
            mine = wanted[drawn]
            if mine.any():
                at = torch.from_numpy(np.searchsorted(out, drawn[mine]))
                inputs[at], targets[at] = part.batch(seed, step, len(drawn), seq_len, stream=k + 1,
                                                     rows=np.flatnonzero(mine))
        if isinstance(rows, np.ndarray):  # in the order asked, as TokenDataset.batch gives them
            order = torch.from_numpy(np.searchsorted(out, rows))
            return inputs[order], targets[order]
        return inputs, targets

    def target_count(self, seed: int, step: int, batch_size: int, seq_len: int) -> int:
        """The learned targets of the whole global batch: each folder's, over the rows drawn for it."""
        check_batch_args(seed, step, batch_size, seq_len)
        src = self.sources(seed, step, batch_size)
        return sum(part.target_count(seed, step, n, seq_len, stream=k + 1)
                   for k, part in enumerate(self.parts) if (n := int((src == k).sum())))

    def describe(self) -> str:
        """E.g. ``a blend of 0.7 data/code, 0.3 data/prose (each row drawn by weight)``: the run log's line."""
        mix = ", ".join(f"{w:.3g} {part.path}" for w, part in zip(self.weights, self.parts, strict=True))
        return f"a blend of {mix} (each row drawn by weight)"

    def __repr__(self) -> str:
        return f"BlendedDataset({self.describe()}, split={self.split!r})"
