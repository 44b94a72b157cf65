"""Sharding units from the config alone: the one place the plan layer says what a unit holds.

ZeRO reduces and FSDP gathers a unit at a time (``meshtrain/parallel/units.py`` builds the runtime's units from
the module): each transformer block is one, the embedding is one, and the final norm with the LM head is one
(merged with the embedding at the end when the two are tied; across pipeline stages the tied weight is a unit of
its own on both ends). ``unit_layouts`` gives each unit's name and its
parameters in order on one tensor-parallel rank; the planner's estimate, ``plan/check.py``'s prediction of a
run and the byte and memory models all read it (``tests/test_planner.py`` holds it equal to the runtime's units).
"""

from __future__ import annotations

import math

from meshtrain.config import ModelConfig

Param = tuple[int, str]  # (elements on this tp rank, the group holding copies: "tp", "tp_kv", or "" if sliced)


def expert_numel(cfg: ModelConfig) -> int:
    """Parameters of one SwiGLU expert (three d x expert_hidden matrices)."""
    return 3 * cfg.d_model * cfg.expert_hidden


def block_layout(cfg: ModelConfig, tp: int = 1, ep: int = 1) -> list[Param]:
    """One block's parameters in order on one tensor-parallel rank: attention norm, wq, wk, wv, wo, MLP norm,
    then the gated MLP split tp ways, or a mixture of experts' router and experts kept whole (replicated over tp;
    under expert parallelism, ep > 1, the routed experts belong to no unit: they are synchronised over edp on
    their own) and the shared experts. With fewer kv heads than tp, wk and wv hold one kv head, shared by the
    tp / n_kv_heads ranks of a "tp_kv" group. With ``model.qkv_bias`` each of wq, wk and wv is followed by its bias,
    split (or shared) as its rows; with ``model.qk_norm`` wo is followed by the q and k norms' scales."""
    d, hd = cfg.d_model, cfg.head_dim
    q, kv, hidden = cfg.n_heads * hd // tp, max(cfg.kv_heads // tp, 1) * hd, cfg.hidden_dim // tp
    kv_copies = "tp_kv" if cfg.kv_heads < tp else ""
    projections = [(q * d, ""), (kv * d, kv_copies), (kv * d, kv_copies)]
    if cfg.qkv_bias:
        projections = [(q * d, ""), (q, ""), (kv * d, kv_copies), (kv, kv_copies), (kv * d, kv_copies), (kv, kv_copies)]
    norms = [(hd, "tp"), (hd, "tp")] if cfg.qk_norm else []  # q and k heads' scales, whole on every tp rank
    block = [(d, "tp"), *projections, (d * q, ""), *norms, (d, "tp")]
    if cfg.moe_experts:
        expert = [(cfg.expert_hidden * d, "tp")] * 3
        block += [(cfg.moe_experts * d, "tp")] + (expert * cfg.moe_experts if ep == 1 else [])
        if cfg.moe_shared_experts:
            block += [(cfg.moe_shared_experts * cfg.expert_hidden * d, "tp")] * 3
    else:
        block += [(hidden * d, ""), (hidden * d, ""), (d * hidden, "")]
    return block


def unit_layouts(cfg: ModelConfig, tp: int = 1, layers: list[int] | range | None = None, first: bool = True,
                 last: bool = True, ep: int = 1) -> list[tuple[str, list[Param]]]:
    """(name, parameters in order) of each unit one tensor-parallel rank holds, named as the runtime names them:
    ``embedding`` (if ``first``), ``layers.<i>`` for each block in ``layers`` (default all), ``head`` (final norm
    and output, if ``last``), or ``embedding+head`` at the end when the embeddings are tied. Tied across a
    pipeline's stages (``first`` or ``last`` alone), the weight is an ``embedding`` unit on both, and the last
    stage's ``head`` is its norm (``parallel/tied.py``). The vocabulary is padded to a multiple of tp."""
    d = cfg.d_model
    layers = range(cfg.n_layers) if layers is None else layers
    emb = math.ceil(cfg.vocab_size / tp) * d
    block = block_layout(cfg, tp, ep)
    blocks = [(f"layers.{i}", block) for i in layers]
    if cfg.tie_embeddings and first and last:
        return blocks + [("embedding+head", [(emb, ""), (d, "tp")])]
    if cfg.tie_embeddings:  # a pipeline's first or last stage: each holds the tied weight as a unit of its own
        return ([("embedding", [(emb, "")])] if first or last else []) + blocks + (
            [("head", [(d, "tp")])] if last else [])
    return ([("embedding", [(emb, "")])] if first else []) + blocks + (
        [("head", [(d, "tp"), (emb, "")])] if last else [])


def unit_numels(cfg: ModelConfig, tp: int = 1, layers: list[int] | range | None = None, first: bool = True,
                last: bool = True, ep: int = 1) -> list[int]:
    """Parameters per sharding unit one tensor-parallel rank holds (``unit_layouts`` summed): by default the whole
    model's units at tp = 1, what the runtime's ``model_units`` gives."""
    sizes: dict[int, int] = {}  # every block shares one layout list: sum it once (the search calls this a lot)
    out = []
    for _, params in unit_layouts(cfg, tp, layers, first, last, ep):
        if id(params) not in sizes:
            sizes[id(params)] = sum(n for n, _ in params)
        out.append(sizes[id(params)])
    return out


def block_params(cfg: ModelConfig) -> int:
    """Parameters of one block (attention, MLP, two norms)."""
    return sum(n for n, _ in block_layout(cfg))


def padded_numel(numel: int, n: int) -> int:
    """A flat unit of ``numel`` elements padded to a multiple of its ``n`` shards."""
    return -(-numel // n) * n


def norm_elems_held(cfg: ModelConfig, tp: int, layers: list[int], first: bool, last: bool, zero: int,
                    n: int, k: int, ep: int = 1, over: str = "tp") -> int:
    """Replicated (over tp) elements in this rank's optimizer pieces: all of them without ZeRO, else
    those inside shard k of n of each flat unit (the tensor-parallel all-reduce covers exactly these).
    ``over="tp_kv"``: the shared kv heads' elements instead (their gradients are summed over "tp_kv")."""
    total = 0
    for _, unit in unit_layouts(cfg, tp, layers, first, last, ep):
        size = sum(numel for numel, _ in unit)
        lo, hi = (0, size) if zero == 0 else (k * -(-size // n), (k + 1) * -(-size // n))
        off = 0
        for numel, copies in unit:
            if copies == over:
                total += max(0, min(off + numel, hi) - max(off, lo))
            off += numel
    return total


def expert_params_per_rank(cfg: ModelConfig, ep: int, layers: int) -> int:
    """Routed-expert parameters one expert-parallel rank holds (E/ep whole experts in each of its ``layers`` MoE
    blocks); 0 without experts or expert parallelism (then the experts sit inside the block units)."""
    if not cfg.moe_experts or ep <= 1:
        return 0
    return layers * cfg.moe_experts // ep * expert_numel(cfg)
