"""Seed 002's sharded-matmul cases, compiled by XLA's GSPMD partitioner and read back from the HLO.

``collectives(hlo_text, mesh)`` lists every collective of a compiled module (all-gather, all-reduce,
reduce-scatter, all-to-all, collective-permute) with the mesh axes its replica groups span and its per-device
payload bytes in the comm meter's convention (``plan/sharded_matmul.py``). ``seed_cases`` compiles Case 1A
(both endings), Case 1B, Case 2, the fully sharded matmul and the 2-D FFN for one model layer's shapes on a 2 x 4
mesh, and ``report`` prints them beside the planner's prediction.

One backend detail is folded in: jaxlib's CPU compiler emits a reduce-scatter as an all-reduce whose only use is
a per-device slice of the result. That pair *is* a reduce-scatter (same payload in the meter's
convention; a real reduce-scatter sends half the wire bytes), and is reported as ``reduce_scatter`` with
``(all-reduce + slice)`` in its note.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from meshtrain.plan.sharded_matmul import Collective, Spec, ffn_2d_collectives, matmul_collectives
from meshtrain.plan.sharded_matmul import matmul_flops_per_device as predicted_flops

OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8}
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\(.*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?)\s+"
                    r"(?P<op>[\w\-]+)\((?P<args>[^)]*)\)(?P<attrs>.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s.*\{\s*$")


@dataclass
class Instr:
    name: str
    op: str
    shapes: list[tuple[str, tuple[int, ...]]]  # (dtype, dims) of the result (several for a tuple)
    operands: list[str]
    attrs: str
    computation: str

    @property
    def bytes(self) -> int:
        return sum(_BYTES.get(t, 4) * math.prod(d) for t, d in self.shapes)


def parse(hlo: str) -> list[Instr]:
    """Every instruction of an HLO module's text, with its computation."""
    out, comp = [], ""
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m and "=" not in line.split("{")[0]:
            comp = m["name"]
            continue
        m = _INSTR.match(line)
        if m:
            shapes = [(t, tuple(int(x) for x in d.split(",") if x)) for t, d in _ARRAY.findall(m["shape"])]
            out.append(Instr(m["name"], m["op"], shapes, re.findall(r"%([\w.\-]+)", m["args"]), m["attrs"], comp))
    return out


def _iota(dims: str, src: str | None, perm: str | None) -> np.ndarray:
    """XLA's iota device list ``[dims]<=[src]T(perm)``: 0..n-1 shaped ``src`` (default ``dims``), transposed by
    ``perm``, reshaped to ``dims``."""
    shape = [int(x) for x in dims.split(",")]
    ids = np.arange(math.prod(shape)).reshape([int(x) for x in (src or dims).split(",")])
    if perm:
        ids = ids.transpose([int(x) for x in perm.split(",")])
    return ids.reshape(shape)


def replica_groups(attrs: str) -> list[list[int]]:
    """The device groups of a collective, from any of XLA's three spellings: explicit ``{{0,1},{2,3}}``, iota
    ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)``, or mesh ``mesh['axis_0'=2,...], device_ids=(...) {'axis_0'}``."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:<=\[([\d,]+)\])?"
                  r"(?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}", attrs)
    if m:
        axes = re.findall(r"'(\w+)'=(\d+)", m[1])
        sizes = [int(s) for _, s in axes]
        ids = (_iota(m[2], m[3], m[4]).ravel() if m[2] else np.arange(math.prod(sizes))).reshape(sizes)
        names = [a for a, _ in axes]
        grouped = [names.index(a) for a in re.findall(r"'(\w+)'", m[5])]
        rest = [d for d in range(len(names)) if d not in grouped]
        return ids.transpose(rest + grouped).reshape(-1, math.prod(sizes[d] for d in grouped)).tolist()
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        ids = _iota(m[1], m[2], m[3])
        return ids.reshape(-1, ids.shape[-1]).tolist()
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs)
    if m and m[1]:
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m[1])]
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
    if m:
        return [[int(s), int(t)] for s, t in re.findall(r"\{(\d+),(\d+)\}", m[1]) if s != t]
    return []


def group_axes(groups: list[list[int]], mesh_shape: dict[str, int]) -> str:
    """The mesh axes along which the members of the groups differ (device id = position in the row-major mesh)."""
    names = list(mesh_shape)
    coords = np.array(np.unravel_index(np.arange(math.prod(mesh_shape.values())), list(mesh_shape.values()))).T
    varying = set()
    for g in groups:
        c = coords[g]
        varying |= {names[d] for d in range(len(names)) if len(set(c[:, d])) > 1}
    return ",".join(a for a in names if a in varying) or "-"


def _slices_only(instr: Instr, users: list[Instr], by_comp: dict[str, list[Instr]], group: int) -> bool:
    """Is every use of ``instr`` a dynamic slice (directly, or a fusion whose body slices) to 1/``group`` of it,
    i.e. each device keeping its own part of the sum?"""
    def slices(u: Instr) -> bool:
        if u.bytes * group != instr.bytes:
            return False
        if u.op == "dynamic-slice":
            return True
        called = re.search(r"calls=%([\w.\-]+)", u.attrs)
        return u.op == "fusion" and bool(called) and any(i.op == "dynamic-slice" for i in by_comp.get(called[1], []))
    return bool(users) and group > 1 and all(slices(u) for u in users)


def collectives(hlo: str, mesh_shape: dict[str, int]) -> list[Collective]:
    """The collectives of a compiled (partitioned) module, payload bytes per device in the meter's convention."""
    instrs = parse(hlo)
    by_name = {(i.computation, i.name): i for i in instrs}
    by_comp: dict[str, list[Instr]] = {}
    for i in instrs:
        by_comp.setdefault(i.computation, []).append(i)
    out = []
    for i in instrs:
        op = i.op.removesuffix("-start")
        if op not in OPS:
            continue
        operands = [by_name[(i.computation, n)] for n in i.operands if (i.computation, n) in by_name]
        groups = replica_groups(i.attrs)
        axes = group_axes(groups, mesh_shape)
        name, note = op.replace("-", "_"), ""
        if op in ("reduce-scatter", "all-to-all", "collective-permute"):
            payload = sum(o.bytes for o in operands)  # the input (the meter's convention for these)
        elif op == "all-gather" and i.op.endswith("-start"):  # async: the result is (operand, gathered output)
            payload = _BYTES.get(i.shapes[-1][0], 4) * math.prod(i.shapes[-1][1])
        else:
            payload = i.bytes  # the all-reduced tensor, the gathered output
        if op == "all-reduce":
            users = [u for u in by_comp[i.computation] if i.name in u.operands]
            if _slices_only(i, users, by_comp, len(groups[0]) if groups else 1):
                name, note = "reduce_scatter", "(all-reduce + slice)"
        out.append(Collective(name, axes, int(payload), note))
    return out


def dot_flops(hlo: str) -> int:
    """FLOPs of every dot of a compiled module on one device: 2 x output elements x contracted length."""
    instrs = parse(hlo)
    by_name = {(i.computation, i.name): i for i in instrs}
    total = 0
    for i in instrs:
        if i.op != "dot":
            continue
        lhs = by_name.get((i.computation, i.operands[0]))
        dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", i.attrs)
        k = math.prod(lhs.shapes[0][1][int(d)] for d in dims[1].split(",") if d) if lhs and dims else 0
        total += 2 * math.prod(i.shapes[0][1]) * k
    return total


# ----------------------------------------------------------------------------------------------- the seed's cases

STRATEGIES = {"gather": "seed's rule", "reshard": "reshard W, then 1A"}


@dataclass
class Case:
    """One row of the table: a sharding, the planner's prediction under each plan, and what XLA emitted."""

    name: str
    spec: str
    predicted: dict[str, tuple[list[Collective], float]]  # strategy -> (collectives, ways the work is shared)
    measured: list[Collective]
    measured_share: float  # whole matmul FLOPs / FLOPs per device (8: no duplicated work on 8 devices)

    @property
    def chosen(self) -> str | None:
        """The predicted plan XLA's collectives and per-device work equal, if any."""
        key = lambda cs: sorted((c.op, c.axis, c.payload) for c in cs)  # noqa: E731
        for strategy, (cs, share) in self.predicted.items():
            if key(cs) == key(self.measured) and abs(share - self.measured_share) < 1e-9:
                return strategy
        return None


def _spec_text(spec: Spec, letters: str, mesh_letters: dict[str, str]) -> str:
    return "".join(ch + (f"_{mesh_letters[a]}" if a else "") + " " for ch, a in zip(letters, spec, strict=True)).strip()


def seed_cases(batch: int, seq: int, d_model: int, hidden: int, dp: int = 2, tp: int = 4) -> list[Case]:
    """Compile the seed's cases for one layer's shapes on a ``dp x tp`` mesh (the seed's X x Y = 2 x 4): the
    matmul x [tokens, D] @ W_in [D, F] for Cases 1A/1B/2 and full sharding, and the 2-D SwiGLU FFN."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from meshtrain.jax.sharding import make_mesh

    mesh = make_mesh(dp, tp)
    sizes = {"dp": dp, "tp": tp}
    letters = {"dp": "X", "tp": "Y"}
    f32 = 4

    def compiled(fn, shapes, specs, out_spec):
        args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, PartitionSpec(*p)))
                for s, p in zip(shapes, specs, strict=True)]
        return jax.jit(fn, out_shardings=NamedSharding(mesh, PartitionSpec(*out_spec))).lower(*args).compile().as_text()

    n = batch * seq
    a_shape, b_shape = (n, d_model), (d_model, hidden)
    whole = 2 * n * d_model * hidden
    matmuls = [
        ("Case 1A (all-reduce)", (None, "tp"), ("tp", None), (None, None)),
        ("Case 1A (reduce-scatter)", (None, "tp"), ("tp", None), (None, "tp")),
        ("Case 1B", (None, "tp"), ("dp", None), (None, None)),
        ("Case 2", ("dp", "tp"), ("dp", None), ("dp", None)),
        ("Case 2 + 1B (full sharding)", ("dp", "tp"), ("dp", "tp"), ("dp", "tp")),
    ]
    cases = []
    for name, a, b, c in matmuls:
        hlo = compiled(lambda x, w: x @ w, [a_shape, b_shape], [a, b], c)
        predicted = {}
        for strategy in STRATEGIES:
            cs, _ = matmul_collectives(a_shape, a, b_shape, b, c, sizes, f32, ("x", "W", "out"), strategy)
            share = whole / predicted_flops(a_shape, a, b_shape, b, c, sizes, strategy)
            if not any(_same(cs, other) for other, _ in predicted.values()):
                predicted[strategy] = (cs, share)
        spec = (f"x[{_spec_text(a, 'ND', letters)}] W[{_spec_text(b, 'DF', letters)}] -> "
                f"[{_spec_text(c, 'NF', letters)}]")
        cases.append(Case(name, spec, predicted, collectives(hlo, sizes), whole / dot_flops(hlo)))

    def ffn(x, w1, w3, w2):  # SwiGLU in nn.Linear layouts ([out, in]), the hidden constrained b_x S h_y
        def hidden_of(w):
            h = jnp.einsum("bsm,hm->bsh", x, w)
            return jax.lax.with_sharding_constraint(h, NamedSharding(mesh, PartitionSpec("dp", None, "tp")))
        return jnp.einsum("bsh,mh->bsm", jax.nn.silu(hidden_of(w1)) * hidden_of(w3), w2)

    act, w_in, w_out = ("dp", None, "tp"), ("tp", "dp"), ("dp", "tp")  # weights [out, in]: W_in m_x h_y
    hlo = compiled(ffn, [(batch, seq, d_model), (hidden, d_model), (hidden, d_model), (d_model, hidden)],
                   [act, w_in, w_in, w_out], act)
    a2 = ("dp", None, "tp")  # the seed's spec in its [in, out] weight layout: W_in m_x h_y, W_out h_y m_x
    per_device = (2 * predicted_flops((batch, seq, d_model), a2, (d_model, hidden), ("dp", "tp"), a2, sizes)
                  + predicted_flops((batch, seq, hidden), a2, (hidden, d_model), ("tp", "dp"), a2, sizes))
    predicted = ffn_2d_collectives(batch, seq, d_model, hidden, sizes, elem_bytes=f32)
    cases.append(Case("2-D FFN (SwiGLU)", "x[B_X S M_Y] W_in[M_X H_Y] W_out[H_Y M_X] -> [B_X S M_Y]",
                      {"gather": (predicted, 3 * whole / per_device)}, collectives(hlo, sizes),
                      3 * whole / dot_flops(hlo)))
    return cases


def _same(a: list[Collective], b: list[Collective]) -> bool:
    return sorted((c.op, c.axis, c.payload) for c in a) == sorted((c.op, c.axis, c.payload) for c in b)


def _wire(cs: list[Collective], sizes: dict[str, int]) -> float:
    """Bytes each device sends (ring model, ``plan/network.py``); a permute sends its block once."""
    from meshtrain.plan.network import wire_factor

    return sum(c.payload * (1.0 if c.op == "collective_permute" else
                            wire_factor(c.op, math.prod(sizes[a] for a in c.axis.split(","))))
               for c in cs)


def _fmt(cs: list[Collective], letters: dict[str, str]) -> str:
    if not cs:
        return "none"
    axis = lambda a: ",".join(letters.get(x, x) for x in a.split(","))  # noqa: E731
    return "; ".join(f"{c.op}@{axis(c.axis)} {c.payload:,} B" + (f" {c.what}" if c.what.startswith("(") else "")
                     for c in sorted(cs, key=lambda c: (c.op, c.axis, c.payload)))


def report(cases: list[Case], sizes: dict[str, int], header: str = "") -> str:
    """The table: each case's sharding, the planner's collectives under each plan, XLA's, and how many ways the
    matmul's work is shared (8 on 8 devices: nothing computed twice)."""
    letters = {"dp": "X", "tp": "Y"}
    lines = [header] if header else []
    for c in cases:
        lines.append(f"{c.name}: {c.spec}")
        for strategy, (cs, share) in c.predicted.items():
            lines.append(f"  {'predicted, ' + STRATEGIES[strategy] + ':':<34}{_fmt(cs, letters)}  "
                         f"[wire {_wire(cs, sizes):,.0f} B, work shared {share:g} ways]")
        lines.append(f"  {'XLA HLO:':<34}{_fmt(c.measured, letters)}  [wire {_wire(c.measured, sizes):,.0f} B, "
                     f"work shared {c.measured_share:g} ways]")
        chosen = c.chosen
        lines.append(f"  -> {'matches the ' + STRATEGIES[chosen] if chosen else 'DIFFERS from every predicted plan'}")
    return "\n".join(lines)
