"""Python's garbage collector during training (``train/gc_schedule.py``, ``train.gc_every``): off between scheduled
collections, which run at a fixed step on every rank, walk only what training made since the first step, and still
free every cycle within ``train.gc_every`` steps."""

import gc
import weakref

import pytest

from meshtrain.config import ConfigError, load_config
from meshtrain.train.gc_schedule import GcClock, GcSchedule
from meshtrain.train.trainer import Trainer


class _Node:
    """A container the collector tracks; ``cycle()`` makes garbage only a collection frees."""

    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_the_schedule_collects_cycles_only_at_its_steps_and_restores_the_collector():
    gc.collect()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with GcSchedule(every=3) as schedule:
        assert not gc.isenabled()
        before = _cycle()  # made before the first step's freeze: collected by it, not frozen
        schedule.after_step(1)
        assert before() is None
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # torch, the test session: out of every later collection
        young = _cycle()
        old = _cycle()
        holder = [old()]  # keeps the second cycle alive through step 3's collection
        kept = [_Node() for _ in range(2000)]  # past automatic collection's threshold (700): it would free `young`
        schedule.after_step(2)
        assert young() is not None  # step 2 is not a multiple of 3, and nothing collected automatically
        schedule.after_step(3)
        assert young() is None and old() is not None  # step 3 collects what was made since the freeze
        holder.clear()  # `old` is garbage now, and survived a collection into the oldest generation
        schedule.after_step(4)
        schedule.after_step(5)
        assert old() is not None  # nothing collects before step 6
        schedule.after_step(6)
        assert old() is None  # a full collection: a generation-1 one (torchtitan's) would keep it for good
        assert gc.get_freeze_count() == frozen and len(kept) == 2000
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_every_0_leaves_pythons_automatic_collection_alone():
    with GcSchedule(every=0) as schedule:
        assert gc.isenabled()
        schedule.after_step(1)
        assert gc.get_freeze_count() == 0
    assert gc.isenabled()


def test_a_disabled_collector_stays_disabled_after_the_schedule():
    gc.disable()
    try:
        with GcSchedule(every=2) as schedule:
            schedule.after_step(1)
        assert not gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_the_clock_times_collections_by_generation():
    with GcClock() as clock:
        clock.take()
        gc.collect()
        gc.collect(0)
        ms, collections = clock.take()
        assert ms > 0 and collections == [1, 0, 1]
        assert clock.take() == (0.0, [0, 0, 0])
    gc.collect()
    assert clock.take() == (0.0, [0, 0, 0])  # left: no longer called


def test_the_trainer_runs_steps_without_automatic_collection_and_records_what_collections_took(tmp_path,
                                                                                             monkeypatch):
    enabled: list[bool] = []
    original = Trainer.train_step

    def train_step(self, step):
        enabled.append(gc.isenabled())
        return original(self, step)

    monkeypatch.setattr(Trainer, "train_step", train_step)
    base = ["data.source=synthetic", "train.steps=4", "train.progress=false", "train.tensorboard=false",
            "train.sample_tokens=0"]
    records = Trainer(load_config("tiny", base + ["train.gc_every=2"]), out_dir=tmp_path / "a").train()
    assert enabled == [False] * 4 and gc.isenabled() and gc.get_freeze_count() == 0
    ms = [r["gc_ms"] for r in records]
    # Step 1 collects the whole heap before freezing it (tens of ms with torch loaded); steps 2 and 4 collect what
    # was made since (well under a millisecond); step 3 does not collect.
    assert ms[0] > 1.0 and ms[2] == 0.0 and max(ms[1], ms[3]) < ms[0] / 10, ms

    enabled.clear()
    records = Trainer(load_config("tiny", base + ["train.gc_every=0"]), out_dir=tmp_path / "b").train()
    assert enabled == [True] * 4 and all("gc_ms" in r for r in records)


def test_a_negative_gc_every_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"train.gc_every must be >= 0, got -1"):
        load_config("tiny", ["train.gc_every=-1"])


@pytest.mark.slow
def test_the_benchmark_runs_both_sides_as_the_same_run(tmp_path):
    """benchmarks/gc_pauses.py on a short eager run, started from another folder than the repository: both sides
    train in their own process, the table has a row per side, and the losses agree to the bit (the collector changes
    no arithmetic)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "gc_pauses.py"), "--eager", "--steps", "3",
                          "--runs", "1"], capture_output=True, text=True, cwd=tmp_path, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "| automatic (0) |" in out.stdout and "| scheduled (50) |" in out.stdout
    assert "same run: every side's losses are equal to the bit" in out.stdout
