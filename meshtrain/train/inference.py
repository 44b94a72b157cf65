"""``meshtrain generate``'s engine: a checkpoint loaded into a generation layout (one device, or tensor parallel
over ``parallel.tp`` and pipelined over ``parallel.pp`` processes), each rank reading only its pieces, then
``generate`` (KV cache, batched prompts).

Tensor parallelism: every rank runs the same tokens, its attention holds n_heads / tp query heads and their kv
heads (so its KV cache too), and the vocabulary-parallel head's next-token choice is agreed over tp without
gathering the logits (``parallel/next_token.py``). Pipeline parallelism: each pp rank holds the blocks of one
stage (training's cut at the model's context: ``plan/generation.py``) and their cache, and the hidden states
pass from stage to stage (``parallel/pipeline/decode.py``). No sequence parallelism (a decode step has one
position), no data parallelism (batch the prompts).
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
from meshtrain.parallel.pipeline.decode import PipelineDecoder
from meshtrain.parallel.pipeline.engine import prune_to_stages
from meshtrain.parallel.state import check_shapes, load_state
from meshtrain.parallel.tensor import VocabParallelHead, apply_tensor_parallel
from meshtrain.plan.generation import generation_partition
from meshtrain.rules import rules_for
from meshtrain.train.checkpoint import CheckpointReader
from meshtrain.train.preflight import resolve_device, resolve_dtype

# The options `meshtrain generate` takes as overrides: the layout is tp x pp, the rest is the checkpoint's.
# ``train.dtype`` is the weights' and the KV cache's dtype here (bf16: both held in bf16, as transformers'
# ``torch_dtype=torch.bfloat16``), not training's autocast over fp32 weights.
GENERATE_OPTIONS = ("parallel.tp", "parallel.pp", "train.dtype", "train.device", "train.threads",
                    "train.collective_timeout_s")
GENERATION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def generation_config(saved: Config, overrides: list[str]) -> Config:
    """The checkpoint's model with a generation layout: tp and pp (default 1) and the device from ``overrides``;
    the training layout and options it was saved with do not apply. One ``error:`` line for any other option."""
    cfg = Config(model=saved.model, train=TrainConfig(seed=saved.train.seed, seq_len=saved.train.seq_len))
    for item in overrides:
        section, key, value = parse_override(item)
        if f"{section}.{key}" not in GENERATE_OPTIONS:
            raise ConfigError(f"meshtrain generate takes {', '.join(GENERATE_OPTIONS)}; {section}.{key} is not one "
                              f"of them (generation splits the model over tp and pp only, and the model is the "
                              f"checkpoint's): drop {item}.")
        update_from_dict(cfg, {section: {key: value}}, "the command line")
    return cfg


def check_generation(cfg: Config, world_size: int, new_tokens: int) -> None:
    """What can be refused before any process starts: the layout (tp divides the heads, the MLP; a block per
    stage at least; --nproc equals tp x pp), the device (a GPU per process), the number of tokens."""
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    for name, size in (("tp", tp), ("pp", pp)):
        if size < 1:
            raise ConfigError(f"parallel.{name}={size}: generation needs parallel.{name} >= 1 (1: the model not "
                              f"split that way).")
    if pp > cfg.model.n_layers:
        raise ConfigError(f"parallel.pp={pp} stages need a block each, but the model has model.n_layers="
                          f"{cfg.model.n_layers}: pass parallel.pp={cfg.model.n_layers} or fewer.")
    if world_size != tp * pp:
        other = f", or parallel.tp={world_size // pp} for {world_size} processes" \
            if world_size % pp == 0 and world_size // pp != tp else ""
        raise ConfigError(f"{world_size} process(es) for parallel.tp={tp} x parallel.pp={pp} = {tp * pp} ranks: "
                          f"generation runs one process per rank; pass --nproc {tp * pp}{other}.")
    if new_tokens < 1:
        raise ConfigError(f"--tokens {new_tokens}: ask for at least 1 new token.")
    validate(cfg, world_size)
    device = resolve_device(cfg.train.device)
    # this node's processes: all of them under --nproc, a node's share when torchrun spans several nodes
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if device.type == "cuda" and torch.cuda.device_count() < local:
        raise ConfigError(f"--nproc {local} runs one process per GPU but {torch.cuda.device_count()} GPU(s) "
                          f"are visible: pass --nproc {torch.cuda.device_count()}, or train.device=cpu.")


@dataclass
class GenerationModel:
    """A model ready to generate on this rank: the module (whole, this rank's tp slices, or under pp its stage's
    ``PipelineDecoder``), which vocabulary columns its logits hold, and the mesh (tp x pp)."""

    model: Llama | PipelineDecoder
    vocab: VocabSlice
    mesh: Mesh
    param_bytes: int = field(default=0)


def load_for_generation(cfg: Config, path: str | Path | None, source=None) -> GenerationModel:
    """Build the model for ``cfg.parallel.tp`` x ``cfg.parallel.pp`` ranks and fill this rank's pieces from the
    checkpoint at ``path`` (or from ``source``, any ``TensorSource``), reading only the boxes it holds: tensor
    parallelism first, then the pipeline's cut, as training applies them (``parallel/parallelize.py``)."""
    device = resolve_device(cfg.train.device)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    init_distributed(device.type, cfg.train.collective_timeout_s)
    comm.configure(cfg.train.collective_timeout_s)
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    mesh = Mesh.from_config(cfg, tp * pp, device)  # generation_config's layout: tp x pp, nothing else
    model = build_model(cfg.model, cfg.train.seed, device, meta=True)
    placements = {}
    if tp > 1:
        placements = apply_tensor_parallel(model, mesh, rules_for(cfg.parallel), sp=False).placements
    head = model.output  # every rank's vocabulary slice, taken before the pipeline's cut drops the head
    vocab = VocabSlice(head.start, head.end - head.start, head.vocab, head.group) \
        if isinstance(head, VocabParallelHead) else VocabSlice.whole(cfg.model.vocab_size)
    module: Llama | PipelineDecoder = model
    if pp > 1:
        stage = mesh.coord("pp")
        cut = prune_to_stages(model, [stage], generation_partition(cfg.model, pp))[stage]
        module = PipelineDecoder(cut, mesh, head.weight.shape[0])
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
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return GenerationModel(module, vocab, mesh, nbytes)


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
