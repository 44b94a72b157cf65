"""Tests for the data pipeline: tokenizers, prepare-data and the datasets/sampler."""

from __future__ import annotations

import json
import os
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from meshtrain.parallel.parallelize import shard_rows
from meshtrain.train import prepare as prep
from meshtrain.train.data import SyntheticDataset, TokenDataset
from meshtrain.train.prepare import ensure_prepared, is_val_document, prepare_data
from meshtrain.train.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def make_corpus(root: Path, n: int = 40) -> Path:
    """A small source folder: n Python files in two subfolders, plus things that must be ignored."""
    src = root / "src"
    for i in range(n):
        sub = src / ("pkg_a" if i % 2 else "pkg_b")
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"mod_{i:03d}.py").write_text(
            f"# module {i} — ünïcödé\n"
            + "".join(f"def f{i}_{j}(x):\n    return x + {j}\n" for j in range(30)),
            encoding="utf-8",
        )
    (src / "notes.txt").write_text("not python\n")
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "cached.py").write_text("x = 1\n")
    (src / "tests").mkdir()
    (src / "tests" / "test_x.py").write_text("assert True\n")
    (src / ".hidden").mkdir()
    (src / ".hidden" / "h.py").write_text("h = 1\n")
    (src / "bad.py").write_bytes(b"x = '\xff\xfe not utf8'\n")
    (src / "empty.py").write_bytes(b"")
    return src


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return make_corpus(tmp_path)


@pytest.fixture
def prepared(tmp_path: Path, corpus: Path) -> Path:
    out = tmp_path / "data"
    prepare_data(corpus, out, val_fraction=0.2)
    return out


# ---------------------------------------------------------------- tokenizer


def test_byte_tokenizer_round_trip_non_ascii() -> None:
    tok = ByteTokenizer()
    text = "héllo wörld — 日本語 🚀"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_id]) == text  # special ids are dropped
    assert np.array_equal(tok.encode_array(text), np.array(ids, dtype=np.uint8))
    assert tok.encode_prompt(text) == ids  # no special tokens to add
    assert (tok.vocab_size, tok.eos_id, tok.name) == (257, 256, "byte")
    assert tok.decode([0xFF, 0x41]) == "\ufffdA"  # broken utf-8 is replaced, not an error


def test_hf_tokenizer_missing_package_is_clear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` raise ImportError
    f = tmp_path / "tokenizer.json"
    f.write_text("{}")
    with pytest.raises(ImportError, match="pip install tokenizers"):
        HFTokenizer(f)
    with pytest.raises(ImportError, match="pip install tokenizers"):
        load_tokenizer(str(f))
    with pytest.raises(ImportError, match="pip install tokenizers"):
        load_tokenizer("hf", data_dir=tmp_path)


class _FakeEncoding:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids


class _FakeHF:
    """Stands in for tokenizers.Tokenizer (not installed here): one id per character, vocab 'a'..'z'."""

    def __init__(self, specials: dict[str, int]) -> None:
        self.specials = specials

    @classmethod
    def from_file(cls, path: str) -> _FakeHF:
        return cls(json.loads(Path(path).read_text()))

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return 26 + len(self.specials)

    def token_to_id(self, token: str) -> int | None:
        return self.specials.get(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> _FakeEncoding:
        return _FakeEncoding([ord(c) - ord("a") for c in text if "a" <= c <= "z"])

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i + ord("a")) for i in ids if i < 26)


def test_a_tokenizer_file_that_is_not_one_is_refused_in_one_line(tmp_path: Path) -> None:
    for text in ("not json {", "{}"):
        bad = tmp_path / "tokenizer.json"
        bad.write_text(text)
        with pytest.raises(ValueError, match=r"tokenizer.json is not a HuggingFace tokenizer.json .*data.tokenizer"):
            HFTokenizer(bad)


def test_a_checkpoint_without_its_tokenizer_says_so(tmp_path: Path) -> None:
    """generate/convert load a checkpoint's tokenizer with ``load_tokenizer("hf", ckpt)``: a missing file is named
    as the checkpoint's, not as a data folder's."""
    for name in ("meta.json", "index.json"):
        (tmp_path / name).write_text("{}")
    with pytest.raises(ValueError, match=r"holds no tokenizer.json .*copy the run's tokenizer.json"):
        load_tokenizer("hf", tmp_path)


def test_hf_tokenizer_eos_and_prepare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", types.SimpleNamespace(Tokenizer=_FakeHF))
    with_eos = tmp_path / "with_eos.json"
    with_eos.write_text(json.dumps({"<eos>": 27, "<|endoftext|>": 26}))
    tok = HFTokenizer(with_eos)
    assert (tok.vocab_size, tok.eos_id) == (28, 26)  # first candidate present in EOS_CANDIDATES order
    no_eos = tmp_path / "tokenizer.json"
    no_eos.write_text("{}")
    tok = HFTokenizer(no_eos)
    assert (tok.vocab_size, tok.eos_id) == (27, 26)  # one id appended
    assert tok.decode(tok.encode("hello") + [tok.eos_id]) == "hello"
    assert isinstance(load_tokenizer("hf", data_dir=tmp_path), HFTokenizer)

    src = tmp_path / "txt"
    src.mkdir()
    for i in range(4):
        (src / f"{i}.txt").write_text("abc" * (i + 1))
    meta = prepare_data(src, tmp_path / "out", tokenizer=str(no_eos), val_fraction=0.3, extensions=(".txt",))
    assert meta["tokenizer"] == "hf" and meta["vocab_size"] == 27 and meta["eos_id"] == 26
    assert meta["train_tokens"] + meta["val_tokens"] == 3 * (1 + 2 + 3 + 4) + 4
    assert (tmp_path / "out" / "tokenizer.json").read_text() == "{}"


def test_a_data_tokenizer_that_is_not_the_prepared_folders_is_refused(tmp_path: Path) -> None:
    """A prepared data.path brings its own tokenizer: a data.tokenizer naming another was ignored without a word."""
    from meshtrain.config import ConfigError
    from meshtrain.train.preflight import check_tokenizer_option

    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    same, other = tmp_path / "same.json", tmp_path / "other.json"
    same.write_text("{}")
    other.write_text('{"a": 1}')
    hf, byte = {"tokenizer": "hf"}, {"tokenizer": "byte"}
    for spec, meta in [("byte", hf), ("byte", byte), ("hf", hf), (str(same), hf), (str(folder), hf)]:
        check_tokenizer_option(spec, meta, folder)  # the default, or the folder's own: passes
    for spec, meta in [(str(other), hf), ("hf", byte), (str(same), byte)]:
        with pytest.raises(ConfigError, match=f"data.tokenizer={spec} is not the tokenizer data.path {folder} was"):
            check_tokenizer_option(spec, meta, folder)
    with pytest.raises(ValueError, match="is missing"):
        check_tokenizer_option(str(tmp_path / "nope.json"), hf, folder)


def test_train_fallback_when_all_documents_hash_to_val(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prep, "is_val_document", lambda rel, frac: True)
    meta = prepare_data(corpus, tmp_path / "d", val_fraction=0.5)
    assert meta["train_files"] == 1 and meta["val_files"] == 39


def test_load_tokenizer_specs(tmp_path: Path) -> None:
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(ValueError, match="data.tokenizer.*'byte'"):
        load_tokenizer("gpt2")
    with pytest.raises(ValueError, match="data.tokenizer"):
        load_tokenizer("hf", data_dir=tmp_path)  # no tokenizer.json there
    with pytest.raises(ValueError, match="data.tokenizer"):
        load_tokenizer("hf")
    with pytest.raises(ValueError, match=f"the folder {tmp_path} holds no tokenizer.json"):  # not "file missing"
        load_tokenizer(str(tmp_path))


# ---------------------------------------------------------------- prepare-data


def test_prepare_writes_consistent_files(prepared: Path, corpus: Path) -> None:
    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["format"] == 3 and meta["tokenizer"] == "byte" and meta["dtype"] == "uint16"
    assert (meta["vocab_size"], meta["eos_id"]) == (257, 256)
    assert meta["files"] == 40 and meta["skipped"] == 1  # bad.py; tests/, __pycache__/, .hidden/ excluded
    assert meta["source"] == str(corpus)
    train = np.fromfile(prepared / "train.bin", dtype=np.uint16)
    val = np.fromfile(prepared / "val.bin", dtype=np.uint16)
    assert len(train) == meta["train_tokens"] > 0 and len(val) == meta["val_tokens"] > 0
    # One eos after each document, and the whole corpus is there.
    assert int((train == 256).sum()) + int((val == 256).sum()) == 40
    assert train[-1] == 256 and val[-1] == 256
    total = sum(len(p.read_bytes()) for p in corpus.rglob("mod_*.py"))
    assert len(train) + len(val) == total + 40
    assert not list(prepared.parent.glob(".data.tmp-*"))
    for split, tokens in (("train", train), ("val", val)):  # each token id's count, for the unigram baseline
        counts = np.load(prepared / f"{split}.counts.npy", allow_pickle=False)
        assert counts.dtype == np.dtype("<i8") and np.array_equal(counts, np.bincount(tokens, minlength=257))


def test_the_unigram_baseline_reads_the_counts_prepare_data_wrote_not_the_split(prepared: Path) -> None:
    """The trainer's baseline (``token_probs``) comes from ``train.counts.npy``: with ``train.bin``'s bytes zeroed
    (the size kept, so the folder still opens) the distribution is still the text's. Counts that do not add up to
    the split, or a missing file, are refused in one line that names the file and the fix."""
    tokens = np.fromfile(prepared / "train.bin", dtype=np.uint16)
    exact = np.bincount(tokens, minlength=257)
    (prepared / "train.bin").write_bytes(bytes(tokens.nbytes))
    ds = TokenDataset(prepared)
    assert np.array_equal(ds.token_counts(), exact) and np.allclose(ds.token_probs(), exact / exact.sum())
    np.save(prepared / "train.counts.npy", exact + (np.arange(257) == 3))
    with pytest.raises(ValueError, match=r"train\.counts\.npy is corrupt \(not 257 int64 counts adding up to the "
                                         r"split's \d+ tokens\); re-run `meshtrain prepare-data --force`"):
        ds.token_counts()
    (prepared / "train.counts.npy").unlink()
    with pytest.raises(FileNotFoundError, match=r"train\.counts\.npy is missing"):
        ds.token_counts()


def test_a_folder_without_counts_counts_a_bounded_sample(prepared: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Folders prepared before the counts (formats 1 and 2) are counted at startup: exactly below
    ``COUNT_SAMPLE_TOKENS``, else in evenly spaced blocks adding up to it, so a corpus of any size costs the same
    read. Here a split of 10^12 virtual tokens (no file: each slice is made when read) is counted by reading exactly
    the sample; and a real older folder gives the exact counts."""
    from meshtrain.train import data

    meta = json.loads((prepared / "meta.json").read_text())
    (prepared / "meta.json").write_text(json.dumps({**meta, "format": 2}))
    for p in prepared.glob("*.counts.npy"):
        p.unlink()
    exact = np.bincount(np.fromfile(prepared / "train.bin", dtype=np.uint16), minlength=257)
    assert np.array_equal(TokenDataset(prepared).token_counts(), exact)

    class Virtual:  # token id = position mod 257, made per slice; records what was read
        read = 0

        def __len__(self) -> int:
            return 10**12

        def __getitem__(self, s: slice) -> np.ndarray:
            Virtual.read += s.stop - s.start
            return (np.arange(s.start, s.stop, dtype=np.int64) % 257).astype(np.uint32)

    monkeypatch.setattr(data, "COUNT_SAMPLE_TOKENS", 64 * 257 * 1000)
    counts = data.count_tokens(Virtual(), 257)
    assert Virtual.read == counts.sum() == 64 * 257 * 1000  # the sample and nothing more
    assert (counts == 64 * 1000).all()  # each block of 257,000 holds every id 1000 times


def test_prepare_is_deterministic(tmp_path: Path, corpus: Path) -> None:
    prepare_data(corpus, tmp_path / "a", val_fraction=0.2)
    prepare_data(corpus, tmp_path / "b", val_fraction=0.2)
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_val_and_train_hold_disjoint_documents(prepared: Path, corpus: Path) -> None:
    tok = ByteTokenizer()

    def documents(split: str) -> set[str]:
        arr = np.fromfile(prepared / f"{split}.bin", dtype=np.uint16)
        return {tok.decode(d.tolist()) for d in np.split(arr, np.flatnonzero(arr == 256) + 1) if len(d)}

    docs = {split: documents(split) for split in ("train", "val")}
    assert docs["train"] and docs["val"] and not docs["train"] & docs["val"]
    # The split is decided by the relative path's hash.
    for p in sorted(corpus.rglob("mod_*.py")):
        rel = p.relative_to(corpus).as_posix()
        split = "val" if is_val_document(rel, 0.2) else "train"
        assert p.read_text(encoding="utf-8") in docs[split]


def test_val_fallback_keeps_both_splits_non_empty(tmp_path: Path, corpus: Path) -> None:
    # 0.0001 of 10000 buckets = bucket 0 only: almost surely no file hashes there.
    meta = prepare_data(corpus, tmp_path / "d", val_fraction=0.0001)
    assert meta["val_tokens"] > 0 and meta["train_tokens"] > 0 and meta["val_files"] == 1
    meta0 = prepare_data(corpus, tmp_path / "z", val_fraction=0.0)
    assert meta0["val_tokens"] == 0 and meta0["files"] == 40
    assert TokenDataset(tmp_path / "z", "val").num_tokens == 0


def test_prepare_argument_errors(tmp_path: Path, corpus: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"does not exist \(option --src of prepare-data\)"):
        prepare_data(tmp_path / "nope", tmp_path / "o")
    with pytest.raises(ValueError, match=r"--val-fraction must be between 0 and 0.5, or 1 .*got 0.7"):
        prepare_data(corpus, tmp_path / "o", val_fraction=0.7)
    with pytest.raises(ValueError, match=r"no files with extensions \.rs"):
        prepare_data(corpus, tmp_path / "o", extensions=(".rs",))
    one = tmp_path / "one"
    one.mkdir()
    (one / "a.py").write_text("a = 1\n")
    with pytest.raises(ValueError, match=r"at least 2 .*--val-fraction 0"):
        prepare_data(one, tmp_path / "o", val_fraction=0.1)
    # An existing folder that is not prepared data is never overwritten.
    with pytest.raises(ValueError, match="not a prepared data folder"):
        prepare_data(corpus, corpus)
    assert not (tmp_path / "o").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_prepare_is_atomic_on_error(tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    real = ByteTokenizer.encode_array

    def failing(self: ByteTokenizer, text: str) -> np.ndarray:
        calls["n"] += 1
        if calls["n"] == 10:  # fail mid-way, after some tokens were written
            raise RuntimeError("boom")
        return real(self, text)

    monkeypatch.setattr(ByteTokenizer, "encode_array", failing)
    with pytest.raises(RuntimeError, match="boom"):
        prepare_data(corpus, tmp_path / "out")
    assert calls["n"] == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no out, no temp folder


def test_prepare_keeps_folder_finished_concurrently(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If another rank renames its folder into place first, ours is discarded, theirs kept."""
    out = tmp_path / "out"
    real_publish = prep._publish

    def publish_after_other_rank(tmp: Path, dst: Path, overwrite: bool) -> dict:
        dst.mkdir()
        (dst / "meta.json").write_text(json.dumps({"marker": "other rank"}))
        return real_publish(tmp, dst, overwrite)

    monkeypatch.setattr(prep, "_publish", publish_after_other_rank)
    meta = prepare_data(corpus, out)
    assert meta == {"marker": "other rank"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]
    assert sorted(p.name for p in out.iterdir()) == ["meta.json"]


def test_prepare_overwrite(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "out"
    prepare_data(corpus, out, val_fraction=0.0)
    meta = prepare_data(corpus, out, val_fraction=0.2, overwrite=True)
    assert meta["val_tokens"] > 0 and json.loads((out / "meta.json").read_text()) == meta
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_cli(tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    assert prep.main(["--src", str(corpus), "--out", str(out), "--val-fraction", "0.2"]) == 0
    line = capsys.readouterr().out.strip()
    assert "40 documents" in line and "train tokens" in line and str(out) in line
    assert prep.main(["--src", str(corpus), "--out", str(out)]) == 0
    assert "already prepared" in capsys.readouterr().out
    assert prep.main(["--src", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--src" in err and len(err.strip().splitlines()) == 1


def test_options_that_would_do_nothing_are_refused(tmp_path: Path, corpus: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Each was ignored without a word: --format without --src (the standard library was read as text), --ext
    with one JSONL file (read as text: its JSON became the tokens), --field on text files, and an already
    prepared --out answered "already prepared" whatever the options asked."""
    out = tmp_path / "out"
    assert prep.main(["--src", str(corpus), "--out", str(out)]) == 0
    capsys.readouterr()
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"text": "a"}\n{"text": "b"}\n')
    for argv, said in [
        (["--format", "jsonl", "--prompt-field", "p"], "--format and --prompt-field read --src, which is not given"),
        (["--src", str(jsonl), "--ext", ".txt", "--out", str(tmp_path / "x")], "--ext picks the files of a folder"),
        (["--src", str(corpus), "--format", "parquet", "--ext", ".py", "--out", str(tmp_path / "x")],
         "--format parquet reads its own suffixes"),
        (["--src", str(corpus), "--field", "body", "--out", str(tmp_path / "x")], "--src " + str(corpus) + " is read "
         "as text: leave --field out"),
        (["--src", str(corpus), "--out", str(out), "--format", "jsonl"], "already prepared, with format text, not "
         "jsonl: pass --force"),
        (["--src", str(corpus), "--out", str(out), "--tokenizer", str(jsonl)], "tokenizer byte, not " + str(jsonl)),
        # another source or held-out share on a prepared folder: said, not answered "already prepared"
        (["--src", str(jsonl), "--out", str(out)], f"already prepared, with source {corpus.resolve()}, not {jsonl}"),
        (["--src", str(corpus), "--out", str(out), "--val-fraction", "0.5"], "with --val-fraction 0.02, not 0.5"),
        (["--src", str(corpus), "--out", str(out), "--ext", ".md"], "with --ext .py, not .md"),
        # without --out, --src went into the standard library's cache (or was answered from it)
        (["--src", str(corpus)], f"--src {corpus} needs --out"),
        (["--src", "", "--out", str(tmp_path / "x")], "--src is empty"),  # an empty one read the standard library
        (["--src", str(corpus), "--out", " "], "--out is empty"),
        (["--src", str(corpus), "--out", str(tmp_path / "x"), "--tokenizer", "hf"], "--tokenizer hf names a "
         "prepared folder's own tokenizer.json"),
    ]:
        assert prep.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert not (tmp_path / "x").exists()
    assert prep.main(["--src", str(corpus), "--out", str(out), "--tokenizer", "byte", "--ext", ".py"]) == 0  # held
    assert "already prepared" in capsys.readouterr().out
    for bad in ("{bad", "[1]", "{}"):  # a meta.json that is no prepared folder's: named, with --force
        (tmp_path / "other").mkdir(exist_ok=True)
        (tmp_path / "other" / "meta.json").write_text(bad)
        assert prep.main(["--src", str(corpus), "--out", str(tmp_path / "other")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "other/meta.json is not a prepared folder's meta.json: pass --force" \
            in err, err


def test_default_dirs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert (prep.default_source_dir() / "os.py").is_file()
    monkeypatch.setenv("MESHTRAIN_CACHE", str(tmp_path))
    v = sys.version_info
    assert prep.default_data_dir() == tmp_path / f"stdlib-byte-py{v.major}{v.minor}"


def test_ensure_prepared_errors(tmp_path: Path, corpus: Path, prepared: Path) -> None:
    assert ensure_prepared(str(prepared)) == prepared
    with pytest.raises(FileNotFoundError, match="data.path .* does not exist.*prepare-data"):
        ensure_prepared(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"prepare-data --src .*src --out OUT.*data.path=OUT"):
        ensure_prepared(str(corpus))


def test_ensure_prepared_default_uses_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHTRAIN_CACHE", str(tmp_path / "cache"))
    small = make_corpus(tmp_path / "fake_stdlib", n=6)
    monkeypatch.setattr(prep, "default_source_dir", lambda: small)
    out = ensure_prepared(None)
    assert out == prep.default_data_dir() and (out / "meta.json").is_file()
    mtime = (out / "meta.json").stat().st_mtime_ns
    assert ensure_prepared("") == out and (out / "meta.json").stat().st_mtime_ns == mtime  # not redone


@pytest.mark.skipif(os.environ.get("MESHTRAIN_SKIP_STDLIB") == "1", reason="stdlib test disabled")
def test_prepare_real_stdlib(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    meta = prepare_data(prep.default_source_dir(), tmp_path / "stdlib")
    took = time.perf_counter() - t0
    assert meta["train_tokens"] + meta["val_tokens"] > 5_000_000
    assert meta["val_tokens"] > 0 and meta["files"] > 100
    assert took < 30, f"preparing the stdlib took {took:.1f}s"
    ds = TokenDataset(tmp_path / "stdlib")
    x, y = ds.batch(0, 0, 4, 256)
    assert x.shape == (4, 256) and int(x.max()) < 257


# ---------------------------------------------------------------- datasets


def test_batch_deterministic_and_shifted(prepared: Path) -> None:
    ds = TokenDataset(prepared)
    x1, y1 = ds.batch(seed=1, step=5, batch_size=8, seq_len=32)
    x2, y2 = TokenDataset(prepared).batch(seed=1, step=5, batch_size=8, seq_len=32)
    assert x1.dtype == torch.int64 and y1.dtype == torch.int64 and x1.shape == y1.shape == (8, 32)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are inputs shifted by one
    x3, _ = ds.batch(seed=1, step=6, batch_size=8, seq_len=32)
    x4, _ = ds.batch(seed=2, step=5, batch_size=8, seq_len=32)
    assert not torch.equal(x1, x3) and not torch.equal(x1, x4)
    # Each row is a real window of the token file.
    tokens = np.fromfile(prepared / "train.bin", dtype=np.uint16)
    windows = np.lib.stride_tricks.sliding_window_view(tokens, 33)
    for r in range(8):
        row = torch.cat([x1[r], y1[r, -1:]]).numpy()
        assert (windows == row).all(axis=1).any()
    # train and val draw different batches for the same (seed, step).
    xv, _ = TokenDataset(prepared, "val").batch(seed=1, step=5, batch_size=8, seq_len=32)
    assert not torch.equal(x1, xv)


def test_global_batch_independent_of_layout(prepared: Path) -> None:
    ds = TokenDataset(prepared)
    x, y = ds.batch(3, 7, 8, 16)
    for count in (1, 2, 4, 8):
        parts = [shard_rows(x, i, count) for i in range(count)]
        assert torch.equal(torch.cat(parts), x)


def test_batch_too_short_split(prepared: Path) -> None:
    ds = TokenDataset(prepared, "val")
    with pytest.raises(ValueError, match="train.seq_len"):
        ds.batch(0, 0, 2, ds.num_tokens - 1)
    ds.batch(0, 0, 2, ds.num_tokens - 2)  # exactly enough
    with pytest.raises(ValueError, match="train.seed"):
        ds.batch(-1, 0, 2, 4)


def test_dataset_missing_and_corrupt_meta(tmp_path: Path, prepared: Path) -> None:
    with pytest.raises(FileNotFoundError, match="data.path.*prepare-data"):
        TokenDataset(tmp_path)
    meta_path = prepared / "meta.json"
    good = json.loads(meta_path.read_text())

    meta_path.write_text("{not json")
    with pytest.raises(ValueError, match="corrupt"):
        TokenDataset(prepared)
    meta_path.write_text(json.dumps({k: v for k, v in good.items() if k != "eos_id"}))
    with pytest.raises(ValueError, match="missing eos_id"):
        TokenDataset(prepared)
    meta_path.write_text(json.dumps({**good, "format": 99}))
    with pytest.raises(ValueError, match="unknown format"):
        TokenDataset(prepared)
    meta_path.write_text(json.dumps({**good, "dtype": "float32"}))
    with pytest.raises(ValueError, match="dtype"):
        TokenDataset(prepared)
    meta_path.write_text(json.dumps(good))
    with pytest.raises(ValueError, match="unknown data split"):
        TokenDataset(prepared, "test")


def test_dataset_truncated_bin(prepared: Path) -> None:
    ds = TokenDataset(prepared)
    assert (ds.vocab_size, ds.eos_id) == (257, 256)
    n = ds.num_tokens
    del ds
    with open(prepared / "train.bin", "r+b") as f:
        f.truncate((n - 10) * 2)
    with pytest.raises(ValueError, match="truncated or corrupt.*prepare-data"):
        TokenDataset(prepared)
    (prepared / "val.bin").unlink()
    with pytest.raises(FileNotFoundError, match="val.bin.*prepare-data"):
        TokenDataset(prepared, "val")


def test_shard_rows() -> None:
    x = torch.arange(24).reshape(6, 4)
    assert torch.equal(shard_rows(x, 0, 1), x)
    assert torch.equal(shard_rows(x, 1, 3), x[2:4])
    assert torch.equal(shard_rows(x, 2, 3), x[4:6])
    with pytest.raises(ValueError, match="train.global_batch"):
        shard_rows(x, 0, 4)
    with pytest.raises(ValueError, match="out of range"):
        shard_rows(x, 3, 3)


def test_synthetic_dataset() -> None:
    ds = SyntheticDataset(vocab_size=257)
    x1, y1 = ds.batch(0, 3, 4, 128)
    x2, y2 = SyntheticDataset(vocab_size=257).batch(0, 3, 4, 128)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.dtype == torch.int64 and x1.shape == (4, 128)
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    assert not torch.equal(x1, ds.batch(0, 4, 4, 128)[0])
    assert not torch.equal(x1, SyntheticDataset(257, split="val").batch(0, 3, 4, 128)[0])
    assert int(x1.min()) >= 0 and int(x1.max()) < 257
    # Learnable: most next tokens follow the affine rule (noise 0.1 -> about 90%).
    x, y = ds.batch(1, 0, 32, 256)
    follows = (y == (ds.mult * x + ds.incr) % 257).float().mean().item()
    assert 0.85 < follows < 0.95
    assert ds.eos_id == 256 and ds.vocab_size == 257 and ds.num_tokens > 0
    # A data-parallel rank's rows are those of the global batch; every target is learned.
    assert all(torch.equal(u, v[1:3]) for u, v in zip(ds.batch(0, 3, 4, 128, rows=slice(1, 3)), (x1, y1),
                                                        strict=True))
    assert ds.target_count(0, 3, 4, 128) == 4 * 128


def test_a_batch_made_ahead_is_the_one_get_returns_and_any_other_step_is_made_then():
    from meshtrain.train.data import BatchAhead

    made: list[int] = []

    def make(step: int) -> tuple[str, int]:
        made.append(step)
        return ("batch", step)

    batches = BatchAhead(make)
    assert batches.get(0) == ("batch", 0) and made == [0]  # nothing ahead: made then
    batches.ahead(1)
    assert made == [0, 1] and batches.get(1) == ("batch", 1) and made == [0, 1]  # made ahead, not again
    assert batches.get(1) == ("batch", 1) and made == [0, 1, 1]  # taken once: a second get makes it anew
    batches.ahead(2)
    assert batches.get(5) == ("batch", 5) and made == [0, 1, 1, 2, 5]  # another step (a resume): made then
