"""Logical (single-device) state from any layout, and back: how checkpoints stay layout-independent.

Every optimizer tensor is an ``OptimParam``: a piece (ZeRO) of a local tensor (tensor parallel) of a
logical parameter. Saving rebuilds each logical tensor in two stages, each an all-reduce of zeros
with this rank's part filled in: over the ZeRO shard group to rebuild the local tensor, then over
the tensor-parallel group to place the local slices in the logical tensor. Replicated layouts skip
a stage. Loading cuts each rank's piece out of the full tensors. A checkpoint written by one layout
therefore loads into any other.

Under expert parallelism a routed expert lives on the ranks of one ep index (replicated, like the norms,
over tp) and is absent elsewhere: it is rebuilt over its own ZeRO group (edp, when ``parallel.zero`` >= 1
shards it) and then summed over the ep group (``sync.ep_group``), where exactly one index holds it.
"""

from __future__ import annotations

import torch

from meshtrain import comm
from meshtrain.mesh import AxisGroup
from meshtrain.model.moe import expert_index
from meshtrain.parallel.grad_sync import GradSync
from meshtrain.parallel.pieces import OptimParam


def _piece_of(local: torch.Tensor, op: OptimParam) -> torch.Tensor:
    return local.reshape(-1)[op.offset: op.offset + op.tensor.numel()].view_as(op.tensor)


def _local_from_logical(full: torch.Tensor, op: OptimParam) -> torch.Tensor:
    if op.tp is None:
        return full
    local = torch.zeros(op.local, dtype=full.dtype, device=full.device)
    local.narrow(op.tp.dim, 0, op.tp.length).copy_(full.narrow(op.tp.dim, op.tp.start, op.tp.length))
    return local


def _active(group: AxisGroup | None) -> bool:
    return group is not None and group.size > 1


@torch.no_grad()
def gather_state(sync: GradSync, optimizer: torch.optim.Optimizer, shapes: dict[str, tuple[int, ...]],
                 tp_group: AxisGroup | None = None, pp_group: AxisGroup | None = None, grads: bool = False
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(parameters by name, optimizer state by "name/key"), full and on CPU, on every rank.

    ``grads=True``: (the logical gradients by name, {}) instead, read from the pieces' ``.grad`` (call it
    after the gradient sync and before the optimizer step; equivalence tests compare them).

    ``shapes`` lists every logical parameter (the same order on every rank, collectives follow it).
    Under pipeline parallelism each tensor lives on one stage: a final all-reduce over ``pp_group``
    (zeros elsewhere) brings it to every rank.
    """
    pieces = sync.optim_params()
    zgroup = sync.norm_group
    ep_group = sync.ep_group if _active(sync.ep_group) else None
    ezgroup = sync.expert_norm_group if _active(sync.expert_norm_group) else None  # experts' ZeRO group
    by_name: dict[str, list[OptimParam]] = {}
    for op in pieces:
        by_name.setdefault(op.name, []).append(op)
    # What each logical tensor looks like here: local shape, TP placement, state keys. A rank that
    # owns no piece of a tensor (per-tensor ZeRO) learns it from the others.
    info = {name: (ops[0].local, ops[0].tp, sorted({k for op in ops for k, v in optimizer.state.get(op.tensor, {})
                                                   .items() if torch.is_tensor(v)}))
            for name, ops in by_name.items()}
    here: set[str] = set()
    for g in (zgroup, ezgroup, ep_group, pp_group):
        if g is pp_group:
            here = set(info)  # the tensors of this pipeline stage (known to the whole ZeRO group)
        if not _active(g):
            continue
        merged: dict = {}
        for d in comm.gather_objects(info, g):
            for name, (local, tp, keys) in d.items():
                old = merged.get(name)
                merged[name] = (local, tp, sorted(set(keys) | set(old[2] if old else [])))
        info = merged
    device = pieces[0].tensor.device if pieces else torch.device("cpu")

    def logical(name: str, shape: tuple[int, ...], value_of) -> torch.Tensor:
        full = _logical_here(name, shape, value_of) if name in here or not _active(pp_group) else \
            torch.zeros(shape, dtype=torch.float32, device=device)
        if _active(pp_group):
            comm.all_reduce(full, pp_group)
        return full.cpu()

    def _logical_here(name: str, shape: tuple[int, ...], value_of) -> torch.Tensor:
        local_shape, tp, _ = info.get(name, (shape, None, []))
        local = torch.zeros(local_shape, dtype=torch.float32, device=device)
        for op in by_name.get(name, []):
            v = value_of(op)
            if v is not None:
                _piece_of(local, op).copy_(v)
        # Expert pieces: rebuilt over their ZeRO group, then over ep (zeros where another rank's experts sit).
        groups = (ezgroup, ep_group) if ep_group is not None and expert_index(name) is not None else (zgroup,)
        for group in groups:
            if _active(group):
                comm.all_reduce(local, group)
        if tp is None:
            return local
        full = torch.zeros(shape, dtype=torch.float32, device=device)
        full.narrow(tp.dim, tp.start, tp.length).copy_(local.narrow(tp.dim, 0, tp.length))
        if _active(tp_group):
            comm.all_reduce(full, tp_group)
        return full

    params, optim = {}, {}
    if grads:
        return {name: logical(name, shape, lambda op: op.tensor.grad) for name, shape in shapes.items()}, {}
    for name, shape in shapes.items():
        params[name] = logical(name, shape, lambda op: op.tensor)
        for key in info.get(name, (None, None, []))[2]:
            states = [optimizer.state[op.tensor][key] for op in by_name.get(name, []) if op.tensor in optimizer.state]
            if key == "step" or (states and states[0].dim() == 0):  # a counter, the same everywhere
                value = torch.tensor(max([float(s) for s in states], default=0.0), device=device)
                for g in (zgroup, ezgroup, ep_group, pp_group):
                    if _active(g):
                        comm.all_reduce(value, g, op="max")
                optim[f"{name}/{key}"] = value.cpu()
                continue
            optim[f"{name}/{key}"] = logical(
                name, shape, lambda op, k=key: optimizer.state[op.tensor][k] if op.tensor in optimizer.state else None)
    return params, optim


@torch.no_grad()
def load_state(sync: GradSync, optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor],
               optim_by_name: dict[str, dict[str, torch.Tensor]]) -> None:
    """Install full logical tensors into this rank's pieces (parameters and optimizer state)."""
    pieces = sync.optim_params()
    for op in pieces:
        if op.name not in params:
            raise KeyError(f"the checkpoint has no tensor for {op.name}: it was written for another model.")
        full = params[op.name]
        if tuple(full.shape) != op.shape:
            raise ValueError(f"{op.name} has shape {tuple(full.shape)} in the checkpoint but {op.shape} in the "
                             f"model: check the model config.")
        op.tensor.copy_(_piece_of(_local_from_logical(full.to(op.tensor.device), op), op))
    sync.after_step()  # ranks that do not own a piece get it from its owner
    sliced, names = {}, {}
    for i, op in enumerate(pieces):
        state = optim_by_name.get(op.name)
        if state is None:
            continue
        key = f"piece{i}"
        names[id(op.tensor)] = key
        sliced[key] = {k: (v.float() if k == "step" and v.dim() == 0 else
                           _piece_of(_local_from_logical(v, op), op).clone())
                       for k, v in state.items()}
    apply_optimizer_state(optimizer, names, sliced)


def apply_optimizer_state(optimizer: torch.optim.Optimizer, names: dict[int, str],
                          by_name: dict[str, dict[str, torch.Tensor]]) -> None:
    """Install per-name state for the optimizer's tensors (``names``: id(tensor) -> logical name)."""
    optimizer.state.clear()
    # AdamW keeps its step counter on the parameter's device when fused or capturable, else on the CPU.
    step_on_device = bool(optimizer.defaults.get("fused") or optimizer.defaults.get("capturable"))
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = by_name.get(names.get(id(p), ""))
            if state is None:
                continue
            optimizer.state[p] = {
                k: v if (k == "step" and not step_on_device) else v.to(p.device) for k, v in state.items()
            }
