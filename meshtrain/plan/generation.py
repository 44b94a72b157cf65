"""Generation layouts (tp x pp) for ``meshtrain plan generate``: each rank's weight and KV cache bytes as
``meshtrain generate`` allocates them, and a decode step's time from the HBM roofline.

Memory, exact (``tests/test_generation.py`` holds it equal to what the ranks allocate): a rank's weights are its
stage's units on one tensor-parallel rank (``units.unit_numels``; the stages are ``generation_partition``'s, which
``train/inference.py`` cuts by) in the weight dtype; its KV cache holds, for each of the stage's blocks, K and V
of its kv heads (n_kv_heads / tp, or one head replicated when tp exceeds them) for batch x context positions.
Activations of a decode step ([B, 1, d] per block) are not counted.

Time, a model not yet checked on a GPU: the stages run one after another (a decode step is one position); each
reads its weights (all but an untied embedding table, of which a step reads B rows; every expert of a mixture)
and its cache once from HBM or does its FLOPs, whichever is longer (the roofline of
``book_roofline.decode_roofline``, per stage), plus per block the two tensor-parallel all-reduces of [B, d] (and
the embedding's one) and the next token's all-gather, the hidden states sent to the next stage, and the last
stage's logits broadcast over pp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshtrain.config import ModelConfig
from meshtrain.plan.hardware import Hardware
from meshtrain.plan.network import group_link
from meshtrain.plan.partition import layer_costs, partition_model, partitions_up_to
from meshtrain.plan.steptime import op_time
from meshtrain.plan.units import unit_numels


@dataclass(frozen=True)
class StageBytes:
    """What one pp stage's ranks hold: ``weights`` and ``kv`` bytes per tp rank, and its blocks; ``read``: the
    weight bytes a decode step reads (an untied embedding table only looked up is not)."""

    weights: int
    kv: int
    blocks: int
    read: int


@dataclass(frozen=True)
class GenerationEstimate:
    """One generation layout: the heaviest rank's bytes, whether they fit, and a decode step's seconds."""

    tp: int
    pp: int
    stages: tuple[StageBytes, ...]
    budget: float
    step_s: float
    batch: int

    @property
    def devices(self) -> int:
        return self.tp * self.pp

    @property
    def per_device(self) -> int:
        return max(s.weights + s.kv for s in self.stages)

    @property
    def fits(self) -> bool:
        return self.per_device <= self.budget

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_s

    def row(self) -> dict:
        heavy = max(self.stages, key=lambda s: s.weights + s.kv)
        return {"tp": self.tp, "pp": self.pp, "devices": self.devices, "weights_bytes": heavy.weights,
                "kv_bytes": heavy.kv, "bytes_per_device": self.per_device, "fits": self.fits,
                "step_s": self.step_s, "tokens_per_s": self.tokens_per_s}


def generation_tps(cfg: ModelConfig, limit: int) -> list[int]:
    """Tensor-parallel sizes ``meshtrain generate`` takes for ``cfg``, powers of two up to ``limit``: dividing the
    heads and the MLP, and the kv heads or a multiple of them."""
    out, tp = [], 1
    while tp <= limit:
        if cfg.n_heads % tp == 0 and cfg.hidden_dim % tp == 0 and (cfg.kv_heads % tp == 0 or tp % cfg.kv_heads == 0):
            out.append(tp)
        tp *= 2
    return out


def generation_partition(cfg: ModelConfig, pp: int) -> list[list[int]]:
    """The blocks of each of ``pp`` generation stages: training's FLOP-balanced cut (``partition_model``) at the
    model's own context, ``max_seq_len``, so that it depends on the model alone (``meshtrain generate`` and this
    planner cut alike, whatever sequence length a checkpoint was trained at)."""
    return partition_model(cfg, cfg.max_seq_len, pp).layers


def generation_partitions(cfg: ModelConfig, max_pp: int) -> dict[int, list[list[int]]]:
    """``generation_partition(cfg, pp)`` for every pp up to ``max_pp``, from one table (``partitions_up_to``)."""
    return partitions_up_to(layer_costs(cfg, cfg.max_seq_len), max_pp)


def stage_bytes(cfg: ModelConfig, tp: int, pp: int, batch: int, context: int, dtype_bytes: int,
                layers: list[list[int]] | None = None) -> list[StageBytes]:
    """Each pp stage's weight and KV cache bytes on one of its tp ranks, ``context`` positions per sequence
    (``layers``: ``generation_partition(cfg, pp)``, given when already computed)."""
    layers = generation_partition(cfg, pp) if layers is None else layers
    kv_heads = max(cfg.kv_heads // tp, 1)
    table = math.ceil(cfg.vocab_size / tp) * cfg.d_model * dtype_bytes  # the embedding's tp slice (units.py)
    out = []
    for s, blocks in enumerate(layers):
        weights = sum(unit_numels(cfg, tp, blocks, s == 0, s == pp - 1)) * dtype_bytes
        kv = 2 * batch * kv_heads * context * cfg.head_dim * dtype_bytes * len(blocks)
        looked_up = table if s == 0 and not (cfg.tie_embeddings and pp == 1) else 0  # tied at pp 1: the head's too
        out.append(StageBytes(weights, kv, len(blocks), weights - looked_up))
    return out


def decode_step_time(cfg: ModelConfig, hw: Hardware, tp: int, stages: list[StageBytes], batch: int, context: int,
                     dtype_bytes: int) -> float:
    """Seconds of one decode step of ``batch`` sequences at ``context`` positions (see the module docstring)."""
    tp_link = group_link(hw, tp, 1)
    hidden = batch * cfg.d_model * dtype_bytes
    heads = cfg.n_heads // tp
    total = 0.0
    for i, s in enumerate(stages):
        attention = 4.0 * batch * context * cfg.head_dim * heads * s.blocks  # q.k and p.v over the context
        flops = 2.0 * batch * s.read / dtype_bytes + attention
        total += max(flops / hw.bf16_flops, (s.read + s.kv) / hw.hbm_bw)
        total += op_time(hw, "all_reduce", hidden, tp_link, calls=2 * s.blocks + (1 if i == 0 else 0))
    total += op_time(hw, "all_gather", 16 * batch, tp_link)  # the greedy choice's (value, index) per row
    pp = len(stages)
    if pp > 1:
        neighbours = group_link(hw, 2, tp)
        total += (pp - 1) * op_time(hw, "send", hidden, neighbours)
        logits = batch * -(-cfg.vocab_size // tp) * dtype_bytes
        total += op_time(hw, "broadcast", logits, group_link(hw, pp, tp))
    return total


def generation_layouts(cfg: ModelConfig, hw: Hardware, devices: int, batch: int, context: int, dtype_bytes: int = 2,
                       memory_fraction: float = 0.9) -> list[GenerationEstimate]:
    """Every tp x pp on at most ``devices`` devices (tp within ``hw.tp_max``, pp up to the blocks), fastest first
    among those that fit ``memory_fraction`` of a device, then the rest by bytes per device."""
    budget = memory_fraction * hw.hbm_bytes
    tps = generation_tps(cfg, min(hw.tp_max, devices))
    cuts = generation_partitions(cfg, min(cfg.n_layers, devices))
    out = []
    for tp in tps:
        for pp in range(1, min(cfg.n_layers, devices // tp) + 1):
            stages = stage_bytes(cfg, tp, pp, batch, context, dtype_bytes, cuts[pp])
            step = decode_step_time(cfg, hw, tp, stages, batch, context, dtype_bytes)
            out.append(GenerationEstimate(tp, pp, tuple(stages), budget, step, batch))
    return sorted(out, key=lambda e: (not e.fits, e.step_s if e.fits else e.per_device))
