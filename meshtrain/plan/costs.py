"""The one FLOP/parameter model: the trainer's MFU, the planner and the tests all read it.

Notation follows the scaling book (seed 000): D = d_model, F = MLP hidden, L = layers,
V = vocabulary, T = sequence length. Training FLOPs per token are 6 x (matmul parameters)
plus the attention score/value term, 6 x 2 x L x T x D for causal attention (half of the
full T x T square, forward 2 matmuls x 2 FLOPs, backward twice forward).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from meshtrain.config import ModelConfig


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts by part; ``total`` counts a tied embedding once.

    With a mixture of experts ``mlp`` counts the router and every expert (memory) and ``mlp_active`` the
    router and the experts one token runs through, top_k routed + the shared ones (FLOPs); for a dense
    model the two are equal.
    """

    embedding: int
    attention: int  # per model, all layers
    mlp: int
    norms: int
    head: int
    mlp_active: int = -1  # -1: the same as mlp (dense)

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.mlp + self.norms + self.head

    @property
    def active_mlp(self) -> int:
        return self.mlp if self.mlp_active < 0 else self.mlp_active

    @property
    def matmul(self) -> int:
        """Parameters that take part in a matmul for every token (the head, not the embedding lookup)."""
        return self.attention + self.active_mlp + self.head


def param_count(cfg: ModelConfig) -> ParamCount:
    """Exact parameter counts of ``meshtrain.model.Llama`` for this config (MoE blocks included)."""
    d, hd, layers = cfg.d_model, cfg.head_dim, cfg.n_layers
    attn = d * cfg.n_heads * hd * 2 + d * cfg.kv_heads * hd * 2  # wq, wo; wk, wv
    mlp = active = 3 * d * cfg.hidden_dim
    if cfg.moe_experts:  # router d x E, then SwiGLU experts: routed ones and the shared ones
        expert = 3 * d * cfg.expert_hidden
        mlp = d * cfg.moe_experts + (cfg.moe_experts + cfg.moe_shared_experts) * expert
        active = d * cfg.moe_experts + (cfg.moe_top_k + cfg.moe_shared_experts) * expert
    embedding = cfg.vocab_size * d
    head = cfg.vocab_size * d
    return ParamCount(
        embedding=embedding,
        attention=layers * attn,
        mlp=layers * mlp,
        norms=(2 * layers + 1) * d,
        head=0 if cfg.tie_embeddings else head,
        mlp_active=layers * active,
    )


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters used in a matmul per token (MoE: the active ones); with tied embeddings the head still
    multiplies."""
    pc = param_count(cfg)
    return pc.attention + pc.active_mlp + cfg.vocab_size * cfg.d_model


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Forward FLOPs of QK^T and AV per token: 2 matmuls x 2 FLOPs x T x (n_heads x head_dim) per layer."""
    full = 4.0 * seq_len * cfg.n_heads * cfg.head_dim * cfg.n_layers
    return full / 2 if causal else full


def flops_per_token(cfg: ModelConfig, seq_len: int, training: bool = True) -> float:
    """Model FLOPs per token: forward 2N + attention; training x3 (backward is twice forward).

    Recomputation is not counted: MFU measures useful model FLOPs, not hardware FLOPs.
    """
    fwd = 2.0 * matmul_params(cfg) + attention_flops_per_token(cfg, seq_len)
    return 3.0 * fwd if training else fwd


def mfu(tokens_per_s: float, cfg: ModelConfig, seq_len: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' peak."""
    if peak_flops <= 0:
        return 0.0
    return tokens_per_s * flops_per_token(cfg, seq_len) / peak_flops


# ----------------------------------------------------------------------------- data-parallel family
# Bytes are the comm meter's payload bytes per rank per optimizer step (see meshtrain/comm.py), so
# the runtime can be checked against them exactly; times divide them by a bandwidth in the planner.


def unit_numels(cfg: ModelConfig) -> list[int]:
    """Parameters per sharding unit (meshtrain/parallel/units.py): embedding, each block, head
    (final norm + output); with tied embeddings, embedding and head are one unit at the end."""
    pc = param_count(cfg)
    block = (pc.attention + pc.mlp) // cfg.n_layers + 2 * cfg.d_model
    emb = cfg.vocab_size * cfg.d_model
    if cfg.tie_embeddings:
        return [block] * cfg.n_layers + [emb + cfg.d_model]
    return [emb] + [block] * cfg.n_layers + [cfg.d_model + emb]


def _padded(numel: int, n: int) -> int:
    return -(-numel // n) * n


def dp_comm_bytes(cfg: ModelConfig, zero: int, dp: int, grad_accum: int = 1, layout: str = "flat",
                  dp_shard: int = 0, compute_bytes: int = 4, reshard_after_forward: bool = True,
                  units: list[int] | None = None) -> dict[tuple[str, str], int]:
    """Payload bytes per rank per step of each (group, collective) of the data-parallel family.

    - DP: one all-reduce of the fp32 gradients, once per step (accumulation communicates last).
    - ZeRO-1: reduce-scatter of the gradients + all-gather of the updated parameters, per unit,
      each padded to a multiple of the shard group; ZeRO-2 reduce-scatters every microbatch.
      The per-tensor layout reduces each tensor to its owner and broadcasts it back instead.
    - ZeRO-3: all-gather of each unit in forward and again in backward (if resharded after
      forward), in the compute dtype, and a reduce-scatter of its fp32 gradient, every microbatch.
    - HSDP (dp_shard < dp): the above within a shard group, plus an all-reduce of the gradient
      shards over the replicas.

    ``units`` (default ``unit_numels(cfg)``) are the rank's own units: a tensor-parallel shard of
    each, or one pipeline stage's. The flat-layout arithmetic is ``dp_family_bytes``.
    """
    units = unit_numels(cfg) if units is None else units
    if zero in (1, 2) and layout == "per_tensor":
        # Every tensor is reduced to its owner and broadcast back, whoever owns it.
        psi = sum(units)
        n = dp_shard or dp
        if dp // n > 1:
            raise ValueError("per-tensor HSDP bytes depend on the ownership; not modelled")
        if n == 1:
            return {}
        return {("dp_shard_cp", "reduce"): (grad_accum if zero == 2 else 1) * 4 * psi,
                ("dp_shard_cp", "broadcast"): 4 * psi}
    return dp_family_bytes(units, zero, dp, grad_accum, dp_shard, gather_bytes=compute_bytes,
                           reshard_after_forward=reshard_after_forward)


def dp_state_bytes(cfg: ModelConfig, zero: int, dp: int, dp_shard: int = 0, optim_bytes_per_param: int = 8,
                   units: list[int] | None = None) -> dict[str, float]:
    """Per-rank bytes of fp32 parameters, fp32 gradients and optimizer state (AdamW: two fp32
    moments, K = 8 bytes per parameter) for each ZeRO stage: the ZeRO paper's 2+2+K, 2+2+K/N,
    2+(2+K)/N and (4+K)/N with our dtypes (4-byte parameters and gradients, no separate master).
    ``units``: the rank's own units (tensor-parallel shards, pipeline stages), as in dp_comm_bytes."""
    units = unit_numels(cfg) if units is None else units
    psi = sum(units)
    n = (dp_shard or dp) if zero > 0 else 1
    padded = sum(_padded(u, n) for u in units) if zero > 0 else psi
    return {
        "params": 4.0 * (padded / n if zero == 3 else padded),
        "grads": 4.0 * (padded / n if zero >= 2 else padded),
        "optim": optim_bytes_per_param * (padded / n if zero >= 1 else psi),
    }


# ----------------------------------------------------------------------------- tensor parallelism


def tp_comm_bytes(cfg: ModelConfig, tp: int, sp: bool, tokens: int, grad_accum: int = 1, act_bytes: int = 4,
                  layers: int | None = None, embedding: bool = True, head: bool = True,
                  norm_elems: int | None = None, recompute: bool = False, mlp_tp: bool = True
                  ) -> dict[tuple[str, str], int]:
    """Payload bytes per rank per step on the tp axis (meshtrain/parallel/tensor.py).

    ``tokens`` is the tokens of one microbatch on this rank (rows x seq_len); S = tokens x d_model x
    act_bytes is one activation. Per microbatch, without SP: forward all-reduces after the embedding
    and after each block's attention and MLP (2L + 1), backward all-reduces the input gradients of
    each block's two column-parallel entries and of the head (2L + 1). With SP each all-reduce
    becomes a reduce-scatter plus an all-gather of the same S (the same volume, split). The loss
    adds three fp32 all-reduces of one value per token (max, sum of exp, target logit); once per step
    the replicated norm weights' gradients ((2L + 1) x d fp32) are all-reduced.

    A pipeline stage passes its ``layers`` and whether it holds the ``embedding`` / ``head`` (the
    loss lives with the head); ``norm_elems`` is how many norm-weight elements this rank's optimizer
    holds (ZeRO shards them; default all).

    With activation recompute (full or selective) each block's forward runs again in backward up to
    the last activation backward needs, which is the input of its final matmul: the two entry
    collectives and the attention's exit collective repeat, the MLP's exit does not. So per block
    and microbatch: SP adds 2 all-gathers and 1 reduce-scatter, no SP adds 1 all-reduce.

    ``mlp_tp=False`` is a mixture-of-experts model: its MoE blocks are not split by tp (each tp rank runs
    them on the tokens it holds), so only the attention's collectives remain (2 per block and
    microbatch instead of 4; under recompute SP repeats 1 all-gather, not 2). The router and the experts
    then count as replicated weights in ``norm_elems``.
    """
    if tp == 1:
        return {}
    n_layers = cfg.n_layers if layers is None else layers
    s = tokens * cfg.d_model * act_bytes
    per_block = 4 if mlp_tp else 2
    count = per_block * n_layers + (1 if embedding else 0) + (1 if head else 0)  # collectives per microbatch
    loss = 3 * 4 * tokens if head else 0
    if norm_elems is None:
        norm_elems = (2 * n_layers + (1 if head else 0)) * cfg.d_model
    norms = norm_elems * 4
    again = n_layers if recompute else 0
    if sp:
        out = {("tp", "all_gather"): grad_accum * (count + (2 if mlp_tp else 1) * again) * s,
               ("tp", "reduce_scatter"): grad_accum * (count + again) * s,
               ("tp", "all_reduce"): grad_accum * loss + norms}
    else:
        out = {("tp", "all_reduce"): grad_accum * ((count + again) * s + loss) + norms}
    return {k: v for k, v in out.items() if v}


# ----------------------------------------------------------------------------- pipeline partitioning


def stage_part_flops(cfg: ModelConfig, seq_len: int) -> tuple[float, float, float]:
    """Forward FLOPs per token of (the embedding, one block, the final norm + head + loss).

    The embedding is a lookup (no matmul); the head is a d x V matmul plus a softmax over V.
    """
    pc = param_count(cfg)
    block = 2.0 * (pc.attention + pc.active_mlp) / cfg.n_layers + attention_flops_per_token(cfg, seq_len) \
        / cfg.n_layers
    head = 2.0 * cfg.vocab_size * cfg.d_model + 5.0 * cfg.vocab_size
    return 0.0, block, head


# ============================================================================= the planner's cost model
# Everything below serves `meshtrain plan` (meshtrain/plan/planner.py) and its tests. It extends the
# models above rather than restating them: FLOPs come from stage_part_flops / flops_per_token, the
# runtime's exact DP and TP bytes from dp_comm_bytes / tp_comm_bytes (dp_family_bytes generalises the
# former to a rank's own units, and a test holds the two equal).


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of state, so one memory/byte model covers several recipes.

    ``optim`` counts every optimizer byte per parameter (AdamW: two fp32 moments = 8; with 16-bit
    parameters an fp32 master copy joins them: K = 12 in the ZeRO paper). ``act`` is what is saved for
    backward and what TP/SP/CP move (the compute dtype); ``hidden`` the residual stream that pipeline
    stages send; ``gather`` what ZeRO-3 all-gathers; DP reduces gradients in ``grad`` and ZeRO-1/2
    all-gather updated parameters in ``param``.
    """

    param: int = 4
    grad: int = 4
    optim: int = 8
    act: int = 2
    hidden: int = 4
    gather: int = 2


# meshtrain itself: fp32 parameters, gradients and AdamW moments, bf16 autocast (docs/ARCHITECTURE.md).
MESHTRAIN_BF16 = Precision(param=4, grad=4, optim=8, act=2, hidden=4, gather=2)
# The ZeRO paper's / Megatron's mixed precision: 16-bit params and grads, fp32 master + Adam (K = 12).
MIXED_16BIT = Precision(param=2, grad=2, optim=12, act=2, hidden=2, gather=2)
PRECISIONS = {"meshtrain": MESHTRAIN_BF16, "mixed": MIXED_16BIT}


# ----------------------------------------------------------------------------- mixture of experts


def moe_param_count(cfg: ModelConfig, n_experts: int, top_k: int, n_shared: int = 0, expert_hidden: int = 0,
                    moe_every: int = 1) -> tuple[int, int]:
    """(total, active) parameters when every ``moe_every``-th block's gated MLP becomes ``n_experts``
    routed experts (each of hidden size ``expert_hidden``, default the dense hidden) plus ``n_shared``
    always-on experts and a d x E router. Active counts the experts a token runs through (top_k + shared).

    The counts are passed explicitly (the planner explores them); ``cfg``'s own MoE fields are ignored. With
    ``n_experts=1, top_k=1`` this is the dense ``param_count(cfg).total`` plus the router; with the config's
    own fields it equals ``param_count`` of the MoE config (``tests/test_moe.py``) when ``moe_every=1``.
    """
    if n_experts < 1 or not 1 <= top_k <= n_experts:
        raise ValueError(f"need n_experts >= 1 and 1 <= top_k <= n_experts, got {n_experts}, {top_k}")
    fe = expert_hidden or cfg.hidden_dim
    cfg = dataclasses.replace(cfg, moe_experts=0)
    pc = param_count(cfg)
    expert = 3 * cfg.d_model * fe
    dense_mlp = pc.mlp // cfg.n_layers
    moe_layers = cfg.n_layers // moe_every
    router = cfg.d_model * n_experts
    base = pc.total - moe_layers * dense_mlp
    total = base + moe_layers * (router + (n_experts + n_shared) * expert)
    active = base + moe_layers * (router + (top_k + n_shared) * expert)
    return total, active


# ----------------------------------------------------------------------------- the book's analysis (seeds 000, 003)
# Notation of "How to Parallelize a Transformer for Training" (seed 000; seed 003 is a later revision):
# B tokens in the global batch, N chips, D = d_model, F = MLP hidden, C = FLOP/s per chip,
# W = bandwidth per chip of one mesh axis (the book's bidirectional W_ici, e.g. 2 x 9e10 on v5p).
# A layer is approximated as two matmuls In[B, D] x Win[D, F] x Wout[F, D] in bf16: 4BDF forward FLOPs.

MIXED_REVISIONS = ("000", "003")
# Default: seed 003's later revision, where the FSDP (X) and TP (Y) collectives overlap each other. They
# run on different links (different torus axes; NVLink for TP against InfiniBand for FSDP on GPU
# clusters), which is what the planner's own link model assumes too. Seed 000's sum is the stricter bound.
DEFAULT_REVISION = "003"


def book_param_count(n_layers: int, d_model: int, ffw: int, n_heads: int, head_dim: int, vocab: int
                     ) -> dict[str, float]:
    """Seed 000, Question 1: FFW 3LDF (gated: two up-projections and one down), attention 4DNHL
    (Q, K, V, O with K = N heads), vocabulary 2VD (untied embedding and head); norms ignored."""
    parts = {"ffw": 3.0 * n_layers * d_model * ffw, "attention": 4.0 * d_model * n_heads * head_dim * n_layers,
             "vocab": 2.0 * vocab * d_model}
    parts["total"] = sum(parts.values())
    return parts


def training_flops(n_params: float, tokens: float) -> float:
    """6 x parameters x tokens (seed 000: LLaMA-3 70B on 15e12 tokens = 15e12 x 70e9 x 6 = 6.3e24)."""
    return 6.0 * n_params * tokens


def critical_batch_per_device(flops: float, bandwidth: float, n_axes: int = 1) -> float:
    """Seed 000: pure DP and FSDP stay compute-bound while the per-device batch (tokens) exceeds C / W,
    the arithmetic intensity of the network; using ``n_axes`` mesh axes multiplies W. On TPU v5p
    4.59e14 / 1.8e11 = 2550 per chip, and 850 with all three axes."""
    return flops / (bandwidth * n_axes)


def tp_limit(ffw: float, flops: float, bandwidth: float, n_axes: int = 1) -> float:
    """Seed 000: tensor (model) parallelism of degree Y is compute-bound while F > Y x C / W, so the largest
    useful degree is Y = F W / C (F = 50k for Gemma 7B on v5p: about 19-way). Independent of the batch."""
    return ffw * bandwidth * n_axes / flops


def tp_min_ffw(tp: int, flops: float, bandwidth: float, n_axes: int = 1) -> float:
    """The MLP width that ``tp``-way model parallelism needs to stay compute-bound: Y x C / W (8-way on v5p
    needs about 20k, seed 000)."""
    return tp * flops / (bandwidth * n_axes)


def mixed_min_batch_per_device(ffw: float, flops: float, bandwidth: float, revision: str = DEFAULT_REVISION
                               ) -> float:
    """The per-chip batch (B / N) above which mixed FSDP + TP at the optimal split is compute-bound.

    - ``"000"`` (seed 000, the two axes' comm times add up): B / N > 2 (C/W)^2 / F (LLaMA-3 70B, F = 30k:
      2 x 2550^2 / 30000 = 432; LLaMA-2 13B: 940).
    - ``"003"`` (seed 003, the two axes overlap): B / N > (C/W)^2 / (2F), four times lower.
    """
    ratio = flops / bandwidth
    if revision == "000":
        return 2.0 * ratio**2 / ffw
    if revision == "003":
        return ratio**2 / (2.0 * ffw)
    raise ValueError(f"revision must be one of {MIXED_REVISIONS}, got {revision!r}")


def optimal_fsdp(batch: float, n_chips: float, ffw: float) -> float:
    """Seed 000/003: the FSDP degree X that minimises mixed FSDP + TP communication, X = sqrt(2 B N / F)
    (FSDP on two mesh axes, TP on one); Y = N / X. Both revisions share it (the sum and the max of
    a/X and bX are both smallest where a/X = bX)."""
    return math.sqrt(2.0 * batch * n_chips / ffw)


def split_fsdp_tp(batch: float, n_chips: int, ffw: float, max_tp: int | None = None) -> tuple[int, int]:
    """``optimal_fsdp`` rounded to a power-of-two X dividing N (nearest in log scale), Y = N / X, with Y capped
    at ``max_tp``. Seed 003, Question 3: B = 3e6, N = 4096, F = 13824 gives X = 1333, so 1024 x 4."""
    x = optimal_fsdp(batch, n_chips, ffw)
    best = min((d for d in range(1, n_chips + 1) if n_chips % d == 0 and d & (d - 1) == 0),
               key=lambda d: abs(math.log(d / x)))
    y = n_chips // best
    if max_tp is not None and y > max_tp:
        y = max_tp
        best = n_chips // y
    return best, y


def dcn_min_batch_per_pod(flops: float, dcn_bandwidth: float) -> float:
    """Seed 003: pure DP across pods (FSDP inside each) is DCN-bound unless every pod's batch exceeds
    C / W_dcn tokens, W_dcn per chip: 4.46e14 / 6.25e9 = 71,360 on v5p (seed 000 rounds it to ~75,000)."""
    return flops / dcn_bandwidth


def chips_for_batch(batch: float, batch_per_chip: float) -> float:
    """How many chips a batch of ``batch`` tokens keeps compute-bound (seed 000: 16e6 / (2550 / 3) = 18,823)."""
    return batch / batch_per_chip


def days_to_train(total_flops: float, chips: float, flops: float, mfu: float) -> float:
    """Wall-clock days at a given MFU (seed 000: 6.3e24 FLOPs on 18,823 v5p chips at 50% is about 17 days)."""
    return total_flops / (chips * flops * mfu) / 86400.0


def book_step_time(n_params: float, batch: float, chips: float, flops: float, mfu: float) -> float:
    """Roofline seconds per step, 6 N B / (chips C MFU) (seed 003, Question 3: 300 ms)."""
    return 6.0 * n_params * batch / (chips * flops * mfu)


def book_checkpoint_bytes(n_layers: int, batch: float, d_model: int, ffw: int, bytes_per: int = 2) -> float:
    """Seed 000, Question 2: activations checkpointed after the three big matmuls of every layer,
    bytes x L x B x (D + 2F) (LLaMA-2 13B at 16M tokens: about 4.2e13 = 42 TB)."""
    return float(bytes_per) * n_layers * batch * (d_model + 2 * ffw)


def book_layer_times(strategy: str, batch: float, n_chips: int, d_model: int, ffw: int, flops: float,
                     bw_x: float, bw_y: float | None = None, x: float | None = None,
                     revision: str = DEFAULT_REVISION) -> tuple[float, float]:
    """(matmul seconds, communication seconds) of one layer's forward pass, per the book's per-strategy
    algebra; the backward pass has the same ratio. ``bw_x`` is the bandwidth of the FSDP/DP axes, ``bw_y``
    of the TP axis.

    - ``dp`` / ``fsdp``: all-gather (or all-reduce in backward) of Win and Wout: 2 x 2DF bytes / W_x.
    - ``tp`` (all N chips on Y): all-gather + reduce-scatter of In/Out [B, D]: 2 x 2BD bytes / W_y.
    - ``fsdp+tp``: X = ``x`` (default ``optimal_fsdp``) and Y = N / X: 4DF / (Y W_x) and 4BD / (X W_y),
      summed (revision 000) or overlapped (003).
    """
    t_math = 4.0 * batch * d_model * ffw / (n_chips * flops)
    bw_y = bw_x if bw_y is None else bw_y
    if strategy in ("dp", "fsdp"):
        return t_math, 4.0 * d_model * ffw / bw_x
    if strategy == "tp":
        return t_math, 4.0 * batch * d_model / bw_y
    if strategy == "fsdp+tp":
        x = optimal_fsdp(batch, n_chips, ffw) if x is None else x
        x = min(max(x, 1.0), float(n_chips))
        y = n_chips / x
        t_fsdp, t_tp = 4.0 * d_model * ffw / (y * bw_x), 4.0 * batch * d_model / (x * bw_y)
        if revision not in MIXED_REVISIONS:
            raise ValueError(f"revision must be one of {MIXED_REVISIONS}, got {revision!r}")
        return t_math, (t_fsdp + t_tp if revision == "000" else max(t_fsdp, t_tp))
    raise ValueError(f"strategy must be dp, fsdp, tp or fsdp+tp, got {strategy!r}")


# ----------------------------------------------------------------------------- collectives: bytes on the wire and time


def wire_factor(op: str, n: int) -> float:
    """Bytes each device sends per payload byte in the ring algorithm (the comm meter's convention:
    payload = the all-reduced tensor, the gathered output, the scattered input, the all-to-all input)."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "reduce", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "send", "p2p"):
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


@dataclass(frozen=True)
class Link:
    """How a group of ``n`` devices sits on the fabrics: ``local`` members share each fast domain (they talk
    at ``intra_bw`` per device), and the group spans ``n / local`` domains joined at ``inter_bw`` per device.
    Latencies are per tree level."""

    n: int
    local: int
    intra_bw: float
    inter_bw: float
    intra_latency: float = 0.0
    inter_latency: float = 0.0


def collective_time(op: str, payload: float, link: Link) -> float:
    """Seconds for one collective of ``payload`` bytes (per device, meter convention) over ``link``.

    Hierarchical ring model: the ``local`` members of each domain do their share on the fast fabric
    ((g-1)/g of the payload, twice for an all-reduce), and the domains exchange 1/g of it each over the
    slow one ((k-1)/k, twice for an all-reduce), k = n / g domains. All-to-all sends (g-1)/n of the payload
    inside and (n-g)/n outside; a point-to-point send goes over the slow fabric unless both ends share a
    domain. Latency grows with the tree depth (log2 of the members on each level).
    """
    n, g = link.n, max(1, min(link.local, link.n))
    if n <= 1 or payload <= 0:
        return 0.0
    k = n / g
    lat = (math.ceil(math.log2(g)) if g > 1 else 0) * link.intra_latency + (
        math.ceil(math.log2(k)) if k > 1 else 0) * link.inter_latency
    if op in ("send", "p2p", "broadcast"):
        return payload / (link.intra_bw if k <= 1 else link.inter_bw) + (link.intra_latency if k <= 1
                                                                         else link.inter_latency)
    if op == "all_to_all":
        return (g - 1) / n * payload / link.intra_bw + (n - g) / n * payload / link.inter_bw + lat
    twice = 2.0 if op == "all_reduce" else 1.0
    intra = twice * (g - 1) / g * payload / link.intra_bw
    inter = twice * (k - 1) / k * (payload / g) / link.inter_bw
    return intra + inter + twice * lat


# ----------------------------------------------------------------------------- bytes of each strategy, per rank


def dp_family_bytes(units: list[int], zero: int, dp: int, grad_accum: int = 1, dp_shard: int = 0,
                    grad_bytes: int = 4, param_bytes: int = 4, gather_bytes: int = 4,
                    reshard_after_forward: bool = True) -> dict[tuple[str, str], int]:
    """Payload bytes per rank per step of the data-parallel family (flat layout) for a rank holding
    ``units`` (parameters per sharding unit, e.g. a tensor-parallel shard of each block, or one pipeline
    stage's blocks). With ``unit_numels(cfg)``, grad/param bytes 4 and ``gather_bytes = compute_bytes`` it
    equals ``dp_comm_bytes`` (tests hold them equal); the planner passes its precision and each rank's units.

    DP: all-reduce of the gradients once per step. ZeRO-1: reduce-scatter of the gradients and all-gather of
    the updated parameters, each unit padded to the shard group; ZeRO-2 reduce-scatters every microbatch.
    ZeRO-3: per microbatch an all-gather in forward and (resharded) again in backward, and a reduce-scatter.
    HSDP (dp_shard < dp): plus an all-reduce of the gradient shards over the replicas.
    """
    psi = sum(units)
    if zero == 0:
        return {("dp_cp", "all_reduce"): grad_bytes * psi} if dp > 1 else {}
    n = dp_shard or dp
    out: dict[tuple[str, str], int] = {}
    padded = sum(_padded(u, n) for u in units)
    if n > 1:
        out[("dp_shard_cp", "reduce_scatter")] = (grad_accum if zero >= 2 else 1) * grad_bytes * padded
        if zero in (1, 2):
            out[("dp_shard_cp", "all_gather")] = param_bytes * padded
        else:
            out[("dp_shard_cp", "all_gather")] = (grad_accum * (2 if reshard_after_forward else 1)
                                                  * gather_bytes * padded)
    if dp // n > 1:
        out[("dp_replicate", "all_reduce")] = grad_bytes * padded // n
    return out


def tp_layer_collectives(tokens: int, d_model: int, tp: int, sp: bool, act_bytes: int = 2
                         ) -> list[tuple[str, str, int, str]]:
    """Tensor-parallel collectives of one block for one microbatch of ``tokens`` tokens on this rank:
    (what, op, payload bytes, phase "fwd"/"bwd"). S = tokens x D x act_bytes.

    Without SP: all-reduce after the attention and after the MLP (row-parallel outputs) in forward, and of
    the input gradients of both column-parallel entries in backward. With SP each becomes a reduce-scatter
    plus an all-gather of the same S (the same wire bytes). All are on the critical path (seed 000:
    "on critical path"). Summed over layers this is ``tp_comm_bytes`` without its embedding, loss and norm
    terms.
    """
    if tp <= 1:
        return []
    s = tokens * d_model * act_bytes
    if not sp:
        return [("attention out", "all_reduce", s, "fwd"), ("mlp out", "all_reduce", s, "fwd"),
                ("attention in grad", "all_reduce", s, "bwd"), ("mlp in grad", "all_reduce", s, "bwd")]
    return [("attention in (seq gather)", "all_gather", s, "fwd"), ("attention out", "reduce_scatter", s, "fwd"),
            ("mlp in (seq gather)", "all_gather", s, "fwd"), ("mlp out", "reduce_scatter", s, "fwd"),
            ("attention out grad", "all_gather", s, "bwd"), ("attention in grad", "reduce_scatter", s, "bwd"),
            ("mlp out grad", "all_gather", s, "bwd"), ("mlp in grad", "reduce_scatter", s, "bwd")]


def pp_p2p_bytes(tokens: int, d_model: int, tp: int = 1, sp: bool = False, hidden_bytes: int = 4) -> int:
    """Bytes one rank sends across one stage boundary per microbatch and direction (the hidden state forward,
    its gradient backward); with SP each tp rank holds and sends 1/tp of the sequence."""
    return tokens * d_model * hidden_bytes // (tp if sp else 1)


def cp_ring_bytes(tokens: int, cfg: ModelConfig, cp: int, tp: int = 1, act_bytes: int = 2) -> dict[str, int]:
    """Ring attention (context parallelism) per block per microbatch, ``tokens`` = this rank's tokens (already
    1/cp of the sequence): forward passes the key/value chunk cp-1 times round the ring; backward passes
    it again plus the key/value gradients. Bytes sent per rank by phase; each step overlaps the attention
    on the chunk it already holds."""
    if cp <= 1:
        return {"fwd": 0, "bwd": 0}
    kv = tokens * 2 * (cfg.kv_heads // max(1, min(tp, cfg.kv_heads))) * cfg.head_dim * act_bytes
    return {"fwd": (cp - 1) * kv, "bwd": 2 * (cp - 1) * kv}


def cp_comm_bytes(cfg: ModelConfig, cp: int, tp: int, tokens: int, attention: str = "ring", layers: int = 1,
                  micro: int = 1, kv_bytes: int = 4, recompute: bool = False) -> dict[tuple[str, str], int]:
    """Payload bytes per rank per step on the cp axis (meshtrain/parallel/context.py), ``tokens`` = this rank's
    tokens of one microbatch (1/cp of each sequence), kv = its stacked K and V (kv heads / tp).

    Ring: forward sends (and receives) K/V cp-1 times; backward passes K/V round again and the dK/dV
    accumulators (fp32) cp-1 hops home. All-gather: one all-gather of K/V forward, one reduce-scatter of
    dK/dV (fp32) backward. Recompute reruns the forward's transfers."""
    if cp <= 1:
        return {}
    kv = 2 * tokens * (cfg.kv_heads // tp) * cfg.head_dim
    n = layers * micro
    if attention == "ring":
        b = n * (cp - 1) * kv * ((3 if recompute else 2) * kv_bytes + 4)
        return {("cp", "send"): b, ("cp", "recv"): b}
    return {("cp", "all_gather"): n * cp * kv * kv_bytes * (2 if recompute else 1),
            ("cp", "reduce_scatter"): n * cp * kv * 4}


def ep_all_to_all_bytes(tokens: int, d_model: int, top_k: int, ep: int, act_bytes: int = 2) -> dict[str, int]:
    """Expert parallelism per MoE layer per microbatch: dispatch and combine all-to-alls of
    tokens x top_k x D (forward), and the same two for the gradients in backward (payload per rank)."""
    if ep <= 1:
        return {"fwd": 0, "bwd": 0}
    s = tokens * top_k * d_model * act_bytes
    return {"fwd": 2 * s, "bwd": 2 * s}


def ep_comm_bytes(tokens: int, cfg: ModelConfig, ep: int, act_bytes: int = 4, recompute: bool = False) -> int:
    """All-to-all payload bytes of one rank per MoE layer per microbatch under expert parallelism
    (meshtrain/parallel/expert.py), with ``tokens`` = the tokens the rank's block sees (1/cp of each sequence,
    1/tp more under SP): the per-expert counts (E int64), the dispatched rows (tokens x top_k x D), the rows
    its experts send back, and in backward the same two row exchanges reversed. What a rank's experts
    receive depends on the routing; summed over the ep group it is the group's tokens x top_k, so the
    group's total is exactly ep times this balanced figure (dropless routing). Recompute repeats the forward
    three."""
    if ep <= 1:
        return 0
    rows = tokens * cfg.moe_top_k * cfg.d_model * act_bytes
    counts = 8 * cfg.moe_experts
    return counts + 4 * rows + ((counts + 2 * rows) if recompute else 0)


def expert_params_per_rank(cfg: ModelConfig, ep: int, layers: int) -> int:
    """Routed-expert parameters one expert-parallel rank holds (E/ep whole experts in each MoE layer)."""
    return layers * cfg.moe_experts // ep * 3 * cfg.d_model * cfg.expert_hidden


# ----------------------------------------------------------------------------- compute time


def layer_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one block (matmuls + causal attention), from ``stage_part_flops``."""
    return stage_part_flops(cfg, seq_len)[1]


def block_params(cfg: ModelConfig) -> int:
    """Parameters of one block (attention, MLP, two norms)."""
    pc = param_count(cfg)
    return (pc.attention + pc.mlp) // cfg.n_layers + 2 * cfg.d_model


def layer_compute_time(cfg: ModelConfig, tokens: int, seq_len: int, flops: float, hbm_bw: float = 0.0,
                       tp: int = 1, efficiency: float = 1.0, weight_bytes: int = 2, act_bytes: int = 2) -> float:
    """Forward seconds of one block on one device for ``tokens`` tokens: the roofline max of its FLOPs
    (split tp ways) at ``efficiency`` x peak and of its HBM traffic (weights read once, activations written
    and read once) when ``hbm_bw`` is given. Small microbatches on wide tensor parallelism turn HBM-bound."""
    t_flops = tokens * layer_flops(cfg, seq_len) / tp / (flops * efficiency)
    if hbm_bw <= 0:
        return t_flops
    traffic = block_params(cfg) / tp * weight_bytes + 2 * tokens * activation_elems_per_token(cfg, "none", tp) \
        * act_bytes
    return max(t_flops, traffic / hbm_bw)


# ----------------------------------------------------------------------------- memory


def state_bytes(n_params: float, zero: int, n_shard: int, param_bytes: float = 4, grad_bytes: float = 4,
                optim_bytes: float = 8) -> dict[str, float]:
    """Per-device parameters, gradients and optimizer state for ZeRO stage ``zero`` over ``n_shard`` ranks
    (the ZeRO paper, Rajbhandari et al. 2020, Figure 1): stage 1 shards the optimizer state, stage 2 also
    the gradients, stage 3 also the parameters. The paper's example, 7.5B parameters on 64 ranks with
    2 + 2 + K=12 bytes: 120 / 31.4 / 16.6 / 1.9 GB. ``dp_state_bytes`` is the same with the runtime's
    padding and 4 + 4 + 8 bytes."""
    n = max(1, n_shard) if zero > 0 else 1
    return {"params": param_bytes * n_params / (n if zero >= 3 else 1),
            "grads": grad_bytes * n_params / (n if zero >= 2 else 1),
            "optim": optim_bytes * n_params / (n if zero >= 1 else 1)}


def activation_elems_per_token(cfg: ModelConfig, recompute: str = "none", tp: int = 1, sp: bool = False) -> float:
    """Elements one block keeps for backward per token on one rank (activation memory = this x tokens x
    layers x bytes). Counted from meshtrain's block (RMSNorm, fused QKV, SDPA, wo, SwiGLU) with
    D = d_model, F = MLP hidden, kv = n_kv_heads x head_dim:

    - ``none``: norm inputs 2D and the column-parallel inputs 2D (normed activations), QKV D + 2kv, attention
      output D, gate/up 2F, SiLU and product 2F. Without SP the D-sized tensors are whole on every tp rank;
      with SP the norm inputs are sequence-sharded (1/tp) but the gathered column-parallel inputs are not
      (meshtrain keeps them for the weight gradient; Megatron re-gathers instead). The rest is split tp ways.
    - ``selective`` (meshtrain's policy: keep matmul and attention outputs, recompute norms, RoPE, SiLU and
      products): block input D, QKV D + 2kv, attention output D, wo and w2 outputs (whole partial sums, 2D),
      gate/up 2F.
    - ``full``: only the block input D.
    Flash attention keeps no T x T scores, so there is no quadratic term.
    """
    d, f = cfg.d_model, cfg.hidden_dim
    kv = cfg.kv_heads * cfg.head_dim
    seq = tp if sp else 1  # what sequence parallelism divides
    if recompute == "full":
        return d / seq
    if recompute == "selective":
        return d / seq + 2 * d + (d + 2 * kv + d + 2 * f) / tp
    if recompute == "none":
        return 2 * d / seq + 2 * d + (d + 2 * kv + d + 4 * f) / tp
    raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")


def activation_bytes(cfg: ModelConfig, tokens: int, layers: int, recompute: str = "none", tp: int = 1,
                     sp: bool = False, act_bytes: int = 2, inflight: int = 1) -> float:
    """Activation bytes one rank holds: ``inflight`` microbatches (the simulator's peak_inflight under a
    pipeline schedule; 1 without one) of ``tokens`` tokens each (already 1/cp of the sequence under context
    parallelism) through ``layers`` blocks, per ``activation_elems_per_token``; full recompute adds the one
    block rebuilt during backward."""
    out = activation_elems_per_token(cfg, recompute, tp, sp) * tokens * layers * inflight * act_bytes
    if recompute == "full":
        out += activation_elems_per_token(cfg, "none", tp, sp) * tokens * act_bytes
    return out


def pipeline_sim(schedule: str, pp: int, microbatches: int, virtual: int = 1, f: float = 1.0, b: float = 2.0,
                 p2p: float = 0.0, w: float | None = None) -> tuple[float, float, list[int]]:
    """(makespan, idle time per rank, peak in-flight (mb, stage) per rank) of a pipeline schedule from the
    simulator (meshtrain/parallel/pipeline/simulator.py), with per-stage action costs ``f``, ``b`` (``w`` the
    deferred weight part of split schedules, default b/2) and ``p2p`` per cross-rank dependency. The order of
    generated schedules is built with the runtime's default costs, as the runtime builds it. The in-flight
    peaks are what activation memory multiplies (each counts one stage's layers for one microbatch)."""
    sched = _cached_schedule(schedule, pp, microbatches, virtual)
    from meshtrain.plan.simulator import simulate

    res = simulate(sched, f, b, w, p2p)
    return res.makespan, res.idle_time, list(res.peak_inflight)


def bubble_fraction(pp: int, microbatches: int) -> float:
    """The classic pipeline bubble of GPipe / 1F1B, (p - 1) / (m + p - 1) (equal forward/backward split,
    no p2p latency); ``pipeline_sim`` reproduces it for those schedules and computes it for the others."""
    return (pp - 1) / (microbatches + pp - 1)


_SCHEDULES: dict[tuple[str, int, int, int], object] = {}


def _cached_schedule(name: str, pp: int, m: int, v: int):  # noqa: ANN202 - a PipelineSchedule
    key = (name, pp, m, v)
    if key not in _SCHEDULES:
        from meshtrain.plan.schedules import build_schedule

        _SCHEDULES[key] = build_schedule(name, pp, m, v)
    return _SCHEDULES[key]


# ----------------------------------------------------------------------------- step time


def exposed(comm: float, window: float, tail: float = 0.0) -> float:
    """Communication left on the critical path when ``comm`` seconds overlap ``window`` seconds of compute,
    plus a ``tail`` that cannot overlap (the last bucket, issued after the last compute it depends on)."""
    return max(0.0, comm - window) + min(tail, comm)


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


def step_mfu(model_flops_per_step: float, n_devices: int, peak_flops: float, step_s: float) -> float:
    """MFU of a predicted step: model FLOPs (no recomputation) over the devices' peak for ``step_s`` seconds."""
    return model_flops_per_step / (n_devices * peak_flops * step_s) if step_s > 0 else 0.0


def days_for_tokens(token_budget: float, tokens_per_step: float, step_s: float) -> float:
    """Days to train ``token_budget`` tokens at ``tokens_per_step`` per ``step_s`` seconds."""
    return token_budget / tokens_per_step * step_s / 86400.0
