"""The training loop: one optimizer step = a global batch, split into microbatches, then
clip -> AdamW -> log -> (validate, checkpoint).

The loss of a step is the mean over every token of the global batch: each microbatch adds
``sum of its token losses / tokens in the global batch``, so accumulation (and, later, data
parallelism) gives exactly the single-device mean.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from meshtrain import comm
from meshtrain.config import BYTE_VOCAB, Config, ConfigError, data_blend, save_config
from meshtrain.errors import NonFiniteError
from meshtrain.generate import sample
from meshtrain.mesh import Mesh, init_distributed
from meshtrain.model.hf import HFSource
from meshtrain.model.init import InitSource
from meshtrain.model.layers import document_ids
from meshtrain.model.llama import build_model
from meshtrain.model.source import tied_aliases
from meshtrain.parallel.parallelize import DTYPES, parallelize
from meshtrain.plan.flops import flops_per_token, mfu, param_count
from meshtrain.plan.hardware import peak_flops
from meshtrain.plan.validate import validate_layout
from meshtrain.train.blend import BlendedDataset
from meshtrain.train.checkpoint import (
    Checkpointer,
    CheckpointReader,
    latest_checkpoint,
    restore_rng,
    unreadable_checkpoints,
)
from meshtrain.train.data import (
    BatchAhead,
    SyntheticDataset,
    TokenDataset,
    read_meta,
    to_device,
)
from meshtrain.train.gc_schedule import GcClock, GcSchedule
from meshtrain.train.metrics import MetricsLogger, alloc_retries, import_wandb, peak_memory_bytes, retries_line
from meshtrain.train.optim import build_optimizer, clip_divisor, non_finite, optimizer_step, set_lr
from meshtrain.train.preflight import (
    RESUME_WITHOUT_OUT,
    check_checkpoint_model,
    check_compile,
    check_out_dir,
    check_tokenizer_option,
    check_vocab,
    no_checkpoint_to_resume,
    resolve_device,
    resolve_dtype,
    resolve_init_from,
    slow_dtype_warning,
    val_folder,
)
from meshtrain.train.prepare import ensure_prepared
from meshtrain.train.profiling import StepProfiler
from meshtrain.train.tokenizer import load_tokenizer
from meshtrain.train.unread_options import unread_options


def unigram_loss(probs: np.ndarray) -> float:
    """Entropy (nats/token) of the training data's unigram distribution (``token_probs()``): the loss of a model
    that ignores context. A language model must go well below it."""
    p = probs[probs > 0]
    return float(-(p * np.log(p)).sum())


class LocalBatch(NamedTuple):
    """This rank's part of a step's global batch, on its device (``Trainer.local_batch``)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    n_tokens: int  # the global batch's token count (the loss divides by it)
    docs: torch.Tensor | None  # the rows' document ids, whole sequences (train.attention_mask=document), or None


class Trainer:
    """Builds everything a run needs from a validated config, then trains."""

    def __init__(self, cfg: Config, out_dir: str | Path | None = None,
                 grad_hook: Callable[[int, Trainer], None] | None = None, notes: Sequence[str] = ()) -> None:
        """``grad_hook(step, trainer)``, if given, is called on every rank once a step's gradients are
        synchronised and before they are clipped and applied (equivalence tests gather them there). ``notes``:
        lines the log says first, from what resolved the config already (``resolve_init_from``'s, by the CLI)."""
        self.grad_hook = grad_hook
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        # torchrun's elastic restart (meshtrain train --max-restarts): the new workers go on from the latest
        # checkpoint, which is always complete and finite, so the run finishes as if never interrupted.
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if self.restart:
            cfg.train.resume = True
        replaced = resolve_init_from(cfg)
        validate_layout(cfg, world_size)  # before any process group starts
        check_out_dir(out_dir, before_launch=world_size == 1)  # alone, it can probe without leaving a folder
        if cfg.train.resume and out_dir is None:
            raise ConfigError(RESUME_WITHOUT_OUT)
        if cfg.train.wandb:
            import_wandb()  # before the process group and the model: a missing extra is one line, not a late failure
        self.cfg = cfg
        # What the run's log says first (rank 0): options it does not read, a fresh start despite resume, ...
        self.notes: list[str] = [*notes, *replaced, *unread_options(cfg)]
        self.out_dir = Path(out_dir) if out_dir else None
        t = cfg.train
        if t.threads:
            torch.set_num_threads(t.threads)
        self.device = resolve_device(t.device)
        asked, t.dtype = t.dtype, resolve_dtype(t.dtype, self.device)  # config.yaml records what runs
        if asked == "auto":
            self.notes.append(f"train.dtype=auto: {t.dtype} ({'native' if t.dtype == 'bf16' else 'no native bf16'} "
                              f"on this {self.device.type})")
        elif warning := slow_dtype_warning(t.dtype, self.device):
            self.notes.append(warning)
        check_compile(cfg, self.device)
        init_distributed("cpu" if self.device.type == "cpu" else "cuda", t.collective_timeout_s)
        # Before the first collective, on every rank: the timeout of every wait, the order check, a fresh log.
        comm.configure(t.collective_timeout_s, t.check_collective_order)
        self.mesh = Mesh.from_config(cfg, world_size, self.device)
        self.is_logger = self.mesh.rank == 0
        if asked == "auto":
            self._check_one_dtype()
        self.dtype = DTYPES[t.dtype]

        # Data: prepared token files (the stdlib by default) or a synthetic stream.
        if cfg.data.source == "synthetic":
            vocab = cfg.model.vocab_size or BYTE_VOCAB
            self.train_data = SyntheticDataset(vocab, "train")
            self.val_data = SyntheticDataset(vocab, "val")
            self.tokenizer = None
            self.data_dir = None
        else:
            prepared = self._prepare_data()
            if isinstance(prepared, list):  # a blend of prepared folders (data.path "W1 DIR1 W2 DIR2 ...")
                self.train_data = BlendedDataset(prepared, "train")
                self.val_data = BlendedDataset(prepared, "val")
            else:
                self.train_data = TokenDataset(prepared, "train")
                self.val_data = TokenDataset(prepared, "val")
            self.data_dir = self.train_data.path  # the tokenizer's folder (a blend's folders share one)
            if cfg.data.val_path:  # another prepared folder's held-out split
                self.val_data = TokenDataset(val_folder(cfg, self.train_data.meta), "val")
                self.notes.append(f"validation: {cfg.data.val_path}'s val split")
            if isinstance(self.train_data, BlendedDataset):
                self.notes.append(f"data: {self.train_data.describe()}")
            self.tokenizer = load_tokenizer(self.train_data.meta["tokenizer"], self.data_dir)
        check_vocab(cfg, self.train_data.vocab_size)
        if cfg.model.vocab_size == 0:
            cfg.model.vocab_size = self.train_data.vocab_size

        # A split too small for one sequence (e.g. prepared with val_fraction=0) means no validation.
        self.can_validate = self.val_data.can_sample(t.seq_len)
        # The plain model on the meta device (no storage), then every parallelism in one fixed order
        # (parallel/parallelize.py), which gives each rank storage for what it holds and nothing more.
        self.model = build_model(cfg.model, t.seed, self.device, meta=True)
        self.aliases = tied_aliases(self.model)
        self.shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()}
        self.parallel = parallelize(self.model, self.mesh, cfg)
        self.batches = BatchAhead(lambda step: self.local_batch(self.train_data, step))
        self.optimizer = build_optimizer(self.parallel.optim_params(), t)
        self.step = 0
        self.elements_read: int | None = None  # of the checkpoint resumed (None: a fresh start or init_from)
        self.bad_steps = 0  # consecutive skipped (non-finite) steps
        self.skipped_steps = 0  # in this session
        self.stop_requested = False  # SIGTERM: save at the next step boundary, then stop
        self.ckpt_root = self.out_dir / "checkpoints" if self.out_dir else None
        self.checkpointer = Checkpointer(self.ckpt_root, self.mesh.group("world"), self.mesh.rank, t.ckpt_keep,
                                         t.ckpt_async)
        trace = self.out_dir / "profile" / f"rank{self.mesh.rank:05d}.json.gz" if self.out_dir else None
        self.profiler = StepProfiler(t.profile_start, t.profile_steps, self.device, trace)
        # The steady step (as logged, after warm-up) whose bytes and time comm.json records for the run report and
        # `meshtrain plan --check-run`.
        self.timed_step = timed = min(3, t.steps)
        if t.profile_steps and t.profile_start <= timed < t.profile_start + t.profile_steps:
            self.notes.append(f"train.profile_start={t.profile_start}: the profiler's window holds step {timed}, the "
                              f"steady step the run report and `meshtrain plan --check-run` time, so their measured "
                              f"step time includes the profiler's overhead.")
        if self.checkpointer.removed:
            self.notes.append(f"removed {len(self.checkpointer.removed)} unfinished save(s) of an interrupted run "
                              f"from {self.ckpt_root}: {', '.join(p.name for p in self.checkpointer.removed)}")
        self._refuse_earlier_run()
        # Then the values, each rank reading only its boxes: from the latest checkpoint, or the seeded init.
        self._load_weights()
        self.flops_per_token = flops_per_token(cfg.model, t.seq_len)
        self.peak = t.peak_flops or peak_flops(self.device, self.dtype)

    # ------------------------------------------------------------------ setup helpers

    def _prepare_data(self) -> Path | list[tuple[float, Path]]:
        blend = data_blend(self.cfg.data.path)
        if blend is not None:  # folders prepared beforehand: nothing to prepare here
            return [(w, ensure_prepared(f)) for w, f in blend]
        # Rank 0 prepares the default corpus first so the others only read it.
        if self.mesh.rank == 0:
            path = ensure_prepared(self.cfg.data.path or None, self.cfg.data.tokenizer, self.cfg.data.val_fraction)
        comm.barrier(self.mesh.group("world"))
        if self.mesh.rank != 0:
            path = ensure_prepared(self.cfg.data.path or None, self.cfg.data.tokenizer, self.cfg.data.val_fraction)
        if self.cfg.data.path:  # as check_data does before a launch
            check_tokenizer_option(self.cfg.data.tokenizer, read_meta(path), path)
        return path

    def _check_one_dtype(self) -> None:
        """``train.dtype=auto`` resolves on each rank's own device: nodes that differ in native bf16 would train
        one model in two dtypes (their collectives' buffers would not even agree in size). One scalar at start-up,
        so every rank refuses together, naming the fix."""
        world = self.mesh.group("world")
        bf16 = comm.all_reduce_scalars([float(self.cfg.train.dtype == "bf16")], world, device=self.device)[0]
        if 0 < bf16 < world.size:
            raise ConfigError(f"train.dtype=auto chose bf16 on {bf16:.0f} of the {world.size} ranks and fp32 on the "
                              f"others (their machines differ in native bf16): set train.dtype=fp32 or bf16 for "
                              f"every node.")

    def _refuse_earlier_run(self) -> None:
        if self.ckpt_root is None or self.cfg.train.resume:
            return
        if latest_checkpoint(self.ckpt_root) is not None:
            raise ConfigError(
                f"--out {self.out_dir} already holds checkpoints of an earlier run: pass train.resume=true to "
                f"continue it, or choose another --out."
            )

    def _load_weights(self) -> None:
        t = self.cfg.train
        path = latest_checkpoint(self.ckpt_root) if t.resume else None
        if t.resume:
            self._same_checkpoint_everywhere(path)
        if t.resume and (unreadable := unreadable_checkpoints(self.ckpt_root)):
            self.notes.append(f"passed over {', '.join(p.name for p in unreadable)}: meta.json does not read (a "
                              f"crash while saving?); resuming from {path.name if path else 'the start'}")
        if t.resume and path is None:
            if t.resume_required:
                raise ConfigError(no_checkpoint_to_resume(self.ckpt_root))
            # Said plainly: a mistyped --out would otherwise throw a run's progress away without a word.
            self.notes.append(f"train.resume=true: no checkpoint in {self.ckpt_root}, so this run starts fresh from "
                              f"{'train.init_from' if t.init_from else 'step 0'} (train.resume_required=true makes "
                              f"this an error)")
        if path is None and t.init_from:  # fine-tuning: each rank reads its pieces of the HF weights
            self.parallel.load_state(self.optimizer, HFSource(t.init_from), what=t.init_from)
            return
        if path is None:  # a fresh start (so a restarted job can always pass resume=true)
            self.parallel.load_state(self.optimizer, InitSource(self.cfg.model, t.seed, self.shapes))
            return
        reader = CheckpointReader(path)
        check_checkpoint_model(self.cfg.model, reader)
        self.parallel.load_state(self.optimizer, reader, reader.optimizer_keys(), what=str(path))
        restore_rng(path)
        self.step = int(reader.meta["step"])
        # The reader's index of every saved box grows with the world size that wrote it: not kept past the load.
        self.elements_read = reader.elements_read

    def _same_checkpoint_everywhere(self, path: Path | None) -> None:
        """Every rank chose ``path`` on its own view of the folder: a shared filesystem whose nodes disagree (a
        listing cached on one) would resume ranks from different steps, a mixed model. Two scalars to compare."""
        step = float(int(path.name.split("_")[1]) if path is not None else -1)
        high, neg_low = comm.all_reduce_scalars([step, -step], self.mesh.group("world"), op="max", device=self.device)
        if high != -neg_low:
            raise ConfigError(f"the ranks see different latest checkpoints in {self.ckpt_root} (steps "
                              f"{-neg_low:.0f} to {high:.0f}; -1: none): the nodes' views of the shared folder "
                              f"disagree. Wait for the filesystem to settle, or remove the newer step folder.")

    # ------------------------------------------------------------------ the step

    def local_batch(self, data, step: int) -> LocalBatch:
        """This rank's part of the global batch of ``step``, on its device, and the global batch's token count
        (and, with ``train.attention_mask=document``, the document ids of its rows, from their tokens: under
        context parallelism every rank needs those of the whole sequence). The rank reads only its rows."""
        t = self.cfg.train
        inputs, targets = data.batch(t.seed, step, t.global_batch, t.seq_len,
                                     rows=self.parallel.batch_rows(t.global_batch))
        # A batch of prompts only (records with a prompt field) learns nothing: a loss of 0, not 0 / 0.
        n_tokens = max(data.target_count(t.seed, step, t.global_batch, t.seq_len), 1)
        docs = document_ids(inputs, data.eos_id) if t.attention_mask == "document" else None
        if docs is None and 0 < self.cfg.model.sliding_window < t.seq_len:  # one document: the window's mask alone,
            docs = torch.zeros(inputs.shape, dtype=torch.int32)  # built once per forward (layers.Documents)
        inputs, targets, docs = self.parallel.shard_batch(inputs, targets, docs)
        return LocalBatch(to_device(inputs, self.device), to_device(targets, self.device), n_tokens,
                          to_device(docs, self.device) if docs is not None else None)

    def train_step(self, step: int) -> dict[str, Any]:
        """One optimizer step on the global batch of ``step``; returns its metrics."""
        t = self.cfg.train
        inputs, targets, n_tokens, docs = self.batches.get(step)
        loss = self.parallel.forward_backward(inputs, targets, n_tokens, docs)
        self.parallel.sync_grads()
        if self.grad_hook is not None:
            self.grad_hook(step, self)
        norm = self.parallel.grad_norm()
        lr = set_lr(self.optimizer, step, t)
        self.checkpointer.wait_for_reads()  # an async save may still be reading what the step changes
        # The clip and the non-finite skip are decided on the device, inside the optimizer's kernel: nothing
        # non-finite reaches the weights or the optimizer state, and the host reads nothing before queueing it.
        optimizer_step(self.optimizer, clip_divisor(norm, t.grad_clip), non_finite(loss, norm))
        if step + 1 < t.steps:
            self.batches.ahead(step + 1)  # the host builds the next batch while the device runs this step
        # The step's one host read, with the whole step queued, so a GPU never waits for the host.
        # Loss and norm are global (reduced over every rank), so every rank takes the same branch.
        loss, norm = torch.stack([loss.double(), norm.double()]).tolist()
        if not (math.isfinite(loss) and math.isfinite(norm)):
            self.parallel.skip_step()  # the optimizer changed nothing; drop the gradients (and MoE's counts)
            return {"loss": loss, "lr": lr, "grad_norm": norm, "skipped": True}
        routing = self.parallel.after_optimizer_step()
        return {"loss": loss, "lr": lr, "grad_norm": norm, **routing}

    def evaluate(self) -> float:
        """Mean token loss on the same ``eval_batches`` validation batches every time (in the
        microbatches of training, so it needs no more memory)."""
        total, count = 0.0, 0
        for i in range(self.cfg.train.eval_batches):
            inputs, targets, _, docs = self.local_batch(self.val_data, i)
            s, c = self.parallel.evaluate(inputs, targets, docs)
            total, count = total + s, count + c
        return total / max(count, 1)  # max: validation batches of prompts only (records with a prompt field)

    def save(self) -> Path | None:
        """Write a checkpoint of the current step (collective: each rank writes the boxes it holds)."""
        if self.ckpt_root is None:
            return None
        self._check_finite_state()
        files = [self.data_dir / "tokenizer.json"] if self.data_dir and (self.data_dir / "tokenizer.json").exists() \
            else []
        meta = {"config": self.cfg.to_dict(), "tokenizer": self.tokenizer.name if self.tokenizer else None,
                "tokens_seen": self.step * self.cfg.train.global_batch * self.cfg.train.seq_len,
                "aliases": self.aliases}
        return self.checkpointer.save(self.step, self.parallel.local_state(self.optimizer), meta, files)

    def _check_finite_state(self) -> None:
        """Refuse to save non-finite parameters or optimizer state (collective: every rank learns of any)."""
        mine = [h.key for h in self.parallel.local_state(self.optimizer) if not bool(torch.isfinite(h.tensor).all())]
        world = self.mesh.group("world")
        if comm.all_reduce_scalars([float(len(mine))], world, device=self.device)[0] == 0:
            return  # the usual case: one scalar, not a list per rank
        everyone = comm.gather_objects(mine[:3], world)
        bad = [(rank, keys) for rank, keys in enumerate(everyone) if keys]
        if bad:
            where = "; ".join(f"rank {r}: {', '.join(k)}" for r, k in bad)
            raise NonFiniteError(f"step {self.step}: the model state is not finite ({where}): no checkpoint was "
                                 f"written, so the last one stays good: resume from it (train.resume=true) with a "
                                 f"lower train.lr (now {self.cfg.train.lr:g}).")

    def _after_bad_step(self, rec: dict[str, Any], log: MetricsLogger) -> None:
        """Count a skipped step; stop with one line after train.max_bad_steps in a row."""
        t = self.cfg.train
        self.bad_steps += 1
        self.skipped_steps += 1
        if self.is_logger:
            log.write(f"step {self.step}: loss {rec['loss']:.4g}, grad norm {rec['grad_norm']:.4g}: not applied "
                      f"({self.bad_steps} in a row of train.max_bad_steps={t.max_bad_steps})")
        if self.bad_steps < t.max_bad_steps:
            return
        self.checkpointer.wait()
        last = latest_checkpoint(self.ckpt_root) if self.ckpt_root is not None else None
        advice = (f"resume from {last} (train.resume=true) with a lower train.lr" if last is not None
                  else "start again with a lower train.lr")
        raise NonFiniteError(f"step {self.step}: {self.bad_steps} steps in a row had a non-finite loss or gradient "
                             f"norm (loss {rec['loss']:.4g}, grad norm {rec['grad_norm']:.4g}; train.max_bad_steps="
                             f"{t.max_bad_steps}). None was applied or saved: {advice} (now {t.lr:g}, e.g. "
                             f"train.lr={t.lr / 10:g}).")

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self.stop_requested = True  # acted on at the next step boundary (a signal handler must not do collectives)

    def _stop_now(self) -> bool:
        """Whether any rank was asked to stop (SIGTERM): every rank must agree before saving collectively."""
        return comm.all_reduce_scalars([float(self.stop_requested)], self.mesh.group("world"),
                                       device=self.device)[0] > 0

    # ------------------------------------------------------------------ the loop

    def train(self, until: int | None = None) -> list[dict[str, Any]]:
        """Run from the current step to ``train.steps`` (or stop early after step ``until``, as an
        interrupted job would); returns every step's metrics record."""
        cfg, t = self.cfg, self.cfg.train
        if self.is_logger:  # before the run folder is made: a bad counts file leaves none behind
            self.baseline = math.log(cfg.model.vocab_size) if isinstance(self.train_data, SyntheticDataset) \
                else unigram_loss(self.train_data.token_probs())
        if self.out_dir is not None and self.is_logger:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.out_dir / "config.yaml")
        log = MetricsLogger(self.out_dir, t.steps, self.step, enabled=self.is_logger, progress=t.progress,
                            tensorboard=t.tensorboard, wandb_project=t.wandb_project if t.wandb else None,
                            run_config=dataclasses.asdict(cfg))
        tokens_per_step = t.global_batch * t.seq_len
        if self.is_logger:
            for note in self.notes:
                log.write(note)
            n = param_count(cfg.model)
            base = self.baseline
            if self.parallel.log_lines():
                log.write(self.parallel.log_lines())
            if not self.can_validate:
                log.write("the validation split is too small for one sequence: no validation loss.")
            if self.restart:
                log.write(f"restart {self.restart}: resumed at step {self.step} from the latest checkpoint.")
            log.write(f"meshtrain: {n.total / 1e6:.2f}M parameters, {tokens_per_step} tokens/step, "
                      f"mesh {self.mesh.describe()}, dtype {t.dtype}"
                      f"{', attention within documents' if t.attention_mask == 'document' else ''}; "
                      f"unigram baseline loss {base:.3f}")
        records = []
        retried, warned = alloc_retries(self.device), False  # None off CUDA
        # A scheduler's preemption (SIGTERM): finish the step, save, stop cleanly (only the main thread may
        # install a handler; a Trainer driven from another thread keeps the default).
        previous = signal.signal(signal.SIGTERM, self._on_sigterm) \
            if threading.current_thread() is threading.main_thread() else None
        collector = contextlib.ExitStack()  # Python's garbage collector: when it runs (train.gc_every), what it took
        gc_schedule, gc_clock = collector.enter_context(GcSchedule(t.gc_every)), collector.enter_context(GcClock())
        try:
            while self.step < min(t.steps, until or t.steps):
                start = time.perf_counter()
                gc_clock.take()  # from here: what the collector takes in this step
                measure = self.step + 1 == self.timed_step
                if measure:
                    comm.METER.reset()
                waited = comm.METER.seconds()
                with self.profiler.step(self.step + 1):
                    rec = self.train_step(self.step)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                gc_schedule.after_step(self.step + 1)  # inside the step's time: every rank pays it at this step
                elapsed = time.perf_counter() - start
                gc_ms = gc_clock.take()[0]
                comm_wait = comm.METER.seconds() - waited  # this rank blocked in collectives (the run report)
                if measure:
                    self._record_comm(elapsed, comm_wait)
                self.step += 1
                tps = tokens_per_step / elapsed
                rec = {"step": self.step, **rec, "tokens_per_s": tps,
                       "mfu": mfu(tps / self.mesh.world_size, cfg.model, t.seq_len, self.peak),
                       "step_time_s": elapsed, "comm_wait_s": comm_wait,
                       "peak_mem_bytes": peak_memory_bytes(self.device), "gc_ms": gc_ms}
                if retried is not None:  # CUDA: the allocator's retries in this step, each a device-wide sync
                    now = alloc_retries(self.device)
                    rec["alloc_retries"], retried = now - retried, now
                    if rec["alloc_retries"] and not warned and self.is_logger:
                        log.write(retries_line(self.step, rec["alloc_retries"]))
                        warned = True
                last = self.step == t.steps
                if self.can_validate and ((t.eval_every and self.step % t.eval_every == 0) or last):
                    rec["val_loss"] = self.evaluate()
                rec["skipped_steps"] = self.skipped_steps + bool(rec.get("skipped"))
                if not records and self.is_logger:  # once: what the report's loss curve is measured against
                    rec["unigram_loss"] = self.baseline
                if self.step % t.log_every == 0 or last or "val_loss" in rec or rec.get("skipped"):
                    log.log(rec)
                profiled = self.profiler.take_summary()
                if profiled and self.is_logger:
                    log.write(profiled)
                records.append(rec)
                if rec.get("skipped"):
                    self._after_bad_step(rec, log)
                else:
                    self.bad_steps = 0
                stop = self._stop_now()
                # No periodic save in a streak of skipped steps: the state has not changed, and the save would
                # push an older checkpoint out of retention (train.ckpt_keep).
                if (t.ckpt_every and self.step % t.ckpt_every == 0 and not self.bad_steps) or last or stop:
                    self.save()
                if stop:
                    if self.is_logger:
                        log.write(f"SIGTERM: stopped after step {self.step} with its checkpoint saved; run again "
                                  f"with train.resume=true to continue.")
                    break
            if self.is_logger and records and self.step == t.steps:
                last_rec = records[-1]
                log.write(f"done: step {self.step}, loss {last_rec['loss']:.4f}, "
                          f"val_loss {last_rec.get('val_loss', float('nan')):.4f} "
                          f"(unigram baseline {self.baseline:.3f}), "
                          f"{np.median([r['tokens_per_s'] for r in records]):,.0f} tokens/s, "
                          f"MFU {np.median([r['mfu'] for r in records]):.1%}")
                if "expert_load" in last_rec:  # tokens routed to each expert in the last step, per layer
                    log.write(f"experts: last step's tokens per expert by layer {last_rec['expert_load']}, "
                              f"busiest/mean {last_rec['moe_imbalance']:.2f}, aux loss {last_rec['aux_loss']:.4f}"
                              + (f", z-loss {last_rec['z_loss']:.4f}" if "z_loss" in last_rec else ""))
            if self.step == t.steps and t.sample_tokens and self.tokenizer is not None and \
                    self.parallel.sampler() is None:
                log.write("(no sample under pipeline or context parallelism, or ZeRO-3, where every token would "
                          "gather the weights: run `meshtrain generate --ckpt` on the checkpoint)")
            elif self.step == t.steps and t.sample_tokens and self.tokenizer is not None:
                # Every rank samples the same tokens (sharded weights are gathered collectively).
                text = self.generate(t.sample_prompt, t.sample_tokens)
                log.write("sample:\n" + t.sample_prompt + text)
        finally:
            collector.close()
            log.close()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        self.checkpointer.wait()  # the last save is on disk (and, on rank 0, committed) before train returns
        return records

    def _record_comm(self, step_s: float, wait_s: float) -> None:
        """Write ``comm.json``: every rank's collective bytes (per axis and op) of one training step and
        the calls behind them (``plan/comm_bytes.py::collective_calls``), and
        its live parameter/gradient/optimizer bytes, for ``meshtrain plan --check-run``; and, for the run
        report, the step's seconds and the seconds this rank was blocked in each (axis, op)."""
        snap = comm.METER.snapshot()
        mine = {
            "rank": self.mesh.rank, "coords": {k: int(v) for k, v in self.mesh.coords.items()},
            "bytes": {f"{axis}/{op}": v["bytes"] for axis, ops in snap.items() for op, v in ops.items()
                      if op != "metrics"},
            "calls": {f"{axis}/{op}": v["calls"] for axis, ops in snap.items() for op, v in ops.items()
                      if op != "metrics"},
            "wait_s": {f"{axis}/{op}": v["seconds"] for axis, ops in snap.items() for op, v in ops.items()},
            "step_time_s": step_s, "comm_wait_s": wait_s,
            "state": self.parallel.state_bytes(self.optimizer),
        }
        everyone = comm.gather_objects_to_first(mine, self.mesh.group("world"))  # rank 0's list alone grows with N
        if self.out_dir is not None and everyone is not None:
            import json

            (self.out_dir / "comm.json").write_text(json.dumps({"step": self.step + 1, "ranks": everyone}, indent=1))

    def generate(self, prompt: str, n_tokens: int, temperature: float = 0.8, top_k: int = 40) -> str:
        logits_fn, pad = self.parallel.sampler()
        ids = sample(self.model, self.tokenizer.encode(prompt), n_tokens, self.cfg.train.seq_len,
                     temperature=temperature, top_k=top_k, seed=self.cfg.train.seed, logits_fn=logits_fn,
                     pad_multiple=pad)
        return self.tokenizer.decode(ids)
