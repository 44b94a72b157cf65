"""The device mesh: the single source of truth for mesh axes, ranks and process groups.

Ranks form a grid (pp, dp, cp, tp) with tp innermost, so tensor-parallel neighbours are
consecutive ranks (one node, fast links) and pipeline stages are outermost (slow links are
fine for p2p). Expert parallelism is carved out of the dp x cp ranks: ep innermost inside
that flattened axis, "edp" (the ranks holding the same experts) outside it. For HSDP the dp axis
splits into dp_replicate (outer) x dp_shard (inner): parameters are sharded over
"dp_shard_cp" (dp_shard x cp) and replicated over "dp_replicate". When a model has fewer key/value heads
than tp, "tp_kv" is the block of consecutive tp ranks that share one kv head (``kv_share`` of them).
"pp_ends" pairs the first and the last pipeline rank of each (dp, cp, tp), which both hold tied embeddings.

Every parallelism asks the mesh for its group by axis name (``mesh.group("tp")``,
``mesh.group("dp", "cp")``); nothing else creates process groups. At world size 1 no
process group exists and every group has size 1.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from meshtrain.config import Config, resolve_dp

AXES = ("pp", "dp", "cp", "tp")  # outermost to innermost


@dataclass(frozen=True)
class AxisGroup:
    """The ranks along one mesh axis (or a product of axes) that include this rank."""

    name: str  # e.g. "tp", "dp_cp", "ep", "world": the comm meter counts bytes under this name
    ranks: tuple[int, ...]  # global ranks, in axis order
    pg: object | None  # the torch ProcessGroup; None when size is 1 or there is no process group

    @property
    def size(self) -> int:
        return len(self.ranks)

    def index(self, global_rank: int) -> int:
        """Position of a global rank in this group."""
        return self.ranks.index(global_rank)


class Mesh:
    """A (pp, dp, cp, tp) rank grid over torch.distributed, plus the ep/edp split of dp x cp."""

    def __init__(self, pp: int = 1, dp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1, dp_shard: int = 0,
                 *, kv_share: int = 1, rank: int | None = None, device: torch.device | None = None,
                 timeout_s: float | None = None) -> None:
        """``timeout_s``: how long a collective on the groups this mesh creates may wait for its peers
        (``train.collective_timeout_s``); None keeps torch's default. new_group does not inherit the world's.
        ``kv_share``: how many consecutive tp ranks share one key/value head (tp / n_kv_heads when a model has
        fewer kv heads than tp, else 1); they form the "tp_kv" group that sums those heads' gradients."""
        self.shape = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
        self.ep = ep
        self.dp_shard = dp_shard or dp
        if dp % self.dp_shard:
            raise ValueError(f"parallel.dp_shard={dp_shard} must divide parallel.dp={dp} (HSDP shard groups).")
        self.world_size = pp * dp * cp * tp
        initialized = dist.is_available() and dist.is_initialized()
        if initialized and dist.get_world_size() != self.world_size:
            raise ValueError(
                f"The mesh pp*dp*cp*tp = {pp}*{dp}*{cp}*{tp} = {self.world_size} does not match the "
                f"world size {dist.get_world_size()}."
            )
        if not initialized and self.world_size != 1 and rank is None:
            raise ValueError(f"A mesh of {self.world_size} ranks needs an initialised process group.")
        if (dp * cp) % ep:
            raise ValueError(f"parallel.ep={ep} must divide dp*cp = {dp * cp} (experts are sharded over them).")
        if kv_share < 1 or tp % kv_share:
            raise ValueError(f"kv_share={kv_share} must divide tp={tp} (tp ranks sharing one key/value head).")
        self.kv_share = kv_share
        self.rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
        self.coords = self.coords_of(self.rank)
        self.device = device if device is not None else default_device()
        self._groups: dict[str, AxisGroup] = {}
        self._timeout = timedelta(seconds=timeout_s) if timeout_s else None
        self._build_groups(create=initialized)

    @classmethod
    def from_config(cls, cfg: Config, world_size: int, device: torch.device | None = None) -> Mesh:
        """The mesh a run's config asks for on ``world_size`` processes: its parallel sizes, dp from
        ``config.resolve_dp``, the tp ranks sharing a kv head, and ``train.collective_timeout_s``."""
        p = cfg.parallel
        return cls(pp=p.pp, dp=resolve_dp(cfg, world_size), cp=p.cp, tp=p.tp, ep=p.ep, dp_shard=p.dp_shard,
                   kv_share=max(1, p.tp // cfg.model.kv_heads), device=device,
                   timeout_s=cfg.train.collective_timeout_s)

    # ------------------------------------------------------------------ coordinates

    def coords_of(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank (tp fastest-varying), plus its ep and edp indices."""
        coords = {}
        rest = rank
        for axis in reversed(AXES):
            coords[axis] = rest % self.shape[axis]
            rest //= self.shape[axis]
        flat = coords["dp"] * self.shape["cp"] + coords["cp"]
        coords["ep"], coords["edp"] = flat % self.ep, flat // self.ep
        coords["dp_shard"], coords["dp_replicate"] = coords["dp"] % self.dp_shard, coords["dp"] // self.dp_shard
        return coords

    def rank_at(self, **coords: int) -> int:
        """Global rank at the given coordinates; missing axes take this rank's coordinate."""
        rank = 0
        for axis in AXES:
            rank = rank * self.shape[axis] + coords.get(axis, self.coords[axis])
        return rank

    def size(self, axis: str) -> int:
        if axis == "ep":
            return self.ep
        if axis == "edp":
            return self.shape["dp"] * self.shape["cp"] // self.ep
        if axis == "dp_shard":
            return self.dp_shard
        if axis == "dp_replicate":
            return self.shape["dp"] // self.dp_shard
        if axis == "tp_kv":
            return self.kv_share
        return self.shape[axis]

    def coord(self, axis: str) -> int:
        return self.coords[axis]

    @property
    def is_first_stage(self) -> bool:
        return self.coords["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords["pp"] == self.shape["pp"] - 1

    # ------------------------------------------------------------------ groups

    def group(self, *axes: str) -> AxisGroup:
        """The group of ranks that differ from this one only along ``axes``.

        ``mesh.group("dp", "cp")`` is the gradient-sync group; ``mesh.group("ep")`` the
        expert-parallel group; ``mesh.group("world")`` everything.
        """
        key = self._key(axes)
        if key not in self._groups:
            raise KeyError(f"No mesh group for axes {axes}; known: {sorted(self._groups)}.")
        return self._groups[key]

    @staticmethod
    def _key(axes: tuple[str, ...]) -> str:
        if axes in (("world",), ("dp_shard", "cp"), ("dp_replicate",), ("tp_kv",), ("pp_ends",)):
            return "world" if axes == ("world",) else "_".join(axes)
        order = list(AXES) + ["edp", "ep"]
        return "_".join(sorted(axes, key=order.index))

    def _partitions(self) -> list[tuple[str, list[tuple[int, ...]]]]:
        """Every group family: all products of the four axes, then ep and edp."""
        fams = []
        for n in range(1, len(AXES) + 1):
            for axes in itertools.combinations(AXES, n):
                fams.append((self._key(axes), self._partition_by(lambda c, a=axes: tuple(
                    v for k, v in c.items() if k in AXES and k not in a))))
        fams.append(("ep", self._partition_by(lambda c: (c["pp"], c["tp"], c["edp"]))))
        fams.append(("edp", self._partition_by(lambda c: (c["pp"], c["tp"], c["ep"]))))
        fams.append(("dp_shard_cp", self._partition_by(lambda c: (c["pp"], c["tp"], c["dp_replicate"]))))
        fams.append(("dp_replicate", self._partition_by(lambda c: (c["pp"], c["tp"], c["dp_shard"], c["cp"]))))
        fams.append(("tp_kv", self._partition_by(lambda c: (c["pp"], c["dp"], c["cp"], c["tp"] // self.kv_share))))
        # The first and the last pipeline rank of each (dp, cp, tp): tied embeddings live on both (tied.py).
        last = self.shape["pp"] - 1
        fams.append(("pp_ends", self._partition_by(
            lambda c: (-1 if c["pp"] in (0, last) else c["pp"], c["dp"], c["cp"], c["tp"]))))
        return fams

    def _partition_by(self, key_fn) -> list[tuple[int, ...]]:
        parts: dict[tuple, list[int]] = {}
        for r in range(self.world_size):
            parts.setdefault(key_fn(self.coords_of(r)), []).append(r)
        return sorted(tuple(v) for v in parts.values())

    def _build_groups(self, create: bool) -> None:
        # Every rank walks the same families in the same order, so new_group calls match up;
        # families that partition the ranks identically share one set of process groups.
        made: dict[tuple[int, ...], object] = {}
        for name, parts in self._partitions():
            mine = next(p for p in parts if self.rank in p)
            for part in parts:
                if create and len(part) > 1 and part not in made:
                    made[part] = dist.new_group(list(part), timeout=self._timeout) if len(part) < self.world_size \
                        else dist.group.WORLD
            self._groups[name] = AxisGroup(name, mine, made.get(mine) if len(mine) > 1 else None)
        world = tuple(range(self.world_size))
        self._groups["world"] = AxisGroup("world", world, dist.group.WORLD if create and len(world) > 1 else None)

    def describe(self) -> str:
        """The layout in one short string, e.g. 'pp=2 dp=2 cp=1 tp=2 ep=1 on cpu'."""
        shape = " ".join(f"{a}={self.shape[a]}" for a in AXES)
        return f"{shape} ep={self.ep} on {self.device.type}"

    def __repr__(self) -> str:
        return f"Mesh({self.describe()}, rank={self.rank}, coords={self.coords})"


def default_device() -> torch.device:
    """CUDA device of this local rank when available, else CPU (for a Mesh built without a device)."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(device_kind: str = "auto", timeout_s: float | None = None) -> tuple[int, int]:
    """Initialise torch.distributed from torchrun's environment (NCCL on CUDA, gloo on CPU).

    ``timeout_s`` (``train.collective_timeout_s``): how long a collective on the world group, and a store
    operation, may wait before the backend fails it; None keeps torch's default (30 min gloo, 10 min NCCL).
    Returns (rank, world_size); does nothing and returns (0, 1) outside torchrun.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1 or (dist.is_available() and dist.is_initialized()):
        return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    use_cuda = torch.cuda.is_available() and device_kind != "cpu"
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl" if use_cuda else "gloo"
    timeout = timedelta(seconds=timeout_s) if timeout_s else None
    store = _elastic_attempt_store(world_size, timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), world_size=world_size,
                                timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def _elastic_attempt_store(world_size: int, timeout: timedelta | None) -> dist.Store | None:
    """Under torchrun, the store of this attempt: the agent's store seen through a prefix of the restart count.

    After an elastic restart (``--max-restarts``) the workers of the new attempt talk to the same agent store as
    the dead attempt's, whose keys are still there: without a fresh prefix, gloo reads a dead worker's address
    and fails to connect ("connectFullMesh ... Connection refused")."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                           **({"timeout": timeout} if timeout else {}))
    return dist.PrefixStore(f"meshtrain/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)
