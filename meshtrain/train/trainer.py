"""The training loop: one optimizer step = a global batch, split into microbatches, then
clip -> AdamW -> log -> (validate, checkpoint).

The loss of a step is the mean over every token of the global batch: each microbatch adds
``sum of its token losses / tokens in the global batch``, so accumulation (and, later, data
parallelism) gives exactly the single-device mean.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshtrain import comm
from meshtrain.config import Config, ConfigError, save_config
from meshtrain.generate import sample
from meshtrain.mesh import Mesh, init_distributed
from meshtrain.model.hf import HFSource
from meshtrain.model.llama import InitSource, Llama, build_model
from meshtrain.model.source import tied_aliases
from meshtrain.parallel.parallelize import DTYPES, parallelize
from meshtrain.plan.flops import flops_per_token, mfu, param_count
from meshtrain.plan.hardware import peak_flops
from meshtrain.plan.validate import validate_layout
from meshtrain.train.checkpoint import Checkpointer, CheckpointError, CheckpointReader, latest_checkpoint, restore_rng
from meshtrain.train.data import SyntheticDataset, TokenDataset
from meshtrain.train.metrics import MetricsLogger, peak_memory_bytes
from meshtrain.train.optim import build_optimizer, set_lr
from meshtrain.train.prepare import ensure_prepared
from meshtrain.train.tokenizer import load_tokenizer


def resolve_device(kind: str) -> torch.device:
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible: use train.device=cpu or auto.")
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def resolve_init_from(cfg: Config) -> None:
    """With ``train.init_from=HF_DIR``, replace the model section by the folder's config.json (checking the
    folder: architecture, shards, shapes; one-line errors). Call before validating the layout."""
    if cfg.train.init_from:
        cfg.model = HFSource(cfg.train.init_from).cfg


def check_before_launch(cfg: Config, out_dir: str | Path | None, world_size: int) -> None:
    """What can be refused before any process starts, with one clear line each: the HF folder of
    ``train.init_from``, the layout, and with ``train.resume`` the latest checkpoint (its format, and its
    tensors' shapes against the model config)."""
    resolve_init_from(cfg)
    validate_layout(cfg, world_size)
    root = Path(out_dir) / "checkpoints" if out_dir else None
    path = latest_checkpoint(root) if root is not None else None
    if path is None:
        return
    if not cfg.train.resume:
        raise ConfigError(f"--out {out_dir} already holds checkpoints of an earlier run: pass train.resume=true to "
                          f"continue it, or choose another --out.")
    reader = CheckpointReader(path)
    reader.verify()
    model = cfg.model
    if model.vocab_size == 0:  # taken from the data: compare with what the checkpoint's run took
        model = dataclasses.replace(model, vocab_size=int(reader.shape("tok_embeddings.weight")[0]))
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in Llama(model).named_parameters()}
    for name, shape in shapes.items():
        saved = reader.shape(name)
        if saved is None:
            raise CheckpointError(f"{path} has no tensor {name}: it was written for another model (model.* differs "
                                  f"from its meta.json).")
        if tuple(saved) != shape:
            raise CheckpointError(f"{path}: {name} has shape {tuple(saved)} in the checkpoint but {shape} with this "
                                  f"config: set the model section as in the checkpoint's meta.json.")


def unigram_loss(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats/token) of the training data's unigram distribution: the loss of a model that
    ignores context. A language model must go well below it."""
    counts = np.bincount(np.asarray(tokens), minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


class Trainer:
    """Builds everything a run needs from a validated config, then trains."""

    def __init__(self, cfg: Config, out_dir: str | Path | None = None,
                 grad_hook: Callable[[int, Trainer], None] | None = None) -> None:
        """``grad_hook(step, trainer)``, if given, is called on every rank once a step's gradients are
        synchronised and before they are clipped and applied (equivalence tests gather them there)."""
        self.grad_hook = grad_hook
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        resolve_init_from(cfg)
        validate_layout(cfg, world_size)  # before any process group starts
        self.cfg = cfg
        self.out_dir = Path(out_dir) if out_dir else None
        t = cfg.train
        if t.threads:
            torch.set_num_threads(t.threads)
        self.device = resolve_device(t.device)
        init_distributed("cpu" if self.device.type == "cpu" else "cuda", t.collective_timeout_s)
        # Before the first collective, on every rank: the timeout of every wait, the order check, a fresh log.
        comm.configure(t.collective_timeout_s, t.check_collective_order)
        p = cfg.parallel
        self.mesh = Mesh(pp=p.pp, dp=world_size // (p.pp * p.cp * p.tp), cp=p.cp, tp=p.tp, ep=p.ep,
                         dp_shard=p.dp_shard, device=self.device, timeout_s=t.collective_timeout_s)
        self.is_logger = self.mesh.rank == 0
        self.dtype = DTYPES[t.dtype]

        # Data: prepared token files (the stdlib by default) or a synthetic stream.
        if cfg.data.source == "synthetic":
            vocab = cfg.model.vocab_size or 257
            self.train_data = SyntheticDataset(vocab, "train")
            self.val_data = SyntheticDataset(vocab, "val")
            self.tokenizer = None
            self.data_dir = None
        else:
            self.data_dir = self._prepare_data()
            self.train_data = TokenDataset(self.data_dir, "train")
            self.val_data = TokenDataset(self.data_dir, "val")
            self.tokenizer = load_tokenizer(self.train_data.meta["tokenizer"], self.data_dir)
        if cfg.model.vocab_size == 0:
            cfg.model.vocab_size = self.train_data.vocab_size
        elif cfg.model.vocab_size < self.train_data.vocab_size:
            raise ConfigError(
                f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                f"{self.train_data.vocab_size} ids: set model.vocab_size=0 to take it from the data."
            )

        # A split too small for one sequence (e.g. prepared with val_fraction=0) means no validation.
        self.can_validate = self.val_data.num_tokens >= t.seq_len + 2
        # The plain model on the meta device (no storage), then every parallelism in one fixed order
        # (parallel/parallelize.py), which gives each rank storage for what it holds and nothing more.
        self.model = build_model(cfg.model, t.seed, self.device, meta=True)
        self.aliases = tied_aliases(self.model)
        self.shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()}
        self.parallel = parallelize(self.model, self.mesh, cfg)
        self.optimizer = build_optimizer(self.parallel.optim_params(), t)
        self.step = 0
        self.ckpt_root = self.out_dir / "checkpoints" if self.out_dir else None
        self.checkpointer = Checkpointer(self.ckpt_root, self.mesh.group("world"), self.mesh.rank, t.ckpt_keep,
                                         t.ckpt_async)
        self._check_out_dir()
        # Then the values, each rank reading only its boxes: from the latest checkpoint, or the seeded init.
        self._load_weights()
        self.flops_per_token = flops_per_token(cfg.model, t.seq_len)
        self.peak = t.peak_flops or peak_flops(self.device, self.dtype)

    # ------------------------------------------------------------------ setup helpers

    def _prepare_data(self) -> Path:
        # Rank 0 prepares the default corpus first so the others only read it.
        if self.mesh.rank == 0:
            path = ensure_prepared(self.cfg.data.path or None, self.cfg.data.tokenizer, self.cfg.data.val_fraction)
        comm.barrier(self.mesh.group("world"))
        if self.mesh.rank != 0:
            path = ensure_prepared(self.cfg.data.path or None, self.cfg.data.tokenizer, self.cfg.data.val_fraction)
        return path

    def _check_out_dir(self) -> None:
        if self.ckpt_root is None or self.cfg.train.resume:
            return
        if latest_checkpoint(self.ckpt_root) is not None:
            raise ConfigError(
                f"--out {self.out_dir} already holds checkpoints of an earlier run: pass train.resume=true to "
                f"continue it, or choose another --out."
            )

    def _load_weights(self) -> None:
        t = self.cfg.train
        if t.resume and self.ckpt_root is None:
            raise ConfigError("train.resume=true needs --out DIR (where the checkpoints are).")
        path = latest_checkpoint(self.ckpt_root) if t.resume else None
        if path is None and t.init_from:  # fine-tuning: each rank reads its pieces of the HF weights
            self.weights = HFSource(t.init_from)
            self.parallel.load_state(self.optimizer, self.weights, what=t.init_from)
            return
        if path is None:  # a fresh start (so a restarted job can always pass resume=true)
            self.weights = InitSource(self.cfg.model, t.seed, self.shapes)
            self.parallel.load_state(self.optimizer, self.weights)
            return
        self.weights = CheckpointReader(path)
        self.parallel.load_state(self.optimizer, self.weights, self.weights.optimizer_keys(), what=str(path))
        restore_rng(path)
        self.step = int(self.weights.meta["step"])

    # ------------------------------------------------------------------ the step

    def local_batch(self, data, step: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """This rank's part of the global batch of ``step``, and the global batch's token count."""
        t = self.cfg.train
        inputs, targets = data.batch(t.seed, step, t.global_batch, t.seq_len)
        n_tokens = int((targets != -100).sum())
        return (*self.parallel.shard_batch(inputs, targets), n_tokens)

    def train_step(self, step: int) -> dict[str, Any]:
        """One optimizer step on the global batch of ``step``; returns its metrics."""
        t = self.cfg.train
        inputs, targets, n_tokens = self.local_batch(self.train_data, step)
        loss = self.parallel.forward_backward(inputs, targets, n_tokens)
        self.parallel.sync_grads()
        if self.grad_hook is not None:
            self.grad_hook(step, self)
        norm = self.parallel.clip_grads(t.grad_clip)
        lr = set_lr(self.optimizer, step, t)
        self.checkpointer.wait_for_reads()  # an async save may still be reading what the step changes
        self.optimizer.step()
        routing = self.parallel.after_optimizer_step()
        return {"loss": loss, "lr": lr, "grad_norm": norm, **routing}

    def evaluate(self) -> float:
        """Mean token loss on the same ``eval_batches`` validation batches every time (in the
        microbatches of training, so it needs no more memory)."""
        total, count = 0.0, 0
        for i in range(self.cfg.train.eval_batches):
            inputs, targets, _ = self.local_batch(self.val_data, i)
            s, c = self.parallel.evaluate(inputs, targets)
            total, count = total + s, count + c
        return total / count

    def save(self) -> Path | None:
        """Write a checkpoint of the current step (collective: each rank writes the boxes it holds)."""
        if self.ckpt_root is None:
            return None
        files = [self.data_dir / "tokenizer.json"] if self.data_dir and (self.data_dir / "tokenizer.json").exists() \
            else []
        meta = {"config": self.cfg.to_dict(), "tokenizer": self.tokenizer.name if self.tokenizer else None,
                "tokens_seen": self.step * self.cfg.train.global_batch * self.cfg.train.seq_len,
                "aliases": self.aliases}
        return self.checkpointer.save(self.step, self.parallel.local_state(self.optimizer), meta, files)

    # ------------------------------------------------------------------ the loop

    def train(self, until: int | None = None) -> list[dict[str, Any]]:
        """Run from the current step to ``train.steps`` (or stop early after step ``until``, as an
        interrupted job would); returns every step's metrics record."""
        cfg, t = self.cfg, self.cfg.train
        if self.out_dir is not None and self.is_logger:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.out_dir / "config.yaml")
        log = MetricsLogger(self.out_dir, t.steps, self.step, enabled=self.is_logger, progress=t.progress,
                            tensorboard=t.tensorboard)
        tokens_per_step = t.global_batch * t.seq_len
        if self.is_logger:
            n = param_count(cfg.model)
            base = unigram_loss(self.train_data._tokens, cfg.model.vocab_size) \
                if isinstance(self.train_data, TokenDataset) else math.log(cfg.model.vocab_size)
            self.baseline = base
            if self.parallel.log_lines():
                log.write(self.parallel.log_lines())
            if not self.can_validate:
                log.write("the validation split is too small for one sequence: no validation loss.")
            log.write(f"meshtrain: {n.total / 1e6:.2f}M parameters, {tokens_per_step} tokens/step, "
                      f"mesh {self.mesh.describe()}, dtype {t.dtype}; unigram baseline loss {base:.3f}")
        records = []
        try:
            while self.step < min(t.steps, until or t.steps):
                start = time.perf_counter()
                measure = self.step == min(2, t.steps - 1)  # a steady-state step (after warm-up)
                if measure:
                    comm.METER.reset()
                rec = self.train_step(self.step)
                if measure:
                    self._record_comm()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                elapsed = time.perf_counter() - start
                self.step += 1
                tps = tokens_per_step / elapsed
                rec = {"step": self.step, **rec, "tokens_per_s": tps,
                       "mfu": mfu(tps / self.mesh.world_size, cfg.model, t.seq_len, self.peak),
                       "step_time_s": elapsed, "peak_mem_bytes": peak_memory_bytes(self.device)}
                last = self.step == t.steps
                if self.can_validate and ((t.eval_every and self.step % t.eval_every == 0) or last):
                    rec["val_loss"] = self.evaluate()
                if not math.isfinite(rec["loss"]):
                    raise FloatingPointError(f"loss is {rec['loss']} at step {self.step}: lower train.lr.")
                if self.step % t.log_every == 0 or last or "val_loss" in rec:
                    log.log(rec)
                records.append(rec)
                if (t.ckpt_every and self.step % t.ckpt_every == 0) or last:
                    self.save()
            if self.is_logger and records and self.step == t.steps:
                last_rec = records[-1]
                log.write(f"done: step {self.step}, loss {last_rec['loss']:.4f}, "
                          f"val_loss {last_rec.get('val_loss', float('nan')):.4f} "
                          f"(unigram baseline {self.baseline:.3f}), "
                          f"{np.median([r['tokens_per_s'] for r in records]):,.0f} tokens/s, "
                          f"MFU {np.median([r['mfu'] for r in records]):.1%}")
                if "expert_load" in last_rec:  # tokens routed to each expert in the last step, per layer
                    log.write(f"experts: last step's tokens per expert by layer {last_rec['expert_load']}, "
                              f"busiest/mean {last_rec['moe_imbalance']:.2f}, aux loss {last_rec['aux_loss']:.4f}")
            if self.step == t.steps and t.sample_tokens and self.tokenizer is not None and \
                    self.parallel.sampler() is None:
                log.write("(no sample under pipeline or context parallelism: run `meshtrain generate --ckpt` on the "
                          "checkpoint)")
            elif self.step == t.steps and t.sample_tokens and self.tokenizer is not None:
                # Every rank samples the same tokens (sharded weights are gathered collectively).
                text = self.generate(t.sample_prompt, t.sample_tokens)
                log.write("sample:\n" + t.sample_prompt + text)
        finally:
            log.close()
        self.checkpointer.wait()  # the last save is on disk (and, on rank 0, committed) before train returns
        return records

    def _record_comm(self) -> None:
        """Write ``comm.json``: every rank's collective bytes (per axis and op) of one training step and
        its live parameter/gradient/optimizer bytes, for ``meshtrain plan --check-run``."""
        mine = {
            "rank": self.mesh.rank, "coords": {k: int(v) for k, v in self.mesh.coords.items()},
            "bytes": {f"{axis}/{op}": v["bytes"] for axis, ops in comm.METER.snapshot().items()
                      for op, v in ops.items() if op != "metrics"},
            "state": self.parallel.state_bytes(self.optimizer),
        }
        everyone = comm.gather_objects(mine, self.mesh.group("world"))
        if self.out_dir is not None and self.is_logger:
            import json

            (self.out_dir / "comm.json").write_text(json.dumps({"step": self.step + 1, "ranks": everyone}, indent=1))

    def generate(self, prompt: str, n_tokens: int, temperature: float = 0.8, top_k: int = 40) -> str:
        logits_fn, pad = self.parallel.sampler()
        ids = sample(self.model, self.tokenizer.encode(prompt), n_tokens, self.cfg.train.seq_len,
                     temperature=temperature, top_k=top_k, seed=self.cfg.train.seed, logits_fn=logits_fn,
                     pad_multiple=pad)
        return self.tokenizer.decode(ids)
