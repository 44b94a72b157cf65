"""The collectives a sharded matmul implies, predicted from the sharding alone (seed 002's cases).

A matmul ``C = A @ B`` with A [outer..., K] and B [K, N], each dimension split over at most one mesh axis (or
whole: None). The seed's rules, applied in order:

- Case 1A: the contracting dimension of A and of B split over the *same* mesh axis: multiply the local shards,
  then sum the partial results over that axis: an **all-reduce**, or a **reduce-scatter** when the output is
  wanted split over that axis (e.g. back in the input's sharding).
- Case 1B: the contracting dimensions split over *different* axes (or one whole): **all-gather** each operand's
  contracting dimension first, then multiply whole dot products.
- Case 2: outer dimensions split: nothing to communicate, each device computes its own block of C, unless A's
  and B's outer dimensions are split over the same mesh axis (each device would miss half the pairs): then B's
  outer dimension is all-gathered ("we prefer to keep the batch axis sharded, so we allgather along W").
- Another plan for mismatched contracting axes (``strategy="reshard"``): move B's contracting split onto A's
  mesh axis (a **collective-permute** of B's new block; a local slice if B's contracting dimension is whole), then
  proceed as Case 1A. It sends a block of B instead of gathering A, and no device repeats another's work; XLA's
  GSPMD partitioner picks between such plans with its own cost model (docs/jax.md shows where it does).
- The result is then brought to the wanted output sharding: a dimension split that the output wants whole is
  all-gathered; one the output wants split and the result has whole is sliced locally (free).

Bytes follow the comm meter's payload convention (``meshtrain/comm.py``, as ``comm_bytes.py``): per device, the
all-reduced tensor, the gathered output, the reduce-scattered input. ``meshtrain/jax/hlo.py`` compares them
with the collectives XLA's GSPMD partitioner actually emits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Spec = tuple[str | None, ...]  # per dimension: the mesh axis it is split over, or None (whole)


@dataclass(frozen=True)
class Collective:
    """One predicted (or measured) collective: op (all_gather, all_reduce, reduce_scatter, all_to_all,
    collective_permute), the mesh axis (or axes, joined by ``,``) it runs over, per-device payload bytes, and
    which tensor it moves."""

    op: str
    axis: str
    payload: int
    what: str = ""


def _local(shape: tuple[int, ...], spec: Spec, mesh: dict[str, int]) -> list[int]:
    """A device's block of a tensor of ``shape`` split by ``spec``."""
    if len(shape) != len(spec):
        raise ValueError(f"spec {spec} does not fit shape {shape}")
    for n, a in zip(shape, spec, strict=True):
        if a is not None and n % mesh[a]:
            raise ValueError(f"dimension {n} does not divide over mesh axis {a} of size {mesh[a]}")
    return [n // (mesh[a] if a else 1) for n, a in zip(shape, spec, strict=True)]


def matmul_collectives(a_shape: tuple[int, ...], a_spec: Spec, b_shape: tuple[int, int], b_spec: Spec,
                       out_spec: Spec, mesh: dict[str, int], elem_bytes: int = 4, names: tuple[str, str, str] = (
                           "A", "B", "C"), strategy: str = "gather") -> tuple[list[Collective], Spec]:
    """The collectives of ``A @ B`` under the seed's rules (module docstring), and the sharding of the result the
    local matmuls compute (A's outer axes, then B's outer axis), before it is reduced and brought to ``out_spec``."""
    a_spec, b_spec = list(a_spec), list(b_spec)
    out: list[Collective] = []
    a_local, b_local = _local(a_shape, tuple(a_spec), mesh), _local(b_shape, tuple(b_spec), mesh)
    na, nb, nc = names
    reduce_axis = None
    ak, bk = a_spec[-1], b_spec[0]
    if ak is not None and ak == bk:  # Case 1A: partial sums over ak
        reduce_axis = ak
    elif strategy == "reshard" and ak is not None:  # B's contracting split moved onto ak, then Case 1A
        b_local[0] = b_shape[0] // mesh[ak]
        if bk is not None:
            out.append(Collective("collective_permute", ",".join(sorted((ak, bk))), math.prod(b_local) * elem_bytes,
                                  f"{nb} (contracting dim onto {ak})"))
        b_spec[0] = reduce_axis = ak
    else:  # Case 1B: gather each contracting dimension that is split
        if ak is not None:
            a_local[-1] = a_shape[-1]
            out.append(Collective("all_gather", ak, math.prod(a_local) * elem_bytes, f"{na} (contracting dim)"))
            a_spec[-1] = None
        if bk is not None:
            b_local[0] = b_shape[0]
            out.append(Collective("all_gather", bk, math.prod(b_local) * elem_bytes, f"{nb} (contracting dim)"))
            b_spec[0] = None
    bn = b_spec[1]
    if bn is not None and (bn in a_spec[:-1] or bn == reduce_axis):  # Case 2 conflict: keep A's split, gather B's
        b_local[1] = b_shape[1]
        out.append(Collective("all_gather", bn, math.prod(b_local) * elem_bytes, f"{nb} (outer dim)"))
        b_spec[1] = None
    result_spec: Spec = (*a_spec[:-1], b_spec[1])
    result_local = [*a_local[:-1], b_local[1]]
    computed = result_spec
    if reduce_axis is not None:
        dims = [d for d, a in enumerate(out_spec) if a == reduce_axis and result_spec[d] is None]
        if dims:
            out.append(Collective("reduce_scatter", reduce_axis, math.prod(result_local) * elem_bytes, nc))
            result_spec = tuple(reduce_axis if d == dims[0] else a for d, a in enumerate(result_spec))
            result_local[dims[0]] //= mesh[reduce_axis]
        else:
            out.append(Collective("all_reduce", reduce_axis, math.prod(result_local) * elem_bytes, nc))
    for d, a in enumerate(result_spec):  # split where the output wants it whole: gather
        if a is not None and out_spec[d] != a:
            result_local[d] *= mesh[a]
            out.append(Collective("all_gather", a, math.prod(result_local) * elem_bytes, f"{nc} (to its output "
                                                                                         f"sharding)"))
    return out, computed


def matmul_flops_per_device(a_shape: tuple[int, ...], a_spec: Spec, b_shape: tuple[int, int], b_spec: Spec,
                            out_spec: Spec, mesh: dict[str, int], strategy: str = "gather") -> int:
    """FLOPs each device spends on the local matmul under the seed's rules: its block of the result (after the
    gathers of Case 1B / Case 2) times the contracting length it holds. The whole matmul's FLOPs divided by this
    is how many devices share the work without duplicating it."""
    _, result_spec = matmul_collectives(a_shape, a_spec, b_shape, b_spec, out_spec, mesh, strategy=strategy)
    split_k = a_spec[-1] is not None and (a_spec[-1] == b_spec[0] or strategy == "reshard")
    k = a_shape[-1] // (mesh[a_spec[-1]] if split_k else 1)
    rows = math.prod(n // (mesh[a] if a else 1) for n, a in zip(a_shape[:-1], result_spec[:-1], strict=True))
    cols = b_shape[1] // (mesh[result_spec[-1]] if result_spec[-1] else 1)
    return 2 * rows * k * cols


def ffn_2d_collectives(batch: int, seq: int, d_model: int, hidden: int, mesh: dict[str, int], x: str = "dp",
                       y: str = "tp", elem_bytes: int = 4, gated: bool = True) -> list[Collective]:
    """The seed's 2-D FFN (GSPMD's "2D finalized" spec): activations b_x S m_y, W_in m_x h_y, hidden b_x S h_y,
    W_out h_y m_x, output back in b_x S m_y. ``gated``: SwiGLU's two input matrices (gate and up) share the one
    gathered input, so it is gathered once."""
    act: Spec = (x, None, y)
    first, _ = matmul_collectives((batch, seq, d_model), act, (d_model, hidden), (x, y), act, mesh, elem_bytes,
                                  ("x", "W_in", "hidden"))
    out = list(first)
    if gated:
        out += [Collective(c.op, c.axis, c.payload, c.what.replace("W_in", "W_up"))
                for c in first if c.what.startswith("W_in")]
    second, _ = matmul_collectives((batch, seq, hidden), act, (hidden, d_model), (y, x), act, mesh, elem_bytes,
                                   ("hidden", "W_out", "out"))
    return out + second
