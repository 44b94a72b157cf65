"""When Python's garbage collector runs during training, and how long it takes.

Python's automatic collection starts whenever enough container objects have been allocated, so a collection of
the oldest generation (which walks every tracked object: ~450,000 after ``torch.compile`` of the demo model, 240-300
ms on this project's CPU) lands inside some step, on some rank, at random. Across many ranks one slow rank stalls
all of them at the next collective, so torchtitan turns automatic collection off and collects every
``training.gc_freq`` steps (default 50) at the same step on every rank. ``GcSchedule`` does the same with
``train.gc_every`` (default 50; 0 keeps Python's automatic collection), and one thing more: after the first step
(compilation done) it collects once and ``gc.freeze()``s what is left, the model, the compiled code and the
libraries, so the scheduled collections walk only what training made since: a full collection then takes ~0.1 ms
where it took ~240, and nothing cyclic outlives ``train.gc_every`` steps (a generation-1 collection, torchtitan's,
would leave cycles that reached the oldest generation uncollected until the run ends).

``GcClock`` measures what the collector took (``gc.callbacks``): the trainer records it per step as ``gc_ms``.
"""

from __future__ import annotations

import gc
import time
from typing import Any


class GcClock:
    """Milliseconds Python's garbage collector spent, and collections by generation, since the last ``take``."""

    def __init__(self) -> None:
        self.ms = 0.0
        self.collections = [0, 0, 0]
        self._started: float | None = None

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.ms += (time.perf_counter() - self._started) * 1e3
            self.collections[info["generation"]] += 1
            self._started = None

    def take(self) -> tuple[float, list[int]]:
        """(ms, collections per generation) since the last call, and start counting afresh."""
        out = self.ms, self.collections
        self.ms, self.collections = 0.0, [0, 0, 0]
        return out


class GcSchedule:
    """Automatic collection off while training; a full collection after every ``every`` steps, the same step on
    every rank; the heap left after the first step frozen out of them (``gc.freeze``). ``every=0``: Python's
    automatic collection, untouched. A context manager: leaving it unfreezes and restores automatic collection as
    it was (the process may go on, as in tests or a notebook)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self._was_enabled = True
        self._frozen = False

    def __enter__(self) -> GcSchedule:
        if self.every:
            self._was_enabled = gc.isenabled()
            gc.disable()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.every:
            if self._frozen:
                gc.unfreeze()
                self._frozen = False
            if self._was_enabled:
                gc.enable()

    def settle(self) -> None:
        """Collect everything once and freeze what is left out of later collections (the warm-up is over)."""
        if self.every and not self._frozen:
            gc.collect()
            gc.freeze()
            self._frozen = True

    def after_step(self, step: int) -> None:
        """Call after each optimizer step with its number (from 1). The first call settles (the first step's
        compilation included); every ``every``-th step after it collects."""
        if not self.every:
            return
        if not self._frozen:
            self.settle()
        elif step % self.every == 0:
            gc.collect()
