"""Logical (single-device) state from any data-parallel layout, and back: how checkpoints stay
layout-independent.

Every optimizer tensor is an ``OptimParam``: a piece of a logical parameter at a known offset.
Saving rebuilds each logical tensor by adding the pieces of all ranks (one all-reduce per tensor
over the shard group; replicated layouts need none). Loading slices each rank's pieces out of the
full tensors. A checkpoint written by one layout therefore loads into any other.
"""

from __future__ import annotations

import torch

from meshtrain import comm
from meshtrain.parallel.data import GradSync
from meshtrain.train.checkpoint import apply_optimizer_state


def _scatter_full(full: torch.Tensor, piece: torch.Tensor, offset: int) -> torch.Tensor:
    return full.reshape(-1)[offset: offset + piece.numel()].view_as(piece)


@torch.no_grad()
def gather_state(sync: GradSync, optimizer: torch.optim.Optimizer, shapes: dict[str, tuple[int, ...]]
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(parameters by name, optimizer state by "name/key"), full and on CPU, on every rank.

    ``shapes`` lists every logical parameter (the same order on every rank, collectives follow it).
    """
    pieces = sync.optim_params()
    group = sync.norm_group
    by_name: dict[str, list] = {}
    for op in pieces:
        by_name.setdefault(op.name, []).append(op)
    keys_here = {name: sorted({k for op in ops for k, v in optimizer.state.get(op.tensor, {}).items()
                               if torch.is_tensor(v)}) for name, ops in by_name.items()}
    if group is None or group.size == 1:
        keys = keys_here
    else:  # a rank that owns nothing of a tensor must still know its state keys to take part
        keys = {}
        for d in comm.gather_objects(keys_here, group):
            for name, ks in d.items():
                keys.setdefault(name, sorted(set(ks) | set(keys.get(name, []))))
    params, optim = {}, {}
    for name, shape in shapes.items():
        ops = by_name.get(name, [])
        full = torch.zeros(shape, dtype=torch.float32, device=_device(pieces))
        for op in ops:
            _scatter_full(full, op.tensor, op.offset).copy_(op.tensor)
        _sum(full, group)
        params[name] = full.cpu()
        for key in keys.get(name, []):
            states = [optimizer.state[op.tensor][key] for op in ops if op.tensor in optimizer.state]
            if states and states[0].dim() == 0 or (not states and key == "step"):
                value = torch.tensor(max([float(s) for s in states], default=0.0))
                _max(value, group)
                optim[f"{name}/{key}"] = value.to(states[0].dtype if states else torch.float32)
                continue
            full = torch.zeros(shape, dtype=torch.float32, device=_device(pieces))
            for op in ops:
                if op.tensor in optimizer.state:
                    _scatter_full(full, op.tensor, op.offset).copy_(optimizer.state[op.tensor][key])
            _sum(full, group)
            optim[f"{name}/{key}"] = full.cpu()
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
        op.tensor.copy_(_scatter_full(full.to(op.tensor.device), op.tensor, op.offset))
    sync.after_step()  # ranks that do not own a piece get it from its owner
    sliced, names = {}, {}
    for i, op in enumerate(pieces):
        state = optim_by_name.get(op.name)
        if state is None:
            continue
        key = f"piece{i}"
        names[id(op.tensor)] = key
        sliced[key] = {k: (v if v.dim() == 0 else _scatter_full(v, op.tensor, op.offset).clone())
                       for k, v in state.items()}
    apply_optimizer_state(optimizer, names, sliced)


def _device(pieces: list) -> torch.device:
    return pieces[0].tensor.device if pieces else torch.device("cpu")


def _sum(t: torch.Tensor, group) -> None:
    if group is not None and group.size > 1:
        comm.all_reduce(t, group)


def _max(t: torch.Tensor, group) -> None:
    if group is not None and group.size > 1:
        comm.all_reduce(t, group, op="max")
