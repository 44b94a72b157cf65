"""Hangs named, not endured: each rank publishes how far it got, and a rank whose collective fails or times out
names the ranks that did not arrive.

Publishing: a daemon thread writes this rank's position (per-group sequence numbers, the last collective it
started, the one it is blocked in, a heartbeat counter) to the process group's key-value store once a second:
never on a collective's path. A stalled rank's thread stops with it, so its heartbeat stops moving.

Diagnosis (``Watch.diagnose``, after a collective failed): read the group's positions, wait for two more
heartbeats, read again. A rank whose counter for the group is below the failed collective's sequence number did
not arrive; one whose heartbeat did not move is stalled or dead (no wall clocks compared across hosts).

Backstop: a wait still blocked ``backstop_grace`` seconds past the timeout means the backend did not time out
(an object collective on a process group made without our timeout, a backend that ignores it). A blocked C call
cannot be interrupted by an exception, so the watchdog prints the diagnosis as one ``error:`` line and ends the
process with ``BACKSTOP_EXIT_CODE``; a launcher (torchrun) then tears the other ranks down.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from meshtrain.comm_log import CollectiveLog, Entry

PUBLISH_EVERY_S = 1.0  # heartbeat period: one small store write per rank per second
SETTLE_S = 2.5  # > 2 heartbeat periods: a live rank's counter moves at least twice meanwhile
STORE_WAIT_S = 10.0  # a store read slower than this: the store's host may be the stalled rank
BACKSTOP_EXIT_CODE = 3
_KEY = "meshtrain/comm/{rank}"


def backstop_grace(timeout_s: float) -> float:
    """Seconds past the timeout before the watchdog ends a process whose wait the backend did not end."""
    return min(60.0, max(2.0, 0.1 * timeout_s))


def rank_list(ranks: list[int]) -> str:
    """``[1, 4, 5, 6]`` -> ``"ranks 1, 4-6"``; ``[2]`` -> ``"rank 2"``."""
    runs: list[str] = []
    for r in sorted(ranks):
        if runs and runs[-1].split("-")[-1] == str(r - 1):
            runs[-1] = f"{runs[-1].split('-')[0]}-{r}"
        else:
            runs.append(str(r))
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(runs)


def _store() -> Any | None:
    """The default process group's key-value store (torchrun's TCPStore, the spawn harness's FileStore)."""
    try:
        if not dist.is_initialized():
            return None
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def _bounded(fn: Callable[[], Any], seconds: float) -> Any | None:
    """``fn()`` in a helper thread; None if it has not returned within ``seconds`` (or raised)."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(fn())
        except Exception:  # noqa: BLE001 - a diagnosis must not raise on top of the failure it explains
            pass

    t = threading.Thread(target=run, name="meshtrain-comm-read", daemon=True)
    t.start()
    t.join(seconds)
    return box[0] if box else None


def _read(store: Any, ranks: list[int]) -> dict[int, dict[str, Any]]:
    """The published positions of ``ranks`` (those that published): two round trips when all did."""
    keys = [_KEY.format(rank=r) for r in ranks]
    if store.check(keys):
        return {r: json.loads(v) for r, v in zip(ranks, store.multi_get(keys), strict=True)}
    # get() would block until a missing key appears: one key at a time, only those present.
    return {r: json.loads(store.get(k)) for r, k in zip(ranks, keys, strict=True) if store.check([k])}


def _described(d: dict[str, Any] | None) -> str:
    return Entry.from_dict(d).describe() if d else "none"


class Watch:
    """The heartbeat publisher and the backstop of one process (``comm.WATCH``)."""

    def __init__(self, log: CollectiveLog) -> None:
        self.log = log
        self.timeout_s = 300.0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._beat = 0
        self._start_lock = threading.Lock()
        self._exit_registered = False
        self.running = False  # read at every collective: a plain attribute

    def start(self) -> None:
        """Start both threads (idempotent; ``comm`` calls it at the first collective between processes)."""
        with self._start_lock:
            if self.running:
                return
            self._stop.clear()
            self._threads = [threading.Thread(target=self._publish_loop, name="meshtrain-comm-heartbeat", daemon=True),
                             threading.Thread(target=self._backstop_loop, name="meshtrain-comm-watchdog", daemon=True)]
            for t in self._threads:
                t.start()
            self.running = True
            if not self._exit_registered:  # out of any store call before the interpreter finalises
                atexit.register(self.stop)
                self._exit_registered = True

    def stop(self) -> None:
        self.running = False
        self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=2.0)
        self._threads = []

    # ------------------------------------------------------------------ publishing

    def publish(self) -> bool:
        """Write this rank's position to the store once; False where there is no store."""
        store = _store()
        if store is None:
            return False
        self._beat += 1
        state = {"beat": self._beat, "pid": os.getpid(), **self.log.position()}
        store.set(_KEY.format(rank=dist.get_rank()), json.dumps(state))
        return True

    def _publish_loop(self) -> None:
        while True:
            try:
                self.publish()
            except Exception:  # noqa: BLE001 - a store going away at shutdown; the next beat retries
                pass
            if self._stop.wait(PUBLISH_EVERY_S):
                return

    # ------------------------------------------------------------------ the backstop

    def _backstop_loop(self) -> None:
        while not self._stop.wait(0.5):
            wait = self.log.oldest_wait()
            if wait is None or wait[1] <= self.timeout_s + backstop_grace(self.timeout_s):
                continue
            entry, waited = wait
            rank = dist.get_rank() if dist.is_initialized() else 0
            what = (f"collective timed out on rank {rank} after {waited:.0f} s (train.collective_timeout_s="
                    f"{self.timeout_s:g}; the backend did not end the wait, so the watchdog ends this process)")
            print(f"error: {self.report(what, entry)}", file=sys.stderr, flush=True)
            os._exit(BACKSTOP_EXIT_CODE)

    # ------------------------------------------------------------------ diagnosis

    def diagnose(self, entry: Entry) -> str:
        """Which of the other ranks ``entry`` waits for did not arrive, and why (one clause, no newline).

        Takes ``SETTLE_S`` seconds: the positions are read twice to tell a stalled rank from a live one."""
        store = _store()
        if store is None:
            return "no process-group store to read the other ranks' progress from"
        me = dist.get_rank()
        peers = [entry.peer] if entry.is_p2p else [r for r in self.log.members(entry.group) if r != me]
        first = _bounded(lambda: _read(store, peers), STORE_WAIT_S)
        time.sleep(SETTLE_S)
        second = _bounded(lambda: _read(store, peers), STORE_WAIT_S)
        if first is None or second is None:
            return "the process-group store did not answer (the rank hosting it may be the stalled one)"
        classes: dict[str, list[int]] = {}
        detail: dict[str, str] = {}
        for r in peers:
            before, now = first.get(r), second.get(r)
            if now is None:
                key, why = "unknown", "published no progress (stalled or died before its first collective)"
            else:
                alive = before is not None and now["beat"] != before["beat"]
                # p2p counts differ between the two sides of a transfer: no "reached" for them
                reached = not entry.is_p2p and now["seq"].get(entry.key, 0) >= entry.seq
                blocked = now.get("blocked")
                if not alive:  # its position is its last heartbeat's: up to PUBLISH_EVERY_S old
                    last = f"after starting {_described(now['last'])}" if now["last"] else "before its first collective"
                    if now["last"] and now["last"]["group"] != entry.group:  # and how far it got on this group
                        last += f", #{now['seq'].get(entry.key, 0)} on '{entry.group}'"
                    key, why = ("stalled-reached" if reached else "stalled",
                                f"stopped responding (stalled or dead), last heard of {last}")
                elif reached:
                    continue  # arrived, and waiting like us
                elif blocked:
                    key, why = "elsewhere", f"is alive but has waited {blocked['for_s']:.0f} s in {_described(blocked)}"
                else:
                    key, why = "busy", f"is alive and busy; the last collective it started is {_described(now['last'])}"
            classes.setdefault(key, []).append(r)
            detail.setdefault(key, why)
        if not classes:
            return ("every other rank of the group reached it and is alive: they may disagree on its shape or on the "
                    "order of collectives (rerun with train.check_collective_order=true)")
        parts = []
        for key, ranks in classes.items():
            names, why = rank_list(ranks), detail[key]
            if len(ranks) > 1:  # one rank's details stand for the class
                why = f"rank {ranks[0]}, the first, {why}"
            if entry.is_p2p:
                parts.append(f"the peer, {names}, {why}")
            elif key.endswith("-reached"):
                parts.append(f"{names} reached it but {why}")
            else:
                parts.append(f"{names} did not arrive: {why if len(ranks) > 1 else 'it ' + why}")
        return "; ".join(parts)

    def report(self, what: str, entry: Entry) -> str:
        """The one-line message of a failed collective: ``what`` happened, in which collective, who is missing."""
        return f"{what} waiting in {entry.describe()}: {self.diagnose(entry)}"
