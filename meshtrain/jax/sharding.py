"""The logical-axis rules table (``meshtrain/rules.py``) as JAX shardings: one table, two executors.

The PyTorch runtime reads ``rules_for(layout)`` to decide which weight dimension it slices over ``tp`` and what
ZeRO-3 shards over ``dp``; here the very same table becomes a ``PartitionSpec`` per tensor, and XLA's GSPMD
partitioner inserts the collectives (seed 002: "we specify sharding constraints for the big tensors, and it
determines ... any collective ops that need to be inserted"). The mesh's axis names are the runtime's (``dp``,
``tp``), so a rule ``mlp -> (tp,)`` means the same thing to both executors.

Which table for which tensor, as in the runtime:
- parameters: ``state_rules(layout, "params")`` (ZeRO-3 adds ``embed -> dp``: FSDP);
- optimizer state: ``state_rules(layout, "optim")`` (ZeRO-1 and up shard it over dp);
- gradients: ``state_rules(layout, "grads")``;
- activations between blocks: ``for_activations(rules)`` (batch over dp, seq over cp / tp under SP);
- inside a block: ``inside_block`` of that (SP's tp split of the sequence is gathered before the matmuls).

``embed_over_tp`` is the one rule only this executor runs: seed 002's 2-D sharding keeps the activations' model
dimension split over tp (``embed -> tp``), which ``rules.check_executable`` refuses for the PyTorch runtime (its
tensor parallelism is Megatron's: activations whole in D between the blocks). With ``zero=3`` the weights are
then ``W_in[D_X, F_Y]``, ``W_out[F_Y, D_X]``: GSPMD's "2D finalized" FFN (docs/jax.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from meshtrain.rules import Rules, for_activations, inside_block, mesh_axes, rules_for, state_rules

AXES = ("dp", "tp")  # the mesh axes this executor builds (pp, cp and ep are the PyTorch runtime's)


@dataclass(frozen=True)
class JaxLayout:
    """A layout of the (dp, tp) mesh, with the fields ``rules.Layout`` reads. ``zero=3`` is FSDP."""

    dp: int = 1
    tp: int = 1
    zero: int = 0
    sp: bool = False
    embed_over_tp: bool = False  # seed 002's 2-D sharding: activations' model dimension over tp (b_x S m_y)
    pp: int = 1
    cp: int = 1
    ep: int = 1

    @property
    def name(self) -> str:
        parts = [f"{'fsdp' if self.zero == 3 else 'dp'}={self.dp}"] if self.dp > 1 else []
        parts += [f"tp={self.tp}{'+sp' if self.sp else ''}"] if self.tp > 1 else []
        return " x ".join(parts) + (" (2-D, seed 002)" if self.embed_over_tp else "") or "one device"


def make_mesh(dp: int, tp: int) -> Mesh:
    """A (dp, tp) mesh of the first dp x tp devices, tp fastest (neighbours share a tp group, as on the
    runtime's mesh). Axes are ``Auto``: GSPMD propagates shardings and picks the collectives (seed 002)."""
    n = dp * tp
    devices = jax.devices()
    if len(devices) < n:
        raise ValueError(f"the mesh dp={dp} x tp={tp} needs {n} devices, JAX has {len(devices)}: on a CPU set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before JAX starts.")
    return Mesh(np.asarray(devices[:n]).reshape(dp, tp), AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def partition_spec(axes: tuple[str, ...], rules: Rules, shape: tuple[int, ...] | None = None,
                   mesh: Mesh | None = None) -> PartitionSpec:
    """The ``PartitionSpec`` of a tensor with logical ``axes`` under ``rules``: each dimension split over the
    mesh axes its logical axis maps to. Mesh axes the mesh lacks (or of size 1) are dropped; with ``shape`` and
    ``mesh``, a dimension the mesh axes do not divide is left whole (the runtime pads or refuses such a split;
    GSPMD would need padding), so a 257-token vocabulary stays replicated rather than failing."""
    entries = []
    for d, mapped in enumerate(mesh_axes(axes, rules)):
        keep = tuple(a for a in mapped if mesh is None or mesh.shape.get(a, 1) > 1)
        if shape is not None and mesh is not None:
            if shape[d] % int(np.prod([mesh.shape[a] for a in keep], dtype=np.int64)):
                keep = ()
        entries.append(None if not keep else keep[0] if len(keep) == 1 else keep)
    return PartitionSpec(*entries)


class Shardings:
    """The rules of one layout on one mesh, for each kind of tensor."""

    def __init__(self, layout: JaxLayout, mesh: Mesh | None = None) -> None:
        self.layout = layout
        self.mesh = mesh if mesh is not None else make_mesh(layout.dp, layout.tp)
        self.rules = rules_for(layout)
        self.params_rules = state_rules(layout, "params")
        self.optim_rules = state_rules(layout, "optim")
        self.grads_rules = state_rules(layout, "grads")
        self.between = for_activations(self.rules)
        if layout.embed_over_tp:  # GSPMD's "2D finalized" spec: b_x S m_y between and inside blocks
            self.between = {**self.between, "embed": ("tp",)}
        self.inside = inside_block(self.between)

    def named(self, axes: tuple[str, ...], rules: Rules, shape: tuple[int, ...] | None = None) -> NamedSharding:
        return NamedSharding(self.mesh, partition_spec(axes, rules, shape, self.mesh))

    def constrain(self, x: jax.Array, axes: tuple[str, ...], inside: bool = False) -> jax.Array:
        """``with_sharding_constraint`` of an activation with logical ``axes`` (between blocks, or inside one)."""
        rules = self.inside if inside else self.between
        return jax.lax.with_sharding_constraint(x, self.named(axes, rules, tuple(x.shape)))


def tree_shardings(shapes: dict[str, tuple[int, ...]], axes_of, rules: Rules, sh: Shardings
                   ) -> dict[str, NamedSharding]:
    """A ``NamedSharding`` per named tensor (``axes_of(name)`` gives its logical axes)."""
    return {name: sh.named(axes_of(name), rules, shape) for name, shape in shapes.items()}
