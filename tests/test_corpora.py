"""prepare-data on real corpus formats: JSONL and Parquet beside text folders, document offsets, the progress
bar, one-line errors for bad input, and a re-run after a kill giving the bytes of an uninterrupted run."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meshtrain.train import prepare as prep
from meshtrain.train.data import TokenDataset
from meshtrain.train.prepare import prepare_data
from meshtrain.train.sources import open_corpus

# Ten documents: non-ASCII, a multi-line one, different lengths (one is 2 bytes long).
DOCS = [f"doc {i}: ünïcödé — 日本 " + "word " * (i * 7) + ("\nsecond line" if i % 3 == 0 else "")
        for i in range(9)] + ["ok"]


def write_jsonl(folder: Path, docs: list[str] = DOCS) -> Path:
    """Two files: a plain one (with a blank line, an empty and a null text) and a gzipped one."""
    folder.mkdir(parents=True, exist_ok=True)
    half = len(docs) // 2
    lines = [json.dumps({"id": i, "text": t}) for i, t in enumerate(docs[:half])]
    lines[1:1] = ["", json.dumps({"id": -1, "text": ""}), json.dumps({"id": -2, "text": None})]
    (folder / "a.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with gzip.open(folder / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t, "meta": {"n": i}}) + "\n" for i, t in enumerate(docs[half:]))
    return folder


def write_text_folder(folder: Path, docs: list[str] = DOCS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, t in enumerate(docs):
        (folder / f"{i:03d}.txt").write_text(t, encoding="utf-8")
    return folder


def write_parquet(folder: Path, docs: list[str] = DOCS) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    folder.mkdir(parents=True, exist_ok=True)
    half = len(docs) // 2
    pq.write_table(pa.table({"id": list(range(half)), "text": docs[:half]}), folder / "part-0.parquet",
                   row_group_size=2)  # several row groups: the reader must walk them in order
    pq.write_table(pa.table({"text": docs[half:] + [None]}), folder / "part-1.parquet")
    return folder


def expected_tokens(docs: list[str]) -> np.ndarray:
    """The byte tokenizer's stream: each document's UTF-8 bytes, then eos (256)."""
    return np.concatenate([np.append(np.frombuffer(t.encode(), np.uint8).astype(np.uint16), 256) for t in docs])


@pytest.mark.parametrize("kind", ["text", "jsonl", "parquet"])
def test_every_format_gives_the_documents_in_order_with_their_offsets(tmp_path: Path, kind: str) -> None:
    src = {"text": write_text_folder, "jsonl": write_jsonl, "parquet": write_parquet}[kind](tmp_path / "src")
    ext = (".txt",) if kind == "text" else None
    meta = prepare_data(src, tmp_path / "out", val_fraction=0.0, extensions=ext)
    assert meta["source_format"] == kind and meta["files"] == len(DOCS) and meta["format"] == 3
    assert meta["empty"] == {"text": 0, "jsonl": 2, "parquet": 1}[kind]  # "" and null texts: no documents
    ds = TokenDataset(tmp_path / "out")
    assert np.array_equal(np.asarray(ds._tokens), expected_tokens(DOCS))
    offsets = ds.doc_offsets
    assert offsets is not None and len(offsets) == len(DOCS) + 1
    tok = np.asarray(ds._tokens)
    for i, text in enumerate(DOCS):  # each document's slice is its text then one eos
        doc = tok[offsets[i]:offsets[i + 1]]
        assert doc[-1] == 256 and bytes(doc[:-1].astype(np.uint8)).decode() == text


def test_split_keeps_whole_documents_and_offsets_match_eos(tmp_path: Path) -> None:
    docs = [f"document number {i} " * (1 + i % 5) for i in range(60)]
    lines = "".join(json.dumps({"text": t}) + "\n" for t in docs)
    (tmp_path / "c.jsonl").write_text(lines)
    meta = prepare_data(tmp_path / "c.jsonl", tmp_path / "out", val_fraction=0.2)  # one file as --src
    assert meta["train_files"] + meta["val_files"] == 60 and meta["val_files"] > 0
    seen = []
    for split in ("train", "val"):
        ds = TokenDataset(tmp_path / "out", split)
        tok, offsets = np.asarray(ds._tokens), ds.doc_offsets
        assert np.array_equal(np.flatnonzero(tok == 256) + 1, offsets[1:])  # every document ends at an eos
        seen += [bytes(tok[a:b - 1].astype(np.uint8)).decode() for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    assert sorted(seen) == sorted(docs)


def test_format_1_folders_still_read(tmp_path: Path) -> None:
    prepare_data(write_jsonl(tmp_path / "src"), tmp_path / "out", val_fraction=0.0)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    (tmp_path / "out" / "meta.json").write_text(json.dumps({**meta, "format": 1}))
    for p in (tmp_path / "out").glob("*.docs.npy"):
        p.unlink()
    ds = TokenDataset(tmp_path / "out")
    assert ds.doc_offsets is None and ds.num_tokens == len(expected_tokens(DOCS))
    (tmp_path / "out" / "meta.json").write_text(json.dumps(meta))  # format 2 without its offsets
    with pytest.raises(FileNotFoundError, match=r"train\.docs\.npy is missing; re-run `meshtrain prepare-data`"):
        TokenDataset(tmp_path / "out").doc_offsets  # noqa: B018


def test_progress_bar_shows_tokens_per_second(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prep.time, "perf_counter", iter(np.arange(0.0, 1e4, 1.0)).__next__)  # 1 s a call
    prepare_data(write_jsonl(tmp_path / "src"), tmp_path / "out", val_fraction=0.0, progress=True)
    err = capsys.readouterr().err
    assert "prepare-data" in err and "tok/s" in err and f"{len(expected_tokens(DOCS)):,} tokens" in err


def cli_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert prep.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    return err


def test_bad_jsonl_is_refused_with_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    src.mkdir()
    f = src / "x.jsonl"
    out = ["--out", str(tmp_path / "out"), "--src", str(src)]
    f.write_text('{"text": "a"}\n\n{"text": "b",\n')
    assert f"{f}:3 is not JSON (" in cli_error(out, capsys)
    f.write_text('{"text": "a"}\n{"body": "b", "id": 2}\n')
    err = cli_error(out, capsys)
    assert f"{f}:2 has no field 'text' (its fields: 'body', 'id'): pass --field NAME" in err
    assert prep.main([*out, "--field", "body"]) == 2  # line 1 has no "body"
    assert f"{f}:1 has no field 'body'" in capsys.readouterr().err
    f.write_text('["text"]\n')
    assert f"{f}:1 is a JSON list, not an object with a 'text' field" in cli_error(out, capsys)
    f.write_text('{"text": 3}\n')
    assert "field 'text' is a int, not a string" in cli_error(out, capsys)
    f.write_bytes(b'{"text": "\xff"}\n')
    assert f"{f}:1 is not UTF-8 text" in cli_error(out, capsys)
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["src"]  # nothing left


def test_bad_parquet_and_folders_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    src = write_parquet(tmp_path / "pq")
    out = ["--out", str(tmp_path / "out"), "--src", str(src)]
    err = cli_error([*out, "--field", "body"], capsys)
    assert "part-0.parquet has no column 'body' (its columns: id, text): pass --field NAME" in err
    assert "column 'id' holds int64, not text" in cli_error([*out, "--field", "id"], capsys)
    (src / "bad.parquet").write_text("not parquet")
    assert "bad.parquet is not a readable Parquet file" in cli_error(out, capsys)
    write_jsonl(src)
    assert "holds both Parquet (3) and JSONL (2) files: pass --format parquet or --format jsonl" in \
        cli_error(out, capsys)
    assert "no files with extensions .md found" in cli_error([*out, "--ext", ".md"], capsys)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    err = cli_error([*out, "--format", "parquet"], capsys)
    assert "needs pyarrow, which is not installed: pip install 'meshtrain[data]'" in err


def test_text_folder_without_matching_files_names_what_it_holds(tmp_path: Path) -> None:
    write_text_folder(tmp_path / "src")
    with pytest.raises(ValueError, match=r"no files with extensions \.py found .* it holds \.txt \(10\): pass --ext"):
        open_corpus(tmp_path / "src")


KILLER = """
import os, signal, sys
from meshtrain.train import prepare
from meshtrain.train.tokenizer import ByteTokenizer
real, calls = ByteTokenizer.encode_array, [0]
def encode_then_die(self, text):
    calls[0] += 1
    if calls[0] > int(sys.argv[1]):  # mid-way: tokens of earlier documents are on disk
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup runs, as for a killed job
    return real(self, text)
ByteTokenizer.encode_array = encode_then_die
prepare.main(sys.argv[2:])
"""


def test_rerun_after_a_kill_gives_the_bytes_of_an_uninterrupted_run(tmp_path: Path) -> None:
    docs = [f"line {i} " * (i % 13 + 1) for i in range(400)]
    src = write_jsonl(tmp_path / "src", docs)
    args = ["--src", str(src), "--val-fraction", "0.1"]
    killed = subprocess.run([sys.executable, "-c", KILLER, "150", *args, "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
    assert not (tmp_path / "out").exists() and len(left) == 1 and (left[0] / "train.bin").stat().st_size > 0
    assert prep.main([*args, "--out", str(tmp_path / "out")]) == 0  # the re-run
    assert prep.main([*args, "--out", str(tmp_path / "clean")]) == 0  # an uninterrupted run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clean", "out", "src"]  # the killed run's temp removed
    names = sorted(p.name for p in (tmp_path / "clean").iterdir())
    assert names == ["meta.json", "train.bin", "train.counts.npy", "train.docs.npy", "val.bin", "val.counts.npy",
                     "val.docs.npy"]
    for name in names:
        a, b = (tmp_path / "out" / name).read_bytes(), (tmp_path / "clean" / name).read_bytes()
        assert (a == b) if name != "meta.json" else (a.replace(b"/out", b"/clean") == b), name
