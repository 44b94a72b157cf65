"""``meshtrain generate``'s engine: a checkpoint loaded into a generation layout (one device, or tensor parallel
over ``parallel.tp`` processes), each rank reading only its pieces, then ``generate`` (KV cache, batched prompts).

Generation splits the model over tp only: every rank runs the same tokens, its attention holds n_heads / tp
query heads and their kv heads (so its KV cache too), and the vocabulary-parallel head's next-token choice is
agreed over tp without gathering the logits (``parallel/next_token.py``). No sequence parallelism (a decode
step has one position), no pipeline (not built: docs/generation.md), no data parallelism (batch the prompts).
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch

from meshtrain import comm
from meshtrain.config import Config, ConfigError, TrainConfig, parse_override, update_from_dict, validate
from meshtrain.generate import Generated, generate
from meshtrain.mesh import Mesh, init_distributed
from meshtrain.model.llama import Llama, build_model
from meshtrain.model.source import full_box
from meshtrain.parallel.next_token import VocabSlice
from meshtrain.parallel.parallelize import materialize
from meshtrain.parallel.pieces import optim_param
from meshtrain.parallel.state import check_shapes, load_state
from meshtrain.parallel.tensor import VocabParallelHead, apply_tensor_parallel
from meshtrain.rules import rules_for
from meshtrain.train.checkpoint import CheckpointReader
from meshtrain.train.trainer import resolve_device, resolve_dtype

# The options `meshtrain generate` takes as overrides: the layout is tp only, the rest is the checkpoint's.
# ``train.dtype`` is the weights' and the KV cache's dtype here (bf16: both held in bf16, as transformers'
# ``torch_dtype=torch.bfloat16``), not training's autocast over fp32 weights.
GENERATE_OPTIONS = ("parallel.tp", "train.dtype", "train.device", "train.threads", "train.collective_timeout_s")
GENERATION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def generation_config(saved: Config, overrides: list[str]) -> Config:
    """The checkpoint's model with a generation layout: tp (default 1) and the device from ``overrides``; the
    training layout and options it was saved with do not apply. One ``error:`` line for any other option."""
    cfg = Config(model=saved.model, train=TrainConfig(seed=saved.train.seed, seq_len=saved.train.seq_len))
    for item in overrides:
        section, key, value = parse_override(item)
        if f"{section}.{key}" not in GENERATE_OPTIONS:
            raise ConfigError(f"meshtrain generate takes {', '.join(GENERATE_OPTIONS)}; {section}.{key} is not one "
                              f"of them (generation splits the model over tp only, and the model is the "
                              f"checkpoint's): drop {item}.")
        update_from_dict(cfg, {section: {key: value}}, "the command line")
    return cfg


def check_generation(cfg: Config, world_size: int, new_tokens: int) -> None:
    """What can be refused before any process starts: the layout (tp divides the heads, the MLP; --nproc equals
    tp), the device (a GPU per process), the number of tokens."""
    tp = cfg.parallel.tp
    if tp < 1:
        raise ConfigError(f"parallel.tp={tp}: generation needs parallel.tp >= 1 (one process per tensor-parallel "
                          f"rank; pass --nproc N parallel.tp=N).")
    if world_size != tp:
        raise ConfigError(f"--nproc {world_size} with parallel.tp={tp}: generation runs one process per "
                          f"tensor-parallel rank; pass parallel.tp={world_size} (or --nproc {tp}).")
    if new_tokens < 1:
        raise ConfigError(f"--tokens {new_tokens}: ask for at least 1 new token.")
    validate(cfg, world_size)
    device = resolve_device(cfg.train.device)
    if device.type == "cuda" and torch.cuda.device_count() < world_size:
        raise ConfigError(f"--nproc {world_size} runs one process per GPU but {torch.cuda.device_count()} GPU(s) "
                          f"are visible: pass --nproc {torch.cuda.device_count()}, or train.device=cpu.")


@dataclass
class GenerationModel:
    """A model ready to generate on this rank: the module (whole, or this rank's tp slices), which vocabulary
    columns its logits hold, and the mesh (tp only)."""

    model: Llama
    vocab: VocabSlice
    mesh: Mesh
    param_bytes: int = field(default=0)


def load_for_generation(cfg: Config, path: str | Path | None, source=None) -> GenerationModel:
    """Build the model for ``cfg.parallel.tp`` ranks and fill this rank's pieces from the checkpoint at ``path``
    (or from ``source``, any ``TensorSource``), reading only the boxes it holds."""
    device = resolve_device(cfg.train.device)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    init_distributed(device.type, cfg.train.collective_timeout_s)
    comm.configure(cfg.train.collective_timeout_s)
    tp = cfg.parallel.tp
    mesh = Mesh(tp=tp, kv_share=max(1, tp // cfg.model.kv_heads), device=device,
                timeout_s=cfg.train.collective_timeout_s)
    model = build_model(cfg.model, cfg.train.seed, device, meta=True)
    placements = {}
    if tp > 1:
        placements = apply_tensor_parallel(model, mesh, rules_for(cfg.parallel), sp=False).placements
    params = dict(model.named_parameters())
    # bf16 weights from the start: a rank never holds its fp32 copy; every box read is cast as it is copied in.
    # The model computes in its weights' dtype (the norms and RoPE in fp32 inside, returning it: model/layers.py),
    # so activations and the KV cache follow.
    materialize(model, list(params), device, GENERATION_DTYPES[resolve_dtype(cfg.train.dtype, device)])
    pieces = [optim_param(n, p, placements) for n, p in model.named_parameters()]
    source = source if source is not None else CheckpointReader(Path(path))
    check_shapes(pieces, source, str(path))
    with torch.no_grad():
        load_state(pieces, source)
        for name, b in model.named_buffers():  # the MoE selection bias (persistent buffers are whole on every rank)
            if source.shape(name) is not None and tuple(source.shape(name)) == tuple(b.shape):
                b.copy_(source.read(name, full_box(b.shape)))
    head = model.output
    vocab = VocabSlice(head.start, head.end - head.start, head.vocab, head.group) \
        if isinstance(head, VocabParallelHead) else VocabSlice.whole(cfg.model.vocab_size)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return GenerationModel(model, vocab, mesh, nbytes)


@dataclass
class GenerationRun:
    """One ``generate`` call on this rank, timed: tokens per second counts every row's new tokens."""

    out: Generated
    seconds: float
    new_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("inf")


def run_generation(gm: GenerationModel, prompts: list[list[int]], new_tokens: int, temperature: float,
                   top_k: int, seed: int, stop_ids: Collection[int] = ()) -> GenerationRun:
    """``generate`` on this rank (every tp rank calls it with the same prompts and gets the same tokens)."""
    if gm.mesh.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = generate(gm.model, prompts, new_tokens, gm.vocab, temperature, top_k, seed, stop_ids)
    if gm.mesh.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return GenerationRun(out, seconds, sum(len(t) for t in out.tokens))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))
