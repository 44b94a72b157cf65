"""Communication bytes of each strategy, per rank.

Bytes are the comm meter's payload bytes per rank (see meshtrain/comm.py), so the runtime can be checked
against them exactly (``plan/check.py``); ``plan/network.py`` turns them into seconds.
"""

from __future__ import annotations

from meshtrain.config import ModelConfig
from meshtrain.plan.units import padded_numel, unit_numels


def dp_comm_bytes(cfg: ModelConfig, zero: int, dp: int, grad_accum: int = 1, layout: str = "flat",
                  dp_shard: int = 0, compute_bytes: int = 4, reshard_after_forward: bool = True,
                  units: list[int] | None = None, reduce_bytes: int = 4) -> dict[tuple[str, str], int]:
    """Payload bytes per rank per step of each (group, collective) of the data-parallel family. Gradients
    travel in ``reduce_bytes`` per element (``parallel.reduce_dtype``: 4 fp32, 2 bf16), ZeRO-1/2's updated
    parameters in fp32, ZeRO-3's gathers in ``compute_bytes`` (``train.dtype``).

    - DP: one all-reduce of the gradients, once per step (accumulation communicates last).
    - ZeRO-1: reduce-scatter of the gradients + all-gather of the updated parameters, per unit,
      each padded to a multiple of the shard group; ZeRO-2 reduce-scatters every microbatch.
      The per-tensor layout reduces each tensor to its owner and broadcasts it back instead.
    - ZeRO-3: all-gather of each unit in forward and again in backward (if resharded after
      forward), in the compute dtype, and a reduce-scatter of its gradient, every microbatch.
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
            raise ValueError("parallel.zero_layout=per_tensor with HSDP (parallel.dp_shard) is not modelled: its bytes "
                             "depend on which rank owns each tensor (the byte check covers zero_layout=flat)")
        if n == 1:
            return {}
        return {("dp_shard_cp", "reduce"): (grad_accum if zero == 2 else 1) * reduce_bytes * psi,
                ("dp_shard_cp", "broadcast"): 4 * psi}
    return dp_family_bytes(units, zero, dp, grad_accum, dp_shard, grad_bytes=reduce_bytes, gather_bytes=compute_bytes,
                           reshard_after_forward=reshard_after_forward)


def dp_family_bytes(units: list[int], zero: int, dp: int, grad_accum: int = 1, dp_shard: int = 0,
                    grad_bytes: int = 4, param_bytes: int = 4, gather_bytes: int = 4,
                    reshard_after_forward: bool = True) -> dict[tuple[str, str], int]:
    """Payload bytes per rank per step of the data-parallel family (flat layout) for a rank holding
    ``units`` (parameters per sharding unit, e.g. a tensor-parallel shard of each block, or one pipeline
    stage's blocks). ``grad_bytes`` is what the gradient collectives send per element (the precision's
    ``reduce``). With ``unit_numels(cfg)``, param bytes 4, ``grad_bytes = reduce_bytes`` and
    ``gather_bytes = compute_bytes`` it equals ``dp_comm_bytes`` (tests hold them equal); the planner passes its
    precision and each rank's units.

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
    padded = sum(padded_numel(u, n) for u in units)
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


def tp_comm_bytes(cfg: ModelConfig, tp: int, sp: bool, tokens: int, grad_accum: int = 1, act_bytes: int = 4,
                  layers: int | None = None, embedding: bool = True, head: bool = True,
                  norm_elems: int | None = None, recompute: bool = False, mlp_tp: bool = True,
                  kv_elems: int | None = None, sp_regather: bool = True, regather_bytes: int | None = None,
                  exit_bytes: int | None = None) -> dict[tuple[str, str], int]:
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

    With fewer kv heads than tp, each rank's wk and wv hold one kv head shared by tp / n_kv_heads ranks: their
    fp32 gradients (``kv_elems`` of them in this rank's optimizer pieces, default 2 x head_dim x d per layer) are
    all-reduced over that "tp_kv" group once per step.

    ``sp_regather`` (SP only, ``parallel.sp_regather``): each column-parallel layer (fused QKV, fused gate/up,
    the head) saves its sequence shard and all-gathers it again in backward: one more all-gather of S per
    column layer and microbatch (2 per block, 1 with MoE, + 1 for the head). Recompute does not change this count.

    Dtypes: everything tp moves per token is in the compute dtype, ``act_bytes`` per element (fp32 4, bf16 2):
    the embedding's output, the norms' outputs entering the column-parallel layers and the re-gathered shards,
    what leaves a row-parallel layer, and their gradients (under bf16 autocast the residual stream is bf16 too:
    model/layers.py). The loss's per-token values and the replicated weights' gradients are fp32.
    """
    if tp == 1:
        return {}
    n_layers = cfg.n_layers if layers is None else layers
    act = tokens * cfg.d_model * act_bytes
    exits = (2 if mlp_tp else 1) * n_layers  # row-parallel outputs per microbatch
    entries = exits + (1 if embedding else 0) + (1 if head else 0)  # column inputs, the embedding's output
    loss = 3 * 4 * tokens if head else 0
    if norm_elems is None:
        norm_elems = (2 * n_layers + (1 if head else 0)) * cfg.d_model
    norms = norm_elems * 4
    again = n_layers if recompute else 0  # recompute repeats each block's entries and its attention's exit
    each_way = (entries + exits) * act  # forward + backward, one direction of SP's pair each
    if sp:
        columns = (2 if mlp_tp else 1) * n_layers + (1 if head else 0) if sp_regather else 0
        regather = columns * act
        out = {("tp", "all_gather"): grad_accum * (each_way + (2 if mlp_tp else 1) * again * act + regather),
               ("tp", "reduce_scatter"): grad_accum * (each_way + again * act),
               ("tp", "all_reduce"): grad_accum * loss + norms}
    else:
        out = {("tp", "all_reduce"): grad_accum * (each_way + again * act + loss) + norms}
    if cfg.kv_heads < tp:
        out[("tp_kv", "all_reduce")] = 4 * (2 * n_layers * cfg.head_dim * cfg.d_model if kv_elems is None
                                            else kv_elems)
    return {k: v for k, v in out.items() if v}


# The backward collectives a column-parallel layer runs beside its own matmuls (``parallel/tensor.py``): with SP
# (``_GatherLinear``, with ``sp_regather``) the re-gather of its input under the input-gradient matmul, then the
# input gradient's reduce-scatter under the weight-gradient matmul; without SP (``_CopyLinear``) the input gradient's
# all-reduce under the weight-gradient matmul. By ``tp_layer_collectives``' names: the layer.
TP_BESIDE_MATMUL = {"attention in (seq re-gather)": "attention", "attention in grad": "attention",
                    "mlp in (seq re-gather)": "mlp", "mlp in grad": "mlp"}


def tp_layer_collectives(tokens: int, d_model: int, tp: int, sp: bool, act_bytes: int = 2,
                         sp_regather: bool = True, mlp_tp: bool = True) -> list[tuple[str, str, int, str]]:
    """Tensor-parallel collectives of one block for one microbatch of ``tokens`` tokens on this rank:
    (what, op, payload bytes, phase "fwd"/"bwd").

    Without SP: all-reduce after the attention and after the MLP (row-parallel outputs) in forward, and of
    the input gradients of both column-parallel entries in backward. With SP each becomes a reduce-scatter
    plus an all-gather of the same activation (the same wire bytes), and with ``sp_regather`` backward all-gathers
    each column-parallel input again. Seed 000 counts them all on the critical path; the runtime runs a column
    layer's backward ones (with SP and ``sp_regather`` two, without SP one) beside its matmuls
    (``TP_BESIDE_MATMUL``), which the step time hides where the hardware overlaps (``steptime.tp_hidden_backward``).
    Summed over layers this is ``tp_comm_bytes`` without its embedding, head, loss and norm terms.

    Dtypes as ``tp_comm_bytes``: every activation and gradient is ``act_bytes`` per element (the compute dtype).
    ``mlp_tp=False`` (a MoE block, as ``tp_comm_bytes``): the attention's collectives only.
    """
    if tp <= 1:
        return []
    if not mlp_tp:
        return [c for c in tp_layer_collectives(tokens, d_model, tp, sp, act_bytes, sp_regather)
                if not c[0].startswith("mlp")]
    out_s = in_s = tokens * d_model * act_bytes
    if not sp:
        return [("attention out", "all_reduce", out_s, "fwd"), ("mlp out", "all_reduce", out_s, "fwd"),
                ("attention in grad", "all_reduce", in_s, "bwd"), ("mlp in grad", "all_reduce", in_s, "bwd")]
    out = [("attention in (seq gather)", "all_gather", in_s, "fwd"), ("attention out", "reduce_scatter", out_s, "fwd"),
           ("mlp in (seq gather)", "all_gather", in_s, "fwd"), ("mlp out", "reduce_scatter", out_s, "fwd"),
           ("attention out grad", "all_gather", out_s, "bwd"), ("attention in grad", "reduce_scatter", in_s, "bwd"),
           ("mlp out grad", "all_gather", out_s, "bwd"), ("mlp in grad", "reduce_scatter", in_s, "bwd")]
    if sp_regather:
        out += [("attention in (seq re-gather)", "all_gather", out_s, "bwd"),
                ("mlp in (seq re-gather)", "all_gather", out_s, "bwd")]
    return out


def pp_p2p_bytes(tokens: int, d_model: int, tp: int = 1, sp: bool = False, hidden_bytes: int = 4) -> int:
    """Bytes one rank sends across one stage boundary per microbatch and direction (the hidden state forward,
    its gradient backward, ``hidden_bytes`` per element: the compute dtype's); with SP each tp rank holds and
    sends 1/tp of the sequence."""
    return tokens * d_model * hidden_bytes // (tp if sp else 1)


def cp_block_elems(cfg: ModelConfig, tokens: int, tp: int = 1) -> tuple[int, int]:
    """(query elements, key + value elements) one tp rank's ``tokens`` give one block's attention: the payloads every
    context-parallel attention moves. A rank holds whole kv heads (tp > kv heads: one, replicated)."""
    return tokens * (cfg.n_heads // tp) * cfg.head_dim, 2 * tokens * max(cfg.kv_heads // tp, 1) * cfg.head_dim


def cp_ring_bytes(tokens: int, cfg: ModelConfig, cp: int, tp: int = 1, act_bytes: int = 2) -> dict[str, int]:
    """Ring attention (context parallelism) per block per microbatch, ``tokens`` = this rank's tokens (already
    1/cp of the sequence): forward passes the key/value chunk cp-1 times round the ring; backward passes
    it again plus the key/value gradients' accumulators (fp32, as the runtime keeps them). Bytes sent per rank by
    phase (``cp_comm_bytes``' ring send, split by phase); each step overlaps the attention on the chunk it already
    holds."""
    if cp <= 1:
        return {"fwd": 0, "bwd": 0}
    _, kv = cp_block_elems(cfg, tokens, tp)
    return {"fwd": (cp - 1) * kv * act_bytes, "bwd": (cp - 1) * kv * (act_bytes + 4)}


def cp_comm_bytes(cfg: ModelConfig, cp: int, tp: int, tokens: int, attention: str = "ring", layers: int = 1,
                  micro: int = 1, kv_bytes: int = 4, recompute: bool = False) -> dict[tuple[str, str], int]:
    """Payload bytes per rank per step on the cp axis (meshtrain/parallel/context.py), ``tokens`` = this rank's
    tokens of one microbatch (1/cp of each sequence), kv = its stacked K and V (kv heads / tp).

    Ring: forward sends (and receives) K/V cp-1 times; backward passes K/V round again and the dK/dV
    accumulators (fp32) cp-1 hops home. All-gather: one all-gather of K/V forward, one reduce-scatter of
    dK/dV (fp32) backward. Ulysses (``parallel/ulysses.py``): per block one all-to-all of q, k and v and one of the
    output forward, the same two reversed backward, all in the activations' dtype (``kv_bytes``). Recompute reruns
    the forward's transfers."""
    if cp <= 1:
        return {}
    q, kv = cp_block_elems(cfg, tokens, tp)
    n = layers * micro
    if attention == "ulysses":
        return {("cp", "all_to_all"): n * (2 * q + kv) * kv_bytes * (3 if recompute else 2)}
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


# --- Calls: how many collectives a rank issues per step, beside how many bytes (the comm meter counts both).
# Each call costs host work (Python, the meter, waking a peer) whatever its size: on a CPU mesh of small tensors
# that, not the bytes, is most of a collective's time, so the step-time model prices calls (``Hardware.call_s``).

def dp_family_calls(n_units: int, zero: int, dp: int, grad_accum: int = 1, dp_shard: int = 0,
                    reshard_after_forward: bool = True, buckets: int = 1) -> dict[tuple[str, str], int]:
    """Calls per rank per step of the data-parallel family, for the same cases as ``dp_family_bytes`` (flat
    layout): DP all-reduces each of its ``buckets`` once; ZeRO-1/2 reduce-scatter every unit (every microbatch
    under ZeRO-2) and all-gather it once; ZeRO-3 all-gathers every unit per microbatch in forward and again in
    backward when resharded, and reduce-scatters it per microbatch; HSDP all-reduces each unit's shard over the
    replicas once."""
    if zero == 0:
        return {("dp_cp", "all_reduce"): buckets} if dp > 1 else {}
    n = dp_shard or dp
    out: dict[tuple[str, str], int] = {}
    if n > 1:
        out[("dp_shard_cp", "reduce_scatter")] = (grad_accum if zero >= 2 else 1) * n_units
        out[("dp_shard_cp", "all_gather")] = n_units if zero in (1, 2) else \
            grad_accum * (2 if reshard_after_forward else 1) * n_units
    if dp // n > 1:
        out[("dp_replicate", "all_reduce")] = n_units
    return out


def tp_calls(tp: int, sp: bool, grad_accum: int = 1, layers: int = 1, embedding: bool = True, head: bool = True,
             norms: bool = True, recompute: bool = False, mlp_tp: bool = True, kv_shared: bool = False,
             sp_regather: bool = True) -> dict[tuple[str, str], int]:
    """Calls per rank per step on the tp axis, term by term as ``tp_comm_bytes`` counts its bytes: per microbatch
    one collective per block entry/exit, embedding and head (each a reduce-scatter + an all-gather under SP),
    the repeated ones under recompute, SP's re-gathers, the loss's three all-reduces; once per step the
    replicated norms' gradients (one all-reduce) and the shared kv heads' (one, on ``tp_kv``)."""
    if tp == 1:
        return {}
    per_block = 4 if mlp_tp else 2
    count = per_block * layers + (1 if embedding else 0) + (1 if head else 0)
    again = layers if recompute else 0
    loss = 3 if head else 0
    if sp:
        columns = ((2 if mlp_tp else 1) * layers + (1 if head else 0)) if sp_regather else 0
        out = {("tp", "all_gather"): grad_accum * (count + (2 if mlp_tp else 1) * again + columns),
               ("tp", "reduce_scatter"): grad_accum * (count + again),
               ("tp", "all_reduce"): grad_accum * loss + (1 if norms else 0)}
    else:
        out = {("tp", "all_reduce"): grad_accum * (count + again + loss) + (1 if norms else 0)}
    if kv_shared:
        out[("tp_kv", "all_reduce")] = 1
    return {k: v for k, v in out.items() if v}


def cp_calls(cp: int, attention: str = "ring", layers: int = 1, micro: int = 1, recompute: bool = False
             ) -> dict[tuple[str, str], int]:
    """Calls per rank per step on the cp axis (``cp_comm_bytes``' transfers one by one): ring attention sends and
    receives K/V cp-1 times per block forward, again in backward plus the dK/dV accumulators' cp-1 hops home
    (and the forward's again under recompute); all-gather attention gathers once per block (twice under
    recompute) and reduce-scatters dK/dV once; ulysses exchanges twice per block each way (and the forward's again
    under recompute)."""
    if cp <= 1:
        return {}
    n = layers * micro
    if attention == "ulysses":
        return {("cp", "all_to_all"): n * (6 if recompute else 4)}
    if attention == "ring":
        c = n * (cp - 1) * (4 if recompute else 3)
        return {("cp", "send"): c, ("cp", "recv"): c}
    return {("cp", "all_gather"): n * (2 if recompute else 1), ("cp", "reduce_scatter"): n}


def ep_calls(ep: int, layers: int = 1, micro: int = 1, recompute: bool = False) -> dict[tuple[str, str], int]:
    """All-to-alls per rank per step under expert parallelism (``ep_comm_bytes``' pieces): per MoE block and
    microbatch the per-expert counts, dispatch and combine forward, the two row exchanges reversed in
    backward; recompute repeats the forward three."""
    if ep <= 1:
        return {}
    return {("ep", "all_to_all"): layers * micro * (5 + (3 if recompute else 0))}
