"""``meshtrain`` command line (also ``python -m meshtrain``): train | prepare-data | generate | convert | ...

    meshtrain train --config FILE [--out DIR] [--nproc N] [section.key=value ...]
    meshtrain prepare-data [--src DIR] [--out DIR] [--tokenizer byte|tokenizer.json]
    meshtrain generate --ckpt DIR [--prompt TEXT] [--tokens N]
    meshtrain convert --ckpt DIR --out HF_DIR [--max-shard-size 5GB]   (a checkpoint -> a HuggingFace Llama folder)
    meshtrain schedule --pp 4 --microbatches 8 --schedule 1f1b [--png out.png]
    meshtrain plan --model llama3-70b --hardware h100 --nodes 128 --batch-tokens 4M [--emit run.yaml] [--json]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from meshtrain.comm import CommError
from meshtrain.config import Config, ConfigError, load_config
from meshtrain.model.source import TensorSource
from meshtrain.train.checkpoint import CheckpointError


def _without_option(argv: list[str], name: str) -> list[str]:
    """argv minus ``name VALUE`` / ``name=VALUE``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


def _train(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="meshtrain train", description="Train a model.")
    ap.add_argument("--config", help="YAML config file or preset name (tiny, small, llama3-8b, ...)")
    ap.add_argument("--out", help="run folder: config.yaml, metrics.jsonl, tb/, checkpoints/")
    ap.add_argument("--nproc", type=int, default=0, help="relaunch under torchrun with N local processes")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100 parallel.tp=2")
    args = ap.parse_intermixed_args(argv)  # overrides may come before or after the options
    cfg = load_config(args.config, args.overrides)
    if args.nproc and "LOCAL_RANK" not in os.environ:
        if args.nproc < 1:
            raise ConfigError(f"--nproc must be >= 1, got {args.nproc}.")
        from meshtrain.train.trainer import check_before_launch

        check_before_launch(cfg, args.out, args.nproc)  # what cannot run is refused before any process starts
        rest = _without_option(argv, "--nproc")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               "-m", "meshtrain.cli", "train", *rest]
        return subprocess.call(cmd)
    import torch.distributed as dist

    from meshtrain.train.trainer import Trainer

    Trainer(cfg, args.out).train()
    if dist.is_initialized():  # an orderly shutdown: every rank done before any tears down
        dist.barrier()
        dist.destroy_process_group()
        # Under CPU load a gloo worker sometimes aborts in C++ static destructors at interpreter exit
        # ("terminate called without an active exception"), after all work is done and written.
        # Leave without that finalisation so torchrun sees the run's real outcome.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _find_checkpoint(arg: str) -> tuple[Path, dict, Config]:
    """The checkpoint ``--ckpt`` names (a step_* folder, or a run folder: its latest), its meta and its config."""
    from meshtrain.config import update_from_dict
    from meshtrain.train.checkpoint import latest_checkpoint, read_checkpoint_meta

    path = Path(arg)
    if not path.exists():
        raise ConfigError(f"--ckpt {path} does not exist.")
    if not (path / "meta.json").exists():
        found = latest_checkpoint(path / "checkpoints") or latest_checkpoint(path)
        if found is None:
            raise CheckpointError(f"--ckpt {path} holds no checkpoint: pass a run's --out folder or a step_* folder.")
        path = found
    meta = read_checkpoint_meta(path)
    return path, meta, update_from_dict(Config(), meta["config"], str(path / "meta.json"))


def _generate(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="meshtrain generate", description="Sample text from a checkpoint.")
    ap.add_argument("--ckpt", required=True, help="a checkpoint folder (step_NNNNNN) or a run folder (--out)")
    ap.add_argument("--prompt", default="def ")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from meshtrain.generate import sample
    from meshtrain.model.llama import Llama
    from meshtrain.model.source import load_full
    from meshtrain.train.checkpoint import CheckpointReader
    from meshtrain.train.tokenizer import load_tokenizer

    path, meta, cfg = _find_checkpoint(args.ckpt)
    if not meta.get("tokenizer"):
        raise CheckpointError(f"{path} was trained on synthetic data: there is no tokenizer to decode with.")
    tok = load_tokenizer("hf" if meta["tokenizer"] == "hf" else meta["tokenizer"], path)
    model = Llama(cfg.model)
    load_full(model, CheckpointReader(path))
    ids = sample(model, tok.encode(args.prompt), args.tokens, cfg.train.seq_len, args.temperature, args.top_k,
                 args.seed)
    print(args.prompt + tok.decode(ids))
    return 0


def _checkpoint_source(path: Path) -> TensorSource:
    """A checkpoint's tensors by logical name, read lazily a tensor at a time (any layout wrote it)."""
    from meshtrain.train.checkpoint import CheckpointReader

    return CheckpointReader(path)


def _parse_size(text: str) -> int:
    """Bytes from ``5GB``, ``200MB``, ``2GiB`` or a plain number of bytes (transformers' max_shard_size style)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    digits = t.rstrip("KMGIB")
    try:
        value = float(digits) * units[t[len(digits):]]
    except (ValueError, KeyError):
        raise ConfigError(f"--max-shard-size {text!r}: expected bytes or a size like 5GB, 200MB, 2GiB.") from None
    if value < 1:
        raise ConfigError(f"--max-shard-size {text!r} must be positive.")
    return int(value)


def _convert(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="meshtrain convert",
                                 description="Export a checkpoint as a HuggingFace LlamaForCausalLM folder "
                                             "(config.json + safetensors; docs/huggingface.md).")
    ap.add_argument("--ckpt", required=True, help="a checkpoint folder (step_NNNNNN) or a run folder (--out)")
    ap.add_argument("--out", required=True, help="the HF folder to write (must not exist, or be empty)")
    ap.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB, as HF)")
    args = ap.parse_args(argv)

    from meshtrain.model.hf import export_hf
    from meshtrain.train.tokenizer import load_tokenizer

    max_bytes = _parse_size(args.max_shard_size)
    path, meta, cfg = _find_checkpoint(args.ckpt)
    tokenizer_json = path / "tokenizer.json"
    files = [tokenizer_json] if tokenizer_json.is_file() else []
    eos = load_tokenizer(meta["tokenizer"], path).eos_id if meta.get("tokenizer") else None
    out = export_hf(_checkpoint_source(path), cfg.model, args.out, max_bytes, files, eos_token_id=eos)
    print(f"wrote {out} (LlamaForCausalLM, {sum(1 for _ in out.glob('*.safetensors'))} safetensors file(s)"
          f"{', tokenizer.json' if files else ''}) from {path}")
    return 0


def _prepare(argv: list[str]) -> int:
    from meshtrain.train.prepare import main

    return main(argv)


def _schedule(argv: list[str]) -> int:
    from meshtrain.plan.schedule_cli import main

    return main(argv)


def _plan(argv: list[str]) -> int:
    from meshtrain.plan.cli import main

    return main(argv)


COMMANDS = {"train": _train, "prepare-data": _prepare, "generate": _generate, "convert": _convert,
            "schedule": _schedule, "plan": _plan}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip())
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nunknown command '{argv[0]}': choose one of {', '.join(COMMANDS)}", file=sys.stderr)
            return 2
        return 0
    try:
        return COMMANDS[argv[0]](argv[1:])
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError, CommError) as e:
        # User errors carry the option and the fix, a failed collective the ranks that did not arrive;
        # MESHTRAIN_DEBUG=1 shows the traceback too.
        if os.environ.get("MESHTRAIN_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
