"""Records with a prompt (``prepare-data --prompt-field``): fine-tuning data whose prompt the model reads and does not
learn. Each record is tokenized as prompt then completion (apart, so the boundary is a token boundary) then eos;
``<split>.prompts.npy`` keeps each document's prompt length, and a batch's targets are -100 (ignored) wherever the
target token is a prompt token. The loss is then the mean over completion and eos tokens, on every layout.
"""

import json
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from meshtrain.config import load_config
from meshtrain.testing.equivalence import check_layouts, reference_runs, run_overrides
from meshtrain.testing.spawn import spawn
from meshtrain.train.data import TokenDataset, batch_rng
from meshtrain.train.prepare import prepare_data


def _records(n: int = 120, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    words = "the a planner mesh rank layout pipeline tensor expert gradient loss step".split()
    out = []
    for i in range(n):
        prompt = f"Q{i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(0, 8))) + "?\n"
        out.append({"prompt": prompt if i % 10 else "", "completion": "A: " + " ".join(
            rng.choice(words) for _ in range(rng.randint(1, 10)))})
    return out


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    root = tmp_path_factory.mktemp("prompts")
    recs = _records()
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    prepare_data(root / "sft.jsonl", root / "data", val_fraction=0.2, field="completion", prompt_field="prompt")
    return recs, str(root / "data")


def test_each_document_is_its_prompt_then_its_completion_then_eos(records):
    recs, data = records
    pairs = {(r["prompt"], r["completion"]) for r in recs}
    seen = 0
    for split in ("train", "val"):
        ds = TokenDataset(data, split)
        assert ds.meta["prompt_field"] == "prompt"
        offsets, prompts = ds._prompts
        tokens = np.asarray(ds._tokens)
        for i in range(len(offsets) - 1):
            doc = tokens[offsets[i]:offsets[i + 1]]
            assert doc[-1] == ds.eos_id
            text = doc[:-1].astype(np.uint8)  # byte tokenizer: ids 0-255 are the bytes
            prompt, completion = bytes(text[:prompts[i]]).decode(), bytes(text[prompts[i]:]).decode()
            assert (prompt, completion) in pairs, (split, i)
            seen += 1
    assert seen == len(recs)


def test_a_batch_ignores_exactly_the_prompt_targets(records):
    _, data = records
    ds = TokenDataset(data, "train")
    offsets, prompts = ds._prompts
    in_prompt = np.zeros(ds.num_tokens, dtype=bool)  # by brute force, token by token
    for start, n in zip(offsets[:-1], prompts, strict=True):
        in_prompt[start:start + n] = True
    assert np.array_equal(ds.prompt_targets(np.arange(ds.num_tokens)), in_prompt)
    seed, step, rows, t = 3, 7, 16, 48
    inputs, targets = ds.batch(seed, step, rows, t)
    # The windows the batch drew (a batch is a pure function of seed, step and split: TokenDataset.batch)
    starts = batch_rng(seed, step, ds._split_id, None).integers(0, ds.num_tokens - t, size=rows)
    positions = starts[:, None] + 1 + np.arange(t)
    tokens = np.asarray(ds._tokens, dtype=np.int64)
    assert torch.equal(targets == -100, torch.from_numpy(in_prompt[positions]))
    assert torch.equal(targets[targets != -100], torch.from_numpy(tokens[positions][~in_prompt[positions]]))
    assert 0.1 < float((targets == -100).float().mean()) < 0.9  # the test data has both


class _CountingTokens:
    """A token array that counts the tokens read through it."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens, self.read = tokens, 0

    def __getitem__(self, idx):
        out = self.tokens[idx]
        self.read += out.size
        return out

    @property
    def shape(self) -> tuple[int, ...]:
        return self.tokens.shape


def test_a_rank_reads_only_its_rows_and_counts_the_global_targets_without_reading(records):
    """``batch(rows=)`` is those rows of the global batch, read alone (what a data-parallel rank reads falls as
    1/dp); ``target_count`` is the global batch's learned targets from the offsets and prompt lengths alone,
    also for windows that end at the split's last token."""
    _, data = records
    ds = TokenDataset(data, "train")
    n = ds.num_tokens
    for seed, step, rows, t in ((3, 7, 16, 48), (0, 1, 8, 5), (1, 2, 8, n - 2), (4, 0, 6, n - 3)):
        inputs, targets = ds.batch(seed, step, rows, t)
        ds._tokens = _CountingTokens(ds._tokens)
        assert ds.target_count(seed, step, rows, t) == int((targets != -100).sum()), (seed, step, t)
        assert ds._tokens.read == 0
        for part in (slice(0, rows // 2), slice(rows // 2, rows), np.array([1, rows - 1])):
            x, y = ds.batch(seed, step, rows, t, rows=part)
            assert torch.equal(x, inputs[part]) and torch.equal(y, targets[part]), (seed, step, t, part)
        assert ds._tokens.read == (rows + 2) * (t + 1)  # the two halves and two rows: nothing else
        ds._tokens = ds._tokens.tokens
    # seq_len n - 2 draws offsets 0 and 1: a window at 1 ends at the split's last token
    assert (batch_rng(1, 2, ds._split_id, None).integers(0, 2, size=8) == 1).any()


def test_a_blend_of_prompt_folders_counts_its_targets_and_gives_any_rows(records, tmp_path):
    """A blend's ``target_count`` is each folder's over the rows drawn for it (each with its own stream), and its
    ``rows`` are those of the global batch in the order asked."""
    from meshtrain.train.blend import BlendedDataset

    _, data = records
    (tmp_path / "more.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(90, seed=1)))
    prepare_data(tmp_path / "more.jsonl", tmp_path / "more", val_fraction=0.2, field="completion",
                 prompt_field="prompt")
    blend = BlendedDataset([(0.6, data), (0.4, tmp_path / "more")])
    for step in range(6):
        inputs, targets = blend.batch(2, step, 12, 40)
        assert blend.target_count(2, step, 12, 40) == int((targets != -100).sum()) < targets.numel(), step
        for rows in (slice(4, 8), np.array([9, 1, 9, 0])):
            x, y = blend.batch(2, step, 12, 40, rows=rows)
            assert torch.equal(x, inputs[rows]) and torch.equal(y, targets[rows]), (step, rows)


def test_the_loss_is_the_mean_over_completion_tokens(records):
    from meshtrain.train.trainer import Trainer

    _, data = records
    cfg = load_config("tiny", [f"data.path={data}", *run_overrides(1), "train.seq_len=48"])
    trainer = Trainer(cfg)
    batch = trainer.local_batch(trainer.train_data, 0)
    with torch.no_grad():
        logits = trainer.model(batch.inputs)
    want = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=-100).item()
    learned = int((batch.targets != -100).sum())
    assert batch.n_tokens == learned < batch.targets.numel()
    assert trainer.train_step(0)["loss"] == pytest.approx(want, rel=1e-6)
    ds = trainer.train_data
    ds._prompts = None  # the control: every target learned
    _, every = ds.batch(cfg.train.seed, 0, cfg.train.global_batch, cfg.train.seq_len)
    unmasked = F.cross_entropy(logits.flatten(0, 1), every.flatten()).item()
    assert abs(unmasked / want - 1) > 1e-4, (unmasked, want)


def test_refusals_name_the_option(tmp_path):
    (tmp_path / "a.txt").write_text("some text")
    with pytest.raises(ValueError, match="--prompt-field prompt reads records"):
        prepare_data(tmp_path / "a.txt", tmp_path / "out", fmt="text", prompt_field="prompt")
    (tmp_path / "r.jsonl").write_text(json.dumps({"question": "q", "text": "a"}) + "\n")
    with pytest.raises(ValueError, match=r"r.jsonl:1 has no field 'prompt' .*pass --prompt-field NAME"):
        prepare_data(tmp_path / "r.jsonl", tmp_path / "out", prompt_field="prompt")
    with pytest.raises(ValueError, match="--prompt-field and --field are both 'text'"):
        prepare_data(tmp_path / "r.jsonl", tmp_path / "out", prompt_field="text")
    assert not (tmp_path / "out").exists()


def test_a_bad_prompts_file_is_refused_before_launch(records, tmp_path):
    """A corrupt or missing ``<split>.prompts.npy`` is one line naming the file and the fix from the pre-launch data
    check (``--nproc`` runs it before any process starts)."""
    import shutil

    from meshtrain.train.preflight import check_data

    _, data = records
    bad = tmp_path / "bad"
    shutil.copytree(data, bad)
    lengths = np.load(bad / "val.prompts.npy")
    lengths[0] = 10**6
    np.save(bad / "val.prompts.npy", lengths)
    with pytest.raises(ValueError, match=r"val.prompts.npy is corrupt .*re-run `meshtrain prepare-data --force`"):
        check_data(load_config("tiny", [f"data.path={bad}"]))
    (bad / "val.prompts.npy").unlink()
    with pytest.raises(FileNotFoundError, match=r"val.prompts.npy is missing \(meta.json names a prompt field\)"):
        check_data(load_config("tiny", [f"data.path={bad}"]))


def test_the_cli_prepares_records_with_a_prompt(tmp_path):
    recs = _records(20)
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    done = subprocess.run([sys.executable, "-m", "meshtrain", "prepare-data", "--src", str(tmp_path / "sft.jsonl"),
                           "--out", str(tmp_path / "data"), "--field", "completion", "--prompt-field", "prompt",
                           "--val-fraction", "0.1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "prepared 20 documents" in done.stdout
    assert TokenDataset(tmp_path / "data").meta["prompt_field"] == "prompt"


# ----------------------------------------------------------------------------- layouts against one device

BASE = [*run_overrides(4), "train.seq_len=48", "train.attention_mask=document"]  # packed fine-tuning
LAYOUTS_4 = [
    ("dp2 x tp2 sp", ["parallel.tp=2", "parallel.sp=true"]),  # the vocabulary-parallel loss ignores the prompts
    ("cp2 x dp2 zero1", ["parallel.cp=2", "parallel.zero=1"]),  # each rank's chunks of the targets
    ("pp2 1f1b x tp2", ["parallel.pp=2", "parallel.microbatches=2", "parallel.tp=2"]),
]


@pytest.mark.slow
def test_prompt_masked_fine_tuning_on_every_layout_equals_one_device(records):
    _, data = records
    per_rank = spawn(_worker, 4, args=(data,), timeout=600)
    check_layouts(data, 4, LAYOUTS_4, per_rank, reference_runs(data, BASE))


def _worker(rank, world_size, data):
    from meshtrain.testing.equivalence import layouts_worker

    return layouts_worker(rank, world_size, data, BASE, LAYOUTS_4)
