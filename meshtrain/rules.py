"""Logical-axis sharding rules: the one table that says how a layout shards every tensor (seed 002).

Every parameter and the activations between blocks name their *logical* axes (``model/axes.py``): vocab,
embed, heads, kv_heads, head_dim, mlp, experts, expert_mlp, layers, batch, seq. ``rules_for(layout)``
maps each logical axis to the mesh axes it is split over for one layout. Two readers, so they cannot
disagree:

- the runtime (``parallel/tensor.py``): a weight dimension whose axis maps to ``tp`` is sliced over the
  tensor-parallel ranks (dim 0: column-parallel, dim 1: row-parallel, vocab: vocab-parallel embedding and
  head); a weight with no tp axis is replicated over tp and its gradient summed (SP) or averaged there;
  ``experts`` -> ``ep`` is what expert parallelism splits; ``seq`` -> ``cp`` (and ``tp`` under SP) is how
  the activations between blocks are cut;
- the planner's sharding notation (``plan``): ``W_in[L, D_X, F_Y]`` is the same table written in the
  book's letters (seed 000).

``check_executable`` refuses a table the runtime cannot execute, with the rule named.
"""

from __future__ import annotations

from typing import Protocol

LOGICAL_AXES = ("batch", "seq", "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "experts",
                "expert_mlp", "layers")
MESH_AXES = ("pp", "dp", "cp", "tp", "ep")

Rules = dict[str, tuple[str, ...]]  # logical axis -> mesh axes it is split over (outer first)


class Layout(Protocol):
    """What the rules depend on: a ``ParallelConfig`` or the planner's ``Layout``."""

    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    zero: int
    sp: bool


def rules_for(layout: Layout) -> Rules:
    """The logical-axis -> mesh-axes table of ``layout`` (an axis of size 1 shards nothing and is left out)."""
    def on(axis: str, size: int) -> tuple[str, ...]:
        return (axis,) if size > 1 else ()

    tp = on("tp", layout.tp)
    return {
        "batch": on("dp", layout.dp),
        "seq": on("cp", layout.cp) + (tp if layout.sp else ()),  # between blocks; gathered over tp inside
        "vocab": tp,
        "embed": on("dp", layout.dp) if layout.zero == 3 else (),  # ZeRO-3: the book's D_X (flat units here)
        "heads": tp,
        "kv_heads": tp,
        "head_dim": (),
        "mlp": tp,
        "experts": on("ep", layout.ep),
        "expert_mlp": (),  # experts are whole on a rank (expert-tensor-parallel size 1)
        "layers": on("pp", layout.pp),
    }


def state_rules(layout: Layout, kind: str) -> Rules:
    """The rules of a kind of per-parameter state: ``params`` (``rules_for``), ``grads`` or ``optim`` (optimizer
    state). The DP family shards the model dimension of gradients from ZeRO-2 and of optimizer state from
    ZeRO-1 (over dp: the book's D_X), of parameters only at ZeRO-3."""
    stage = {"params": 3, "grads": 2, "optim": 1}[kind]
    rules = rules_for(layout)
    rules["embed"] = ("dp",) if layout.zero >= stage and layout.dp > 1 else ()
    return rules


def for_activations(rules: Rules) -> Rules:
    """Activations are never split along the model dimension (ZeRO-3 shards stored weights, not activations)."""
    return {**rules, "embed": ()}


def for_experts(rules: Rules) -> Rules:
    """Routed experts' weights: ZeRO-3 keeps them at stage 2 (whole on each holder, not gathered per forward)."""
    return {**rules, "embed": ()}


def inside_block(rules: Rules) -> Rules:
    """Rules inside a block: sequence parallelism's tp split of the sequence is gathered before the
    column-parallel matmuls, so only cp still splits it."""
    return {**rules, "seq": tuple(a for a in rules["seq"] if a != "tp")}


def mesh_axes(axes: tuple[str, ...], rules: Rules) -> tuple[tuple[str, ...], ...]:
    """For a tensor with logical ``axes``, the mesh axes each of its dimensions is split over."""
    return tuple(rules.get(a, ()) for a in axes)


def tp_dim(axes: tuple[str, ...], rules: Rules) -> int | None:
    """The dimension of a weight with logical ``axes`` that tensor parallelism slices (None: replicated)."""
    dims = [d for d, m in enumerate(mesh_axes(axes, rules)) if "tp" in m]
    return dims[0] if dims else None


# What the runtime can execute, per logical axis: the mesh-axis tuples it implements.
_EXECUTABLE: dict[str, tuple[tuple[str, ...], ...]] = {
    "batch": ((), ("dp",)),
    "seq": ((), ("cp",), ("tp",), ("cp", "tp")),
    "vocab": ((), ("tp",)),
    "embed": ((), ("dp",)),
    "heads": ((), ("tp",)),
    "kv_heads": ((), ("tp",)),
    "head_dim": ((),),
    "mlp": ((), ("tp",)),
    "experts": ((), ("ep",)),
    "expert_mlp": ((),),
    "layers": ((), ("pp",)),
}
_WHY = {
    "embed": "the model dimension is sharded only by ZeRO-3 over dp (flat units), never by tp",
    "head_dim": "a head is never split",
    "expert_mlp": "experts stay whole on a rank (expert-tensor-parallel size 1)",
}


def check_executable(rules: Rules) -> None:
    """Raise ValueError naming the first rule the runtime cannot execute; heads, kv_heads, mlp and vocab
    must agree (one tensor-parallel group shards all four, Megatron-style)."""
    for axis, mesh in rules.items():
        if axis not in _EXECUTABLE:
            raise ValueError(f"sharding rule for unknown logical axis {axis!r}: the axes are "
                             f"{', '.join(LOGICAL_AXES)}.")
        if tuple(mesh) not in _EXECUTABLE[axis]:
            options = " or ".join("(" + ", ".join(m) + ")" for m in _EXECUTABLE[axis])
            raise ValueError(f"sharding rule {axis} -> ({', '.join(mesh)}) cannot be executed: "
                             f"{_WHY.get(axis, 'the runtime implements ' + options)}.")
    tp_axes = {a: rules.get(a, ()) for a in ("heads", "kv_heads", "mlp", "vocab")}
    if len(set(tp_axes.values())) > 1:
        raise ValueError(f"sharding rules {tp_axes} disagree: tensor parallelism splits heads, kv_heads, mlp and "
                         f"vocab over the same group.")


# The book's letters (seed 000) for the notation the planner prints.
LETTERS = {"batch": "B", "seq": "T", "vocab": "V", "embed": "D", "heads": "N", "kv_heads": "K", "head_dim": "H",
           "mlp": "F", "experts": "E", "expert_mlp": "F", "layers": "L"}
MESH_LETTERS = {"dp": "X", "tp": "Y", "pp": "Z", "cp": "S", "ep": "EP"}


def notation(axes: tuple[str, ...], rules: Rules) -> str:
    """``[L_Z, D_X, F_Y]``: each logical axis's letter, subscripted by the mesh axes ``rules`` split it over."""
    parts = []
    for a, mesh in zip(axes, mesh_axes(axes, rules), strict=True):
        sub = "".join(MESH_LETTERS[m] for m in mesh)
        parts.append(LETTERS[a] + (f"_{sub}" if sub else ""))
    return "[" + ", ".join(parts) + "]"
