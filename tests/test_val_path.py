"""Validation on another prepared folder (``data.val_path``): its val split, not the training folder's, is what the
run's validation loss measures; ``prepare-data --val-fraction 1`` makes a folder of nothing but validation."""

import json
from pathlib import Path

import pytest
import torch

from meshtrain.config import ConfigError, load_config
from meshtrain.testing.equivalence import prepared_stdlib
from meshtrain.train.data import TokenDataset
from meshtrain.train.preflight import check_data
from meshtrain.train.prepare import prepare_data
from meshtrain.train.trainer import Trainer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(training folder: the stdlib; an eval-only folder: this repository's docs, every document held out)."""
    root = tmp_path_factory.mktemp("valpath")
    docs = sorted((Path(__file__).parents[1] / "docs").glob("*.md"))
    (root / "eval.jsonl").write_text("".join(json.dumps({"text": p.read_text()}) + "\n" for p in docs))
    prepare_data(root / "eval.jsonl", root / "eval", val_fraction=1.0)
    return prepared_stdlib(tmp_path_factory, "valpath_train"), str(root / "eval")


def _cfg(data, *overrides):
    return load_config("tiny", [f"data.path={data}", "train.progress=false", "train.tensorboard=false",
                                "train.peak_flops=1e11", "train.steps=2", "train.eval_batches=2", *overrides])


def _loss_by_hand(trainer: Trainer, folder: str) -> float:
    """The mean token loss of the model as it is on ``folder``'s val split, batch by batch as the trainer draws."""
    t, data = trainer.cfg.train, TokenDataset(folder, "val")
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(t.eval_batches):
            x, y = data.batch(t.seed, i, t.global_batch, t.seq_len)
            logits = trainer.model(x)
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            count += y.numel()
    return total / count


def test_validation_reads_the_other_folders_val_split(folders, tmp_path):
    train, evaluation = folders
    meta = json.loads((Path(evaluation) / "meta.json").read_text())
    assert meta["train_tokens"] == 0 and meta["val_tokens"] > 10_000  # --val-fraction 1: every document held out
    trainer = Trainer(_cfg(train, f"data.val_path={evaluation}"), tmp_path / "run")
    assert trainer.val_data.path == Path(evaluation)
    want, own = _loss_by_hand(trainer, evaluation), _loss_by_hand(trainer, train)
    assert trainer.evaluate() == pytest.approx(want, rel=1e-6) and abs(want / own - 1) > 1e-5  # the control
    records = trainer.train()
    assert records[-1]["val_loss"] == pytest.approx(_loss_by_hand(trainer, evaluation), rel=1e-6)


def test_a_val_path_that_cannot_validate_is_one_line_before_launch(folders, tmp_path):
    train, _ = folders
    prepare_data(Path(__file__).parents[1] / "meshtrain" / "presets", tmp_path / "none", val_fraction=0.0,
                 extensions=(".yaml",))
    with pytest.raises(ConfigError, match=r"data.val_path=.*none holds 0 validation tokens, less than one "
                                          r"train.seq_len=32 window .* --val-fraction 1"):
        check_data(_cfg(train, f"data.val_path={tmp_path / 'none'}"))
    with pytest.raises(ConfigError, match="data.val_path validates on a prepared folder: it needs data.source=files"):
        _cfg(train, "data.source=synthetic", f"data.val_path={tmp_path / 'none'}")
    with pytest.raises(ValueError, match=r"--val-fraction must be between 0 and 0.5, or 1"):
        prepare_data(tmp_path / "none", tmp_path / "bad", val_fraction=0.7)
    # Another tokenizer: a small BPE one (the tokenizers library, as test_hf.py builds them).
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    texts = [p.read_text() for p in (Path(__file__).parents[1] / "docs").glob("*.md")]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=90, special_tokens=["<unk>", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "bpe.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prepare_data(tmp_path / "bpe.jsonl", tmp_path / "bpe", tokenizer=str(tmp_path / "tokenizer.json"),
                 val_fraction=1.0)
    with pytest.raises(ConfigError, match=r"data.val_path=.*bpe was prepared with another tokenizer than the "
                                          r"training data \(tokenizer"):
        check_data(_cfg(train, f"data.val_path={tmp_path / 'bpe'}"))
