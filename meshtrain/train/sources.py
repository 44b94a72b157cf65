"""Where ``prepare-data`` reads documents from: a folder of text files, JSONL files or Parquet files.

A source lists its files up front (sorted, so every run reads the same documents in the same order), checks
what it can before any tokenizing (a Parquet file's columns), then yields one document at a time:
``(key, text, work)``. ``key`` names the document stably (a relative path, ``path:line`` or ``path:row``) and
decides its train/val side; ``text`` is ``None`` for a document that could not be read as text (skipped and
counted), and a ``(prompt, completion)`` pair for records with a prompt field (``--prompt-field``: fine-tuning
data whose prompt is read, not learned); ``work`` is how far the progress bar moves (bytes for text and JSONL, rows
for Parquet).

Bad input is refused with one line naming the file (and line) and the fix, as ``ValueError``.
"""

from __future__ import annotations

import gzip
import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

FORMATS = ("auto", "text", "jsonl", "parquet")
DEFAULT_EXTENSIONS: tuple[str, ...] = (".py",)
DEFAULT_EXCLUDE_DIRS: tuple[str, ...] = ("site-packages", "test", "tests", "__pycache__", "idlelib")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")
PARQUET_SUFFIXES = (".parquet",)
DATA_EXTRA = "pip install 'meshtrain[data]' (or pip install pyarrow)"

Document = tuple[str, "str | tuple[str, str] | None", int]


def list_source_files(
    src: Path, extensions: Iterable[str], exclude_dirs: Iterable[str] = DEFAULT_EXCLUDE_DIRS
) -> list[str]:
    """Relative POSIX paths of matching files under ``src``, in sorted (deterministic) order.

    Folders named in ``exclude_dirs`` and hidden folders (``.git``, ``.venv``...) are skipped.
    """
    exts = tuple(e.lower() if e.startswith(".") or not e else "." + e.lower() for e in extensions)  # "": all
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


def _suffixes_found(src: Path, exclude_dirs: Iterable[str]) -> str:
    """The most common file suffixes under ``src`` (for an error that says which --ext to pass)."""
    counts = Counter(Path(f).suffix.lower() or "(none)" for f in list_source_files(src, [""], exclude_dirs))
    return ", ".join(f"{ext} ({n})" for ext, n in counts.most_common(5)) or "no files"


def detect_format(src: Path, fmt: str, extensions: tuple[str, ...] | None,
                  exclude_dirs: Iterable[str] = DEFAULT_EXCLUDE_DIRS) -> str:
    """Resolve ``--format auto``: a file by its suffix; a folder by the JSONL or Parquet files it holds
    (text otherwise, or when ``--ext`` was given)."""
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt != "auto":
        return fmt
    if extensions:
        return "text"
    if src.is_file():
        name = src.name.lower()
        return "parquet" if name.endswith(PARQUET_SUFFIXES) else "jsonl" if name.endswith(JSONL_SUFFIXES) else "text"
    parquet = list_source_files(src, PARQUET_SUFFIXES, exclude_dirs)
    jsonl = list_source_files(src, JSONL_SUFFIXES, exclude_dirs)
    if parquet and jsonl:
        raise ValueError(f"{src} holds both Parquet ({len(parquet)}) and JSONL ({len(jsonl)}) files: "
                         f"pass --format parquet or --format jsonl")
    return "parquet" if parquet else "jsonl" if jsonl else "text"


@dataclass
class Corpus:
    """The documents of one source, in a fixed order; iterate it for ``(key, text, work)``."""

    src: Path
    format: str
    files: list[str]  # relative to src ("" for a single file)
    field: str
    total: int  # the progress bar's total, in `unit`
    unit: str
    prompt_field: str | None = None  # records are (prompt, completion) pairs: the prompt in this field

    @property
    def fields(self) -> list[str]:
        """The record fields read, in the order ``text`` holds them (the prompt first)."""
        return [self.field] if self.prompt_field is None else [self.prompt_field, self.field]

    def path(self, rel: str) -> Path:
        return self.src / rel if rel else self.src

    def __iter__(self) -> Iterator[Document]:
        read = {"text": self._text, "jsonl": self._jsonl, "parquet": self._parquet}[self.format]
        for rel in self.files:
            yield from read(rel)

    def _text(self, rel: str) -> Iterator[Document]:
        p = self.path(rel)
        try:
            data = p.read_bytes()
        except OSError:
            yield rel or p.name, None, 0
            return
        try:
            text: str | None = data.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        yield rel or p.name, text, len(data)

    def _jsonl(self, rel: str) -> Iterator[Document]:
        p = self.path(rel)
        with open(p, "rb") as raw:
            # Progress counts the bytes read from disk, compressed or not, as the total does.
            f: IO[bytes] = gzip.GzipFile(fileobj=raw) if p.name.lower().endswith(".gz") else raw
            done = 0
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue  # blank lines (a trailing newline) are not documents
                texts = _jsonl_texts(p, lineno, line, self.fields)
                pos = raw.tell()
                yield f"{rel or p.name}:{lineno}", texts[0] if len(texts) == 1 else (texts[0], texts[1]), pos - done
                done = pos

    def _parquet(self, rel: str) -> Iterator[Document]:
        pq = _pyarrow_parquet()
        p = self.path(rel)
        row = 0
        for batch in pq.ParquetFile(p).iter_batches(columns=self.fields, batch_size=1024):
            columns = [batch.column(i).to_pylist() for i in range(len(self.fields))]
            for values in zip(*columns, strict=True):
                row += 1
                texts = [v or "" for v in values]  # a null is an empty text
                yield f"{rel or p.name}:{row}", texts[0] if len(texts) == 1 else (texts[0], texts[1]), 1


def _jsonl_texts(path: Path, lineno: int, line: bytes, fields: list[str]) -> list[str]:
    """The string ``fields`` of one JSONL record (a null as empty), or one line naming the file, line and fix."""
    try:
        obj: Any = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno} is not JSON ({e.msg} at column {e.colno}): each line of a JSONL file "
                         f"must be one JSON object") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{lineno} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}:{lineno} is a JSON {type(obj).__name__}, not an object with a {fields[-1]!r} "
                         f"field")
    out = []
    for field in fields:
        option = "--field" if field == fields[-1] else "--prompt-field"
        if field not in obj:
            have = ", ".join(repr(k) for k in list(obj)[:10]) or "none"
            raise ValueError(f"{path}:{lineno} has no field {field!r} (its fields: {have}): pass {option} NAME")
        text = obj[field]
        if text is not None and not isinstance(text, str):
            raise ValueError(f"{path}:{lineno}: field {field!r} is a {type(text).__name__}, not a string "
                             f"(pass {option} for a text field)")
        out.append(text or "")
    return out


def _pyarrow_parquet() -> Any:
    # Imported lazily: pyarrow is an optional extra, and text and JSONL need nothing.
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"reading Parquet (--format parquet) needs pyarrow, which is not installed: {DATA_EXTRA}",
                          name="pyarrow") from e
    return pq


def _check_parquet(path: Path, fields: list[str]) -> int:
    """The rows of one Parquet file, after checking it has string columns ``fields`` (metadata only)."""
    pq = _pyarrow_parquet()
    import pyarrow as pa
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path} is not a readable Parquet file ({e})") from None
    schema = pf.schema_arrow
    string_view = getattr(pa.types, "is_string_view", lambda _: False)  # pyarrow >= 16
    for field in fields:
        option = "--field" if field == fields[-1] else "--prompt-field"
        if field not in schema.names:
            raise ValueError(f"{path} has no column {field!r} (its columns: {', '.join(schema.names)}): "
                             f"pass {option} NAME")
        kind = schema.field(field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or string_view(kind)):
            raise ValueError(f"{path}: column {field!r} holds {kind}, not text (pass {option} for a string column)")
    return int(pf.metadata.num_rows)


def open_corpus(src: Path, fmt: str = "auto", field: str = "text", extensions: tuple[str, ...] | None = None,
                exclude_dirs: tuple[str, ...] = DEFAULT_EXCLUDE_DIRS, prompt_field: str | None = None) -> Corpus:
    """List and check the documents of ``src`` (a folder, or one JSONL / Parquet / text file); with
    ``prompt_field``, records of a prompt and a completion (``field``)."""
    fmt = detect_format(src, fmt, extensions, exclude_dirs)
    if prompt_field is not None and fmt == "text":
        raise ValueError(f"--prompt-field {prompt_field} reads records, and {src} is read as text files: pass JSONL "
                         f"or Parquet records with a prompt and a completion field (--format jsonl or parquet)")
    if prompt_field is not None and prompt_field == field:
        raise ValueError(f"--prompt-field and --field are both {field!r}: the prompt and the completion are two "
                         f"fields of each record")
    if src.is_file():
        files = [""]
    else:
        suffixes = {"text": extensions or DEFAULT_EXTENSIONS, "jsonl": JSONL_SUFFIXES,
                    "parquet": PARQUET_SUFFIXES}[fmt]
        files = list_source_files(src, suffixes, exclude_dirs)
        if not files:
            raise ValueError(
                f"no files with extensions {', '.join(suffixes)} found under {src} (option --src of prepare-data); "
                f"it holds {_suffixes_found(src, exclude_dirs)}: pass --ext for the files it holds (repeatable, "
                f"e.g. --ext .txt --ext .md), --format, or another --src"
            )
    corpus = Corpus(src, fmt, files, field, 0, "B", prompt_field)
    if fmt == "parquet":
        corpus.total, corpus.unit = sum(_check_parquet(corpus.path(f), corpus.fields) for f in files), "doc"
    else:
        corpus.total = sum(corpus.path(f).stat().st_size for f in files)
    return corpus
