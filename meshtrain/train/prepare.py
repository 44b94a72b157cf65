"""``meshtrain prepare-data``: turn a folder of text files into memory-mapped token files.

A prepared data folder holds ``train.bin`` and ``val.bin`` (raw little-endian token arrays, one
end-of-document id after each file), ``meta.json`` describing them, and ``tokenizer.json`` when a
HuggingFace tokenizer was used. With no arguments the running Python's standard library is used, so
training works out of the box with no download.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import sys
import sysconfig
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from meshtrain.train.paths import unwritable_reason
from meshtrain.train.tokenizer import HFTokenizer, load_tokenizer, tokenizer_tag

log = logging.getLogger(__name__)

META_FORMAT = 1
DEFAULT_EXTENSIONS: tuple[str, ...] = (".py",)
DEFAULT_EXCLUDE_DIRS: tuple[str, ...] = ("site-packages", "test", "tests", "__pycache__", "idlelib")


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


def list_source_files(
    src: Path, extensions: Iterable[str], exclude_dirs: Iterable[str] = DEFAULT_EXCLUDE_DIRS
) -> list[str]:
    """Relative POSIX paths of matching files under ``src``, in sorted (deterministic) order.

    Folders named in ``exclude_dirs`` and hidden folders (``.git``, ``.venv``...) are skipped.
    """
    exts = tuple(e.lower() if e.startswith(".") else "." + e.lower() for e in extensions)
    excluded = set(exclude_dirs)
    found: list[str] = []
    for root, dirs, files in os.walk(src):
        # Pruning in place stops os.walk descending; sorting makes the walk order deterministic.
        dirs[:] = sorted(d for d in dirs if d not in excluded and not d.startswith("."))
        rel_root = Path(root).relative_to(src)
        for name in sorted(files):
            if name.lower().endswith(exts):
                found.append((rel_root / name).as_posix())
    return found


class _SplitWriter:
    """Appends documents to one ``.bin`` file, holding the last one back.

    Holding the last document back lets the caller move it to the other split at the end (the fallback
    that keeps both splits non-empty) without buffering the whole corpus in memory.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f: BinaryIO = open(path, "wb")  # closed in close()
        self.tokens = 0
        self._written_docs = 0
        self._pending: np.ndarray | None = None

    @property
    def docs(self) -> int:
        return self._written_docs + (self._pending is not None)

    def add(self, doc: np.ndarray) -> None:
        if self._pending is not None:
            self._write(self._pending)
        self._pending = doc

    def take_last(self) -> np.ndarray:
        assert self._pending is not None
        doc, self._pending = self._pending, None
        return doc

    def _write(self, doc: np.ndarray) -> None:
        self._f.write(memoryview(np.ascontiguousarray(doc)))
        self.tokens += len(doc)
        self._written_docs += 1

    def close(self) -> None:
        if self._f.closed:
            return
        if self._pending is not None:
            self._write(self._pending)
            self._pending = None
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _read_meta(out: Path) -> dict[str, Any]:
    with open(out / "meta.json", encoding="utf-8") as f:
        return json.load(f)


def _temp_dir_for(out: Path) -> Path:
    # pid alone can collide between nodes sharing a filesystem, so the host name is added.
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "host"
    return out.parent / f".{out.name}.tmp-{os.getpid()}-{host}"


def prepare_data(
    src: str | Path,
    out: str | Path,
    tokenizer: str = "byte",
    val_fraction: float = 0.02,
    extensions: tuple[str, ...] = DEFAULT_EXTENSIONS,
    exclude_dirs: tuple[str, ...] = DEFAULT_EXCLUDE_DIRS,
    *,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Tokenize every matching text file under ``src`` into ``out/{train,val}.bin`` + ``out/meta.json``.

    Documents are split into train/val by a hash of their relative path; each is followed by the
    tokenizer's eos id. Files that are not valid UTF-8 (or unreadable) are skipped and counted; empty
    files are ignored. The folder is written under a temporary sibling name and renamed into place, so
    ``out`` is either complete or absent. If ``out`` already holds a prepared folder when we are about to
    rename (e.g. another rank prepared it concurrently), ours is discarded and the existing one kept,
    unless ``overwrite`` is set. Returns the meta dict of the folder now at ``out``.
    """
    src = Path(src).expanduser()
    out = Path(out).expanduser()
    if not (0.0 <= val_fraction <= 0.5):
        raise ValueError(f"data.val_fraction must be between 0 and 0.5, got {val_fraction}")
    if not src.is_dir():
        if src.exists():
            raise FileNotFoundError(f"data source {src} is not a folder (option --src of prepare-data)")
        raise FileNotFoundError(f"data source folder {src} does not exist (option --src of prepare-data)")
    if out.exists() and not (out / "meta.json").is_file():
        if not out.is_dir() or any(out.iterdir()):
            # Never clobber something that is not ours (e.g. the user pointed --out at their sources).
            raise ValueError(
                f"output folder {out} already exists and is not a prepared data folder (no meta.json); "
                "choose another output folder or delete it"
            )
    tok = load_tokenizer(tokenizer)
    files = list_source_files(src, extensions, exclude_dirs)
    if not files:
        raise ValueError(
            f"no files with extensions {', '.join(extensions)} found under {src} (option --src of prepare-data): "
            f"pass --ext for the files it holds (repeatable, e.g. --ext .txt --ext .md), or another --src"
        )
    dtype = token_dtype(tok.vocab_size)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_dir_for(out)
    if tmp.exists():  # left over from a killed run that had our pid
        shutil.rmtree(tmp)
    writers: dict[str, _SplitWriter] = {}
    try:
        tmp.mkdir()
        writers = {"train": _SplitWriter(tmp / "train.bin"), "val": _SplitWriter(tmp / "val.bin")}
        skipped = empty = 0
        for rel in files:
            try:
                text = (src / rel).read_bytes().decode("utf-8")
            except (UnicodeDecodeError, OSError):
                skipped += 1
                continue
            if not text:
                empty += 1
                continue
            ids = tok.encode_array(text)
            doc = np.empty(len(ids) + 1, dtype=dtype)
            doc[:-1] = ids
            doc[-1] = tok.eos_id
            writers["val" if is_val_document(rel, val_fraction) else "train"].add(doc)

        train, val = writers["train"], writers["val"]
        total_docs = train.docs + val.docs
        if total_docs == 0:
            raise ValueError(f"none of the {len(files)} files under {src} could be read as UTF-8 text")
        if val_fraction > 0 and (train.docs == 0 or val.docs == 0):
            # Few documents can hash all to one side; move one so both splits are usable.
            if total_docs < 2:
                raise ValueError(
                    f"only one readable document under {src}: need at least 2 for a train/val split "
                    "(or set data.val_fraction=0)"
                )
            if val.docs == 0:
                val.add(train.take_last())
            else:
                train.add(val.take_last())
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
            "source": str(src),
        }
        if isinstance(tok, HFTokenizer):
            shutil.copyfile(tok.path, tmp / "tokenizer.json")
        _write_json(tmp / "meta.json", meta)  # written last: its presence marks a complete folder
        return _publish(tmp, out, overwrite)
    except BaseException:
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
                    check_only: bool = False) -> Path:
    """Resolve the ``data.path`` option to a prepared data folder, preparing the default if needed.

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
            prepare_data(default_source_dir(), out, tokenizer=tokenizer, val_fraction=val_fraction)
        return out
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"data.path {p} does not exist: create it with `meshtrain prepare-data --src SOURCE --out {p}` "
            "or leave data.path empty to use the Python standard library"
        )
    if (p / "meta.json").is_file():
        return p
    if not p.is_dir():
        raise ValueError(
            f"data.path {p} is a file, not a prepared data folder: run "
            f"`meshtrain prepare-data --src SOURCE --out OUT` and set data.path=OUT"
        )
    raise ValueError(
        f"data.path {p} is not a prepared data folder (no meta.json). If it holds text files, run "
        f"`meshtrain prepare-data --src {p} --out OUT` and set data.path=OUT"
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``meshtrain prepare-data`` (``argv`` excludes the subcommand name)."""
    parser = argparse.ArgumentParser(
        prog="meshtrain prepare-data",
        description="Tokenize a folder of text files into train.bin/val.bin/meta.json for training.",
    )
    parser.add_argument("--src", help="folder of text files (default: this Python's standard library)")
    parser.add_argument("--out", help="output folder (default: a cache folder under ~/.cache/meshtrain)")
    parser.add_argument("--tokenizer", default="byte", help="'byte' (default) or a path to a tokenizer.json")
    parser.add_argument("--val-fraction", type=float, default=0.02, help="share of files held out (0..0.5)")
    parser.add_argument("--ext", action="append", help="file extension to include, repeatable (default: .py)")
    parser.add_argument("--force", action="store_true", help="rebuild even if --out is already prepared")
    args = parser.parse_args(argv)

    src = Path(args.src) if args.src else default_source_dir()
    extensions = tuple(args.ext) if args.ext else DEFAULT_EXTENSIONS
    t0 = time.perf_counter()
    try:
        out = Path(args.out) if args.out else default_data_dir(args.tokenizer)
        if (out / "meta.json").is_file() and not args.force:
            meta = _read_meta(out)
            print(
                f"already prepared: {meta['files']} files, {meta['train_tokens']:,} train tokens, "
                f"{meta['val_tokens']:,} val tokens in {out} (use --force to rebuild)"
            )
            return 0
        meta = prepare_data(
            src,
            out,
            tokenizer=args.tokenizer,
            val_fraction=args.val_fraction,
            extensions=extensions,
            overwrite=args.force,
        )
    except (OSError, ValueError, ImportError) as e:
        print(f"meshtrain prepare-data: error: {e}", file=sys.stderr)
        return 1
    print(
        f"prepared {meta['files']} files ({meta['skipped']} skipped): {meta['train_tokens']:,} train tokens, "
        f"{meta['val_tokens']:,} val tokens -> {out} ({time.perf_counter() - t0:.1f}s)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
