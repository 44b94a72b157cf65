"""The one place that calls torch.distributed collectives.

Every call names the mesh group it runs on (an ``AxisGroup`` from ``meshtrain.mesh``) and is
counted by the meter under that group's name: calls, payload bytes and ring wire bytes.
The planner's byte predictions and the tests read the meter, so the payload definition is
fixed here, per rank and per call:

=================  ===========================  =============================
op                 ``bytes`` (payload)          ``wire_bytes`` (ring, sent)
=================  ===========================  =============================
all_reduce         size of the tensor           2 (n-1)/n x bytes
reduce             size of the tensor           (n-1)/n x bytes (to one rank)
all_gather         size of the gathered output  (n-1)/n x bytes
reduce_scatter     size of the full input       (n-1)/n x bytes
all_to_all         size of the input            bytes sent to other ranks
broadcast          size of the tensor           bytes (src sends, others receive)
send / recv        size of the tensor           bytes for send, 0 for recv
=================  ===========================  =============================

Collectives over a group of size 1 return at once and are not counted: nothing moves.

Every collective between processes is also recorded in ``LOG`` (``comm_log.py``: a bounded ring with a sequence
number per group) and waits at most ``train.collective_timeout_s`` (``configure``). When one times out or a peer
dies, the error is a ``CommError`` whose one-line message names the collective and the ranks that did not arrive
(``comm_watch.py`` reads every rank's published progress). With ``check_order`` every collective is first
compared across its group, and a ``CollectiveOrderError`` names the first divergence.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from meshtrain.comm_log import CollectiveLog, Entry, caller_site, dtype_name
from meshtrain.comm_watch import Watch, rank_list
from meshtrain.errors import CommError
from meshtrain.mesh import AxisGroup

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.AVG}


# Compiled blocks (train.compile, parallel/compile.py) reach the collectives below: each runs eagerly as one graph
# break. Traced, dynamo would guard on the meter's counts and the log (recompiling at every call) and stop at locks.
# torch's lazy form of ``torch.compiler.disable`` (its optimizers and DDP use it): dynamo is imported at the first
# call, not here. Importing it takes ~2 s of CPU, which every CLI start (a one-line error included) and every worker
# of an uncompiled run would pay for nothing.
eager = torch._compile._disable_dynamo


class CollectiveTimeout(CommError):
    """A collective waited longer than ``train.collective_timeout_s`` for its peers."""


class CollectiveOrderError(CommError):
    """The ranks of a group issued different collectives (``train.check_collective_order``): the first one."""


LOG = CollectiveLog()  # this process's recent collectives (always on)
WATCH = Watch(LOG)  # its heartbeat in the store, the diagnosis of a failure, the backstop


@dataclass
class _Settings:
    timeout_s: float = 300.0
    check_order: bool = False
    timeout: timedelta = timedelta(seconds=300.0)  # timeout_s as the backends take it (built once, not per wait)


_SETTINGS = _Settings()


def configure(timeout_s: float = 300.0, check_order: bool = False) -> None:
    """Set how long any collective may wait for its peers and whether collective order is checked.

    Call it on every rank at the same point (the trainer does, before building the mesh): it also resets the
    log, so sequence numbers and fingerprints start together."""
    _SETTINGS.timeout_s, _SETTINGS.check_order = float(timeout_s), bool(check_order)
    _SETTINGS.timeout = timedelta(seconds=float(timeout_s))
    WATCH.timeout_s = float(timeout_s)
    LOG.reset()
    if dist.is_initialized() and dist.get_world_size() > 1:  # a rank stalled before its first collective shows
        WATCH.start()


def recent(n: int | None = None) -> list[Entry]:
    """This rank's last ``n`` collectives (oldest first): what it was doing when something went wrong."""
    return LOG.recent(n)


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0
    wire_bytes: float = 0.0
    seconds: float = 0.0  # time inside blocking calls and waits (not the async work itself)


@dataclass
class CommMeter:
    """Per-process counters keyed by (group name, op); optionally a trace of every call in order."""

    stats: dict[tuple[str, str], OpStats] = field(default_factory=lambda: defaultdict(OpStats))
    trace: list[tuple[str, str, tuple[int, ...], str]] | None = None
    timing: bool = False  # record when each async collective completes (benchmarks measure overlap)

    def record(self, group: AxisGroup, op: str, tensor: torch.Tensor, nbytes: int, wire: float) -> None:
        s = self.stats[(group.name, op)]
        s.calls += 1
        s.bytes += nbytes
        s.wire_bytes += wire
        if self.trace is not None:
            self.trace.append((group.name, op, tuple(tensor.shape), str(tensor.dtype)))

    def reset(self, trace: bool = False) -> None:
        self.stats.clear()
        self.trace = [] if trace else None

    def bytes(self, axis: str | None = None, op: str | None = None) -> int:
        """Payload bytes summed over the matching (axis, op) entries."""
        return sum(s.bytes for (a, o), s in self.stats.items() if (axis in (None, a)) and (op in (None, o)))

    def seconds(self) -> float:
        """Seconds this process has been blocked in collectives (waits and blocking calls) since the last reset."""
        return sum(s.seconds for s in self.stats.values())

    def calls(self, axis: str | None = None, op: str | None = None) -> int:
        return sum(s.calls for (a, o), s in self.stats.items() if (axis in (None, a)) and (op in (None, o)))

    def snapshot(self) -> dict[str, dict[str, dict[str, float]]]:
        """{axis: {op: {calls, bytes, wire_bytes, seconds}}}, plain data for logs and JSON."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (axis, op), s in sorted(self.stats.items()):
            out.setdefault(axis, {})[op] = {
                "calls": s.calls, "bytes": s.bytes, "wire_bytes": s.wire_bytes, "seconds": s.seconds
            }
        return out


METER = CommMeter()


class Handle:
    """An in-flight async collective. ``wait()`` blocks until it is done (and charges the wait).

    ``started`` and ``completed`` (perf_counter seconds, set by the backend's completion callback
    where it has one) let benchmarks measure how much communication ran under compute.
    """

    def __init__(self, work: object | None, stats: OpStats | None = None, entry: Entry | None = None,
                 cpu: bool = True) -> None:
        self._work = work
        self._stats = stats
        self._entry = entry
        self._cpu = cpu
        self.started = time.perf_counter()
        self.completed: float | None = None if work is not None else self.started
        if work is not None and METER.timing:
            try:
                work.get_future().then(self._mark_done)
            except (RuntimeError, AttributeError):  # no future for this op (gloo's reduce_scatter): poll it
                _Poller.watch(self)

    def _mark_done(self, fut: object = None) -> None:
        if self.completed is None:
            self.completed = time.perf_counter()

    @eager
    def wait(self) -> None:
        if self._work is not None:
            t = time.perf_counter()
            _wait(self._work, self._entry, self._cpu)
            if self._stats is not None:
                self._stats.seconds += time.perf_counter() - t
            self._mark_done()  # no later than here, whatever a poller would note afterwards
            self._work = None

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


class _Poller:
    """Timing only (``METER.timing``): a background thread that notes when futureless work completes.

    Such work (gloo's reduce_scatter) offers no completion callback, only ``is_completed()``, so the
    thread polls it; the interval bounds the timing error (0.2 ms). With nothing to watch it sleeps on a
    condition instead of polling."""

    _pending: list[Handle] = []
    _ready = threading.Condition()
    _thread: threading.Thread | None = None

    @classmethod
    def watch(cls, handle: Handle) -> None:
        with cls._ready:
            cls._pending.append(handle)
            if cls._thread is None:
                cls._thread = threading.Thread(target=cls._run, daemon=True)
                cls._thread.start()
            cls._ready.notify()

    @classmethod
    def _run(cls) -> None:
        while True:
            with cls._ready:
                while not cls._pending:
                    cls._ready.wait()
                still = []
                for h in cls._pending:
                    work = h._work
                    if work is None or work.is_completed():
                        h._mark_done()
                    else:
                        still.append(h)
                cls._pending = still
            time.sleep(0.0002)  # the polling interval (see the class docstring)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ----------------------------------------------------------------------------- recording, waiting, failing


def _issue(group: AxisGroup, op: str, tensor: torch.Tensor | None, peer: int = -1) -> Entry:
    """Record a collective in the log (and start the heartbeat at the first one)."""
    if not WATCH.running:
        WATCH.start()
    check = _SETTINGS.check_order
    return LOG.issue(group.name, group.ranks, op, tuple(tensor.shape) if tensor is not None else None,
                     dtype_name(tensor.dtype) if tensor is not None else "", peer,
                     caller_site(__file__) if check else "", fingerprint=check and peer < 0)


def _failure(entry: Entry, err: BaseException) -> CommError | None:
    """The error a backend's failure of ``entry`` becomes: a timeout or a lost peer, with the ranks named.
    None for anything else (a programming error keeps its own message)."""
    text = str(err).lower()
    me = dist.get_rank() if dist.is_initialized() else 0
    if "timed out" in text or "timeout" in text:
        cls = CollectiveTimeout
        what = f"collective timed out on rank {me} after {_SETTINGS.timeout_s:g} s (train.collective_timeout_s)"
    elif any(m in text for m in ("connection", "peer", "broken pipe")):
        cls, what = CommError, f"collective failed on rank {me} (a peer closed its connection)"
    else:
        return None
    return cls(WATCH.report(what, entry))


def _watched(entry: Entry, fn: Callable[[], object]) -> object:
    """Run ``fn()`` with the calling thread marked as waiting in ``entry`` (the watchdog's backstop reads it); a
    timeout or a lost peer inside becomes a ``CommError`` naming the ranks that did not arrive, other errors pass
    unchanged. (A plain call rather than a context manager: it runs around every wait.)"""
    LOG.block(entry)
    try:
        return fn()
    except RuntimeError as e:
        LOG.unblock()  # the diagnosis takes seconds: the backstop must not end the process meanwhile
        err = _failure(entry, e)
        if err is None:
            raise
        raise err from e
    finally:
        LOG.unblock()


def _wait(work, entry: Entry | None, cpu: bool) -> None:
    """Wait for ``work`` at most the configured timeout. Gloo (CPU) takes the timeout per wait; NCCL's own
    watchdog enforces the process group's timeout (a timed wait there would block the CPU on the GPU)."""
    if entry is None:
        work.wait()
    elif cpu:
        _watched(entry, lambda: work.wait(_SETTINGS.timeout))
    else:
        _watched(entry, work.wait)


def _blocking(entry: Entry, fn: Callable[[], object]) -> object:
    """Run a call that has no async form (object collectives): the process group's timeout applies, and the
    watchdog's backstop ends the process should it not."""
    return _watched(entry, fn)


def _object_device(group: AxisGroup) -> torch.device:
    """Where a collective without a tensor of ours runs: CPU on gloo, this rank's GPU on NCCL."""
    if dist.get_backend(group.pg) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_order(group: AxisGroup, entry: Entry, device: torch.device) -> None:
    """Compare (sequence number, running fingerprint) of ``entry`` across the group before it runs; on a
    difference, every rank of the group gets the same ``CollectiveOrderError`` naming what each side issued.
    Not metered and not logged: a debug option's cost, one small all-gather per collective."""
    mine = torch.tensor([entry.seq, LOG.fingerprint(entry.key)], dtype=torch.int64, device=device)
    rows = torch.empty(group.size * 2, dtype=torch.int64, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    _wait(gather(rows, mine, group=group.pg, async_op=True), entry, device.type == "cpu")
    got = rows.view(group.size, 2).tolist()
    if all(r == got[0] for r in got):
        return
    said: list[object] = [None] * group.size
    _blocking(entry, lambda: dist.all_gather_object(said, entry.describe(), group=group.pg))
    by_desc: dict[str, list[int]] = {}
    for rank, desc in zip(group.ranks, said, strict=True):
        by_desc.setdefault(str(desc), []).append(rank)
    issued = "; ".join(f"{rank_list(ranks)} issued {desc}" for desc, ranks in by_desc.items())
    raise CollectiveOrderError(f"collective order diverged (the first difference, found before it ran): {issued}")


def _run(group: AxisGroup, op: str, tensor: torch.Tensor, nbytes: int, wire: float, fn: Callable[[], object],
         async_op: bool):
    """Meter and log collective ``op`` on ``group``, then issue it (``fn()``: always async, returning the backend's
    work) and return its ``Handle``; or, for a blocking call, wait for it with the timeout."""
    METER.record(group, op, tensor, nbytes, wire)
    stats = METER.stats[(group.name, op)]
    entry = _issue(group, op, tensor)
    cpu = tensor.device.type == "cpu"
    if _SETTINGS.check_order:
        _check_order(group, entry, tensor.device)
    if async_op:
        return Handle(fn(), stats, entry, cpu)
    t = time.perf_counter()
    _wait(fn(), entry, cpu)  # blocking = issued async, then a wait that has the timeout
    stats.seconds += time.perf_counter() - t
    return None


def _done(async_op: bool) -> Handle | None:
    return Handle(None) if async_op else None


@eager
def all_reduce(tensor: torch.Tensor, group: AxisGroup, op: str = "sum", async_op: bool = False) -> Handle | None:
    """In-place reduction of ``tensor`` over ``group``."""
    if group.size == 1:
        return _done(async_op)
    n, b = group.size, _nbytes(tensor)
    return _run(group, "all_reduce", tensor, b, 2 * (n - 1) / n * b,
                lambda: dist.all_reduce(tensor, _OPS[op], group=group.pg, async_op=True), async_op)


@eager
def reduce(tensor: torch.Tensor, group: AxisGroup, dst_index: int, op: str = "sum",
           async_op: bool = False) -> Handle | None:
    """Reduce ``tensor`` over the group into the group's ``dst_index``-th rank (others' copies are scratch)."""
    if group.size == 1:
        return _done(async_op)
    n, b = group.size, _nbytes(tensor)
    return _run(group, "reduce", tensor, b, (n - 1) / n * b,
                lambda: dist.reduce(tensor, group.ranks[dst_index], _OPS[op], group=group.pg, async_op=True), async_op)


@eager
def all_gather(output: torch.Tensor, tensor: torch.Tensor, group: AxisGroup, async_op: bool = False) -> Handle | None:
    """Concatenate every rank's ``tensor`` along dim 0 into ``output`` (group order)."""
    if group.size == 1:
        output.copy_(tensor)
        return _done(async_op)
    n, b = group.size, _nbytes(output)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return _run(group, "all_gather", tensor, b, (n - 1) / n * b,
                lambda: fn(output, tensor, group=group.pg, async_op=True), async_op)


@eager
def reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, group: AxisGroup, op: str = "sum",
                   async_op: bool = False) -> Handle | None:
    """Reduce ``tensor`` over the group and keep this rank's dim-0 chunk in ``output``."""
    if group.size == 1:
        output.copy_(tensor)
        return _done(async_op)
    n, b = group.size, _nbytes(tensor)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return _run(group, "reduce_scatter", tensor, b, (n - 1) / n * b,
                lambda: fn(output, tensor, op=_OPS[op], group=group.pg, async_op=True), async_op)


@eager
def all_to_all(output: torch.Tensor, tensor: torch.Tensor, group: AxisGroup,
               output_splits: list[int] | None = None, input_splits: list[int] | None = None,
               async_op: bool = False) -> Handle | None:
    """Send dim-0 chunk i of ``tensor`` to rank i of the group; receive theirs into ``output``."""
    if group.size == 1:
        output.copy_(tensor)
        return _done(async_op)
    b = _nbytes(tensor)
    row = b // max(tensor.shape[0], 1)
    me = group.index(dist.get_rank())
    own = (input_splits[me] * row) if input_splits is not None else b // group.size
    return _run(group, "all_to_all", tensor, b, b - own,
                lambda: dist.all_to_all_single(output, tensor, output_splits, input_splits,
                                               group=group.pg, async_op=True), async_op)


@eager
def broadcast(tensor: torch.Tensor, group: AxisGroup, src_index: int = 0, async_op: bool = False) -> Handle | None:
    """Copy the tensor of the group's ``src_index``-th rank to every rank of the group."""
    if group.size == 1:
        return _done(async_op)
    b = _nbytes(tensor)
    return _run(group, "broadcast", tensor, b, b,
                lambda: dist.broadcast(tensor, group.ranks[src_index], group=group.pg, async_op=True), async_op)


@dataclass
class P2P:
    """One side of a point-to-point transfer: ``op`` is "send" or "recv", ``peer`` a global rank;
    ``tag`` tells apart messages between the same pair of ranks."""

    op: str
    tensor: torch.Tensor
    peer: int
    tag: int = 0


@eager
def batch_p2p(ops: list[P2P], group: AxisGroup) -> list[Handle]:
    """Post sends and receives together as one batch (one NCCL group, in which they progress together); one handle
    per op, in order. On NCCL a batch completes as a whole (torch returns one work for it), so each handle waits for
    the whole batch; between batches NCCL keeps posting order (``plan/p2p_order.py`` models both)."""
    if not ops:
        return []
    p2p, entries = [], []
    for o in ops:
        b = _nbytes(o.tensor)
        METER.record(group, o.op, o.tensor, b, b if o.op == "send" else 0)
        entries.append(_issue(group, o.op, o.tensor, peer=o.peer))
        fn = dist.isend if o.op == "send" else dist.irecv
        p2p.append(dist.P2POp(fn, o.tensor, o.peer, group=group.pg, tag=o.tag))
    works = dist.batch_isend_irecv(p2p)
    if len(works) == 1 < len(ops):  # NCCL coalesces the batch into one work
        works = works * len(ops)
    return [Handle(w, METER.stats[(group.name, o.op)], e, o.tensor.device.type == "cpu")
            for w, e, o in zip(works, entries, ops, strict=True)]


def backend(group: AxisGroup) -> str:
    """The torch.distributed backend of ``group`` ("gloo", "nccl", ...): what the pipeline's posting policy follows."""
    return str(dist.get_backend(group.pg))


def send(tensor: torch.Tensor, peer: int, group: AxisGroup) -> None:
    """Blocking send to global rank ``peer``."""
    for h in batch_p2p([P2P("send", tensor, peer)], group):
        h.wait()


def recv(tensor: torch.Tensor, peer: int, group: AxisGroup) -> None:
    """Blocking receive from global rank ``peer`` into ``tensor``."""
    for h in batch_p2p([P2P("recv", tensor, peer)], group):
        h.wait()


def barrier(group: AxisGroup) -> None:
    """Wait for every rank of the group (not metered: no payload)."""
    if group.size > 1:
        entry = _issue(group, "barrier", None)
        device = _object_device(group)
        if _SETTINGS.check_order:
            _check_order(group, entry, device)
        _wait(dist.barrier(group=group.pg, async_op=True), entry, device.type == "cpu")


def shutdown(group: AxisGroup) -> bool:
    """An orderly end of a multi-process run: every rank of ``group`` (the world) is done before any tears its
    connections down (a barrier under the collective timeout, named on failure), then the process group goes.
    False if there was no process group."""
    if not dist.is_initialized():
        return False
    barrier(group)
    dist.destroy_process_group()
    return True


def all_reduce_scalars(values: list[float], group: AxisGroup, op: str = "sum",
                       device: torch.device | str = "cpu") -> list[float]:
    """Reduce a few Python floats (metrics) in one fp64 all-reduce (``device``: the mesh's, for NCCL)."""
    if group.size == 1:
        return list(values)
    return all_reduce_metrics(torch.tensor(values, dtype=torch.float64, device=device), group, op).tolist()


def all_reduce_metrics(t: torch.Tensor, group: AxisGroup, op: str = "sum") -> torch.Tensor:
    """Reduce a few device values (a step's loss, a squared gradient norm) in place and return them, read by
    no one here: the caller decides when the host waits for them (the trainer reads once a step)."""
    if group.size > 1:
        # Metered as "metrics" so per-step byte checks of the training collectives stay exact.
        _run(group, "metrics", t, _nbytes(t), 0.0,
             lambda: dist.all_reduce(t, _OPS[op], group=group.pg, async_op=True), False)
    return t


def gather_objects(obj: object, group: AxisGroup) -> list[object]:
    """Every rank's picklable ``obj`` (not metered): small metadata, or a tiny test model's tensors for the
    equivalence helpers (``state.gather_full``); never model tensors on the training path."""
    if group.size == 1:
        return [obj]
    out: list[object] = [None] * group.size
    _object_collective(group, "gather_objects", lambda: dist.all_gather_object(out, obj, group=group.pg))
    return out


def gather_objects_to_first(obj: object, group: AxisGroup) -> list[object] | None:
    """Every rank's picklable ``obj`` (metadata, not metered) on the group's first rank; None elsewhere. Unlike
    ``gather_objects`` no rank but the first holds a list that grows with the group."""
    if group.size == 1:
        return [obj]
    first = group.ranks[0]
    out: list[object] | None = [None] * group.size if dist.get_rank() == first else None
    _object_collective(group, "gather_objects_to_first",
                       lambda: dist.gather_object(obj, out, dst=first, group=group.pg))
    return out


def scatter_objects_from_first(objs: list[object] | None, group: AxisGroup) -> object:
    """Object ``objs[i]`` (given on the group's first rank) to the group's i-th rank (metadata, not metered)."""
    if group.size == 1:
        return objs[0]
    out: list[object] = [None]
    _object_collective(group, "scatter_objects_from_first",
                       lambda: dist.scatter_object_list(out, objs, src=group.ranks[0], group=group.pg))
    return out[0]


def _object_collective(group: AxisGroup, op: str, fn: Callable[[], object]) -> None:
    entry = _issue(group, op, None)
    if _SETTINGS.check_order:
        _check_order(group, entry, _object_device(group))
    _blocking(entry, fn)
