"""The spawn harness: results in rank order, a failing rank and a hung rank become test failures."""

import sys
import time

import pytest
import torch
import torch.distributed as dist

from meshtrain.testing.spawn import SpawnError, SpawnTimeout, spawn

pytestmark = pytest.mark.slow


def _sum_ranks(rank, world_size, scale):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, world_size, t.item() * scale


def _fail_on_rank_2(rank, world_size):
    if rank == 2:
        raise ValueError("rank two is broken")
    dist.barrier()  # the others wait for a rank that never arrives: the harness must not hang
    return rank


def _hang_on_rank_1(rank, world_size):
    if rank == 1:
        while True:
            time.sleep(0.1)
    return rank


def _crash_on_rank_0(rank, world_size):
    import os

    if rank == 0:
        os._exit(3)
    dist.barrier()


def test_results_in_rank_order():
    out = spawn(_sum_ranks, 4, args=(10.0,))
    assert out == [(r, 4, 60.0) for r in range(4)]


def test_failing_rank_is_reported():
    start = time.monotonic()
    with pytest.raises(SpawnError, match=r"rank 2 of 4 failed:(.|\n)*rank two is broken"):
        spawn(_fail_on_rank_2, 4, timeout=60)
    assert time.monotonic() - start < 30  # reported at once, not after the timeout


def test_hung_rank_times_out():
    with pytest.raises(SpawnTimeout, match=r"ranks \[1\] of 2 did not finish within 8 s"):
        spawn(_hang_on_rank_1, 2, timeout=8)


def test_crashed_rank_is_reported():
    with pytest.raises(SpawnError, match=r"rank 0 of 2 exited with code 3"):
        spawn(_crash_on_rank_0, 2, timeout=60)


def _where_am_i(rank, world_size):
    import os
    import sys

    probe = os.environ.get("MESHTRAIN_SPAWN_PROBE")
    for stream in (sys.stdout, sys.stderr):  # one write each, so that the two ranks' lines do not interleave
        stream.write(f"{'out' if stream is sys.stdout else 'err'} {probe} {rank}\n")
        stream.flush()
    return probe, os.getcwd(), sys.path[-1]


def test_each_spawn_gives_its_ranks_the_callers_environment_streams_folder_and_path(tmp_path, monkeypatch, capfd):
    """The ranks come from a fork server started by an earlier spawn (their imports done once), yet each spawn's
    ranks see the caller's environment, stdout and stderr (here pytest's, captured by ``capfd``), working folder
    and ``sys.path`` as they are at that spawn."""
    with capfd.disabled():  # the server is running (started here, or by an earlier test), with other streams
        spawn(_sum_ranks, 2, args=(1.0,))
    for value in ("one", "two"):
        monkeypatch.setenv("MESHTRAIN_SPAWN_PROBE", value)
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr("sys.path", [*sys.path, str(tmp_path / value)])
        out = spawn(_where_am_i, 2)
        assert out == [(value, str(tmp_path), str(tmp_path / value))] * 2, out
        printed = capfd.readouterr()
        assert sorted(printed.out.split("\n")) == ["", f"out {value} 0", f"out {value} 1"], printed
        assert sorted(printed.err.split("\n")) == ["", f"err {value} 0", f"err {value} 1"], printed
