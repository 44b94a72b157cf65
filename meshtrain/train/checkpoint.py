"""Sharded checkpoints: every rank writes only what it holds, any layout reads them back.

A checkpoint is a folder ``step_000123/`` holding

- ``rank_00000.safetensors``, ``rank_00001.safetensors``, ...: each rank's boxes of the logical tensors
  (``parallel/state.py``): parameters under their single-device names, optimizer state as ``<name>/exp_avg``,
  ``/exp_avg_sq``, ``/step``, the MoE selection bias. A box held by several ranks (replicas) is written once;
- ``index.json``: each logical tensor's shape and its boxes, with the file that holds each;
- ``rng.safetensors`` (the torch RNG states) and ``meta.json`` (format, step, resolved config, tokenizer, shapes).

Loading reads, for each box a rank holds, only the saved boxes that overlap it (``safe_open`` reads slices),
so a checkpoint written by one layout loads into any other (dp, zero, tp, pp, cp, ep and world size) and no
rank holds more than its own state plus one box in flight. Nothing is unpickled: tensors are safetensors,
metadata is JSON.

Atomic: all ranks write into ``.step_000123.tmp-<id>``; each rank's file appears under its final name only when
complete; rank 0 writes the index and meta once every rank's file is there, then renames the folder. A crash
at any point leaves no folder that ``latest_checkpoint`` picks up. Every rank must see the same filesystem
(one machine, or a shared filesystem across nodes: the usual requirement of sharded checkpoints).

Async (``train.ckpt_async``): the files are written by a background thread while training goes on. The thread
reads the live tensors (no staging copy, so no extra memory); the trainer waits for it before the next
optimizer step changes them (``wait_for_reads``), so the save overlaps the next step's forward and backward.

Why not ``torch.distributed.checkpoint`` (DCP): its filesystem format stores metadata with pickle, which our
rule never to unpickle a file forbids; its safetensors format stores one chunk per tensor per rank, where a
ZeRO flat piece of a row-sliced weight is up to three boxes; and our pieces are not DTensors, so its planners
would need replacing anyway. The box arithmetic above is what DCP's resharding does; the files stay
standard safetensors that any tool can read.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from meshtrain import comm
from meshtrain.errors import CheckpointError
from meshtrain.mesh import AxisGroup
from meshtrain.model.source import Box, box_numel, full_box, intersect, relative, tied_aliases, write_safetensors
from meshtrain.parallel.state import Held, check_shapes, load_state, local_state
from meshtrain.train.optim import model_params

FORMAT = 2  # 1: whole tensors in model.safetensors / optim.safetensors (still readable)
_STEP_DIR = re.compile(r"^step_(\d+)$")
REPLACED = ".tmp-replaced"  # a re-saved step's old folder, aside until the new one is in: .step_N.tmp-replaced
_NO_DIR_SYNC = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EACCES, errno.EBADF}


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (temporary folders are ignored)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def _meta_reads(path: Path) -> bool:
    """False for what a crash can leave of meta.json: missing, empty or cut off (not JSON). A meta.json that reads
    but is wrong (a newer format, a hand edit) is the reader's to refuse, with its fix."""
    try:
        json.loads((path / "meta.json").read_text())
        return True
    except (OSError, ValueError):
        return False


def latest_checkpoint(root: Path) -> Path | None:
    """The newest checkpoint under ``root`` whose meta.json reads, or None. A newer one whose meta.json is missing,
    empty or cut off (a machine crash after the rename, before the file reached the disk) is passed over, so a
    restart resumes from the one before instead of failing on it at every attempt (``unreadable_checkpoints``)."""
    for path in reversed(list_checkpoints(root)):
        if _meta_reads(path):
            return path
    return None


def unreadable_checkpoints(root: Path) -> list[Path]:
    """The checkpoints newer than ``latest_checkpoint(root)``: those whose meta.json does not read."""
    ckpts, latest = list_checkpoints(root), latest_checkpoint(root)
    return ckpts[ckpts.index(latest) + 1:] if latest is not None else ckpts


# ----------------------------------------------------------------------------- writing


def _box_name(key: str, box: Box) -> str:
    return f"{key}@" + ",".join(f"{a}:{b}" for a, b in box)


class Checkpointer:
    """Saves sharded checkpoints under ``root`` (collective: every rank of ``group`` calls ``save``).

    ``keep``: how many checkpoints to keep (0: all). ``async_save``: write in a background thread.
    ``commit_timeout_s``: how long rank 0 waits for the other ranks' files before giving the save up.
    """

    def __init__(self, root: Path | None, group: AxisGroup, rank: int, keep: int = 0, async_save: bool = False,
                 commit_timeout_s: float = 1800.0) -> None:
        self.root, self.group, self.rank, self.keep = root, group, rank, keep
        self.async_save, self.commit_timeout_s = async_save, commit_timeout_s
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_path: Path | None = None
        self.removed: list[Path] = []  # temporary folders of interrupted saves, removed here (rank 0)
        if rank == 0 and root is not None and root.is_dir():  # left by a crashed save (before any save starts)
            # A crash while a step was re-saved, between moving the old folder aside and renaming the new one in:
            # the old one (complete) goes back.
            for aside in sorted(root.glob(f".step_*{REPLACED}")):
                final = root / aside.name[1:].removesuffix(REPLACED)
                if not final.exists():
                    os.rename(aside, final)
            # Only the temporary names: a complete checkpoint (step_*) never matches.
            for stale in sorted(root.glob(".step_*.tmp-*")):
                shutil.rmtree(stale, ignore_errors=True)
                self.removed.append(stale)

    def save(self, step: int, held: list[Held], meta: dict[str, Any] | None = None,
             files: list[Path] = ()) -> Path:
        """Write this rank's boxes of ``held`` for checkpoint ``step``; rank 0 also writes ``meta`` (extra
        fields for meta.json) and copies ``files`` in, then commits. Returns the checkpoint's final path.

        Synchronous: returns when this rank's file is written (on rank 0: when the checkpoint is committed).
        Async: returns at once; ``wait_for_reads`` / ``wait`` join the writer.
        """
        self.wait()  # one save in flight at most
        parts = [(h.key, h.shape, box, t) for h in held for box, t in h.parts()]
        # Metadata only, on rank 0 (no other rank holds a list that grows with the world size): who holds which
        # box. Rank 0 picks one writer per box (a replicated box is written by its lowest rank), builds the
        # index, and tells each rank which of its boxes to write and the save's folder id.
        everyone = comm.gather_objects_to_first([(key, shape, str(t.dtype), box) for key, shape, box, t in parts],
                                                self.group)
        index, plans = None, None
        if self.rank == 0:
            owner: dict[tuple[str, Box], int] = {}
            for r, boxes in enumerate(everyone):
                for key, _, _, box in boxes:
                    owner.setdefault((key, box), r)
            index = self._index(everyone, owner)
            token = uuid.uuid4().hex[:8]
            plans = [(token, [owner[(key, box)] == r for key, _, _, box in boxes]) for r, boxes in enumerate(everyone)]
            del everyone, owner
        token, mask = comm.scatter_objects_from_first(plans, self.group)
        me = self.group.index(self.rank)
        writes = [(_box_name(key, box), tuple(t.shape), t.dtype, lambda t=t: t)
                  for (key, _, box, t), mine in zip(parts, mask, strict=True) if mine]
        final = checkpoint_dir(self.root, step)
        tmp = self.root / f".{final.name}.tmp-{token}"
        # Only a rank that writes makes the folder: rank 0 waits for the writers' files alone, so a rank with
        # nothing to write (every box it holds is a lower rank's: plain DP's rank 1) could reach mkdir after rank 0
        # renamed the folder, and either fail (it vanished between mkdir and the check) or leave an empty one.
        if writes or self.rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)
        my_file = tmp / f"rank_{me:05d}.safetensors"
        rng = _rng_state() if self.rank == 0 else None
        self.last_path = final

        def work() -> None:
            try:
                if writes:
                    write_safetensors(my_file, writes)
                if self.rank == 0:
                    self._commit(tmp, final, step, index, rng, meta or {}, files)
            except BaseException:
                if self.rank == 0:  # without rank 0 the save can never commit: nothing half-written stays
                    shutil.rmtree(tmp, ignore_errors=True)
                raise

        if self.async_save:
            self._thread = threading.Thread(target=self._guard(work), name=f"ckpt-{step}", daemon=True)
            self._thread.start()
        else:
            try:
                work()
            except CheckpointError:
                raise
            except Exception as e:  # the errno alone ("No space left on device") would not say what was saving
                raise CheckpointError(f"saving a checkpoint under {self.root} failed: {e}") from e
        return final

    def _guard(self, fn):
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # surfaced on the main thread by wait()
                self._error = e
        return run

    def wait_for_reads(self) -> None:
        """Block until a save in progress no longer reads the live tensors (call before changing them)."""
        self.wait()

    def wait(self) -> None:
        """Block until the save in flight (if any) is written; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise CheckpointError(f"saving a checkpoint under {self.root} failed: {e}") from e

    # ------------------------------------------------------------------ rank 0

    @staticmethod
    def _index(everyone: list, owner: dict[tuple[str, Box], int]) -> dict[str, Any]:
        tensors: dict[str, dict[str, Any]] = {}
        for r, boxes in enumerate(everyone):
            for key, shape, dtype, box in boxes:
                entry = tensors.setdefault(key, {"shape": list(shape), "dtype": dtype, "boxes": []})
                if owner[(key, box)] == r:
                    entry["boxes"].append({"box": [list(b) for b in box], "file": f"rank_{r:05d}.safetensors",
                                           "name": _box_name(key, box)})
        for key, entry in tensors.items():  # every element written exactly once, or the layout code is wrong
            total = sum(box_numel(tuple(tuple(b) for b in x["box"])) for x in entry["boxes"])
            numel = box_numel(full_box(entry["shape"]))
            if total != numel:
                raise CheckpointError(f"internal error: the ranks hold {total} elements of {key}, which has {numel}")
        return {"format": FORMAT, "tensors": tensors}

    def _commit(self, tmp: Path, final: Path, step: int, index: dict[str, Any], rng: dict[str, torch.Tensor],
                meta: dict[str, Any], files: list[Path]) -> None:
        expected = {x["file"] for e in index["tensors"].values() for x in e["boxes"]}
        deadline = time.monotonic() + self.commit_timeout_s
        while not all((tmp / f).exists() for f in expected):  # the other ranks' files, complete
            if time.monotonic() > deadline:
                missing = sorted(f for f in expected if not (tmp / f).exists())
                raise CheckpointError(f"ranks' files {missing[:3]} never appeared in {tmp}: the save was abandoned "
                                      f"(a rank failed?). Resume uses the previous checkpoint.")
            time.sleep(0.02)  # polling the shared folder: this may run in a background thread, where no
            # collective may be issued (it would interleave with the training step's)
        (tmp / "index.json").write_text(json.dumps(index))
        save_file(rng, str(tmp / "rng.safetensors"))
        for f in files:
            shutil.copy(f, tmp / Path(f).name)
        shapes = {k: e["shape"] for k, e in index["tensors"].items() if "/" not in k}
        (tmp / "meta.json").write_text(json.dumps({"format": FORMAT, "step": step, "shapes": shapes, **meta},
                                                  indent=1))
        # On disk before the rename makes the folder a checkpoint: without it a machine crash can leave a renamed
        # folder whose files are empty (ext4, XFS). The rank files are synced by their writers.
        for name in ("index.json", "rng.safetensors", "meta.json", *(Path(f).name for f in files)):
            _fsync(tmp / name)
        _fsync(tmp)
        old = self.root / f".{final.name}{REPLACED}"
        if final.exists():  # re-saving the same step (e.g. after a resume): the old one goes only once the new is in
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync(self.root)
        shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".step_*.tmp-*"):  # left by a crashed save
            shutil.rmtree(stale, ignore_errors=True)
        # Folders a crash left unreadable (passed over by the resume that led here) are no checkpoints: they must
        # not take the places ``keep`` counts, or pruning would delete the good ones and keep them.
        readable = []
        for path in list_checkpoints(self.root):
            if _meta_reads(path):
                readable.append(path)
            elif path != final:
                shutil.rmtree(path, ignore_errors=True)
        if self.keep > 0:
            for old in [p for p in readable if p != final][:max(0, len(readable) - self.keep)]:
                shutil.rmtree(old, ignore_errors=True)


def _fsync(path: Path) -> None:
    """Flush a file's or a folder's entries to the disk. Some network and FUSE filesystems cannot sync a folder
    (EINVAL, ENOTSUP, EACCES): there it is skipped, as the rename is all they offer."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno in _NO_DIR_SYNC and path.is_dir():
            return
        raise


def _rng_state() -> dict[str, torch.Tensor]:
    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["torch_cuda"] = torch.cuda.get_rng_state()
    return rng


# ----------------------------------------------------------------------------- reading


def _read_json(file: Path, missing: str) -> dict[str, Any]:
    if not file.is_file():
        raise CheckpointError(missing)
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is corrupt ({e}): resume from another checkpoint.") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} is corrupt (not a JSON object): resume from another checkpoint.")
    return data


def read_checkpoint_meta(path: Path) -> dict[str, Any]:
    """meta.json of a checkpoint folder, checked for format and completeness."""
    meta_file = path / "meta.json"
    meta = _read_json(meta_file, f"{path} is not a meshtrain checkpoint (no meta.json): pass a step_NNNNNN folder.")
    fmt = meta.get("format")
    if isinstance(fmt, int) and fmt > FORMAT:
        raise CheckpointError(f"{meta_file}: written by a newer meshtrain (checkpoint format {fmt}; this version "
                              f"reads formats 1 to {FORMAT}): upgrade meshtrain to load it.")
    if fmt not in (1, FORMAT) or "step" not in meta:
        raise CheckpointError(f"{meta_file}: unknown checkpoint format {fmt!r} (expected 1 to {FORMAT}).")
    # the fields others read, by type: a hand-edited or damaged file is one line here, not a traceback there
    kinds = {"step": int, "tokenizer": (str, type(None)), "aliases": dict, "config": dict}
    bad = [k for k, kind in kinds.items() if k in meta and not isinstance(meta[k], kind)]
    aliases = meta.get("aliases", {})
    if isinstance(aliases, dict) and not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        bad.append("aliases")
    if bad:
        raise CheckpointError(f"{meta_file} is corrupt ({', '.join(bad)} of the wrong type): delete the folder or "
                              f"resume from an earlier checkpoint.")
    return meta


def _open(file: Path):
    if not file.is_file():
        raise CheckpointError(f"Checkpoint file {file} is missing: the checkpoint is incomplete.")
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"Checkpoint file {file} is corrupt ({e}): delete the folder or resume "
                              f"from an earlier checkpoint.") from None


class CheckpointReader:
    """A checkpoint folder as a ``TensorSource``: any box of any logical tensor, reading only the saved boxes
    that overlap it. Reads format 2 (sharded) and format 1 (whole tensors)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.meta = read_checkpoint_meta(self.path)
        self.aliases: dict[str, str] = self.meta.get("aliases", {})
        self.elements_read = 0  # what this reader has read so far (a rank reads only what it holds)
        # key -> (shape, [(box, file, name in file)])
        self.tensors: dict[str, tuple[tuple[int, ...], list[tuple[Box, str, str]]]] = {}
        if self.meta["format"] == 1:
            for file in ("model.safetensors", "optim.safetensors"):
                with _open(self.path / file) as f:
                    for key in f.keys():
                        shape = tuple(f.get_slice(key).get_shape())
                        self.tensors[key] = (shape, [(full_box(shape), file, key)])
        else:
            index_file = self.path / "index.json"
            index = _read_json(index_file, f"{index_file} is missing: the checkpoint is incomplete.")
            try:
                for key, e in index["tensors"].items():
                    self.tensors[key] = (tuple(int(n) for n in e["shape"]),
                                         [(tuple((int(lo), int(hi)) for lo, hi in x["box"]), str(x["file"]),
                                           str(x["name"])) for x in e["boxes"]])
            except (KeyError, TypeError, AttributeError, ValueError) as e:
                raise CheckpointError(f"{index_file} is corrupt (not a checkpoint index: {type(e).__name__} "
                                      f"{e}): delete the folder or resume from an earlier checkpoint.") from None

    def keys(self) -> list[str]:
        return list(self.tensors) + list(self.aliases)

    def shape(self, key: str) -> tuple[int, ...] | None:
        entry = self.tensors.get(self.aliases.get(key, key))
        return None if entry is None else entry[0]

    def optimizer_keys(self) -> dict[str, list[str]]:
        """The optimizer state saved for each parameter: {name: ["exp_avg", "exp_avg_sq", "step"]}."""
        out: dict[str, list[str]] = {}
        for key in self.tensors:
            name, sep, field = key.rpartition("/")
            if sep:
                out.setdefault(name, []).append(field)
        return out

    def verify(self) -> None:
        """Every file the index names opens and holds its tensors (headers only, no tensor data is read): a
        missing or truncated file is found before any process starts, not by every rank mid-load."""
        names: dict[str, set[str]] = {"rng.safetensors": set()}  # restored with the weights: checked with them
        for _, saved in self.tensors.values():
            for _, file, name in saved:
                names.setdefault(file, set()).add(name)
        for file, wanted in names.items():
            with _open(self.path / file) as f:
                absent = wanted - set(f.keys())
            if absent:
                raise CheckpointError(f"Checkpoint file {self.path / file} lacks {sorted(absent)[:2]}: the checkpoint "
                                      f"is incomplete; resume from an earlier one.")

    def read(self, key: str, box: Box) -> torch.Tensor:
        key = self.aliases.get(key, key)
        shape, saved = self.tensors[key]
        out, covered = None, 0
        for sbox, file, name in saved:
            common = intersect(sbox, box)
            if common is None:
                continue
            # The file is open for this read only: safetensors maps it, and every page a read touches stays
            # resident while the file is open. Kept open, a resumed rank would hold its share of the checkpoint
            # a second time for the whole run, since the trainer keeps its reader (benchmarks/checkpoint.py
            # measured +0.84 GB after resuming 72M parameters in one process).
            with _open(self.path / file) as f:
                part = f.get_slice(name)[relative(common, sbox)] if common else f.get_tensor(name)
                if out is None:
                    out = torch.empty([b - a for a, b in box], dtype=part.dtype)
                out[relative(common, box)] = part
            covered += box_numel(common)
        self.elements_read += covered
        if out is None or covered != box_numel(box):
            raise CheckpointError(f"{self.path}: the saved boxes of {key} do not cover {list(box)}: the "
                                  f"checkpoint is incomplete.")
        return out

    def read_full(self, key: str) -> torch.Tensor:
        return self.read(key, full_box(self.shape(key)))


def restore_rng(path: Path) -> None:
    file = path / "rng.safetensors"
    if not file.is_file():
        raise CheckpointError(f"Checkpoint file {file} is missing: the checkpoint is incomplete.")
    try:
        rng = load_file(str(file))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"Checkpoint file {file} is corrupt ({e}): delete the folder or resume "
                              f"from an earlier checkpoint.") from None
    torch.set_rng_state(rng["torch_cpu"])
    if "torch_cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["torch_cuda"])


# ----------------------------------------------------------------------------- one whole model


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Persistent buffers (state, such as the MoE selection bias) by name."""
    persistent = set(model.state_dict())
    return {n: b for n, b in model.named_buffers() if n in persistent}


def save_checkpoint(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    meta: dict[str, Any] | None = None, keep: int = 0) -> Path:
    """Checkpoint a whole model held by one process (tools and tests; training ranks use ``Checkpointer``)."""
    held = local_state(model_params(model), optimizer, _buffers(model))
    group = AxisGroup("world", (0,), None)
    return Checkpointer(Path(root), group, 0, keep).save(step, held, {**(meta or {}), "aliases": tied_aliases(model)})


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Restore a whole model (and ``optimizer``, and the RNG) from a checkpoint of any layout; returns its meta."""
    reader = CheckpointReader(Path(path))
    pieces = model_params(model)
    check_shapes(pieces, reader, str(path))
    load_state(pieces, reader, optimizer, reader.optimizer_keys() if optimizer is not None else None)
    with torch.no_grad():
        for name, b in _buffers(model).items():
            if reader.shape(name) == tuple(b.shape):
                b.copy_(reader.read_full(name))
    restore_rng(Path(path))
    return reader.meta
