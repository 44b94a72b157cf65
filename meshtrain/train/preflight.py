"""Checks before a run starts, on the launcher before any process and again in each process: the device and
dtype, the layout, the run folder, the data and its tokenizer, the checkpoint to resume against the model. Each
refusal is one line naming the option or file and the fix (docs/reliability.md, "One clear line")."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from meshtrain.config import Config, ConfigError, ModelConfig, data_blend
from meshtrain.model.hf import HFSource
from meshtrain.model.llama import Llama
from meshtrain.parallel.compile import compile_unavailable
from meshtrain.plan.validate import validate_layout
from meshtrain.train.blend import BlendedDataset
from meshtrain.train.checkpoint import (
    CheckpointError,
    CheckpointReader,
    latest_checkpoint,
)
from meshtrain.train.data import (
    TokenDataset,
    check_fits,
    read_counts,
    read_meta,
)
from meshtrain.train.metrics import import_wandb
from meshtrain.train.paths import unwritable_reason
from meshtrain.train.prepare import ensure_prepared
from meshtrain.train.tokenizer import load_tokenizer, same_tokenizer
from meshtrain.train.unread_options import replaced_model_options


def resolve_device(kind: str) -> torch.device:
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible: use train.device=cpu or auto.")
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 matmuls natively: a GPU that supports bf16, a CPU whose oneDNN has bf16
    kernels (AVX-512 or AMX on x86, the BF16 extension on Arm). Elsewhere (an AVX2-only CPU) PyTorch falls back
    to a scalar path: a bf16 matmul ran at 0.9 GFLOP/s against fp32's 131 on an AVX2 EPYC (2026-11-28)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: no fast bf16 either
        return False


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """``train.dtype`` for a run on ``device``: ``auto`` is bf16 where the device computes it natively, else fp32;
    fp32 and bf16 stay as asked. Resolved before the run's config.yaml is written, so the run folder, the planner's
    check and a resume see what ran."""
    if dtype != "auto":
        return dtype
    return "bf16" if native_bf16(device) else "fp32"


def slow_dtype_warning(dtype: str, device: torch.device) -> str | None:
    """One line when ``train.dtype=bf16`` asks for what ``device`` has no fast kernels for, naming the fix."""
    if dtype == "bf16" and not native_bf16(device):
        return (f"warning: train.dtype=bf16 on a {device.type} without native bf16 (its matmuls run ~100x slower "
                f"than fp32 here): set train.dtype=fp32, or auto to choose per machine.")
    return None


def check_compile(cfg: Config, device: torch.device) -> None:
    """``train.compile=true`` where inductor cannot build kernels for ``device``: one line, before any process."""
    reason = compile_unavailable(device) if cfg.train.compile else None
    if reason:
        raise ConfigError(f"train.compile=true but {reason}; or set train.compile=false.")


def resolve_init_from(cfg: Config) -> list[str]:
    """With ``train.init_from=HF_DIR``, replace the model section by the folder's config.json (checking the
    folder: architecture, shards, shapes; one-line errors). Call before validating the layout. Returns a line for
    each model option the folder's value replaced (``unread_options.replaced_model_options``)."""
    if not cfg.train.init_from:
        return []
    if not Path(cfg.train.init_from).is_dir():  # HFSource's own line would not name the option
        raise ConfigError(f"train.init_from={cfg.train.init_from} is not a folder: give a HuggingFace model "
                          f"folder (config.json and safetensors), or leave train.init_from out.")
    given, cfg.model = cfg.model, HFSource(cfg.train.init_from).cfg
    return replaced_model_options(given, cfg.model, cfg.train.init_from)


def check_before_launch(cfg: Config, out_dir: str | Path | None, world_size: int, local_procs: int | None = None,
                        shared_out: bool = False) -> None:
    """What can be refused before any process starts, with one clear line each: the HF folder of
    ``train.init_from``, the layout, the device (``train.device=cuda`` and a GPU per process), the run folder
    (made here, and written to), the data (``data.path`` prepared, its tokenizer, or the default corpus's cache
    writable) and, with ``train.resume``, the latest checkpoint (its files and its tensors against the model).
    Whatever passes here can only fail inside a worker, where the launcher reports its one ``error:`` line.
    ``local_procs``: the processes on this node (several nodes: ``world_size`` is all of them); ``shared_out``:
    the launchers of other nodes probe the same run folder at once, so the probe leaves the folder it makes."""
    resolve_init_from(cfg)
    validate_layout(cfg, world_size)
    device = resolve_device(cfg.train.device)
    check_compile(cfg, device)
    local = world_size if local_procs is None else local_procs
    if device.type == "cuda" and torch.cuda.device_count() < local:
        n = torch.cuda.device_count()
        raise ConfigError(f"--nproc {local} runs one process per GPU but {n} GPU(s) are visible: pass "
                          f"--nproc {n} (and a layout for it), or train.device=cpu.")
    check_out_dir(out_dir, before_launch=not shared_out)
    if cfg.train.wandb:
        import_wandb()
    check_data(cfg)
    root = Path(out_dir) / "checkpoints" if out_dir else None
    if cfg.train.resume and root is None:
        raise ConfigError(RESUME_WITHOUT_OUT)
    path = latest_checkpoint(root) if root is not None else None
    if path is None:
        if cfg.train.resume_required:
            raise ConfigError(no_checkpoint_to_resume(root))
        return
    if not cfg.train.resume:
        raise ConfigError(f"--out {out_dir} already holds checkpoints of an earlier run: pass train.resume=true to "
                          f"continue it, or choose another --out.")
    reader = CheckpointReader(path)
    reader.verify()
    check_checkpoint_model(cfg.model, reader)


RESUME_WITHOUT_OUT = "train.resume=true needs --out DIR (the run folder whose checkpoints/ it resumes from)."


def no_checkpoint_to_resume(root: Path) -> str:
    return (f"train.resume_required=true but {root} holds no complete checkpoint: check --out (a typo starts a new "
            f"run elsewhere), or drop train.resume_required to start fresh.")


def check_out_dir(out_dir: str | Path | None, before_launch: bool = False) -> None:
    """``--out`` is a folder this process can write (made when missing, but not ``before_launch``), and its
    ``checkpoints`` is a folder."""
    if out_dir is None:
        return
    out = Path(out_dir)
    reason = unwritable_reason(out, leave_nothing=before_launch)
    if reason:
        raise ConfigError(f"--out {out} cannot be used as the run folder ({reason}): choose a folder you can "
                          f"write, e.g. --out runs/NAME (it is created when missing).")
    if (out / "checkpoints").exists() and not (out / "checkpoints").is_dir():
        raise ConfigError(f"--out {out}: {out / 'checkpoints'} is a file, where the run keeps its checkpoint "
                          f"folders: move it away, or choose another --out.")


def check_tokenizer_option(spec: str, meta: dict, path: Path) -> None:
    """``data.tokenizer`` is the default corpus's tokenizer; a prepared ``data.path`` brings its own. One that is
    not the folder's would be ignored without a word: refused. (``byte``, the default, cannot be told from a
    choice, so it passes.)"""
    if spec == "byte" or same_tokenizer(spec, meta["tokenizer"], path):
        return
    again = spec if spec != "hf" else "FILE"
    raise ConfigError(f"data.tokenizer={spec} is not the tokenizer data.path {path} was prepared with "
                      f"({meta['tokenizer']}): a prepared folder brings its own, so leave data.tokenizer out, or "
                      f"prepare the data again with `meshtrain prepare-data --tokenizer {again}`.")


def check_vocab(cfg: Config, data_vocab: int) -> None:
    if cfg.model.vocab_size and cfg.model.vocab_size < data_vocab:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
            f"{data_vocab} ids: set model.vocab_size=0 to take it from the data."
        )


def val_folder(cfg: Config, meta: dict | None) -> Path:
    """``data.val_path``, checked against the training data's ``meta`` (None: not prepared yet, so its size alone):
    a prepared folder of the same tokenizer whose val split holds a ``train.seq_len`` window. One line naming the
    option otherwise."""
    path = ensure_prepared(cfg.data.val_path, option="data.val_path")
    theirs = read_meta(path)
    for key in ("tokenizer", "vocab_size", "eos_id"):
        if meta is not None and theirs[key] != meta[key]:
            raise ConfigError(f"data.val_path={cfg.data.val_path} was prepared with another tokenizer than the "
                              f"training data ({key} {theirs[key]!r} against {meta[key]!r}): prepare it with the same "
                              f"--tokenizer (meshtrain prepare-data).")
    tokens = int(theirs["val_tokens"])
    if tokens < cfg.train.seq_len + 1:
        raise ConfigError(f"data.val_path={cfg.data.val_path} holds {tokens} validation tokens, less than one "
                          f"train.seq_len={cfg.train.seq_len} window and its next token: prepare it with "
                          f"--val-fraction 1 (every document held out) or more text.")
    return path


def check_data(cfg: Config) -> None:
    """The data a run will read, checked without reading tokens: a set ``data.path`` is a prepared folder (or a
    blend of them, of one tokenizer) whose tokenizer loads and fits ``model.vocab_size`` and whose train split holds
    a ``train.seq_len`` window; for the default corpus, its tokenizer exists and its cache can be written (rank 0
    prepares it on first use). A ``data.val_path`` is checked against it (``val_folder``)."""
    d = cfg.data
    if d.source != "files":
        return
    meta = _check_train_data(cfg)
    if d.val_path:
        val_folder(cfg, meta)


def _check_train_data(cfg: Config) -> dict | None:
    """``check_data`` for ``data.path``; returns its meta.json (a blend's first folder's), None for the default
    corpus not prepared yet."""
    d = cfg.data
    blend = data_blend(d.path)
    if blend is not None:  # prepared folders, one tokenizer (BlendedDataset checks it; opening reads no tokens)
        folders = [(w, ensure_prepared(f)) for w, f in blend]
        data = BlendedDataset(folders, "train")
        BlendedDataset(folders, "val")  # opening a split checks its files' sizes
        load_tokenizer(data.meta["tokenizer"], data.path)
        check_vocab(cfg, data.vocab_size)
        data.check_fits(cfg.train.seq_len)
        for part in data.parts:  # rank 0 reads them for the unigram baseline
            if part.meta["format"] >= 3:
                read_counts(part.path, "train", part.meta)
        return data.meta
    path = ensure_prepared(d.path or None, d.tokenizer, d.val_fraction, check_only=True)
    if not (path / "meta.json").is_file():  # the default corpus, not prepared yet
        load_tokenizer(d.tokenizer)
        return None  # a data.val_path's tokenizer is checked against it once prepared (the trainer's val_folder)
    meta = read_meta(path)  # meta.json only: the ranks open the token files
    load_tokenizer(meta["tokenizer"], path)
    check_tokenizer_option(d.tokenizer, meta, path)
    check_vocab(cfg, int(meta["vocab_size"]))
    check_fits(path, "train", int(meta["train_tokens"]), cfg.train.seq_len)
    if meta["format"] >= 3:  # rank 0 reads them for the unigram baseline: a bad file is refused before launch
        read_counts(path, "train", meta)
    for split in ("train", "val"):  # opening a split checks its file's size (and <split>.prompts.npy): no read
        TokenDataset(path, split)
    return meta


# Options that decide a tensor's name or shape: what a checkpoint and the config must agree on to resume.
_SHAPE_OPTIONS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "multiple_of",
                  "tie_embeddings", "moe_experts", "moe_shared_experts", "moe_hidden")


def check_checkpoint_model(model: ModelConfig, reader: CheckpointReader) -> None:
    """The checkpoint holds exactly this model's tensors (names and shapes, both ways: a checkpoint with more
    layers or experts than the config is refused too, not half-loaded), or one line naming the checkpoint, the
    ``model.*`` options that differ and the fix."""
    path = reader.path
    if model.vocab_size == 0:  # taken from the data: compare with what the checkpoint's run took
        saved = reader.shape("tok_embeddings.weight")
        model = dataclasses.replace(model, vocab_size=int(saved[0]) if saved else 1)
    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in Llama(model).state_dict().items()}  # parameters and the MoE bias
    detail = None
    for name, shape in shapes.items():
        saved = reader.shape(name)
        if saved is None:
            detail = f"{name} is not in the checkpoint"
        elif tuple(saved) != shape:
            detail = f"{name} has shape {tuple(saved)} in the checkpoint but {shape} with this config"
        if detail:
            break
    else:
        extra = sorted(k for k in reader.keys() if "/" not in k and k not in shapes)
        if not extra:
            return
        detail = f"the checkpoint's {extra[0]} is not in this model"
    theirs = reader.meta.get("config", {}).get("model", {})
    differ = [k for k in _SHAPE_OPTIONS if k in theirs and theirs[k] != getattr(model, k)]
    if differ:
        fix = " ".join(f"model.{k}={theirs[k]}" for k in differ)
        ours = ", ".join(f"model.{k}={getattr(model, k)}" for k in differ)
        raise CheckpointError(f"cannot resume from {path}: {detail}. This config has {ours}; the checkpoint was "
                              f"written with {fix.replace(' ', ', ')}: set {fix} (as in its meta.json) to resume "
                              f"it, or choose another --out for a new run.")
    raise CheckpointError(f"cannot resume from {path}: {detail}: it was written for another model; set the model "
                          f"section as in its meta.json, or choose another --out for a new run.")
