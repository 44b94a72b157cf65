"""Datasets and the layout-independent batch sampler.

Every batch is a pure function of ``(seed, step, split)``: the random offsets come from
``np.random.default_rng([seed, step, split_id])``. Each rank draws every row's offset of the *global* batch
(a few integers) and reads only its own rows' tokens (``rows``: its data-parallel coordinate's,
``Parallel.batch_rows``), so the data seen does not depend on the parallel layout, a run resumed at step N sees
exactly the batches it would have seen without stopping, and what a rank reads falls as 1/dp. The global batch's
token count, which the loss divides by, comes from the offsets and the prompt lengths alone (``target_count``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshtrain.config import BYTE_VOCAB
from meshtrain.parallel.cross_entropy import IGNORE
from meshtrain.train.prepare import COUNT_CHUNK, META_FORMAT, counts_path, docs_path, prompts_path

SPLIT_IDS = {"train": 0, "val": 1}
_REQUIRED_META = ("format", "tokenizer", "vocab_size", "eos_id", "dtype", "train_tokens", "val_tokens")
_DTYPES = ("uint16", "uint32")
# 1: tokens only; 2: plus <split>.docs.npy, the document offsets; 3: plus <split>.counts.npy, each token id's
# count. The tokens are the same in all three.
READABLE_FORMATS = (1, 2, META_FORMAT)
# A folder without counts (formats 1 and 2): the unigram baseline counts at most this many tokens of a split, in
# evenly spaced blocks, so startup reads a bounded part of a corpus of any size (exact below it).
COUNT_SAMPLE_TOKENS = 1 << 26
COUNT_SAMPLE_BLOCKS = 64


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch tensor on ``device`` without the host waiting for the device: on CUDA it is copied from pinned
    memory, asynchronously (a copy from pageable memory would block the host until the device finished the
    work queued before it, leaving the device idle while the host then builds and queues the step)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class BatchAhead:
    """The next step's batch, made while this step's work runs on the device.

    ``make(step)`` builds a step's batch on the host and queues its copy to the device (``to_device``: pinned,
    asynchronous). The trainer calls ``ahead(step + 1)`` once its step is queued, before the step's one host read,
    so on a GPU the host builds the next batch while the device works, as a prefetching data loader would, where
    otherwise the device would sit idle at the start of every step while the host built it. Batches are pure
    functions of the step, so a batch made ahead is the one ``get`` would have made; ``get`` of any other step
    (the first, or after a resume) makes it then.
    """

    def __init__(self, make: Callable[[int], Any]) -> None:
        self._make = make
        self._step: int | None = None
        self._batch: Any = None

    def ahead(self, step: int) -> None:
        """Make ``step``'s batch now, for the ``get(step)`` to come."""
        self._step, self._batch = step, self._make(step)

    def get(self, step: int) -> Any:
        """``step``'s batch: the one made ahead, or a new one."""
        if self._step != step:
            return self._make(step)
        batch, self._step, self._batch = self._batch, None, None
        return batch


def split_index(split: str) -> int:
    """The split's number in every batch generator's seed (``train`` 0, ``val`` 1)."""
    if split not in SPLIT_IDS:
        raise ValueError(f"unknown data split {split!r}; expected one of {sorted(SPLIT_IDS)}")
    return SPLIT_IDS[split]


Rows = slice | np.ndarray | None  # which rows of a global batch to read (None: all)


def row_index(rows: Rows, batch_size: int) -> slice | np.ndarray:
    """``rows`` as an index of the global batch's ``batch_size`` rows (None: all of them)."""
    return slice(0, batch_size) if rows is None else rows


def check_batch_args(seed: int, step: int, batch_size: int, seq_len: int) -> None:
    """Refuse, naming it, an argument of ``batch`` out of range (SeedSequence rejects negative entries with an
    obscure message)."""
    if int(seed) < 0:
        raise ValueError(f"train.seed must be >= 0, got {seed}")
    if int(step) < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if int(batch_size) < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    if int(seq_len) < 1:
        raise ValueError(f"train.seq_len must be >= 1, got {seq_len}")


def batch_rng(seed: int, step: int, split_id: int, stream: int | None = None) -> np.random.Generator:
    """The generator of one step's batch; ``stream`` names another independent one of the same step (a blend's
    choice of sources and each source's rows, ``blend.py``)."""
    key = [int(seed), int(step), split_id] + ([int(stream)] if stream is not None else [])
    return np.random.default_rng(key)


def check_fits(path: str | Path, split: str, num_tokens: int, seq_len: int) -> None:
    """Raise, naming ``train.seq_len`` and the folder, when a split of ``num_tokens`` cannot give one window of
    ``seq_len`` tokens and the target after them (and one more: the offsets' exclusive bound)."""
    if num_tokens < seq_len + 2:
        raise ValueError(f"the {split} split of {path} has only {num_tokens} tokens, fewer than train.seq_len + 2 = "
                         f"{seq_len + 2}; lower train.seq_len or use more data")


def read_meta(path: str | Path) -> dict[str, Any]:
    """Read and validate ``meta.json`` of a prepared data folder, with errors that say how to fix it."""
    path = Path(path)
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"data.path {path} has no meta.json: it is not a prepared data folder. Run "
            f"`meshtrain prepare-data --src SOURCE --out {path}` (or leave data.path empty for the stdlib)"
        )
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{meta_path} is corrupt ({e}); re-run `meshtrain prepare-data`") from e
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path} is corrupt (not a JSON object); re-run `meshtrain prepare-data`")
    missing = [k for k in _REQUIRED_META if k not in meta]
    if missing:
        raise ValueError(
            f"{meta_path} is corrupt (missing {', '.join(missing)}); re-run `meshtrain prepare-data`"
        )
    if meta["format"] not in READABLE_FORMATS:
        raise ValueError(
            f"{meta_path} has unknown format {meta['format']!r} (this meshtrain reads formats "
            f"{', '.join(map(str, READABLE_FORMATS))}); "
            "re-run `meshtrain prepare-data`"
        )
    if meta["dtype"] not in _DTYPES:
        raise ValueError(f"{meta_path} has unknown dtype {meta['dtype']!r}; expected one of {_DTYPES}")
    for k in ("vocab_size", "eos_id", "train_tokens", "val_tokens"):
        if not isinstance(meta[k], int) or isinstance(meta[k], bool) or meta[k] < 0:
            raise ValueError(f"{meta_path} is corrupt ({k}={meta[k]!r}); re-run `meshtrain prepare-data`")
    return meta


def read_counts(path: str | Path, split: str, meta: dict[str, Any]) -> np.ndarray:
    """``<split>.counts.npy`` of a format 3 folder (``meta``: its meta.json), read with ``allow_pickle=False`` and
    checked against the split's token count: ``vocab_size`` numbers, so the trainer checks it before launch."""
    file = counts_path(Path(path), split)
    fix = "re-run `meshtrain prepare-data --force`"
    if not file.is_file():
        raise FileNotFoundError(f"{file} is missing; {fix}")
    try:
        counts = np.load(file, allow_pickle=False)
    except ValueError as e:
        raise ValueError(f"{file} is corrupt ({e}); {fix}") from None
    vocab, tokens = int(meta["vocab_size"]), int(meta[f"{split}_tokens"])
    if counts.dtype != np.dtype("<i8") or counts.shape != (vocab,) or (counts < 0).any() or int(counts.sum()) != tokens:
        raise ValueError(f"{file} is corrupt (not {vocab} int64 counts adding up to the split's {tokens} tokens); "
                         f"{fix}")
    return counts


def count_tokens(tokens: np.ndarray, vocab_size: int, limit: int | None = None,
                 blocks: int = COUNT_SAMPLE_BLOCKS) -> np.ndarray:
    """Each token id's count (int64 ``[vocab_size]``) in ``tokens`` (a memory map): exact when it holds at most
    ``limit`` tokens (default ``COUNT_SAMPLE_TOKENS``), else over ``blocks`` evenly spaced blocks adding up to
    ``limit``, an estimate that reads the same amount whatever the corpus's size. Counted ``COUNT_CHUNK`` tokens
    at a time, so memory stays that chunk's int64 copy and the counts."""
    limit = COUNT_SAMPLE_TOKENS if limit is None else limit
    n = len(tokens)
    if n <= limit:
        spans = [(0, n)]
    else:
        size = max(limit // blocks, 1)
        spans = [(int(a), int(a) + size) for a in np.linspace(0, n - size, blocks).astype(np.int64)]
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start, stop in spans:
        for i in range(start, stop, COUNT_CHUNK):
            counts += np.bincount(tokens[i:min(stop, i + COUNT_CHUNK)], minlength=vocab_size)[:vocab_size]
    return counts


class TokenDataset:
    """One split of a prepared data folder, memory-mapped read-only."""

    def __init__(self, path: str | Path, split: str = "train") -> None:
        """Open ``<path>/<split>.bin`` after checking it against ``meta.json``."""
        self.path = Path(path)
        self.split = split
        self._split_id = split_index(split)
        self.meta = read_meta(self.path)
        n = int(self.meta[f"{split}_tokens"])
        # Files are little-endian on disk whatever the host.
        dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")
        bin_path = self.path / f"{split}.bin"
        if not bin_path.is_file():
            raise FileNotFoundError(f"{bin_path} is missing; re-run `meshtrain prepare-data`")
        size = bin_path.stat().st_size
        if size != n * dtype.itemsize:
            raise ValueError(
                f"{bin_path} is truncated or corrupt: {size} bytes but meta.json says {n} tokens of "
                f"{dtype.name} ({n * dtype.itemsize} bytes); re-run `meshtrain prepare-data`"
            )
        # np.memmap cannot map an empty file; an empty split is still valid (e.g. val_fraction=0).
        self._tokens: np.ndarray = (
            np.memmap(bin_path, dtype=dtype, mode="r", shape=(n,)) if n > 0 else np.zeros(0, dtype=dtype)
        )
        # Records with a prompt (prepare-data --prompt-field): (document offsets, each one's prompt tokens).
        self._prompts = self._read_prompts() if self.meta.get("prompt_field") is not None else None

    def _read_prompts(self) -> tuple[np.ndarray, np.ndarray]:
        """The document offsets and ``<split>.prompts.npy`` (memory-mapped, ``allow_pickle=False``), checked: one
        count per document, each from 0 to the document's tokens less its eos."""
        offsets = self.doc_offsets
        path = prompts_path(self.path, self.split)
        fix = "re-run `meshtrain prepare-data --force`"
        if offsets is None or not path.is_file():
            raise FileNotFoundError(f"{path} is missing (meta.json names a prompt field); {fix}")
        try:
            prompts = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise ValueError(f"{path} is corrupt ({e}); {fix}") from None
        if prompts.dtype != np.dtype("<i8") or prompts.shape != (len(offsets) - 1,) or (prompts < 0).any() \
                or (prompts >= np.diff(offsets)).any():
            raise ValueError(f"{path} is corrupt (not one int64 prompt length per document, each shorter than its "
                             f"document); {fix}")
        return offsets, prompts

    def _prompt_tokens_in(self, lo: np.ndarray, hi: np.ndarray) -> int:
        """How many positions of the ranges ``[lo[i], hi[i])`` of the split are prompt tokens (``prompt_targets``
        counted without visiting each position): each range's overlap with the prompt of every document it spans.
        Only those documents' offsets and prompt lengths are read (the memory maps), nothing per document."""
        offsets, prompts = self._prompts
        first = np.searchsorted(offsets, lo, side="right") - 1
        last = np.searchsorted(offsets, hi - 1, side="right") - 1
        spans = last - first + 1
        row = np.repeat(np.arange(len(lo)), spans)  # one entry per (range, document it spans)
        doc = first[row] + np.arange(len(row)) - np.repeat(np.cumsum(spans) - spans, spans)
        start = offsets[doc]
        overlap = np.minimum(hi[row], start + prompts[doc]) - np.maximum(lo[row], start)
        return int(np.maximum(overlap, 0).sum())

    def prompt_targets(self, positions: np.ndarray) -> np.ndarray:
        """Whether each token position [B, T] of the split is part of a prompt (records with a prompt field; all
        False otherwise): a target there is not learned."""
        if self._prompts is None:
            return np.zeros(positions.shape, dtype=bool)
        offsets, prompts = self._prompts
        doc = np.searchsorted(offsets, positions, side="right") - 1
        return positions - offsets[doc] < prompts[doc]

    @property
    def doc_offsets(self) -> np.ndarray | None:
        """Where each document starts: int64 ``offsets`` with document ``i`` at tokens ``[offsets[i],
        offsets[i+1])`` (its eos last), memory-mapped; ``None`` for a format 1 folder (eos ids only).

        Read with ``allow_pickle=False``: the file is a plain ``.npy`` array, never unpickled.
        """
        if self.meta["format"] < 2:
            return None
        path = docs_path(self.path, self.split)
        fix = "re-run `meshtrain prepare-data`"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; {fix}")
        try:
            offsets = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise ValueError(f"{path} is corrupt ({e}); {fix}") from None
        if offsets.dtype != np.dtype("<i8") or offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0 \
                or offsets[-1] != self.num_tokens:
            raise ValueError(f"{path} is corrupt (not int64 offsets from 0 to the split's {self.num_tokens} "
                             f"tokens); {fix}")
        return offsets

    @property
    def vocab_size(self) -> int:
        """Number of token ids (model embedding size)."""
        return int(self.meta["vocab_size"])

    @property
    def eos_id(self) -> int:
        """Id appended after each document."""
        return int(self.meta["eos_id"])

    @property
    def num_tokens(self) -> int:
        """Tokens in this split."""
        return int(self._tokens.shape[0])

    def can_sample(self, seq_len: int) -> bool:
        """Whether the split holds one window of ``seq_len`` (inputs and the target after them) and one more."""
        return self.num_tokens >= seq_len + 2

    def check_fits(self, seq_len: int) -> None:
        """Raise, naming ``train.seq_len``, when the split cannot give one window (``can_sample``)."""
        check_fits(self.path, self.split, self.num_tokens, seq_len)

    def token_counts(self) -> np.ndarray:
        """How many times each token id occurs in the split, int64 ``[vocab_size]``: from ``<split>.counts.npy``
        (format 3, written by ``prepare-data``), read with ``allow_pickle=False`` and checked against the split;
        for an older folder, counted over at most ``COUNT_SAMPLE_TOKENS`` of it (``count_tokens``)."""
        if self.meta["format"] < 3:
            return count_tokens(self._tokens, self.vocab_size)
        return read_counts(self.path, self.split, self.meta)

    def token_probs(self) -> np.ndarray:
        """The split's unigram distribution over the vocabulary (float64, sums to 1; ``token_counts``)."""
        counts = self.token_counts().astype(np.float64)
        return counts / max(counts.sum(), 1.0)

    def _offsets(self, seed: int, step: int, batch_size: int, seq_len: int, stream: int | None) -> np.ndarray:
        """Where each row of the global batch starts: ``batch_size`` integers, whichever rows are read."""
        check_batch_args(seed, step, batch_size, seq_len)
        self.check_fits(seq_len)
        rng = batch_rng(seed, step, self._split_id, stream)
        # A window needs seq_len + 1 tokens (inputs plus the one extra target); high is exclusive.
        return rng.integers(0, self.num_tokens - seq_len, size=batch_size)

    def batch(self, seed: int, step: int, batch_size: int, seq_len: int, stream: int | None = None,
              rows: Rows = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``rows`` (default all) of the global batch of ``batch_size`` rows for ``step``: int64 ``(inputs,
        targets)`` of shape ``[len(rows), seq_len]``, read from the token file for those rows only.

        Rows are windows at random offsets; ``targets`` is ``inputs`` shifted left by one token, and -100 (not
        learned) where that token belongs to a record's prompt (``prepare-data --prompt-field``). The result
        depends only on ``(seed, step, split)`` (and ``stream``, which a blend sets per source).
        """
        offsets = self._offsets(seed, step, batch_size, seq_len, stream)
        idx = offsets[row_index(rows, batch_size), None] + np.arange(seq_len + 1)
        window = np.asarray(self._tokens[idx], dtype=np.int64)
        targets = window[:, 1:].copy()
        targets[self.prompt_targets(idx[:, 1:])] = IGNORE
        return torch.from_numpy(window[:, :-1].copy()), torch.from_numpy(targets)

    def target_count(self, seed: int, step: int, batch_size: int, seq_len: int, stream: int | None = None) -> int:
        """The learned targets (not -100) of the whole global batch of ``step``, from its rows' offsets and the
        prompt lengths: no token is read."""
        offsets = self._offsets(seed, step, batch_size, seq_len, stream)
        if self._prompts is None:
            return batch_size * seq_len
        # a row's targets are the split's positions offset + 1 .. offset + seq_len
        return batch_size * seq_len - self._prompt_tokens_in(offsets + 1, offsets + seq_len + 1)

    def __repr__(self) -> str:
        return f"TokenDataset({str(self.path)!r}, split={self.split!r}, num_tokens={self.num_tokens})"


class SyntheticDataset:
    """Tokens generated on the fly (``data.source=synthetic``), for benchmarks without any data files.

    Each row starts at a random token and follows ``next = (mult * prev + incr) % vocab_size``, except
    that with probability ``noise`` a token is replaced by a random one (and the chain continues from
    it). A model can learn the rule, so the loss falls, which makes benchmark runs look like training.
    """

    def __init__(
        self,
        vocab_size: int = BYTE_VOCAB,
        split: str = "train",
        num_tokens: int = 1 << 30,
        noise: float = 0.1,
        mult: int = 31,
        incr: int = 7,
    ) -> None:
        """``num_tokens`` is nominal (the stream is unbounded); it only feeds progress/epoch reporting."""
        if vocab_size < 2:
            raise ValueError(f"model.vocab_size must be >= 2 for synthetic data, got {vocab_size}")
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"synthetic data noise must be in [0, 1], got {noise}")
        self.split = split
        self._split_id = split_index(split)
        self._vocab_size = int(vocab_size)
        self._num_tokens = int(num_tokens)
        self.noise = float(noise)
        # A multiplier coprime to the vocabulary makes the rule a permutation (no collapsing chains).
        m = int(mult) % self._vocab_size or 1
        while math.gcd(m, self._vocab_size) != 1:
            m += 1
        self.mult = m
        self.incr = int(incr) % self._vocab_size
        self._tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def vocab_size(self) -> int:
        """Number of token ids."""
        return self._vocab_size

    @property
    def eos_id(self) -> int:
        """Nominal separator id (the last id); the synthetic stream has no documents."""
        return self._vocab_size - 1

    @property
    def num_tokens(self) -> int:
        """Nominal size of the split."""
        return self._num_tokens

    def can_sample(self, seq_len: int) -> bool:
        """Always: the stream is unbounded."""
        return True

    def _affine_tables(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        # k steps of x -> a*x + b from v give A[k]*v + b*S[k] with A[k] = a^k, S[k] = 1 + a + ... + a^(k-1);
        # precomputing them lets a whole batch be generated without a Python loop over positions.
        if n not in self._tables:
            v, a = self._vocab_size, self.mult
            A = np.empty(n, dtype=np.int64)
            S = np.empty(n, dtype=np.int64)
            A[0], S[0] = 1, 0
            for k in range(1, n):
                A[k] = A[k - 1] * a % v
                S[k] = (S[k - 1] + A[k - 1]) % v
            self._tables[n] = (A, S)
        return self._tables[n]

    def batch(self, seed: int, step: int, batch_size: int, seq_len: int,
              rows: Rows = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Same contract as :meth:`TokenDataset.batch`: a pure function of ``(seed, step, split)``. The random
        stream runs over the whole batch, so every rank generates all of it (cheap arithmetic, no file) and keeps
        its ``rows``."""
        check_batch_args(seed, step, batch_size, seq_len)
        n = seq_len + 1
        rng = batch_rng(seed, step, self._split_id)
        restart = rng.random((batch_size, n)) < self.noise
        restart[:, 0] = True  # every row starts from a random token
        rand = rng.integers(0, self._vocab_size, size=(batch_size, n), dtype=np.int64)
        pos = np.arange(n)
        last = np.maximum.accumulate(np.where(restart, pos, 0), axis=1)  # latest restart at or before t
        A, S = self._affine_tables(n)
        k = pos - last
        start = np.take_along_axis(rand, last, axis=1)
        toks = (A[k] * start + self.incr * S[k]) % self._vocab_size
        toks = toks[row_index(rows, batch_size)]
        return torch.from_numpy(toks[:, :-1].copy()), torch.from_numpy(toks[:, 1:].copy())

    def target_count(self, seed: int, step: int, batch_size: int, seq_len: int) -> int:
        """Every target is learned."""
        check_batch_args(seed, step, batch_size, seq_len)
        return batch_size * seq_len

    def __repr__(self) -> str:
        return f"SyntheticDataset(vocab_size={self._vocab_size}, split={self.split!r})"
