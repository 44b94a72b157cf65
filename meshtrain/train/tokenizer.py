"""Tokenizers for the data pipeline: a dependency-free byte tokenizer and a HuggingFace wrapper.

Both expose the same small interface (``name``, ``vocab_size``, ``eos_id``, ``encode``, ``decode``,
``encode_array``) so ``prepare.py`` and generation code never need to know which one is in use.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import numpy as np

from meshtrain.config import BYTE_VOCAB

# Tried in order when looking for the document separator of a HuggingFace tokenizer.
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>")

TOKENIZER_CHOICES = "'byte', 'hf' (the tokenizer.json inside data.path) or a path to a tokenizer.json file"


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]: ...

    def encode_array(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus id 256 as the end-of-document separator."""

    name = "byte"
    vocab_size = BYTE_VOCAB
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as a list of ids (no eos appended)."""
        return list(text.encode("utf-8"))

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt's ids: its bytes (the byte tokenizer has no special tokens)."""
        return self.encode(text)

    def encode_array(self, text: str) -> np.ndarray:
        """Like :meth:`encode` but as a uint8 numpy array; avoids a Python int per byte on big corpora."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Iterable[int]) -> str:
        """Turn ids back into text; special ids (>= 256) are dropped, broken UTF-8 becomes U+FFFD."""
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A HuggingFace ``tokenizers`` tokenizer loaded from a ``tokenizer.json`` file.

    If the tokenizer has none of the usual end-of-text tokens, one extra id (``vocab_size`` of the
    file) is appended as the document separator, so ``vocab_size`` grows by one.
    """

    name = "hf"

    def __init__(self, path: str | Path) -> None:
        """Load ``path`` (a tokenizer.json). Raises ImportError if ``tokenizers`` is not installed."""
        # Imported lazily: `tokenizers` is an optional dependency and the byte tokenizer needs nothing.
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as e:
            raise ImportError(
                "a tokenizer.json tokenizer needs the `tokenizers` package: run `pip install tokenizers` "
                "(or `pip install meshtrain[tokenizers]`), or use data.tokenizer=byte"
            ) from e
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"the tokenizer file {self.path} is missing (option data.tokenizer)")
        try:
            self._tok = _HFTokenizer.from_file(str(self.path))
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception for a bad file
            raise ValueError(f"the tokenizer file {self.path} is not a HuggingFace tokenizer.json ({e}): pass the "
                             f"tokenizer.json of a model folder (option data.tokenizer, or prepare-data "
                             f"--tokenizer)") from None
        self._base_vocab = int(self._tok.get_vocab_size(with_added_tokens=True))
        eos = None
        for cand in EOS_CANDIDATES:
            tid = self._tok.token_to_id(cand)
            if tid is not None:
                eos = int(tid)
                break
        if eos is None:
            # No separator in the vocabulary: reserve one id past the end for it.
            self.eos_id = self._base_vocab
            self.vocab_size = self._base_vocab + 1
        else:
            self.eos_id = eos
            self.vocab_size = self._base_vocab

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens (no eos appended)."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt to a HuggingFace model, with the special tokens its tokenizer.json's
        post-processor adds (Llama's beginning-of-text token): the form the model was trained on, as
        ``tokenizer(text)`` in transformers gives it."""
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def encode_array(self, text: str) -> np.ndarray:
        """Like :meth:`encode` but as an int64 numpy array."""
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        """Text for ``ids``; the appended eos id (if any) and out-of-range ids are dropped."""
        keep = [int(i) for i in ids if 0 <= int(i) < self._base_vocab]
        return self._tok.decode(keep)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r})"


def tokenizer_tag(spec: str) -> str:
    """A short, filesystem-safe name for a tokenizer spec, used in cache folder names.

    ``"byte"`` stays ``"byte"``; a tokenizer.json becomes ``hf-<hash of its content>`` so two different
    files never share a cache folder. Does not import ``tokenizers``.
    """
    if spec == "byte":
        return "byte"
    p = Path(spec).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if p.is_file():
        return "hf-" + hashlib.sha1(p.read_bytes()).hexdigest()[:10]
    raise ValueError(_missing(spec, p))


def same_tokenizer(spec: str, prepared: str, folder: Path) -> bool:
    """Does ``spec`` (a ``data.tokenizer`` or ``--tokenizer`` value) name the tokenizer a prepared ``folder`` holds
    (``prepared``: its meta.json's ``tokenizer``, ``byte`` or ``hf``, the latter with its tokenizer.json)? ``hf``
    names the folder's own; a file is compared by content. A missing file is a ``ValueError`` naming it."""
    theirs = "byte" if prepared == "byte" else tokenizer_tag(str(folder / "tokenizer.json"))
    return theirs != "byte" if spec == "hf" else theirs == tokenizer_tag(spec)


def _missing(spec: str, path: Path) -> str:
    # A path that is not there is the usual mistake (a typo, a relative path from another folder): say so first.
    if path.is_dir():
        return (f"the folder {path} holds no tokenizer.json (data.tokenizer={spec!r}, or --tokenizer of "
                f"prepare-data): data.tokenizer must be {TOKENIZER_CHOICES}")
    return (f"the tokenizer file {path} is missing (data.tokenizer={spec!r}, or --tokenizer of prepare-data): "
            f"data.tokenizer must be {TOKENIZER_CHOICES}")


def load_tokenizer(spec: str, data_dir: str | Path | None = None) -> ByteTokenizer | HFTokenizer:
    """Build the tokenizer named by ``spec`` (the ``data.tokenizer`` option).

    ``"byte"`` -> :class:`ByteTokenizer`; a path to a tokenizer.json -> :class:`HFTokenizer`;
    ``"hf"`` -> the ``tokenizer.json`` stored in ``data_dir`` (a prepared data folder).
    """
    if spec == "byte":
        return ByteTokenizer()
    if spec == "hf":
        if data_dir is not None and (Path(data_dir) / "tokenizer.json").is_file():
            return HFTokenizer(Path(data_dir) / "tokenizer.json")
        if data_dir is not None and (Path(data_dir) / "meta.json").is_file() \
                and (Path(data_dir) / "index.json").is_file():  # a checkpoint folder, not a data folder
            raise ValueError(f"checkpoint {data_dir} was trained with a HuggingFace tokenizer but holds no "
                             f"tokenizer.json (it is saved beside every checkpoint): copy the run's tokenizer.json "
                             f"into it, or use another checkpoint.")
        where = f"data folder {data_dir}" if data_dir is not None else "data folder (data.path is not set)"
        raise ValueError(
            f"data.tokenizer=hf needs a tokenizer.json in the {where}; "
            f"data.tokenizer must be {TOKENIZER_CHOICES}"
        )
    p = Path(spec).expanduser()
    if p.is_dir() and (p / "tokenizer.json").is_file():
        p = p / "tokenizer.json"
    if p.is_file():
        return HFTokenizer(p)
    raise ValueError(_missing(spec, p))
