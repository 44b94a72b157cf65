"""Checkpoints: per logical tensor, in safetensors, written atomically, loaded without pickle.

A checkpoint is a folder ``step_000123/`` holding

- ``model.safetensors``: every parameter under its name in the plain model (tied weights once);
- ``optim.safetensors``: AdamW state as ``<param name>/exp_avg``, ``/exp_avg_sq``, ``/step``;
- ``rng.safetensors``: the torch RNG states;
- ``meta.json``: step, resolved config, tokenizer, tensor shapes and a format version.

Tensors are stored under the names and global shapes of the single-device model, so a
later layout can load what another layout wrote (sharded layouts gather or slice by name).
The folder is written as ``.step_000123.tmp-<pid>`` and renamed when complete: a crash
leaves no half-written checkpoint under a real name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from meshtrain.parallel.state import apply_optimizer_state

FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, with the file and the fix in the message."""


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (temporary folders are ignored)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: Path) -> Path | None:
    ckpts = list_checkpoints(root)
    return ckpts[-1] if ckpts else None


def model_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Parameters by name with tied tensors stored once; returns (tensors, aliases name -> stored name)."""
    tensors, aliases, first = {}, {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
            continue
        first[id(p)] = name
        tensors[name] = p.detach().cpu().contiguous()
    return tensors, aliases


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Optimizer state of a non-sharded model as ``{"<param name>/<key>": tensor}``."""
    names = _param_names(model)
    return {f"{names[id(p)]}/{key}": v.detach().cpu().contiguous()
            for p, state in optimizer.state.items() for key, v in state.items() if torch.is_tensor(v)}


def save_checkpoint(root: Path, step: int, model: nn.Module | None, optimizer: torch.optim.Optimizer | None,
                    extra: dict[str, Any], keep: int = 0, files: list[Path] = (),
                    state: tuple[dict, dict, dict] | None = None) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically; keep the newest ``keep`` (0: all).

    The tensors come from ``model``/``optimizer`` or, for sharded layouts, ready-made as
    ``state = (tensors by name, aliases, optimizer tensors by "name/key")`` of the logical model.
    ``files`` are copied in as they are (e.g. a tokenizer.json that generation will need).
    """
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(root, step)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if state is None:
            tensors, aliases = model_state(model)
            optim = optimizer_state(model, optimizer)
        else:
            tensors, aliases, optim = state
        save_file(tensors, str(tmp / "model.safetensors"))
        save_file(optim, str(tmp / "optim.safetensors"))
        rng = {"torch_cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["torch_cuda"] = torch.cuda.get_rng_state()
        save_file(rng, str(tmp / "rng.safetensors"))
        for f in files:
            shutil.copy(f, tmp / Path(f).name)
        meta = {
            "format": FORMAT, "step": step, "aliases": aliases,
            "shapes": {n: list(t.shape) for n, t in tensors.items()}, **extra,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if final.exists():  # re-saving the same step (e.g. after a resume): replace it whole
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep > 0:
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def read_checkpoint_meta(path: Path) -> dict[str, Any]:
    """meta.json of a checkpoint folder, checked for format and completeness."""
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise CheckpointError(f"{path} is not a meshtrain checkpoint (no meta.json): pass a step_NNNNNN folder.")
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_file} is corrupt ({e}): resume from another checkpoint.") from None
    if meta.get("format") != FORMAT or "step" not in meta:
        raise CheckpointError(f"{meta_file}: unknown checkpoint format {meta.get('format')!r} (expected {FORMAT}).")
    return meta


def _load_tensors(file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise CheckpointError(f"Checkpoint file {file} is missing: the checkpoint is incomplete.")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"Checkpoint file {file} is corrupt ({e}): delete the folder or resume "
                              f"from an earlier checkpoint.") from None


def load_model_weights(path: Path, model: nn.Module) -> dict[str, Any]:
    """Load parameters by name into ``model`` (whose shapes must match); returns the meta."""
    meta = read_checkpoint_meta(path)
    tensors = read_model_state(path)
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise CheckpointError(f"{path}: the checkpoint has no tensor for {missing[:3]}: it was written for "
                              f"another model shape.")
    with torch.no_grad():
        for name, p in params.items():
            t = tensors[name]
            if t.shape != p.shape:
                raise CheckpointError(f"{path}: {name} has shape {tuple(t.shape)} in the checkpoint but "
                                      f"{tuple(p.shape)} in the model: check the model config.")
            p.copy_(t)
        for name, b in model.named_buffers():  # persistent state such as the MoE selection bias, when saved
            if name in tensors and tensors[name].shape == b.shape:
                b.copy_(tensors[name])
    return meta


def read_optimizer_state(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """``{param name: {key: tensor}}`` from a checkpoint's optim.safetensors."""
    by_name: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in _load_tensors(path / "optim.safetensors").items():
        pname, _, field = key.rpartition("/")
        by_name.setdefault(pname, {})[field] = t
    return by_name


def read_model_state(path: Path) -> dict[str, torch.Tensor]:
    """Every parameter by name (tied names included) from a checkpoint's model.safetensors."""
    meta = read_checkpoint_meta(path)
    tensors = _load_tensors(path / "model.safetensors")
    for alias, name in meta.get("aliases", {}).items():
        tensors.setdefault(alias, tensors[name])
    return tensors


def restore_rng(path: Path) -> None:
    rng = _load_tensors(path / "rng.safetensors")
    torch.set_rng_state(rng["torch_cpu"])
    if "torch_cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["torch_cuda"])


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore model, optimizer state and RNG from a checkpoint folder; returns its meta."""
    meta = load_model_weights(path, model)
    apply_optimizer_state(optimizer, _param_names(model), read_optimizer_state(path))
    restore_rng(path)
    return meta
