"""How the model is cut into sharding units: each transformer block is one, the embedding is one,
and the final norm with the LM head is one (merged with the embedding when the two are tied, except across
pipeline stages, where each end keeps the tied weight as a unit of its own: ``parallel/tied.py``).

ZeRO reduces and FSDP gathers a unit at a time, so a unit is the grain of communication and of
overlap; the planner computes the same units from the config to predict bytes exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass
class Unit:
    """A named group of modules (in forward order) and the parameters they own, each once."""

    name: str
    modules: list[nn.Module]
    params: list[tuple[str, nn.Parameter]]  # (logical name, parameter), in a fixed order

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.params)


def model_units(model: nn.Module, exclude: frozenset[int] = frozenset(), merge_tied: bool = True) -> list[Unit]:
    """Units of a ``Llama`` (or of a pipeline stage of one) in forward order.

    Parameters whose ``id`` is in ``exclude`` belong to no unit (expert-parallel experts, which are
    synchronised over their own group: ``data.wrap``). ``merge_tied=False`` keeps a tied embedding a unit of its
    own, first, as on a pipeline's first stage, so that the last stage's rank shards it alike (``tied.py``).
    """
    names = {id(p): n for n, p in model.named_parameters()}
    seen = set(exclude)  # each parameter in one unit: the first that holds it (a tied head holds no new one)

    def own(*modules: nn.Module) -> list[tuple[str, nn.Parameter]]:
        out = []
        for m in modules:
            for p in m.parameters():
                if id(p) not in seen and p.requires_grad:
                    seen.add(id(p))
                    out.append((names[id(p)], p))
        return out

    units = []
    emb = getattr(model, "tok_embeddings", None)
    head = [m for m in (getattr(model, "norm", None), getattr(model, "output", None)) if m is not None]
    tied = merge_tied and emb is not None and head and any(p is emb.weight for m in head for p in m.parameters())
    if emb is not None and not tied:
        units.append(Unit("embedding", [emb], own(emb)))
    for key, block in model.layers.items():
        units.append(Unit(f"layers.{key}", [block], own(block)))
    if tied:
        units.append(Unit("embedding+head", [emb, *head], own(emb, *head)))
    elif head:
        units.append(Unit("head", head, own(*head)))
    covered = {id(p) for u in units for _, p in u.params} | exclude
    missing = [n for n, p in model.named_parameters() if id(p) not in covered and p.requires_grad]
    if missing:
        raise ValueError(f"parameters outside every sharding unit: {missing[:3]}")
    return units
