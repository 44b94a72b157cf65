"""A blend of prepared folders (``data.path="0.7 A 0.3 B"``): the form, the rows, the weights, one tokenizer, and
the same run on any layout."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from meshtrain.config import ConfigError, data_blend, load_config
from meshtrain.testing.equivalence import assert_same_cli_run, cli_train
from meshtrain.train.blend import BlendedDataset
from meshtrain.train.prepare import prepare_data

SEQ = 16


def _folder(root: Path, name: str, char: str) -> Path:
    """A prepared folder whose documents are runs of one character: each row says which folder it came from."""
    src = root / f"src_{name}"
    src.mkdir()
    for i in range(12):
        (src / f"doc_{i}.py").write_text(char * (300 + 20 * i))
    out = root / name
    prepare_data(src, out)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("blend")
    return _folder(root, "a", "a"), _folder(root, "b", "b")


def test_the_blend_form_is_parsed_and_bad_forms_are_one_line(folders, tmp_path):
    a, b = folders
    assert data_blend(f"3 {a} 1 {b}") == [(0.75, str(a)), (0.25, str(b))]  # normalised, as Megatron does
    assert data_blend(str(a)) is None and data_blend("") is None
    spaced = tmp_path / "2024 corpus"
    spaced.mkdir()
    assert data_blend(str(spaced)) is None  # an existing folder is one folder, spaces and all
    for text, says in [(f"0.7 {a} 0.3", "has 3 words"), (f"0.7 {a} x {b}", "'x' (before"),
                       (f"0 {a} 1 {b}", "must be a finite number > 0"), (f"1 {a} 2 {a}", "names a folder twice")]:
        with pytest.raises(ConfigError, match="data.path") as e:
            load_config("tiny", [f"data.path={text}"])
        assert says in str(e.value) and "\n" not in str(e.value)


def test_rows_come_from_the_folder_drawn_for_them_in_the_weights_share(folders):
    a, b = folders
    blend = BlendedDataset([(0.7, a), (0.3, b)])
    ids = {ord("a"): 0, ord("b"): 1}
    drawn = []
    for step in range(150):
        x, y = blend.batch(0, step, 16, SEQ)
        src = blend.sources(0, step, 16)
        for row, k in zip(x.numpy(), src, strict=True):
            letters = {ids[t] for t in row if t in ids}
            assert letters == {k}, f"step {step}: a row of folder {k} holds tokens of {letters}"
        drawn.append(src)
    share = float(np.mean(np.concatenate(drawn) == 0))
    assert abs(share - 0.7) < 0.035, share  # 2,400 rows: the binomial spread is 0.0094
    # A pure function of (seed, step, split): the same batch again, another seed or step another one.
    again = blend.batch(0, 7, 16, SEQ)
    assert all((u == v).all() for u, v in zip(again, blend.batch(0, 7, 16, SEQ), strict=True))
    assert not (blend.batch(1, 7, 16, SEQ)[0] == again[0]).all()
    assert not (BlendedDataset([(0.7, a), (0.3, b)], "val").batch(0, 7, 16, SEQ)[0] == again[0]).all()
    # A data-parallel rank's rows (Trainer.local_batch): those rows of the global batch, each folder reading only
    # its windows among them; every target of these folders is learned.
    for rows in (slice(0, 8), slice(8, 16), np.array([3, 15])):
        part = blend.batch(0, 7, 16, SEQ, rows=rows)
        assert all((u == v[rows]).all() for u, v in zip(part, again, strict=True)), rows
    assert blend.target_count(0, 7, 16, SEQ) == 16 * SEQ
    # The unigram baseline of the blend: the folders' distributions, weighted.
    p = blend.token_probs()
    assert p.sum() == pytest.approx(1.0) and p[ord("a")] > 0.6 and p[ord("b")] > 0.25


def test_folders_prepared_with_other_tokenizers_are_refused(folders, tmp_path):
    a, b = folders
    other = tmp_path / "other"
    other.mkdir()
    for f in b.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    meta = json.loads((other / "meta.json").read_text())
    meta["tokenizer"] = "hf-0123456789"
    (other / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="prepared with different tokenizers") as e:
        BlendedDataset([(0.5, a), (0.5, other)])
    assert "--tokenizer" in str(e.value)


def _stdlib_folder(root: Path, package: str) -> Path:
    """A prepared folder of one standard-library package's source: real text, unlike the one-letter folders."""
    out = root / package
    prepare_data(Path(json.__file__).parent.parent / package, out)
    return out


@pytest.mark.slow
def test_a_blend_trains_the_same_run_on_two_ranks_as_on_one(tmp_path):
    """The blend is drawn per global batch, so every layout cuts its rows from the same batch: dp=2 with ZeRO-1
    through the CLI equals the one-process run (losses, grad norms, final checkpoint), and dp moved bytes.

    On real text: the one-letter folders above give near-zero gradients on most entries, whose AdamW updates take
    their sign from the order of sums (docs/testing.md, the layout fuzz), so their parameters are no test of the
    blend."""
    a, b = _stdlib_folder(tmp_path, "json"), _stdlib_folder(tmp_path, "email")
    data = f"0.7 {a} 0.3 {b}"
    base = ["train.steps=4", f"train.seq_len={SEQ}", "train.global_batch=8", "train.sample_tokens=0",
            "train.progress=false", "train.eval_every=2"]
    one, stdout = cli_train(data, tmp_path / "one", base)
    assert f"a blend of 0.7 {a}, 0.3 {b}" in stdout
    layout = ["parallel.dp=2", "parallel.zero=1"]
    two, _ = cli_train(data, tmp_path / "two", [*base, "--nproc", "2", *layout])
    assert len(two) == 4 and any("val_loss" in r for r in two)
    assert_same_cli_run("blend dp2 zero1", tmp_path / "two", two, tmp_path / "one", one, layout, nproc=2)


def test_a_blend_with_an_unprepared_folder_is_refused_before_launch(folders, tmp_path, capsys):
    from meshtrain import cli

    a, _ = folders
    argv = ["train", "--config", "tiny", "--nproc", "2", "--dry-run", f"data.path=0.5 {a} 0.5 {tmp_path}"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"data.path {tmp_path} is not a prepared data folder" in err[0], err


@pytest.mark.parametrize("blend", [False, True])
def test_a_split_too_short_for_train_seq_len_is_refused_before_launch(folders, tmp_path, capsys, blend):
    """It used to stop the launched ranks at their first batch, after the run folder was written."""
    from meshtrain import cli

    a, b = folders
    data = f"0.5 {b} 0.5 {a}" if blend else str(a)
    out = tmp_path / "run"
    argv = ["train", "--config", "tiny", "--nproc", "2", "--out", str(out), "train.steps=1", "train.seq_len=8192",
            "model.max_seq_len=8192", f"data.path={data}"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"the train split of {b if blend else a} has only" in err[0], err
    assert "fewer than train.seq_len + 2 = 8194" in err[0] and not out.exists()


@pytest.mark.parametrize("blend", [False, True])
def test_miscounted_token_counts_are_refused_before_launch(folders, tmp_path, capsys, blend):
    """Rank 0 reads ``train.counts.npy`` for the unigram baseline: one that does not add up to the split used to
    stop the launched ranks after the run folder was written; it is refused before launch, naming the file."""
    import shutil

    import numpy as np

    from meshtrain import cli

    a = folders[0]
    b = shutil.copytree(folders[1], tmp_path / "b")  # the module's folders stay as they are
    counts = np.load(b / "train.counts.npy")
    counts[0] += 1
    np.save(b / "train.counts.npy", counts)
    data = f"0.5 {a} 0.5 {b}" if blend else str(b)
    out = tmp_path / "run"
    assert cli.main(["train", "--config", "tiny", "--nproc", "2", "--out", str(out), "train.steps=1",
                     f"data.path={data}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{b / 'train.counts.npy'} is corrupt" in err[0] and "prepare-data --force" in err[0], err
    assert not out.exists()
