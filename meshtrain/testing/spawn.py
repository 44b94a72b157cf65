"""Run a function on N real processes with a process group (gloo; nccl for GPU benchmarks).

``spawn(fn, 4, args)`` starts 4 processes, initialises torch.distributed through a file
store in a private temp folder (no ports to race for), calls ``fn(rank, world_size, *args)``
and returns the list of return values in rank order. Any rank that raises makes the whole
call raise ``SpawnError`` with that rank's traceback; a rank that has not finished within
``timeout`` seconds makes it raise ``SpawnTimeout`` naming the ranks still running.
Every process is killed before either error is raised, so a failing test never leaves
workers behind.

The processes come from a fork server that has imported torch and the trainer once: each is a
fresh copy of that clean process (not of the caller), with the caller's environment, stdout,
stderr, working folder and ``sys.path`` at the call. The spawn start method would have every
rank import torch itself, ~3 s of CPU a rank: a 16-rank test on 2 cores spent ~25 s before
its first line (45 s in all; 8 s from the fork server).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any


class SpawnError(RuntimeError):
    """A rank raised or died; the message carries its rank and traceback."""


class SpawnTimeout(SpawnError):
    """Some ranks did not finish in time (a hang or a deadlock)."""


# What the fork server imports once for every rank it starts.
_PRELOAD = ["torch", "torch.distributed", "meshtrain.train.trainer"]


class _Caller:
    """What each rank takes from the caller at its spawn, where it would otherwise have the fork server's, as they
    were at the caller's first spawn: the environment, and stdout and stderr (handed over as file descriptors, so
    that what a rank prints goes where the caller's output goes now, e.g. into pytest's ``capfd``)."""

    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.fds: tuple[int, int] | None = None  # in a rank: its copies of the caller's stdout and stderr

    def __reduce__(self):  # pickled as the rank starts: the descriptors travel with it
        return _caller_in_rank, (self.env, reduction.DupFd(1), reduction.DupFd(2))

    def enter(self) -> None:
        """In the rank: take the caller's environment and output streams."""
        os.environ.clear()
        os.environ.update(self.env)
        assert self.fds is not None, "a _Caller enters in the rank it was sent to"
        for fd, stream in zip(self.fds, (1, 2), strict=True):
            os.dup2(fd, stream)
            os.close(fd)


def _caller_in_rank(env: dict[str, str], out: Any, err: Any) -> _Caller:
    caller = _Caller.__new__(_Caller)
    caller.env, caller.fds = env, (out.detach(), err.detach())
    return caller


def _worker(fn: Callable, rank: int, world_size: int, store: str, threads: int, backend: str, args: tuple,
            kwargs: dict, results: Any, caller: _Caller) -> None:
    caller.enter()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args, **kwargs)
        # By value: torch's queue pickler would share tensors through file descriptors that die with
        # this process, which may exit before the parent reads them.
        results.put((rank, True, pickle.dumps(out)))
        dist.barrier()  # no rank tears its connections down while a peer still talks to it
        dist.destroy_process_group()
    except BaseException:  # noqa: B036 - any failure must reach the parent
        results.put((rank, False, traceback.format_exc()))


_SECONDARY = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing")


def _failure(procs: list, results: Any, world_size: int, failures: dict[int, str],
             outputs: dict[int, Any]) -> SpawnError:
    """Name the rank that failed first: when one rank dies, its peers fail soon after with
    transport errors, which are symptoms. Give them a moment to report, then prefer a rank whose
    own code raised, then a rank that died without a word, then the symptoms."""
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        try:
            rank, ok, value = results.get(timeout=0.1)
        except queue.Empty:
            continue
        (outputs if ok else failures)[rank] = value
    primary = [r for r, tb in sorted(failures.items()) if not any(m in tb for m in _SECONDARY)]
    if primary:
        return SpawnError(f"rank {primary[0]} of {world_size} failed:\n{failures[primary[0]]}")
    silent = [r for r, p in enumerate(procs) if r not in outputs and r not in failures
              and p.exitcode is not None]
    if silent:
        return SpawnError(f"rank {silent[0]} of {world_size} exited with code {procs[silent[0]].exitcode} "
                          f"without a result (killed or crashed).")
    r = min(failures)
    return SpawnError(f"rank {r} of {world_size} failed:\n{failures[r]}")


def _collect(procs: list, results: Any, world_size: int, timeout: float) -> dict[int, Any]:
    outputs: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(outputs) < world_size:
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            if time.monotonic() > deadline:
                running = [r for r in range(world_size) if r not in outputs]
                raise SpawnTimeout(
                    f"ranks {running} of {world_size} did not finish within {timeout:.0f} s "
                    f"(a hang or deadlock); all processes were killed."
                ) from None
            if any(r not in outputs and p.exitcode is not None for r, p in enumerate(procs)):
                raise _failure(procs, results, world_size, failures, outputs) from None
            continue
        if not ok:
            failures[rank] = value
            raise _failure(procs, results, world_size, failures, outputs)
        outputs[rank] = value
    return outputs


def spawn(fn: Callable[..., Any], world_size: int, args: tuple = (), kwargs: dict | None = None,
          timeout: float = 120.0, threads: int = 1, backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes.

    ``fn`` must be importable (a module-level function). Return values must be picklable;
    return CPU tensors or plain data. ``threads`` sets torch's intra-op threads per rank
    (1 by default: this machine has 2 cores and tests run up to 8 ranks). ``backend`` is gloo
    (tests), or nccl for benchmarks on a machine with a GPU per rank (rank r uses ``cuda:r``).
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"spawn backend must be gloo or nccl, got {backend!r}")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts: the first call of a process
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="meshtrain-spawn-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(fn, r, world_size, store, threads, backend, args, kwargs or {}, results,
                                               _Caller()),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        ok = False
        try:
            outputs = _collect(procs, results, world_size, timeout)
            ok = True
        finally:
            if ok:  # every rank reported: let them finish their shutdown barrier
                for p in procs:
                    p.join(timeout=30)
            for p in procs:  # after a failure (or a stuck shutdown) nothing is left running
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)
            results.close()
    return [pickle.loads(outputs[r]) for r in range(world_size)]
