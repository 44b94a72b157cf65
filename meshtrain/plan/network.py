"""How long a collective takes: the ring model over a two-level fabric, and where a group of ranks sits on it."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from meshtrain.plan.hardware import Hardware


def wire_factor(op: str, n: int) -> float:
    """Bytes each device sends per payload byte in the ring algorithm (the comm meter's convention:
    payload = the all-reduced tensor, the gathered output, the scattered input, the all-to-all input)."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "reduce", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "send", "p2p"):
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


@dataclass(frozen=True)
class Link:
    """How a group of ``n`` devices sits on the fabrics: ``local`` members share each fast domain (they talk
    at ``intra_bw`` per device), and the group spans ``n / local`` domains joined at ``inter_bw`` per device.
    Latencies are per tree level."""

    n: int
    local: int
    intra_bw: float
    inter_bw: float
    intra_latency: float = 0.0
    inter_latency: float = 0.0


def collective_time(op: str, payload: float, link: Link) -> float:
    """Seconds for one collective of ``payload`` bytes (per device, meter convention) over ``link``.

    Hierarchical ring model: the ``local`` members of each domain do their share on the fast fabric
    ((g-1)/g of the payload, twice for an all-reduce), and the domains exchange 1/g of it each over the
    slow one ((k-1)/k, twice for an all-reduce), k = n / g domains. All-to-all sends (g-1)/n of the payload
    inside and (n-g)/n outside; a point-to-point send goes over the slow fabric unless both ends share a
    domain. Latency grows with the tree depth (log2 of the members on each level).
    """
    n, g = link.n, max(1, min(link.local, link.n))
    if n <= 1 or payload <= 0:
        return 0.0
    k = n / g
    lat = (math.ceil(math.log2(g)) if g > 1 else 0) * link.intra_latency + (
        math.ceil(math.log2(k)) if k > 1 else 0) * link.inter_latency
    if op in ("send", "p2p", "broadcast"):
        return payload / (link.intra_bw if k <= 1 else link.inter_bw) + (link.intra_latency if k <= 1
                                                                         else link.inter_latency)
    if op == "all_to_all":
        return (g - 1) / n * payload / link.intra_bw + (n - g) / n * payload / link.inter_bw + lat
    twice = 2.0 if op == "all_reduce" else 1.0
    intra = twice * (g - 1) / g * payload / link.intra_bw
    inter = twice * (k - 1) / k * (payload / g) / link.inter_bw
    return intra + inter + twice * lat


def calls_time(op: str, total_bytes: float, calls: int, link: Link) -> float:
    """Seconds for ``calls`` equal collectives that move ``total_bytes`` between them."""
    return calls * collective_time(op, total_bytes / calls, link) if total_bytes > 0 else 0.0


def exposed(comm: float, window: float, tail: float = 0.0) -> float:
    """Communication left on the critical path when ``comm`` seconds overlap ``window`` seconds of compute,
    plus a ``tail`` that cannot overlap (the last bucket, issued after the last compute it depends on)."""
    return max(0.0, comm - window) + min(tail, comm)


def group_link(hw: Hardware, n: int, stride: int, axes: int = 1) -> Link:
    """The fabric of a group of ``n`` ranks ``stride`` apart in rank order (consecutive ranks share a node):
    members sharing a fast domain talk at intra_bw (x ``axes`` torus axes), the rest at inter_bw."""
    local = max(1, min(n, hw.domain // stride)) if stride <= hw.domain else 1
    intra = hw.intra_bw * (max(1, axes) if hw.torus else 1)
    return Link(n, local, intra, hw.inter_bw, hw.intra_latency, hw.inter_latency)


def dp_axes(hw: Hardware, tp: int, cp: int, pp: int) -> int:
    """Torus axes left to the data-parallel group once tp, cp and pp took one each (the book: '3 axes')."""
    if not hw.torus:
        return 1
    used = sum(1 for x in (tp, cp, pp) if x > 1)
    return max(1, len(hw.mesh_axes) - used)


def effective_bw(link: Link) -> float:
    """Per-device bandwidth a large all-gather over ``link`` achieves: (n-1)/n x bytes / time."""
    big = 1e12
    t = collective_time("all_gather", big, replace(link, intra_latency=0.0, inter_latency=0.0))
    return (link.n - 1) / link.n * big / t if t > 0 else link.intra_bw
