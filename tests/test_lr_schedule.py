"""The learning-rate schedules of ``train.lr_schedule``, and what warmup-stable-decay is for: a run branched from
a checkpoint of its stable phase, with more steps, is the run that had those steps from the start."""

import json
import math
import shutil

import pytest

from meshtrain.config import ConfigError, TrainConfig, load_config
from meshtrain.train.optim import lr_at
from meshtrain.train.trainer import Trainer


def _lrs(**kw) -> list[float]:
    cfg = TrainConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=4, steps=40, **kw)
    return [lr_at(step, cfg) for step in range(cfg.steps)]


def test_warmup_then_each_schedule_follows_its_formula():
    floor, span = 0.1, 36  # lr 1, min_lr_ratio 0.1, 40 steps of which 4 warm up
    for name in ("cosine", "linear", "constant", "wsd"):
        assert _lrs(lr_schedule=name)[:4] == [0.25, 0.5, 0.75, 1.0], name
    cosine, linear = _lrs(lr_schedule="cosine"), _lrs(lr_schedule="linear")
    for step in range(4, 40):
        p = (step - 4) / span
        assert cosine[step] == pytest.approx(floor + 0.9 * 0.5 * (1 + math.cos(math.pi * p)), abs=1e-12)
        assert linear[step] == pytest.approx(floor + 0.9 * (1 - p), abs=1e-12)
    assert _lrs(lr_schedule="constant")[4:] == [1.0] * 36


@pytest.mark.parametrize("shape, left", [("sqrt", lambda p: 1 - math.sqrt(p)), ("linear", lambda p: 1 - p),
                                         ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p)))])
def test_wsd_holds_the_peak_then_decays_its_last_share_of_steps_to_the_floor(shape, left):
    lrs = _lrs(lr_schedule="wsd", decay_fraction=0.25, decay_shape=shape)  # the last 10 of 40 steps decay
    assert lrs[4:30] == [1.0] * 26
    for k in range(1, 11):  # the k-th decay step
        assert lrs[29 + k] == pytest.approx(0.1 + 0.9 * left(k / 10), abs=1e-12), (shape, k)
    assert lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[4:-1], lrs[5:], strict=True))
    by_steps = _lrs(lr_schedule="wsd", decay_steps=7, decay_fraction=0.9, decay_shape=shape)  # steps win
    assert by_steps[32:34] == [1.0, pytest.approx(0.1 + 0.9 * left(1 / 7), abs=1e-12)]


def test_wsd_before_its_decay_does_not_depend_on_the_length_of_the_run():
    short = [lr_at(s, TrainConfig(steps=100, warmup_steps=5, lr_schedule="wsd", decay_steps=20)) for s in range(100)]
    long = [lr_at(s, TrainConfig(steps=300, warmup_steps=5, lr_schedule="wsd", decay_steps=20)) for s in range(300)]
    assert short[:80] == long[:80] and short[80] < long[80]
    # The control: cosine's lr at every step after warmup depends on train.steps.
    c100, c300 = (TrainConfig(steps=n, warmup_steps=5) for n in (100, 300))
    assert all(lr_at(s, c100) < lr_at(s, c300) for s in range(6, 80))


@pytest.mark.parametrize("overrides, message", [
    (["train.lr_schedule=step"], "train.lr_schedule must be cosine, linear, constant or wsd, got 'step'."),
    (["train.decay_shape=exp"], "train.decay_shape must be sqrt, linear or cosine, got 'exp'."),
    (["train.decay_fraction=0"], "train.decay_fraction must be in (0, 1]"),
    (["train.decay_steps=-1"], "train.decay_steps must be >= 0 (0: from train.decay_fraction), got -1."),
    (["train.lr_schedule=wsd", "train.steps=10", "train.warmup_steps=4", "train.decay_fraction=0.7"],
     "train.lr_schedule=wsd warms up for train.warmup_steps=4 and decays for 7 steps (train.decay_fraction=0.7 of "
     "train.steps=10), more than train.steps=10: lower the warmup or the decay, or raise train.steps."),
    (["train.lr_schedule=wsd", "train.steps=10", "train.decay_steps=9"], "decays for train.decay_steps=9, more than"),
])
def test_bad_schedules_are_one_line_naming_the_option(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", overrides)
    assert message in str(e.value)


def test_a_run_branched_from_a_stable_checkpoint_with_more_steps_is_the_longer_run(tmp_path):
    """The WSD workflow: train in the stable phase, and from any of its checkpoints, decay (or go on longer)
    in a new run folder. Bit-for-bit the run that was that long from the start."""
    common = ["data.source=synthetic", "train.progress=false", "train.tensorboard=false", "train.peak_flops=1e11",
              "train.lr_schedule=wsd", "train.decay_steps=3", "train.warmup_steps=2", "train.ckpt_keep=0"]

    def cfg(*more):
        return load_config("tiny", [*common, *more])

    straight = Trainer(cfg("train.steps=12"), tmp_path / "straight").train()
    short = Trainer(cfg("train.steps=8", "train.ckpt_every=4"), tmp_path / "short").train()
    assert [r["loss"] for r in short[:5]] == [r["loss"] for r in straight[:5]]
    assert short[7]["lr"] == pytest.approx(0.1 * 3e-3)  # the short run decayed to the floor by its step 8
    assert short[7]["loss"] != straight[7]["loss"]

    (tmp_path / "branch" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "short" / "checkpoints" / "step_000004",
                    tmp_path / "branch" / "checkpoints" / "step_000004")
    branch = Trainer(cfg("train.steps=12", "train.resume=true"), tmp_path / "branch")
    assert branch.step == 4
    rest = branch.train()
    assert [(r["loss"], r["lr"]) for r in rest] == [(r["loss"], r["lr"]) for r in straight[4:]]  # bit-for-bit
    logged = [json.loads(line) for line in (tmp_path / "branch" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(5, 13))
    assert logged[-1]["lr"] == pytest.approx(0.1 * 3e-3)
