"""What the planner reasons about: the problem (model, batch, cluster, assumptions), a layout, and the estimate of
a layout (step time by cause, memory, the collectives of one layer)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from meshtrain.config import Config, ConfigError, ModelConfig, load_config
from meshtrain.plan.book import DEFAULT_REVISION
from meshtrain.plan.flops import step_mfu
from meshtrain.plan.hardware import Hardware
from meshtrain.plan.memory import MESHTRAIN_BF16, Precision

HF_PLAN_SEQ = 8192  # the sequence length planned for an HF folder without --seq-len (at most its context)


def plan_config(model: str) -> Config:
    """What ``--model`` names: a preset, a YAML config, or a HuggingFace model folder, whose config.json gives the
    model (``hf_model_config``: what ``train.init_from`` would train; the weights are not read) and sequences of its
    context up to ``HF_PLAN_SEQ`` tokens."""
    if (Path(model) / "config.json").is_file():
        from meshtrain.model.hf import hf_model_config

        cfg = Config()
        cfg.model = hf_model_config(model)
        cfg.train.seq_len = min(cfg.model.max_seq_len, HF_PLAN_SEQ)
        return cfg
    if Path(model).is_dir():
        raise ConfigError(f"--model {model} is a folder without a config.json: pass a preset name, a YAML config "
                          f"or a HuggingFace model folder.")
    return load_config(model, option="--model")


@dataclass(frozen=True)
class Problem:
    """What to plan for: a model, a global batch and a cluster, plus the modelling assumptions.

    ``efficiency`` is the fraction of the datasheet peak a large bf16 matmul reaches (the roofline's compute
    ceiling; MFU can only be lower). ``memory_fraction`` of HBM is usable (the rest: CUDA context, allocator
    fragmentation, communication buffers).
    """

    model: ModelConfig
    seq_len: int
    sequences: int  # global batch in sequences
    hw: Hardware
    nodes: int
    model_name: str = "model"
    precision: Precision = MESHTRAIN_BF16
    efficiency: float = 0.75
    memory_fraction: float = 0.9
    revision: str = DEFAULT_REVISION
    train_tokens: float = 0.0  # a token budget to report days for (0: none)
    documents: bool = False  # train.attention_mask=document: attention within documents (a mask, kept for backward)

    @property
    def devices(self) -> int:
        return self.nodes * self.hw.devices_per_node

    @property
    def batch_tokens(self) -> int:
        return self.sequences * self.seq_len

    @property
    def memory_budget(self) -> float:
        return self.memory_fraction * self.hw.hbm_bytes


@dataclass(frozen=True)
class Layout:
    """One way to lay the job on the cluster. ``microbatches`` are the pipeline microbatches when pp > 1,
    else the gradient-accumulation steps; ``dp_shard`` 0 shards ZeRO over all of dp (else HSDP groups);
    ``cp_attention`` is how context parallelism exchanges attention's inputs (``parallel.cp_attention``);
    ``sp_regather`` whether SP's column-parallel layers gather their input again in backward rather than keep it
    (``parallel.sp_regather``; the search keeps the runtime's default)."""

    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    dp_shard: int = 0
    sp: bool = False
    schedule: str = "1f1b"
    virtual: int = 1
    microbatches: int = 1
    recompute: str = "none"
    cp_attention: str = "ring"  # parallel.cp_attention: ring | allgather | ulysses (only read when cp > 1)
    sp_regather: bool = True  # parallel.sp_regather (only read with sp)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def shard(self) -> int:
        """ZeRO shard group over dp (HSDP: dp_shard), before cp joins it."""
        return self.dp_shard or self.dp

    def describe(self) -> str:
        """A one-line summary, e.g. ``dp32 zero1 tp8 sp pp4 interleaved(v2) m16 recompute=selective``."""
        parts = [f"dp{self.dp}"]
        if self.dp > 1:
            parts.append(f"zero{self.zero}" + (f"/hsdp{self.dp_shard}" if self.dp_shard else ""))
        if self.tp > 1:
            sp = ("+sp" + ("" if self.sp_regather else "(kept)")) if self.sp else ""  # (kept): no backward re-gather
            parts.append(f"tp{self.tp}{sp}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}" + (f"({self.cp_attention})" if self.cp_attention != "ring" else ""))
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.pp > 1:
            sched = self.schedule + (f"(v{self.virtual})" if self.virtual > 1 else "")
            parts.append(f"pp{self.pp} {sched} m{self.microbatches}")
        elif self.microbatches > 1:
            parts.append(f"accum{self.microbatches}")
        parts.append(f"rc={self.recompute}")
        return " ".join(parts)


@dataclass
class StepTime:
    """Seconds per optimizer step on the critical rank, by cause; ``total`` is their sum."""

    compute: float = 0.0  # matmuls and attention, recomputation included
    tp: float = 0.0  # TP/SP collectives (critical path)
    cp: float = 0.0  # ring-attention transfers not hidden behind attention
    ep: float = 0.0  # expert-parallel all-to-alls (dispatch and combine: critical path)
    p2p: float = 0.0  # pipeline sends on the critical path (inside the simulated makespan)
    bubble: float = 0.0  # pipeline idle time
    dp: float = 0.0  # data-parallel / ZeRO communication not hidden behind compute
    optimizer: float = 0.0  # the optimizer step (HBM-bound)

    @property
    def total(self) -> float:
        return self.compute + self.tp + self.cp + self.ep + self.p2p + self.bubble + self.dp + self.optimizer

    @property
    def communication(self) -> float:
        return self.tp + self.cp + self.ep + self.p2p + self.dp

    def bound(self) -> str:
        """What dominates besides useful compute: 'compute' unless communication or the bubble costs more
        than a quarter of the step."""
        parts = {"communication": self.communication, "bubble": self.bubble}
        name, value = max(parts.items(), key=lambda kv: kv[1])
        return name if value > 0.25 * self.total else "compute"


@dataclass
class Collective:
    """One collective of the explained layout: bytes and seconds per call, calls per step, and where it sits."""

    axis: str
    op: str
    what: str
    group: int
    bytes: float
    seconds: float
    calls: int
    critical: str  # "yes", "overlapped", "partly", "exposed"


@dataclass
class Estimate:
    """The prediction for one layout."""

    layout: Layout
    step: StepTime
    memory: dict[str, float]
    budget: float
    model_flops: float  # per step, all devices, no recomputation
    n_devices: int
    peak_flops: float
    tokens: int
    collectives: list[Collective] = field(default_factory=list)
    runnable: bool | None = None
    not_runnable_reason: str = ""

    @property
    def step_s(self) -> float:
        return self.step.total

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())

    @property
    def fits(self) -> bool:
        return self.memory_total <= self.budget

    @property
    def mfu(self) -> float:
        return step_mfu(self.model_flops, self.n_devices, self.peak_flops, self.step_s)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s if self.step_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        return {
            "layout": asdict(self.layout), "describe": self.layout.describe(), "step_s": self.step_s,
            "step": {**asdict(self.step), "total": self.step.total, "bound": self.step.bound()},
            "memory_bytes": {**self.memory, "total": self.memory_total}, "memory_budget_bytes": self.budget,
            "fits": self.fits, "mfu": self.mfu, "tokens_per_s": self.tokens_per_s, "runnable": self.runnable,
            "not_runnable_reason": self.not_runnable_reason,
        }
