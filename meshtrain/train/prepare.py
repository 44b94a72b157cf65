"""``meshtrain prepare-data``: turn text files, JSONL or Parquet into memory-mapped token files.

A prepared data folder holds ``train.bin`` and ``val.bin`` (raw little-endian token arrays, one
end-of-document id after each document), ``train.docs.npy`` and ``val.docs.npy`` (where each document
starts), ``meta.json`` describing them, and ``tokenizer.json`` when a HuggingFace tokenizer was used.
The readers of each source format are in ``sources.py``. With no arguments the running Python's
standard library is used, so training works out of the box with no download.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import sysconfig
import time
from array import array
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from meshtrain.config import ArgumentParser, refuse_empty
from meshtrain.temp_folders import remove_stale_temp_folders, temp_folder_for
from meshtrain.train.paths import check_out_parent, unwritable_reason
from meshtrain.train.sources import (  # noqa: F401  (list_source_files: re-exported)
    DEFAULT_EXCLUDE_DIRS,
    DEFAULT_EXTENSIONS,
    FORMATS,
    detect_format,
    list_source_files,
    open_corpus,
)
from meshtrain.train.tokenizer import HFTokenizer, load_tokenizer, same_tokenizer, tokenizer_tag

log = logging.getLogger(__name__)

# 2: adds <split>.docs.npy (document offsets); 3: adds <split>.counts.npy (each token id's count). Folders of
# formats 1 and 2 are still read. A folder of records with a prompt (meta "prompt_field") also has
# <split>.prompts.npy: each document's prompt tokens, which training reads and does not learn.
META_FORMAT = 3
# Tokens counted per bincount while writing a split: bounds the int64 copy bincount makes (32 MB).
COUNT_CHUNK = 1 << 22


def default_source_dir() -> Path:
    """The running Python's standard library source folder (the default corpus)."""
    return Path(sysconfig.get_paths()["stdlib"])


def default_data_dir(tokenizer: str = "byte", val_fraction: float = 0.02) -> Path:
    """Cache folder for the prepared standard library: ``$MESHTRAIN_CACHE`` or ``~/.cache/meshtrain``.

    The subfolder name records the tokenizer, Python version and a non-default validation fraction,
    since each changes the tokens.
    """
    base = os.environ.get("MESHTRAIN_CACHE") or "~/.cache/meshtrain"
    v = sys.version_info
    val = "" if val_fraction == 0.02 else f"-val{val_fraction:g}"
    return Path(base).expanduser() / f"stdlib-{tokenizer_tag(tokenizer)}-py{v.major}{v.minor}{val}"


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest on-disk dtype for ``vocab_size`` ids (uint16 halves the files for small vocabularies).

    Always little-endian, so files move between hosts unchanged.
    """
    return np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")


def is_val_document(rel_path: str, val_fraction: float) -> bool:
    """Whether a document goes to the validation split, from a stable hash of its relative path.

    Hashing the path (not shuffling) makes the split reproducible across machines and runs, and keeps
    whole documents out of training so validation measures unseen text.
    """
    h = int(hashlib.sha1(rel_path.encode("utf-8")).hexdigest(), 16) % 10000
    return h < val_fraction * 10000


class _SplitWriter:
    """Appends documents to one ``.bin`` file, holding the last one back, and records where each starts.

    Holding the last document back lets the caller move it to the other split at the end (the fallback
    that keeps both splits non-empty) without buffering the whole corpus in memory. ``close`` writes the
    document offsets beside the tokens (``<split>.docs.npy``) and each token id's count
    (``<split>.counts.npy``): the trainer's unigram baseline then reads ``vocab_size`` numbers, not the split.
    """

    def __init__(self, path: Path, vocab_size: int, prompts: bool = False) -> None:
        self.path = path
        self._f: BinaryIO = open(path, "wb")  # closed in close()
        self.tokens = 0
        self._lengths = array("q")  # tokens of each written document, eos included (8 bytes a document)
        self._prompts = array("q") if prompts else None  # each written document's prompt tokens
        self._pending: tuple[np.ndarray, int] | None = None
        self.counts = np.zeros(vocab_size, dtype=np.int64)
        self._uncounted: list[np.ndarray] = []  # written documents not yet in counts (under COUNT_CHUNK tokens)
        self._uncounted_tokens = 0

    @property
    def docs(self) -> int:
        return len(self._lengths) + (self._pending is not None)

    def add(self, doc: np.ndarray, prompt: int = 0) -> None:
        """Append a document (its eos last) whose first ``prompt`` tokens are its prompt."""
        if self._pending is not None:
            self._write(*self._pending)
        self._pending = (doc, prompt)

    def take_last(self) -> tuple[np.ndarray, int]:
        assert self._pending is not None
        last, self._pending = self._pending, None
        return last

    def _write(self, doc: np.ndarray, prompt: int) -> None:
        self._f.write(memoryview(np.ascontiguousarray(doc)))
        self.tokens += len(doc)
        self._lengths.append(len(doc))
        if self._prompts is not None:
            self._prompts.append(prompt)
        # Counted in chunks: one bincount per document would cost O(vocab_size) each.
        self._uncounted.append(doc)
        self._uncounted_tokens += len(doc)
        if self._uncounted_tokens >= COUNT_CHUNK:
            self._count()

    def _count(self) -> None:
        if self._uncounted:
            ids = np.concatenate(self._uncounted)
            self.counts += np.bincount(ids, minlength=len(self.counts))[:len(self.counts)]
        self._uncounted, self._uncounted_tokens = [], 0

    def close(self) -> None:
        if self._f.closed:
            return
        if self._pending is not None:
            self._write(*self._pending)
            self._pending = None
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        offsets = np.zeros(len(self._lengths) + 1, dtype="<i8")
        np.cumsum(np.frombuffer(self._lengths, dtype=np.int64), out=offsets[1:])
        self._count()
        files = [(docs_path(self.path.parent, self.path.stem), offsets),
                 (counts_path(self.path.parent, self.path.stem), self.counts.astype("<i8"))]
        if self._prompts is not None:
            files.append((prompts_path(self.path.parent, self.path.stem),
                          np.frombuffer(self._prompts, dtype=np.int64).astype("<i8")))
        for path, array_ in files:
            with open(path, "wb") as f:
                np.save(f, array_, allow_pickle=False)
                f.flush()
                os.fsync(f.fileno())


def docs_path(folder: Path, split: str) -> Path:
    """``<split>.docs.npy``: int64 offsets, document ``i`` is tokens ``[offsets[i], offsets[i+1])`` (format 2)."""
    return folder / f"{split}.docs.npy"


def prompts_path(folder: Path, split: str) -> Path:
    """``<split>.prompts.npy``: int64, how many of document ``i``'s first tokens are its prompt (folders of
    records with a prompt field, meta ``prompt_field``): training reads them and does not learn them."""
    return folder / f"{split}.prompts.npy"


def counts_path(folder: Path, split: str) -> Path:
    """``<split>.counts.npy``: int64 ``[vocab_size]``, how many times each token id occurs in the split (format
    3)."""
    return folder / f"{split}.counts.npy"


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _read_meta(out: Path) -> dict[str, Any]:
    with open(out / "meta.json", encoding="utf-8") as f:
        return json.load(f)


def _prepared_meta(out: Path) -> dict[str, Any]:
    """The meta.json of a folder ``--out`` names, or a ``ValueError`` naming it (and ``--force``) when it is no
    prepared folder's."""
    path = out / "meta.json"
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        meta = e
    if not isinstance(meta, dict) or not all(k in meta for k in ("tokenizer", "files", "train_tokens", "val_tokens")):
        raise ValueError(f"{path} is not a prepared folder's meta.json: pass --force to rebuild {out}, or give "
                         f"another --out")
    return meta


class _Progress:
    """The bar: the source read so far (bytes, or rows for Parquet) and the tokens written per second."""

    def __init__(self, total: int, unit: str, enabled: bool | None) -> None:
        from tqdm import tqdm

        # enabled=None: tqdm's own rule, a bar only on a terminal (no control characters in a log file).
        self._bar = tqdm(total=total, unit=unit, unit_scale=True, dynamic_ncols=True, mininterval=0.5,
                         disable=None if enabled is None else not enabled, desc="prepare-data", file=sys.stderr)
        self._t0 = self._shown = time.perf_counter()
        self.tokens = 0

    def advance(self, work: int, tokens: int) -> None:
        self.tokens += tokens
        now = time.perf_counter()
        if now - self._shown >= 0.5:  # formatting the rate for every document would cost more than the bar
            self._shown = now
            self._bar.set_postfix_str(f"{self.tokens:,} tokens, {self.tokens_per_s():,.0f} tok/s", refresh=False)
        self._bar.update(work)

    def tokens_per_s(self) -> float:
        return self.tokens / max(time.perf_counter() - self._t0, 1e-9)

    def close(self) -> None:
        self._bar.set_postfix_str(f"{self.tokens:,} tokens, {self.tokens_per_s():,.0f} tok/s", refresh=False)
        self._bar.close()


def prepare_data(
    src: str | Path,
    out: str | Path,
    tokenizer: str = "byte",
    val_fraction: float = 0.02,
    extensions: tuple[str, ...] | None = None,
    exclude_dirs: tuple[str, ...] = DEFAULT_EXCLUDE_DIRS,
    *,
    fmt: str = "auto",
    field: str = "text",
    overwrite: bool = False,
    progress: bool | None = False,
    prompt_field: str | None = None,
) -> dict[str, Any]:
    """Tokenize the documents of ``src`` into ``out/{train,val}.bin``, ``{train,val}.docs.npy`` and ``meta.json``.

    ``src`` is a folder or one file; ``fmt`` (``auto`` | ``text`` | ``jsonl`` | ``parquet``, see
    ``sources.py``) says how to read it: each text file, JSONL line (its ``field``) or Parquet row (column
    ``field``) is a document. Documents are split into train/val by a hash of their key (relative path, or
    ``path:line`` / ``path:row``); each is followed by the tokenizer's eos id, and where each starts is saved
    beside the tokens. Text files that are not valid UTF-8 (or unreadable) are skipped and counted; empty
    documents are ignored. The folder is written under a temporary sibling name and renamed into place, so
    ``out`` is either complete or absent, and a run killed at any point leaves nothing a re-run would read
    (its temporary folder is removed by the next run). If ``out`` already holds a prepared folder when we are
    about to rename (e.g. another rank prepared it concurrently), ours is discarded and the existing one kept,
    unless ``overwrite`` is set. ``progress``: draw a bar (None: only on a terminal). Returns the meta dict of
    the folder now at ``out``.

    ``prompt_field`` (JSONL and Parquet): each record is a prompt (that field) and a completion (``field``),
    tokenized apart and joined, then the eos; ``<split>.prompts.npy`` records each document's prompt tokens, whose
    targets the trainer ignores (the loss is the completions' and eos'). A record with an empty completion is
    empty.
    """
    src = Path(src).expanduser()
    out = Path(out).expanduser()
    if not (0.0 <= val_fraction <= 0.5 or val_fraction == 1.0):
        # The trainer checks data.val_fraction in its config first, so this names prepare-data's option.
        raise ValueError(f"--val-fraction must be between 0 and 0.5, or 1 (every document held out: a folder to "
                         f"validate on, data.val_path), got {val_fraction}")
    if not src.exists():
        raise FileNotFoundError(f"data source {src} does not exist (option --src of prepare-data)")
    if out.exists() and not (out / "meta.json").is_file():
        if not out.is_dir() or any(out.iterdir()):
            # Never clobber something that is not ours (e.g. the user pointed --out at their sources).
            raise ValueError(
                f"output folder {out} already exists and is not a prepared data folder (no meta.json); "
                "choose another output folder or delete it"
            )
    tok = load_tokenizer(tokenizer)
    corpus = open_corpus(src, fmt, field, extensions, exclude_dirs, prompt_field)
    dtype = token_dtype(tok.vocab_size)

    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_folders(out, "prepare-data")
    tmp = temp_folder_for(out)
    if tmp.exists():  # left over from a killed run that had our pid
        shutil.rmtree(tmp)
    writers: dict[str, _SplitWriter] = {}
    bar: _Progress | None = None
    try:
        tmp.mkdir()
        writers = {split: _SplitWriter(tmp / f"{split}.bin", int(tok.vocab_size), prompt_field is not None)
                   for split in ("train", "val")}
        bar = _Progress(corpus.total, corpus.unit, progress)
        skipped = empty = 0
        for key, text, work in corpus:
            prompt, text = text if isinstance(text, tuple) else ("", text)
            if text is None:
                skipped += 1
            elif not text:
                empty += 1
            else:
                # A prompt is tokenized apart from its completion, so that where one ends is a token boundary.
                ids = [tok.encode_array(prompt), tok.encode_array(text)] if prompt else [tok.encode_array(text)]
                doc = np.empty(sum(len(i) for i in ids) + 1, dtype=dtype)
                doc[:-1] = np.concatenate(ids)
                doc[-1] = tok.eos_id
                writers["val" if is_val_document(key, val_fraction) else "train"].add(doc, len(ids[0]) if prompt
                                                                                       else 0)
                bar.advance(work, len(doc))
                continue
            bar.advance(work, 0)
        bar.close()

        train, val = writers["train"], writers["val"]
        total_docs = train.docs + val.docs
        if total_docs == 0:
            what = "files" if corpus.format == "text" else "documents"
            raise ValueError(f"none of the {what} under {src} holds any text (skipped {skipped} that are not "
                             f"UTF-8, {empty} empty)")
        if 0 < val_fraction < 1 and (train.docs == 0 or val.docs == 0):
            # Few documents can hash all to one side; move one so both splits are usable.
            if total_docs < 2:
                raise ValueError(
                    f"only one readable document under {src}: need at least 2 for a train/val split "
                    "(or pass --val-fraction 0: no validation split)"
                )
            if val.docs == 0:
                val.add(*train.take_last())
            else:
                train.add(*val.take_last())
        for w in writers.values():
            w.close()

        meta: dict[str, Any] = {
            "format": META_FORMAT,
            "tokenizer": tok.name,
            "vocab_size": int(tok.vocab_size),
            "eos_id": int(tok.eos_id),
            "dtype": dtype.name,
            "train_tokens": train.tokens,
            "val_tokens": val.tokens,
            "files": total_docs,
            "train_files": train.docs,
            "val_files": val.docs,
            "skipped": skipped,
            "empty": empty,
            "source": str(Path(src).resolve()),
            "source_format": corpus.format,
            "val_fraction": val_fraction,
        }
        if corpus.format != "text":
            meta["field"] = field
        else:
            meta["extensions"] = sorted(set(extensions or DEFAULT_EXTENSIONS))
        if prompt_field is not None:
            meta["prompt_field"] = prompt_field
        if isinstance(tok, HFTokenizer):
            shutil.copyfile(tok.path, tmp / "tokenizer.json")
        _write_json(tmp / "meta.json", meta)  # written last: its presence marks a complete folder
        return _publish(tmp, out, overwrite)
    except BaseException:
        if bar is not None:
            bar.close()
        for w in writers.values():
            try:
                w._f.close()
            except OSError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: Path, out: Path, overwrite: bool) -> dict[str, Any]:
    """Rename the finished ``tmp`` folder to ``out``; returns the meta of whatever ends up at ``out``."""
    if (out / "meta.json").is_file():
        if not overwrite:
            # Someone (another rank) finished first: theirs is equivalent, keep it.
            shutil.rmtree(tmp)
            return _read_meta(out)
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
        return _read_meta(out)
    try:
        os.rename(tmp, out)  # atomic; also replaces an empty folder
    except OSError:
        if (out / "meta.json").is_file():  # lost a race with a concurrent rank
            shutil.rmtree(tmp)
            return _read_meta(out)
        raise
    return _read_meta(out)


def ensure_prepared(path: str | None, tokenizer: str = "byte", val_fraction: float = 0.02,
                    check_only: bool = False, option: str = "data.path") -> Path:
    """Resolve the ``data.path`` option (or ``option``, e.g. ``data.val_path``) to a prepared data folder, preparing
    the default if needed.

    Empty/None -> the cached standard-library corpus (prepared on first use). A folder with meta.json is
    returned as is. Anything else raises with the command that fixes it. ``check_only`` (before any process
    starts): the default corpus is not prepared, only its cache folder checked for writing.
    """
    if not path:
        out = default_data_dir(tokenizer, val_fraction)
        if not (out / "meta.json").is_file():
            reason = unwritable_reason(out.parent)
            if reason:
                raise ValueError(
                    f"the data cache {out.parent} is not writable ({reason}), so the default corpus cannot be "
                    f"prepared there: set MESHTRAIN_CACHE to a writable folder, or run `meshtrain prepare-data "
                    f"--out DIR` and set data.path=DIR"
                )
            if check_only:
                return out
            log.info("preparing the Python standard library as training data into %s", out)
            prepare_data(default_source_dir(), out, tokenizer=tokenizer, val_fraction=val_fraction, fmt="text")
        return out
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"{option} {p} does not exist: create it with `meshtrain prepare-data --src SOURCE --out {p}`"
            + (" or leave data.path empty to use the Python standard library" if option == "data.path" else "")
        )
    if (p / "meta.json").is_file():
        return p
    if not p.is_dir():
        raise ValueError(
            f"{option} {p} is a file, not a prepared data folder: run "
            f"`meshtrain prepare-data --src SOURCE --out OUT` and set {option}=OUT"
        )
    raise ValueError(
        f"{option} {p} is not a prepared data folder (no meta.json). If it holds text files, run "
        f"`meshtrain prepare-data --src {p} --out OUT` and set {option}=OUT"
    )


def _check_options(args: argparse.Namespace) -> None:
    """Options that would do nothing as given are refused (each was ignored without a word), as are an empty
    path (which would mean the default, or the current folder) and a source without a folder to prepare into."""
    refuse_empty(args, {"src": "a path", "out": "a path"})
    if args.src and not args.out:
        raise ValueError(f"--src {args.src} needs --out: without it the folder is the standard library's cache, "
                         f"which training uses when data.path is not set")
    if args.tokenizer == "hf":
        raise ValueError("--tokenizer hf names a prepared folder's own tokenizer.json, and prepare-data makes the "
                         "folder: give --tokenizer PATH/tokenizer.json, or byte")
    if not args.src:
        given = [o for o, v in (("--format", args.format != "auto"), ("--field", args.field is not None),
                                ("--prompt-field", args.prompt_field is not None)) if v]
        if given:
            raise ValueError(f"{' and '.join(given)} read --src, which is not given (the default source is this "
                             f"Python's standard library, as text): give --src")
        return
    src = Path(args.src)
    if args.ext and src.is_file():
        raise ValueError(f"--ext picks the files of a folder, and --src {src} is one file: leave --ext out")
    if args.ext and args.format in ("jsonl", "parquet"):
        raise ValueError(f"--ext picks text files, and --format {args.format} reads its own suffixes: leave --ext out")
    if args.field is not None and src.exists() and detect_format(src, args.format, args.ext) == "text":
        raise ValueError(f"--field names a JSONL field or Parquet column, and --src {src} is read as text: leave "
                         f"--field out, or give --format jsonl or parquet")


def _differences(args: argparse.Namespace, meta: dict[str, Any], out: Path) -> list[str]:
    """What the options ask for that the folder prepared at ``out`` does not hold (what its meta.json records)."""
    differs = []
    was = meta.get("source")
    # folders prepared before the source was recorded resolved hold it as given: relative to an unknown folder
    if args.src and isinstance(was, str) and Path(was).is_absolute() and Path(was) != Path(args.src).resolve():
        differs.append(f"source {was}, not {args.src}")
    if args.ext and meta.get("extensions", sorted(set(args.ext))) != sorted(set(args.ext)):
        differs.append(f"--ext {' '.join(meta['extensions'])}, not {' '.join(sorted(set(args.ext)))}")
    if args.val_fraction is not None and meta.get("val_fraction", args.val_fraction) != args.val_fraction:
        differs.append(f"--val-fraction {meta['val_fraction']}, not {args.val_fraction}")
    if not same_tokenizer(args.tokenizer, meta["tokenizer"], out):
        differs.append(f"tokenizer {meta['tokenizer']}, not {args.tokenizer}")
    if args.src and args.format != "auto" and meta.get("source_format", args.format) != args.format:
        differs.append(f"format {meta.get('source_format')}, not {args.format}")
    for option, key in (("field", "field"), ("prompt_field", "prompt_field")):
        asked = getattr(args, option)
        if asked is not None and meta.get(key) != asked:
            differs.append(f"--{option.replace('_', '-')} {meta.get(key)}, not {asked}")
    return differs


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``meshtrain prepare-data`` (``argv`` excludes the subcommand name)."""
    parser = ArgumentParser(
        prog="meshtrain prepare-data",
        description="Tokenize text files, JSONL or Parquet into train.bin/val.bin (+ document offsets) for training.",
    )
    parser.add_argument("--src", help="a folder, or one JSONL / Parquet / text file (default: this Python's "
                                      "standard library)")
    parser.add_argument("--out", help="output folder (default: a cache folder under ~/.cache/meshtrain)")
    parser.add_argument("--format", default="auto", choices=FORMATS,
                        help="how to read --src (default auto: by the files' suffixes; text otherwise)")
    parser.add_argument("--field", help="the JSONL field / Parquet column holding the text (default: text)")
    parser.add_argument("--prompt-field", help="JSONL / Parquet: each record's prompt, read before --field (the "
                                               "completion) and not learned: its tokens get no loss")
    parser.add_argument("--tokenizer", default="byte", help="'byte' (default) or a path to a tokenizer.json")
    parser.add_argument("--val-fraction", type=float, default=None,
                        help="share of documents held out (0..0.5), or 1: all of them, a folder for data.val_path "
                             "(default 0.02)")
    parser.add_argument("--ext", action="append", help="text format: file extension to include, repeatable "
                                                       "(default: .py)")
    parser.add_argument("--force", action="store_true", help="rebuild even if --out is already prepared")
    args = parser.parse_args(argv)
    val_fraction = 0.02 if args.val_fraction is None else args.val_fraction  # None: not asked for (_differences)

    src = Path(args.src) if args.src else default_source_dir()
    fmt = args.format if args.src else "text"
    t0 = time.perf_counter()
    try:
        _check_options(args)
        out = Path(args.out) if args.out else default_data_dir(args.tokenizer, val_fraction)
        if (out / "meta.json").is_file() and not args.force:
            meta = _prepared_meta(out)
            if differs := _differences(args, meta, out):
                raise ValueError(f"--out {out} is already prepared, with {'; '.join(differs)}: pass --force to "
                                 f"rebuild it, or another --out")
            print(
                f"already prepared: {meta['files']} documents, {meta['train_tokens']:,} train tokens, "
                f"{meta['val_tokens']:,} val tokens in {out} (use --force to rebuild)"
            )
            return 0
        check_out_parent(out)  # before tokenizing, not after
        meta = prepare_data(src, out, tokenizer=args.tokenizer, val_fraction=val_fraction,
                            extensions=tuple(args.ext) if args.ext else None, fmt=fmt, field=args.field or "text",
                            overwrite=args.force, progress=None, prompt_field=args.prompt_field)
    except (OSError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        where = args.out or "the cache"
        print(f"error: interrupted; nothing was written to {where}: run the same command again", file=sys.stderr)
        return 130
    took = time.perf_counter() - t0
    tokens = meta["train_tokens"] + meta["val_tokens"]
    print(
        f"prepared {meta['files']} documents ({meta['skipped']} skipped): {meta['train_tokens']:,} train tokens, "
        f"{meta['val_tokens']:,} val tokens -> {out} ({took:.1f}s, {tokens / max(took, 1e-9):,.0f} tokens/s)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
