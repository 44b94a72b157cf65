"""What this rank's collectives were: a bounded ring of the recent ones, with a sequence number per group.

Always on (``meshtrain.comm`` records every collective it issues), so that when one hangs or fails the
message can name it (group, op, sequence number, shape, dtype) and the watchdog (``comm_watch.py``) can publish
how far this rank got. Recording one is a lock, a counter increment and a deque append: no store traffic and
nothing that grows. Collective sequence numbers count per group name, so they agree across the ranks of a group
in a correct program; point-to-point transfers count under ``"<group>/p2p"``, apart, because the stages of a
pipeline send and receive different numbers of them.

With the order check on (``train.check_collective_order``) the log also keeps, per group, a running fingerprint
of what was issued (``comm.py`` compares it across the group before each collective) and the call site of each
entry, for the report of the first divergence.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

RING_SIZE = 64  # entries kept per process: enough to read back a step's collectives, small enough to publish


@dataclass(frozen=True, slots=True)
class Entry:
    """One collective this rank issued."""

    group: str  # the mesh group's name ("dp", "tp", "world", ...): the meter's axis
    op: str  # all_reduce, all_gather, ..., send, recv, barrier, gather_objects, ...
    seq: int  # 1 for the first collective this rank issued on ``group`` (p2p: on "<group>/p2p")
    shape: tuple[int, ...] | None  # None for object collectives and barriers
    dtype: str  # "float32", or "" where there is no tensor
    peer: int = -1  # the other global rank of a send / recv
    site: str = ""  # file:line of the caller, recorded only with the order check on

    @property
    def is_p2p(self) -> bool:
        return self.op in ("send", "recv")

    @property
    def key(self) -> str:
        """The counter this entry's ``seq`` belongs to."""
        return f"{self.group}/p2p" if self.is_p2p else self.group

    def describe(self) -> str:
        """E.g. ``all_reduce on 'dp' #12 (shape [4, 8], float32)``, ``recv from rank 3 on 'pp' #5 (...)``."""
        what = self.op if self.peer < 0 else f"{self.op} {'to' if self.op == 'send' else 'from'} rank {self.peer}"
        tensor = f" (shape {list(self.shape)}, {self.dtype})" if self.shape is not None else ""
        site = f" at {self.site}" if self.site else ""
        return f"{what} on '{self.group}' #{self.seq}{tensor}{site}"

    def signature(self) -> tuple:
        """What every rank of the group must agree on. all_to_all's first dim is each rank's own token count
        (uneven splits), so only its row shape is compared."""
        shape = self.shape[1:] if self.op == "all_to_all" and self.shape else self.shape
        return (self.group, self.op, shape, self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Entry:
        shape = d.get("shape")
        return Entry(d["group"], d["op"], int(d["seq"]), tuple(shape) if shape is not None else None, d["dtype"],
                     int(d.get("peer", -1)), d.get("site", ""))


def dtype_name(dtype: object) -> str:
    """``torch.float32`` -> ``float32``."""
    return str(dtype).removeprefix("torch.")


# torch's wrappers that keep the collectives out of compiled graphs (``comm.eager``): the lazy one, then dynamo's.
_DYNAMO_WRAPPERS = (os.path.join("torch", "_compile.py"), os.path.join("torch", "_dynamo", "eval_frame.py"))


def caller_site(skip_file: str) -> str:
    """``path:line`` of the nearest frame outside ``skip_file`` (the comm module): where a collective was asked
    for. Walking frames costs microseconds, so only the order check asks."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename in (skip_file, __file__)
                                 or frame.f_code.co_filename.endswith(_DYNAMO_WRAPPERS)):
        frame = frame.f_back
    if frame is None:
        return ""
    path = frame.f_code.co_filename
    for marker in ("/meshtrain/", "/tests/", "/benchmarks/"):  # short and machine-independent
        if marker in path:
            path = marker[1:] + path.split(marker, 1)[1]
            break
    return f"{path}:{frame.f_lineno}"


class CollectiveLog:
    """The ring of recent entries, the per-group counters, what each thread is blocked in, and (order check)
    the per-group fingerprints. Thread-safe: an async checkpoint may issue collectives beside the main thread."""

    def __init__(self, size: int = RING_SIZE) -> None:
        self._lock = threading.Lock()
        self.size = size
        self.reset()

    def reset(self) -> None:
        """Forget everything (``comm.configure`` calls it on every rank at the same point of a run)."""
        with self._lock:
            self._ring: deque[Entry] = deque(maxlen=self.size)
            self._seq: dict[str, int] = {}
            self._fingerprint: dict[str, int] = {}
            self._members: dict[str, tuple[int, ...]] = {}
            self.blocked: dict[int, tuple[Entry, float]] = {}  # thread id -> (entry, monotonic start of the wait)

    def issue(self, group: str, members: tuple[int, ...], op: str, shape: tuple[int, ...] | None, dtype: str,
              peer: int = -1, site: str = "", fingerprint: bool = False) -> Entry:
        """Record a collective about to be issued on ``group`` (global ``members``); returns its entry."""
        key = f"{group}/p2p" if op in ("send", "recv") else group
        with self._lock:
            seq = self._seq.get(key, 0) + 1
            self._seq[key] = seq
            entry = Entry(group, op, seq, shape, dtype, peer, site)
            self._ring.append(entry)
            self._members[group] = members
            if fingerprint:
                self._fingerprint[key] = _chain(self._fingerprint.get(key, 0), entry.signature())
        return entry

    def fingerprint(self, key: str) -> int:
        """The running hash of every signature issued on ``key`` since the last reset (a signed 64-bit int)."""
        with self._lock:
            return self._fingerprint.get(key, 0)

    def members(self, group: str) -> tuple[int, ...]:
        with self._lock:
            return self._members.get(group, ())

    def recent(self, n: int | None = None) -> list[Entry]:
        """The last ``n`` entries (all kept ones by default), oldest first."""
        with self._lock:
            items = list(self._ring)
        return items if n is None else items[-n:]

    def position(self) -> dict[str, Any]:
        """How far this rank got, as plain data: counters, the last entry, what it is blocked in and for how long."""
        now = time.monotonic()
        with self._lock:
            last = self._ring[-1].to_dict() if self._ring else None
            waits = sorted(self.blocked.values(), key=lambda w: w[1])
            seq = dict(self._seq)
        blocked = {**waits[0][0].to_dict(), "for_s": round(now - waits[0][1], 1)} if waits else None
        return {"seq": seq, "last": last, "blocked": blocked}

    def block(self, entry: Entry) -> None:
        """The calling thread starts waiting for ``entry`` (the watchdog's backstop reads this)."""
        with self._lock:
            self.blocked[threading.get_ident()] = (entry, time.monotonic())

    def unblock(self) -> None:
        with self._lock:
            self.blocked.pop(threading.get_ident(), None)

    def oldest_wait(self) -> tuple[Entry, float] | None:
        """(entry, seconds waited) of the longest wait in progress, if any."""
        now = time.monotonic()
        with self._lock:
            waits = list(self.blocked.values())
        if not waits:
            return None
        entry, start = min(waits, key=lambda w: w[1])
        return entry, now - start


def _chain(previous: int, signature: tuple) -> int:
    """The next running fingerprint: a hash of the previous one and this signature (the same on every process,
    unlike Python's salted ``hash``)."""
    h = hashlib.blake2b(previous.to_bytes(8, "little", signed=True) + repr(signature).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little", signed=True)
