"""The mesh's groups and the comm meter, on real gloo processes."""

import pytest
import torch

from meshtrain import comm
from meshtrain.mesh import Mesh
from meshtrain.testing.spawn import spawn

pytestmark = pytest.mark.slow


def _meter_worker(rank, world_size):
    mesh = Mesh(dp=world_size)
    g = mesh.group("dp")
    comm.METER.reset()
    n = world_size
    # all_reduce of 1000 fp32 values: payload 4000 bytes, ring wire 2(n-1)/n of it.
    t = torch.full((1000,), float(rank + 1))
    comm.all_reduce(t, g)
    # all_gather of 3 x 5 bf16 rows per rank into 12 x 5: payload is the gathered output.
    part = torch.full((3, 5), float(rank), dtype=torch.bfloat16)
    gathered = torch.empty(3 * n, 5, dtype=torch.bfloat16)
    comm.all_gather(gathered, part, g)
    # reduce_scatter of 8 x 7 fp32 (input) into 2 x 7.
    full = torch.arange(8 * 7, dtype=torch.float32).view(8, 7) * (rank + 1)
    shard = torch.empty(2, 7)
    comm.reduce_scatter(shard, full, g)
    # async all_reduce, twice, counted as two calls.
    h = [comm.all_reduce(torch.ones(10, dtype=torch.float64), g, async_op=True) for _ in range(2)]
    for x in h:
        x.wait()
    snap = comm.METER.snapshot()
    return {
        "sum": t[0].item(),
        "gathered_rows": gathered[:, 0].float().tolist(),
        "shard": shard.tolist(),
        "snap": snap,
        "trace_len": len(comm.METER.trace or []),
        "wire": {op: v["wire_bytes"] for op, v in snap["dp"].items()},
    }


def _mesh_worker(rank, world_size):
    mesh = Mesh(pp=2, dp=2, tp=2, ep=2)
    out = {"coords": mesh.coords, "rank_at": mesh.rank_at(tp=0)}
    for axes in [("tp",), ("dp",), ("pp",), ("dp", "cp"), ("pp", "tp"), ("ep",), ("edp",), ("world",)]:
        g = mesh.group(*axes)
        t = torch.tensor([float(rank)])
        comm.all_reduce(t, g)
        out[axes] = (g.ranks, t.item())
    return out


def test_meter_counts_bytes_exactly_on_4_ranks():
    outs = spawn(_meter_worker, 4)
    n = 4
    for rank, o in enumerate(outs):
        assert o["sum"] == 1 + 2 + 3 + 4
        assert o["gathered_rows"] == [float(r) for r in range(n) for _ in range(3)]
        expected_shard = (torch.arange(56.0).view(8, 7) * 10)[2 * rank: 2 * rank + 2]
        assert torch.equal(torch.tensor(o["shard"]), expected_shard)
        dp = o["snap"]["dp"]
        assert dp["all_reduce"]["calls"] == 3
        assert dp["all_reduce"]["bytes"] == 1000 * 4 + 2 * 10 * 8
        assert dp["all_gather"] == {**dp["all_gather"], "calls": 1, "bytes": 3 * n * 5 * 2}
        assert dp["reduce_scatter"]["calls"] == 1 and dp["reduce_scatter"]["bytes"] == 8 * 7 * 4
        assert o["wire"]["all_reduce"] == pytest.approx(2 * (n - 1) / n * (4000 + 160))
        assert o["wire"]["all_gather"] == pytest.approx((n - 1) / n * 120)
        assert o["wire"]["reduce_scatter"] == pytest.approx((n - 1) / n * 224)
        assert set(o["snap"]) == {"dp"}  # nothing is counted under another axis


def test_mesh_groups_on_8_ranks():
    outs = spawn(_mesh_worker, 8)
    for rank, o in enumerate(outs):
        c = o["coords"]
        # tp innermost, then cp (size 1), dp, pp outermost.
        assert rank == ((c["pp"] * 2 + c["dp"]) * 1 + c["cp"]) * 2 + c["tp"]
        assert o["rank_at"] == rank - c["tp"]
        base = rank - rank % 2
        assert o[("tp",)] == ((base, base + 1), float(2 * base + 1))
        dp_ranks = tuple(r for r in range(8) if r // 4 == rank // 4 and r % 2 == rank % 2)
        assert o[("dp",)] == (dp_ranks, float(sum(dp_ranks)))
        assert o[("dp", "cp")][0] == dp_ranks  # cp is 1: the grad-sync group is the dp group
        pp_ranks = (rank % 4, rank % 4 + 4)
        assert o[("pp",)] == (pp_ranks, float(sum(pp_ranks)))
        assert o[("ep",)][0] == dp_ranks  # ep=2 over dp*cp=2: all of it
        assert o[("edp",)][0] == (rank,)  # one copy of each expert shard per pp x tp slot
        assert o[("world",)] == (tuple(range(8)), 28.0)
        assert len(o[("pp", "tp")][0]) == 4


def test_mesh_single_process_has_no_groups():
    mesh = Mesh()
    assert mesh.world_size == 1 and mesh.coords["tp"] == 0
    g = mesh.group("dp", "cp")
    assert g.size == 1 and g.pg is None
    t = torch.ones(3)
    comm.METER.reset()
    comm.all_reduce(t, g)  # a no-op: nothing moves, nothing is counted
    assert comm.METER.bytes() == 0 and torch.equal(t, torch.ones(3))


def test_mesh_rejects_bad_sizes():
    with pytest.raises(ValueError, match="needs an initialised process group"):
        Mesh(dp=2)
    with pytest.raises(ValueError, match="ep=3 must divide"):
        Mesh(ep=3, rank=0)
