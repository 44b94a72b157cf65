"""``meshtrain`` command line (also ``python -m meshtrain``): train | prepare-data | generate | convert | ...

    meshtrain train --config FILE [--out DIR] [--nproc N] [section.key=value ...]
    meshtrain train ... --nproc N --nnodes M --node-rank R --rdzv-endpoint HOST:PORT   (one node of M: multi-node.md)
    meshtrain prepare-data [--src DIR|FILE] [--out DIR] [--format auto|text|jsonl|parquet] [--field text]
                           [--tokenizer byte|tokenizer.json]
    meshtrain generate --ckpt DIR [--prompt TEXT ...] [--tokens N] [--greedy] [--nproc N parallel.tp=T parallel.pp=P]
    meshtrain convert --ckpt DIR --out HF_DIR [--max-shard-size 5GB] [--dtype bf16]   (a checkpoint -> an HF folder)
    meshtrain schedule --pp 4 --microbatches 8 --schedule 1f1b [--png out.png]
    meshtrain plan --model llama3-70b --hardware h100 --nodes 128 --batch-tokens 4M [--emit run.yaml] [--json]
    meshtrain demo [--config configs/small.yaml] [--out runs/small] [--nproc N]   (plan, train, check, report)
"""

from __future__ import annotations

import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshtrain import launch
from meshtrain.config import ArgumentParser, Config, ConfigError, load_config, refuse_empty, validate
from meshtrain.errors import CheckpointError, CommError, NonFiniteError

if TYPE_CHECKING:
    from meshtrain.model.source import TensorSource


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
    ap = ArgumentParser(prog="meshtrain train", description="Train a model.")
    ap.add_argument("--config", help="YAML config file or preset name (tiny, small, llama3-8b, ...)")
    ap.add_argument("--out", help="run folder: config.yaml, metrics.jsonl, tb/, checkpoints/")
    ap.add_argument("--nproc", type=int, default=None, help="relaunch under torchrun with N >= 1 local processes")
    ap.add_argument("--max-restarts", type=int, default=0,
                    help="with --nproc: restart every process up to K times after one fails, resuming from the "
                         "latest checkpoint (torchrun's elastic restarts)")
    launch.add_node_options(ap)
    ap.add_argument("--dry-run", action="store_true",
                    help="with --nproc: validate, print the torchrun line this node would run, launch nothing")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100 parallel.tp=2")
    args = ap.parse_intermixed_args(argv)  # overrides may come before or after the options
    if args.nproc is not None and args.nproc < 1:  # 0 used to mean "no torchrun": refused, not a silent 1 process
        raise ConfigError(f"--nproc {args.nproc}: launch at least 1 process (--nproc N, N >= 1), or leave --nproc "
                          f"out to train in this process.")
    refuse_empty(args, {"config": "a YAML file or preset name", "out": "a run folder"})
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts}: give the number of restarts allowed, >= 0.")
    if args.max_restarts and args.nproc is None:
        raise ConfigError("--max-restarts restarts torchrun's processes: use it with --nproc N.")
    nodes = launch.nodes_from_args(args)
    if args.dry_run and args.nproc is None:
        raise ConfigError("--dry-run prints the torchrun line of a launch: use it with --nproc N.")
    cfg = load_config(args.config, args.overrides, check=False)
    replaced: list[str] = []  # model options init_from's config.json replaces: the run's log names them
    if cfg.train.init_from:  # its config.json is the model: the layout is checked against it, not the preset's
        from meshtrain.train.preflight import resolve_init_from

        replaced = resolve_init_from(cfg)
    validate(cfg)
    if args.nproc is not None and "LOCAL_RANK" not in os.environ:
        from meshtrain.train.preflight import check_before_launch

        nnodes = nodes.nnodes if nodes else 1  # what cannot run is refused before any process starts
        try:
            check_before_launch(cfg, args.out, args.nproc * nnodes, local_procs=args.nproc,
                                shared_out=nnodes > 1 and not args.dry_run)
        except ConfigError as e:  # the world spans the nodes: say how its size came about
            if nnodes > 1 and str(e).startswith("World size"):
                raise ConfigError(f"--nnodes {nnodes} x --nproc {args.nproc} = {nnodes * args.nproc} processes: "
                                  f"{e}") from None
            raise
        rest = argv
        for option in ("--nproc", "--max-restarts", *launch.LAUNCH_OPTIONS):
            rest = _without_option(rest, option)
        cmd = launch.torchrun_command(args.nproc, args.max_restarts, nodes,
                                      ["train", *(o for o in rest if o != "--dry-run")])
        if args.dry_run:
            print(shlex.join(cmd))
            return 0
        if nodes:
            launch.check_rendezvous(nodes)
        return _run_torchrun(cmd, args.out, nodes)
    from meshtrain import comm
    from meshtrain.train.trainer import Trainer

    trainer = Trainer(cfg, args.out, notes=replaced)
    trainer.train()
    if comm.shutdown(trainer.mesh.group("world")):  # every rank done before any tears down
        # Under CPU load a gloo worker sometimes aborts in C++ static destructors at interpreter exit
        # ("terminate called without an active exception"), after all work is done and written.
        # Leave without that finalisation so torchrun sees the run's real outcome.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _launch_log(out_dir: str | None, nodes: launch.Nodes | None = None) -> Path:
    """Where the workers' stderr goes: ``<out>/logs/train-<time>-<pid>.log``, or a temporary file without --out."""
    if out_dir is None:
        fd, name = tempfile.mkstemp(prefix="meshtrain-train-", suffix=".log")
        os.close(fd)
        return Path(name)
    logs = Path(out_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    node = f"node{nodes.node_rank}-" if nodes else ""  # nodes share the run folder; their pids may coincide
    return logs / f"train-{time.strftime('%Y%m%d-%H%M%S')}-{node}{os.getpid()}.log"


def _run_torchrun(cmd: list[str], out_dir: str | None, nodes: launch.Nodes | None = None) -> int:
    """Run torchrun: its workers' stdout (log lines, the progress bar) passes through; their stderr and
    torchrun's own go to a log file in the run folder. On failure, print the workers' ``error:`` line once
    (every rank may print the same one) and where the full log is, not every rank's traceback and torchrun's
    ChildFailedError; the exit code stays non-zero."""
    from meshtrain.train.metrics import LAUNCHER_LOG_ENV

    log = _launch_log(out_dir, nodes)
    interrupted = False
    terminated: list[int] = []
    # torchrun makes a folder per run for its workers' error files (torchelastic_* in the temp dir) and never
    # removes it: give it one that goes when the run does.
    with open(log, "wb") as f, tempfile.TemporaryDirectory(prefix="meshtrain-torchrun-") as torchrun_dir:
        cmd = launch.with_log_dir(cmd, torchrun_dir)
        proc = subprocess.Popen(cmd, stderr=f, env={**os.environ, LAUNCHER_LOG_ENV: str(log)})

        def forward(signum: int, frame: object) -> None:
            # A scheduler's preemption: torchrun passes it to the workers, which save at the next step and stop;
            # this process waits for that instead of dying first and orphaning them.
            terminated.append(signum)
            proc.send_signal(signum)

        previous = signal.signal(signal.SIGTERM, forward)
        try:
            code = proc.wait()
        except KeyboardInterrupt:  # Ctrl-C reached torchrun and its workers too: let them finish stopping
            interrupted, code = True, proc.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
    if code == 0:
        if out_dir is None:
            log.unlink(missing_ok=True)
        return 0
    if terminated:
        print("stopped by SIGTERM (the workers saved a checkpoint of their last step if they could: see the log "
              "above); run again with train.resume=true to continue.", file=sys.stderr)
        print(f"full log (every rank's stderr, torchrun's report): {log}", file=sys.stderr)
        return 128 + signal.SIGTERM
    text = "" if interrupted else log.read_text(errors="replace")
    message, user_error = ("interrupted (Ctrl-C)", False) if interrupted else worker_error(text, code)
    if not interrupted and not user_error and (rendezvous := launch.rendezvous_error(text, nodes)):
        message, user_error = rendezvous, True  # a node missing, or node 0 gone: no worker said why
    print(f"error: {message}", file=sys.stderr)
    print(f"full log (every rank's stderr, torchrun's report): {log}", file=sys.stderr)
    return 130 if interrupted else 2 if user_error else code


_ERROR_LINE = re.compile(r"^(?:\[(?:rank|default)\d+\]:\s*)?error: (.+)$")
# An exception's last line, as Python prints it (torch prefixes a worker's with its rank): not an indented source line.
_EXCEPTION_LINE = re.compile(r"^(?:\[rank(\d+)\]: )?((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt)"
                             r"(?::.*)?)$")
_EXIT_LINE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
# What a rank raises when another one died first: a consequence, named only when nothing else was found.
_CONSEQUENCES = ("ChildFailedError", "Connection closed by peer", "Connection reset by peer", "Broken pipe")


def worker_error(log: str, code: int) -> tuple[str, bool]:
    """The one line that says why a torchrun launch failed, from its log, and whether it is a user error.

    First choice, the first worker's ``error:`` line (a mistake meshtrain explains, printed by ``main``); else
    the first exception a rank raised that is not the echo of another rank's death; else the signal or exit code
    torchrun reports."""
    exceptions, consequences = [], []
    for line in log.splitlines():
        if m := _ERROR_LINE.match(line):
            # two ranks writing at once can run their lines together: the first rank's line alone
            return re.split(r"\[(?:rank|default)\d+\]:", m.group(1))[0].strip(), True
        if m := _EXCEPTION_LINE.match(line):
            rank = f" (rank {m.group(1)})" if m.group(1) else ""
            (consequences if any(c in line for c in _CONSEQUENCES) else exceptions).append(m.group(2) + rank)
    if exceptions or consequences:
        return f"a training process failed: {(exceptions or consequences)[0]}", False
    if m := _EXIT_LINE.search(log):
        exit_code, rank = int(m.group(1)), m.group(2)
        if exit_code < 0:
            name = signal.Signals(-exit_code).name if -exit_code in signal.valid_signals() else str(-exit_code)
            return (f"local rank {rank} was killed by {name}"
                    f"{' (out of memory, or killed from outside)' if name == 'SIGKILL' else ''}"), False
        return f"local rank {rank} exited with code {exit_code}", False
    return f"torchrun exited with code {code}", False


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
    if not isinstance(meta.get("config"), dict):
        raise CheckpointError(f"{path / 'meta.json'} holds no model config (key 'config'): the checkpoint is "
                              f"incomplete or not meshtrain's; pass another --ckpt.")
    return path, meta, update_from_dict(Config(), meta["config"], str(path / "meta.json"))


def _generation_source(arg: str) -> tuple[Path, TensorSource | None, Config, Any, tuple[int, ...]]:
    """What ``generate --ckpt`` names: a meshtrain checkpoint (its folder, config and tokenizer; None: read with
    ``CheckpointReader``), or a HuggingFace model folder (``config.json`` and safetensors, with its
    ``tokenizer.json``), read through ``HFSource`` a rank's pieces at a time; and the ids that end a row (the
    tokenizer's end of text, or the HF folder's ``eos_token_id`` as transformers reads it)."""
    from meshtrain.config import TrainConfig
    from meshtrain.train.tokenizer import load_tokenizer

    path = Path(arg)
    if (path / "config.json").is_file() and not (path / "meta.json").exists():
        from meshtrain.model.hf import HFSource, hf_stop_ids

        source = HFSource(path)
        if not (path / "tokenizer.json").is_file():
            raise ConfigError(f"--ckpt {path} is a HuggingFace model folder without a tokenizer.json to encode the "
                              f"prompts with: copy the model's tokenizer.json into it.")
        tok = load_tokenizer(str(path / "tokenizer.json"))
        if tok.vocab_size > source.cfg.vocab_size:
            raise ConfigError(f"{path / 'tokenizer.json'} has {tok.vocab_size} tokens but the model's vocabulary is "
                              f"{source.cfg.vocab_size}: the tokenizer is not this model's.")
        m = source.cfg
        cfg = Config(model=m, train=TrainConfig(seq_len=min(TrainConfig.seq_len, m.max_seq_len)))
        return path, source, cfg, tok, hf_stop_ids(path, m.vocab_size) or (tok.eos_id,)
    path, meta, saved = _find_checkpoint(arg)
    if not meta.get("tokenizer"):
        raise CheckpointError(f"{path} was trained on synthetic data: there is no tokenizer to decode with.")
    tok = load_tokenizer(meta["tokenizer"], path)
    return path, None, saved, tok, (tok.eos_id,)


def _generate(argv: list[str]) -> int:
    ap = ArgumentParser(prog="meshtrain generate", description="Generate text from a checkpoint "
                                 "(KV cache, batched prompts; over --nproc N ranks, tensor parallel with parallel.tp "
                                 "and pipelined with parallel.pp; docs/generation.md).")
    ap.add_argument("--ckpt", required=True, help="a checkpoint folder (step_NNNNNN), a run folder (--out), or a "
                                                  "HuggingFace model folder with its tokenizer.json")
    ap.add_argument("--prompt", action="append", help="a prompt; repeat for a batch (default: 'def ')")
    ap.add_argument("--tokens", type=int, default=200, help="new tokens per prompt")
    ap.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 0.8)")
    ap.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens (0: all; default 40)")
    ap.add_argument("--greedy", action="store_true", help="the most likely token each step (temperature 0)")
    ap.add_argument("--seed", type=int, default=None, help="the sampling's seed (default 0)")
    ap.add_argument("--nproc", type=int, default=None, help="relaunch under torchrun with N ranks (tp x pp)")
    ap.add_argument("--stats", action="store_true", help="print tokens/s and KV cache bytes per rank (a last line)")
    ap.add_argument("overrides", nargs="*", help=f"generation options: {', '.join(_generate_options())}")
    args = ap.parse_intermixed_args(argv)

    from meshtrain.train.inference import check_generation, generation_config, load_for_generation, run_generation

    if args.nproc is not None and args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc}: launch at least 1 process (--nproc N, N >= 1).")
    if args.greedy and (given := [f"--{n.replace('_', '-')}" for n in ("temperature", "top_k", "seed")
                                  if getattr(args, n) is not None]):
        raise ConfigError(f"--greedy takes the most likely token, so {' and '.join(given)} would do nothing: give "
                          f"--greedy or the sampling options, not both.")
    if not args.ckpt.strip():  # an unset shell variable must not mean the current folder
        raise ConfigError("--ckpt is empty: give a checkpoint, run or HuggingFace model folder.")
    args.temperature = 0.8 if args.temperature is None else args.temperature
    args.top_k = 40 if args.top_k is None else args.top_k
    args.seed = 0 if args.seed is None else args.seed
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError(f"--temperature must be a number >= 0 (0 or --greedy: the most likely token), got "
                          f"{args.temperature}.")
    if args.top_k < 0:
        raise ConfigError(f"--top-k must be >= 0 (0: sample from every token), got {args.top_k}.")
    if args.seed < 0:  # as train.seed
        raise ConfigError(f"--seed must be >= 0, got {args.seed}.")
    path, source, saved, tok, stop_ids = _generation_source(args.ckpt)
    cfg = generation_config(saved, args.overrides)
    prompts = args.prompt or ["def "]
    # a HuggingFace model's prompts as transformers tokenizes them (Llama's beginning-of-text first); a meshtrain
    # run's as its data was prepared (no special tokens)
    ids = [tok.encode_prompt(p) if source is not None else tok.encode(p) for p in prompts]
    world = args.nproc or int(os.environ.get("WORLD_SIZE", "1"))
    check_generation(cfg, world, args.tokens)
    if args.nproc is not None and "LOCAL_RANK" not in os.environ:
        cmd = launch.torchrun_command(args.nproc, 0, None, ["generate", *_without_option(argv, "--nproc")])
        return _run_torchrun(cmd, None)
    gm = load_for_generation(cfg, path, source)
    del source  # an HF folder's source keeps the files it read mapped: not through the whole generation
    run = run_generation(gm, ids, args.tokens, 0.0 if args.greedy else args.temperature, args.top_k, args.seed,
                         stop_ids)
    from meshtrain import comm

    kv = comm.gather_objects(run.out.kv_bytes, gm.mesh.group("world")) if gm.mesh.world_size > 1 else [run.out.kv_bytes]
    if gm.mesh.rank == 0:
        print("\n---\n".join(p + tok.decode(t) for p, t in zip(prompts, run.out.tokens, strict=True)))
        if args.stats:
            print(f"generated {run.new_tokens} tokens ({len(prompts)} prompt(s)) in {run.seconds:.3f} s: "
                  f"{run.tokens_per_s:,.1f} tokens/s on tp={cfg.parallel.tp} pp={cfg.parallel.pp}; KV cache bytes "
                  f"per rank {', '.join(f'{b:,}' for b in kv)}")
    sys.stdout.flush()
    if gm.mesh.world_size > 1:  # an orderly shutdown, as a training worker's (see _train)
        comm.shutdown(gm.mesh.group("world"))
        sys.stderr.flush()
        os._exit(0)
    return 0


def sample_checkpoint(ckpt: str | Path, prompt: str, tokens: int, temperature: float = 0.8, top_k: int = 40,
                      seed: int = 0) -> str:
    """The text sampled after ``prompt`` from a checkpoint (a step_* folder or a run folder: its latest), on one
    process, whatever layout wrote it."""
    from meshtrain.generate import sample
    from meshtrain.model.llama import Llama
    from meshtrain.model.source import load_full
    from meshtrain.train.checkpoint import CheckpointReader
    from meshtrain.train.tokenizer import load_tokenizer

    path, meta, cfg = _find_checkpoint(str(ckpt))
    if not meta.get("tokenizer"):
        raise CheckpointError(f"{path} was trained on synthetic data: there is no tokenizer to decode with.")
    tok = load_tokenizer(meta["tokenizer"], path)
    model = Llama(cfg.model)
    load_full(model, CheckpointReader(path))
    ids = sample(model, tok.encode(prompt), tokens, cfg.train.seq_len, temperature, top_k, seed)
    return tok.decode(ids)


def _generate_options() -> tuple[str, ...]:
    from meshtrain.train.inference import GENERATE_OPTIONS

    return GENERATE_OPTIONS


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
    if not math.isfinite(value) or value < 1:
        raise ConfigError(f"--max-shard-size {text!r} must be a positive, finite size, e.g. 5GB.")
    return int(value)


def _convert(argv: list[str]) -> int:
    ap = ArgumentParser(prog="meshtrain convert",
                                 description="Export a checkpoint as a HuggingFace folder: LlamaForCausalLM, or "
                                             "Mixtral, Qwen2, Qwen3 or Qwen3-MoE where the model's options say "
                                             "(config.json + safetensors; docs/huggingface.md).")
    ap.add_argument("--ckpt", required=True, help="a checkpoint folder (step_NNNNNN) or a run folder (--out)")
    ap.add_argument("--out", required=True, help="the HF folder to write (must not exist, or be empty)")
    ap.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB, as HF)")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"),
                    help="the weights' dtype: fp32 (default, exact) or bf16/fp16 (half the bytes, as models ship)")
    args = ap.parse_args(argv)

    from meshtrain.model.hf import export_hf, hf_architecture, hf_model_type, init_from_extras
    from meshtrain.train.tokenizer import load_tokenizer

    max_bytes = _parse_size(args.max_shard_size)
    from meshtrain.train.paths import check_out_parent

    check_out_parent(args.out)
    path, meta, cfg = _find_checkpoint(args.ckpt)
    tokenizer_json = path / "tokenizer.json"
    files = [tokenizer_json] if tokenizer_json.is_file() else []
    eos = load_tokenizer(meta["tokenizer"], path).eos_id if meta.get("tokenizer") else None
    ids: dict = {}
    init = cfg.train.init_from
    # A fine-tune keeps its model's bos/eos ids and generation and chat settings, where its data spoke that model's
    # tokens: the model's own tokenizer.json, or no tokenizer (token ids as they are). Another tokenizer's ids
    # would be a stop token the model never learned, beside another tokenizer.
    ours = tokenizer_json.read_bytes() if tokenizer_json.is_file() else None
    theirs = Path(init, "tokenizer.json") if init else None
    same_tokens = meta.get("tokenizer") is None or (
        ours is not None and theirs is not None and theirs.is_file() and theirs.read_bytes() == ours)
    if init and Path(init).is_dir() and same_tokens:
        ids, extra = init_from_extras(init, cfg.model.vocab_size)
        files += [f for f in extra if f.name not in {p.name for p in files}]
    elif init:
        why = "is gone" if not Path(init).is_dir() else "has another tokenizer than the data this run trained on"
        print(f"note: train.init_from={init} {why}: its bos/eos ids and generation settings are not copied")
    out = export_hf(_checkpoint_source(path), cfg.model, args.out, max_bytes, files,
                    eos_token_id=ids.get("eos_token_id", eos), dtype=args.dtype, bos_token_id=ids.get("bos_token_id"))
    arch = hf_architecture(hf_model_type(cfg.model))
    print(f"wrote {out} ({arch}, {sum(1 for _ in out.glob('*.safetensors'))} safetensors file(s)"
          f"{''.join(', ' + f.name for f in files)}) from {path}")
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


def _demo(argv: list[str]) -> int:
    from meshtrain.demo import main

    return main(argv, launch=_train, sample=sample_checkpoint)


COMMANDS = {"train": _train, "prepare-data": _prepare, "generate": _generate, "convert": _convert,
            "schedule": _schedule, "plan": _plan, "demo": _demo}


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
    except KeyboardInterrupt:  # Ctrl-C: what was written is complete (atomic saves); no traceback to read
        print(f"\ninterrupted: meshtrain {argv[0]} stopped (Ctrl-C)", file=sys.stderr)
        return 130
    except (ConfigError, CheckpointError, NonFiniteError, CommError, OSError, ValueError, ImportError) as e:
        # User errors carry the option and the fix, a failed collective the ranks that did not arrive;
        # MESHTRAIN_DEBUG=1 shows the traceback too.
        message = _user_error(e, argv)
        if message is None or os.environ.get("MESHTRAIN_DEBUG"):
            raise
        if argv[0] in ("train", "generate") and "LOCAL_RANK" in os.environ:
            # A torchrun worker: its line goes to the launcher's log, marked with its rank as torch marks
            # tracebacks; the launcher prints it once. Leave now, as a finished worker does (see _train), so
            # that gloo's teardown cannot hang or abort it.
            print(f"[rank{os.environ.get('RANK', '?')}]: error: {message}", file=sys.stderr, flush=True)
            os._exit(2)
        print(f"error: {message}", file=sys.stderr)
        return 2


# Optional dependencies (pyproject.toml's extras): the module, its extra, and the option of each command needing it.
OPTIONAL = {"matplotlib": ("plot", {"schedule": "--png", "plan": "--plot"}),
            "tokenizers": ("tokenizers", {"train": "data.tokenizer", "prepare-data": "--tokenizer"}),
            "pyarrow": ("data", {"prepare-data": "--format parquet"}),
            "wandb": ("wandb", {"train": "train.wandb=true"})}


def _user_error(e: BaseException, argv: list[str]) -> str | None:
    """The one line for an error the user can fix, or None for a bug (whose traceback is the useful part)."""
    if isinstance(e, ImportError):
        module = (e.name or "").split(".")[0]
        if module in OPTIONAL:
            extra, options = OPTIONAL[module]
            what = " ".join(x for x in ("meshtrain", argv[0], options.get(argv[0])) if x)
            return (f"{what} needs {module}, which is not installed: pip install 'meshtrain[{extra}]' "
                    f"(or pip install {module}).")
        return str(e) if "pip install" in str(e) else None  # ours name their extra; others are bugs
    return str(e)


if __name__ == "__main__":
    sys.exit(main())
