"""Reliability: what a run guarantees when something goes wrong, shown with real processes (docs/reliability.md)."""

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from meshtrain import cli, comm, comm_watch
from meshtrain.comm_log import CollectiveLog, Entry
from meshtrain.config import ConfigError, load_config
from meshtrain.mesh import Mesh
from meshtrain.testing.spawn import SpawnError, SpawnTimeout, spawn
from meshtrain.train.trainer import Trainer

# ---- hangs and collective order (deliverable 2)
#
# Faults are committed by rank 1 of a 2-process run from the trainer's grad hook at step 1 (after step 0 ran
# clean): SIGSTOP (a stalled rank), os._exit (a dead one), or one extra collective. Each rank writes what it
# raised to a file, because spawn reports one rank only; the time of the fault is written first, so the test can
# measure how long the run took to end after it.

HANG_TIMEOUT_S = 3.0
HANG_BASE = ["data.source=synthetic", "train.steps=4", "train.progress=false", "train.tensorboard=false",
             "train.peak_flops=1e11", "train.sample_tokens=0", f"train.collective_timeout_s={HANG_TIMEOUT_S}"]


def _hang_train(rank: int, world_size: int, out: str, fault: str, overrides: list[str]) -> None:
    """Train the tiny model; rank 1 commits ``fault`` in step 1: "stop", "stop-async" (rank 0 then waits on an
    async handle), "die", "extra" or "none"."""
    if fault == "die":
        # spawn gives the peers of a rank that exited 2 s to report before killing them; a faster heartbeat lets
        # rank 0's diagnosis (two heartbeats) finish inside that window. The logic is the same.
        comm_watch.PUBLISH_EVERY_S, comm_watch.SETTLE_S = 0.25, 0.8
    cfg = load_config("tiny", [*HANG_BASE, *overrides])

    def hook(step: int, trainer: Trainer) -> None:
        if rank == 0 and step == 1 and fault == "stop-async":  # wait on a Handle, as the DP buckets do
            comm.all_reduce(torch.ones(2), trainer.mesh.group("world"), async_op=True).wait()
        if rank != 1 or step != 1 or fault == "none":
            return
        if fault == "extra":
            comm.all_reduce(torch.zeros(3), trainer.mesh.group("world"))  # the extra collective
            return
        Path(out, "fault").write_text(f"{os.getpid()} {time.time()}")  # no more collectives from here
        time.sleep(2 * comm_watch.PUBLISH_EVERY_S)  # a heartbeat publishes where it is: mid-run, not at start-up
        if fault.startswith("stop"):
            os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(9)

    try:
        return [r["loss"] for r in Trainer(cfg, grad_hook=hook).train()]
    except Exception as e:
        Path(out, f"rank{rank}.txt").write_text(f"{time.time()}\n{type(e).__name__}: {e}")
        raise


def _hang_run(tmp_path: Path, fault: str, *overrides: str) -> tuple[str, float, float]:
    """Run ``fault``; return rank 0's error, and the seconds from the fault to that error and to the run's end
    (which adds spawn's 2 s for the other ranks to report)."""
    try:
        with pytest.raises(SpawnError) as info:
            spawn(_hang_train, 2, (str(tmp_path), fault, list(overrides)), timeout=60)
        assert not isinstance(info.value, SpawnTimeout), f"the run hung until spawn's timeout: {info.value}"
        ended = time.time()
    finally:
        if (tmp_path / "fault").exists():  # spawn kills its processes; a stopped one must not outlive the test
            pid = int((tmp_path / "fault").read_text().split()[0])
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break
    assert (tmp_path / "rank0.txt").exists(), f"rank 0 did not end with an error of its own: {info.value}"
    raised, msg = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    if fault == "extra":
        return msg, 0.0, 0.0
    at = float((tmp_path / "fault").read_text().split()[1])
    return msg, float(raised) - at, ended - at


def _hang_parse(msg: str) -> tuple[str, str, int]:
    """(op, group, sequence number) of the collective a timeout message says rank 0 was waiting in."""
    m = re.search(r"waiting in (\w+) on '(\w+)' #(\d+)", msg)
    assert m, msg
    return m.group(1), m.group(2), int(m.group(3))


def test_collective_log_keeps_recent_collectives_with_a_sequence_number_per_group():
    log = CollectiveLog(size=4)
    log.issue("dp", (0, 1), "all_reduce", (8,), "float32")
    log.issue("tp", (0, 2), "all_gather", (2, 4), "bfloat16")
    log.issue("dp", (0, 1), "reduce_scatter", (16,), "float32")
    log.issue("pp", (0, 4), "send", (2, 8), "float32", peer=4)
    last = log.issue("dp", (0, 1), "all_reduce", (1,), "float64")
    # Bounded: the oldest entry went; the counters did not (dp is at 3, the p2p send counts apart from pp's).
    assert [(e.group, e.op, e.seq) for e in log.recent()] == [
        ("tp", "all_gather", 1), ("dp", "reduce_scatter", 2), ("pp", "send", 1), ("dp", "all_reduce", 3)]
    assert log.recent(1) == [last]
    assert last.describe() == "all_reduce on 'dp' #3 (shape [1], float64)"
    assert log.recent()[2].describe() == "send to rank 4 on 'pp' #1 (shape [2, 8], float32)"
    pos = log.position()
    assert pos["seq"] == {"dp": 3, "tp": 1, "pp/p2p": 1} and pos["blocked"] is None
    assert Entry.from_dict(pos["last"]) == last  # what the heartbeat publishes reads back as the entry
    log.block(last)
    assert log.position()["blocked"]["seq"] == 3 and log.oldest_wait()[0] == last
    log.unblock()
    assert log.oldest_wait() is None
    log.reset()
    assert log.recent() == [] and log.issue("dp", (0, 1), "all_reduce", (8,), "float32").seq == 1


def test_collective_fingerprints_agree_only_on_the_same_sequence():
    def run(shapes: list[tuple[int, ...]], op: str = "all_reduce") -> int:
        log = CollectiveLog()
        for s in shapes:
            log.issue("dp", (0, 1), op, s, "float32", fingerprint=True)
        return log.fingerprint("dp")

    assert run([(4,), (8,)]) == run([(4,), (8,)]) != 0  # the same on every process (no salted hash)
    assert run([(4,), (8,)]) != run([(8,), (4,)])  # order matters
    assert run([(4,), (8,)]) != run([(4,), (8,), (8,)])  # one extra
    # all_to_all's first dim is this rank's own token count: uneven splits are not a divergence.
    assert run([(5, 16)], "all_to_all") == run([(7, 16)], "all_to_all") != run([(7, 8)], "all_to_all")


def test_rank_lists_are_short():
    assert comm_watch.rank_list([2]) == "rank 2"
    assert comm_watch.rank_list([6, 1, 4, 5]) == "ranks 1, 4-6"


class _HangFakeStore:
    """Published positions by rank; every read moves the heartbeat of the ranks in ``alive``."""

    def __init__(self, positions: dict[int, dict], alive: set[int]) -> None:
        self.positions, self.alive, self.reads = positions, alive, 0

    def check(self, keys: list[str]) -> bool:
        return all(int(k.rsplit("/", 1)[1]) in self.positions for k in keys)

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.reads += 1
        out = []
        for k in keys:
            r = int(k.rsplit("/", 1)[1])
            out.append(json.dumps({**self.positions[r], "beat": self.reads if r in self.alive else 1}).encode())
        return out


def test_diagnosis_tells_stalled_busy_elsewhere_and_arrived_ranks_apart(monkeypatch):
    log = CollectiveLog()
    waited = log.issue("dp", tuple(range(6)), "all_reduce", (4,), "float32")  # rank 0 waits in dp #1
    last = Entry("dp", "all_reduce", 1, (4,), "float32").to_dict()
    other = {**Entry("tp", "all_gather", 3, (2, 4), "bfloat16").to_dict(), "for_s": 12.0}
    positions = {
        1: {"seq": {"dp": 1}, "last": last, "blocked": None},  # arrived and alive: not named
        2: {"seq": {"dp": 0}, "last": None, "blocked": None},  # stalled before its first collective
        3: {"seq": {"dp": 0}, "last": other, "blocked": None},  # stalled too: one clause for both
        4: {"seq": {"dp": 0}, "last": other, "blocked": other},  # alive, waiting in another collective
        # 5 never published
    }
    store = _HangFakeStore(positions, alive={1, 4})
    monkeypatch.setattr(comm_watch, "_store", lambda: store)
    monkeypatch.setattr(comm_watch.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(comm_watch, "SETTLE_S", 0.0)
    msg = comm_watch.Watch(log).diagnose(waited)
    assert msg == ("ranks 2-3 did not arrive: rank 2, the first, stopped responding (stalled or dead), last heard of "
                   "before its first collective; rank 4 did not arrive: it is alive but has waited 12 s in all_gather "
                   "on 'tp' #3 (shape [2, 4], bfloat16); rank 5 did not arrive: it published no progress (stalled or "
                   "died before its first collective)"), msg
    positions[2] = positions[3] = positions[4] = positions[5] = positions[1]  # all reached dp #1 ...
    assert comm_watch.Watch(log).diagnose(waited) == (  # ... but 2, 3 and 5 stopped there
        "ranks 2-3, 5 reached it but rank 2, the first, stopped responding (stalled or dead), last heard of after "
        "starting all_reduce on 'dp' #1 (shape [4], float32)")
    store.alive = set(range(6))
    assert comm_watch.Watch(log).diagnose(waited).startswith("every other rank of the group reached it and is alive")


@pytest.mark.parametrize("value", ["0", "-5", ".nan"])
def test_collective_timeout_must_be_positive(value):
    with pytest.raises(ConfigError, match=r"train\.collective_timeout_s must be a positive number of seconds"):
        load_config("tiny", [f"train.collective_timeout_s={value}"])
    cfg = load_config("tiny", ["train.collective_timeout_s=2.5", "train.check_collective_order=true"])
    assert cfg.train.collective_timeout_s == 2.5 and cfg.train.check_collective_order


def test_cli_prints_a_failed_collective_as_one_error_line(monkeypatch, capsys):
    msg = "collective timed out on rank 0 after 3 s (train.collective_timeout_s) waiting in ...: rank 1 did not arrive"

    def train(argv):
        raise comm.CollectiveTimeout(msg)

    monkeypatch.setitem(cli.COMMANDS, "train", train)
    monkeypatch.delenv("MESHTRAIN_DEBUG", raising=False)
    assert cli.main(["train"]) == 2
    assert capsys.readouterr().err == f"error: {msg}\n"


@pytest.mark.slow
def test_a_stalled_rank_is_named_within_the_timeout(tmp_path):
    msg, raised, ended = _hang_run(tmp_path, "stop", "parallel.zero=1")
    # The timeout, then the diagnosis (two heartbeats); the run's end adds spawn's 2 s for other ranks' reports.
    assert HANG_TIMEOUT_S < raised < HANG_TIMEOUT_S + comm_watch.SETTLE_S + 2, raised
    assert ended < HANG_TIMEOUT_S + comm_watch.SETTLE_S + 5, ended
    assert msg.startswith(f"CollectiveTimeout: collective timed out on rank 0 after {HANG_TIMEOUT_S:g} s "
                          f"(train.collective_timeout_s) waiting in "), msg
    op, group, seq = _hang_parse(msg)
    assert f"{op} on '{group}' #{seq} (shape [" in msg  # the collective, with its shape and dtype
    # Its position is its last heartbeat's (up to a second old): maybe from before its first collective.
    m = re.search(r"rank 1 did not arrive: it stopped responding \(stalled or dead\), last heard of (before its first "
                  r"collective|after starting (\w+) on '(\w+)' #(\d+)( \(shape [^)]*\))?(, #(\d+) on '(\w+)')?$)", msg)
    assert m, msg
    if m.group(2):  # its count on rank 0's group is behind the collective rank 0 waits in
        behind = int(m.group(4)) if m.group(3) == group else int(m.group(7))
        assert behind < seq and (m.group(3) == group or m.group(8) == group), msg
    assert "\n" not in msg


@pytest.mark.slow
def test_an_async_wait_has_the_timeout_too(tmp_path):
    # The spawn harness's process group keeps torch's 30 min default: the 3 s come from Handle.wait itself.
    msg, raised, _ = _hang_run(tmp_path, "stop-async")
    assert HANG_TIMEOUT_S < raised < HANG_TIMEOUT_S + comm_watch.SETTLE_S + 2, raised
    assert msg.startswith(f"CollectiveTimeout: collective timed out on rank 0 after {HANG_TIMEOUT_S:g} s "
                          f"(train.collective_timeout_s) waiting in all_reduce on 'world' #1 (shape [2], float32): "
                          f"rank 1 did not arrive: it stopped responding (stalled or dead)"), msg


@pytest.mark.slow
def test_a_dead_rank_is_named(tmp_path):
    msg, raised, ended = _hang_run(tmp_path, "die")
    assert raised < HANG_TIMEOUT_S, raised  # a closed connection needs no timeout, only the diagnosis
    assert ended < HANG_TIMEOUT_S + 5, ended
    assert msg.startswith("CommError: collective failed on rank 0 (a peer closed its connection) waiting in "), msg
    _hang_parse(msg)
    assert "rank 1 did not arrive: it stopped responding (stalled or dead)" in msg, msg


@pytest.mark.slow
def test_order_check_names_the_first_divergence(tmp_path):
    # ZeRO-1: all-reduces, all-gathers and metrics all pass the check in step 0 (no false alarm); in step 1 rank 1
    # issues one extra all-reduce of 3 values on 'world' where rank 0 issues the next collective of the step.
    msg, _, _ = _hang_run(tmp_path, "extra", "parallel.zero=1", "train.check_collective_order=true")
    assert msg.startswith("CollectiveOrderError: collective order diverged (the first difference, found before it "
                          "ran): "), msg
    mine = re.search(r"rank 0 issued (\w+) on '(\w+)' #(\d+) \(shape \[[\d, ]*\], (\w+)\) at meshtrain/[\w/]+\.py:\d+",
                     msg)
    theirs = re.search(r"rank 1 issued all_reduce on 'world' #(\d+) \(shape \[3\], float32\) at "
                       r"tests/test_reliability\.py:(\d+)", msg)
    assert mine and theirs, msg
    line = Path(__file__).read_text().splitlines()[int(theirs.group(2)) - 1]
    assert "the extra collective" in line  # the call site of the extra one, not a later symptom
    assert (tmp_path / "rank1.txt").read_text().split("\n", 1)[1] == msg  # both sides report the same divergence


def _hang_object_collective(rank: int, world_size: int, out: str) -> None:
    """An object collective (no async form, so no per-wait timeout) on the spawn harness's process group (made
    with torch's 30 min default): only the watchdog can end rank 0's wait once rank 1 stalls."""
    comm.configure(timeout_s=HANG_TIMEOUT_S)
    group = Mesh(dp=world_size).group("dp")
    comm.all_reduce(torch.ones(2), group)
    if rank == 1:
        Path(out, "fault").write_text(f"{os.getpid()} {time.time()}")
        time.sleep(2 * comm_watch.PUBLISH_EVERY_S)  # a heartbeat publishes the all-reduce
        os.kill(os.getpid(), signal.SIGSTOP)
    comm.gather_objects({"rank": rank}, group)


@pytest.mark.slow
def test_the_watchdog_ends_a_wait_the_backend_does_not(tmp_path, capfd):
    try:
        with pytest.raises(SpawnError) as info:
            spawn(_hang_object_collective, 2, (str(tmp_path),), timeout=60)
        ended = time.time()
    finally:
        pid = int((tmp_path / "fault").read_text().split()[0])
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break
    assert f"exited with code {comm_watch.BACKSTOP_EXIT_CODE}" in str(info.value), info.value
    since = ended - float((tmp_path / "fault").read_text().split()[1])
    assert since < HANG_TIMEOUT_S + comm_watch.backstop_grace(HANG_TIMEOUT_S) + comm_watch.SETTLE_S + 5, since
    err = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1, err
    assert re.match(r"error: collective timed out on rank 0 after \d+ s \(train\.collective_timeout_s=3; the "
                    r"backend did not end the wait, so the watchdog ends this process\) waiting in gather_objects on "
                    r"'dp' #2: rank 1 did not arrive: it stopped responding \(stalled or dead\), last heard of after "
                    r"starting all_reduce on 'dp' #1 \(shape \[2\], float32\)$", err[0]), err[0]


def _hang_checked_and_not(rank: int, world_size: int, overrides: list[str]) -> list[list[float]]:
    out = []
    for check in ("false", "true"):
        cfg = load_config("tiny", [*HANG_BASE, "train.steps=2", *overrides, f"train.check_collective_order={check}"])
        out.append([r["loss"] for r in Trainer(cfg).train()])
    return out


@pytest.mark.slow
def test_order_check_raises_no_false_alarm_and_changes_nothing():
    # 4 ranks, pp=2 x ep=2 MoE with ZeRO-1: pipeline p2p (not compared), all-to-all with uneven splits (rows
    # compared, not token counts), all-gathers, all-reduces and metrics all pass, and the losses are unchanged.
    layout = ["parallel.pp=2", "parallel.ep=2", "model.moe_experts=4", "parallel.microbatches=2", "parallel.zero=1"]
    for plain, checked in spawn(_hang_checked_and_not, 4, (layout,), timeout=120):
        assert plain == checked and len(plain) == 2
