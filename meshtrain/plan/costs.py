"""The one FLOP/parameter model: the trainer's MFU, the planner and the tests all read it.

Notation follows the scaling book (seed 000): D = d_model, F = MLP hidden, L = layers,
V = vocabulary, T = sequence length. Training FLOPs per token are 6 x (matmul parameters)
plus the attention score/value term, 6 x 2 x L x T x D for causal attention (half of the
full T x T square, forward 2 matmuls x 2 FLOPs, backward twice forward).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.config import ModelConfig


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts by part; ``total`` counts a tied embedding once."""

    embedding: int
    attention: int  # per model, all layers
    mlp: int
    norms: int
    head: int

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.mlp + self.norms + self.head

    @property
    def matmul(self) -> int:
        """Parameters that take part in a matmul for every token (the head, not the embedding lookup)."""
        return self.attention + self.mlp + self.head


def param_count(cfg: ModelConfig) -> ParamCount:
    """Exact parameter counts of ``meshtrain.model.Llama`` for this config."""
    d, hd, layers = cfg.d_model, cfg.head_dim, cfg.n_layers
    attn = d * cfg.n_heads * hd * 2 + d * cfg.kv_heads * hd * 2  # wq, wo; wk, wv
    mlp = 3 * d * cfg.hidden_dim
    embedding = cfg.vocab_size * d
    head = cfg.vocab_size * d
    return ParamCount(
        embedding=embedding,
        attention=layers * attn,
        mlp=layers * mlp,
        norms=(2 * layers + 1) * d,
        head=0 if cfg.tie_embeddings else head,
    )


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters used in a matmul per token; with tied embeddings the head still multiplies."""
    pc = param_count(cfg)
    return pc.attention + pc.mlp + cfg.vocab_size * cfg.d_model


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
                  dp_shard: int = 0, compute_bytes: int = 4, reshard_after_forward: bool = True
                  ) -> dict[tuple[str, str], int]:
    """Payload bytes per rank per step of each (group, collective) of the data-parallel family.

    - DP: one all-reduce of the fp32 gradients, once per step (accumulation communicates last).
    - ZeRO-1: reduce-scatter of the gradients + all-gather of the updated parameters, per unit,
      each padded to a multiple of the shard group; ZeRO-2 reduce-scatters every microbatch.
      The per-tensor layout reduces each tensor to its owner and broadcasts it back instead.
    - ZeRO-3: all-gather of each unit in forward and again in backward (if resharded after
      forward), in the compute dtype, and a reduce-scatter of its fp32 gradient, every microbatch.
    - HSDP (dp_shard < dp): the above within a shard group, plus an all-reduce of the gradient
      shards over the replicas.
    """
    psi = param_count(cfg).total
    if zero == 0:
        return {("dp_cp", "all_reduce"): 4 * psi} if dp > 1 else {}
    n = dp_shard or dp
    out: dict[tuple[str, str], int] = {}
    units = unit_numels(cfg)
    sent_per_step = grad_accum if zero >= 2 else 1
    if n > 1:
        if zero in (1, 2) and layout == "per_tensor":
            out[("dp_shard_cp", "reduce")] = sent_per_step * 4 * psi
            out[("dp_shard_cp", "broadcast")] = 4 * psi
        else:
            padded = sum(_padded(u, n) for u in units)
            out[("dp_shard_cp", "reduce_scatter")] = sent_per_step * 4 * padded
            if zero in (1, 2):
                out[("dp_shard_cp", "all_gather")] = 4 * padded
            else:
                gathers = 2 if reshard_after_forward else 1
                out[("dp_shard_cp", "all_gather")] = grad_accum * gathers * compute_bytes * padded
    if dp // n > 1:
        shard = psi if (zero in (1, 2) and layout == "per_tensor") else sum(_padded(u, n) for u in units) // n
        if layout == "per_tensor" and zero in (1, 2):
            raise ValueError("per-tensor HSDP bytes depend on the ownership; not modelled")
        out[("dp_replicate", "all_reduce")] = 4 * shard
    return out


def dp_state_bytes(cfg: ModelConfig, zero: int, dp: int, dp_shard: int = 0, optim_bytes_per_param: int = 8
                   ) -> dict[str, float]:
    """Per-rank bytes of fp32 parameters, fp32 gradients and optimizer state (AdamW: two fp32
    moments, K = 8 bytes per parameter) for each ZeRO stage: the ZeRO paper's 2+2+K, 2+2+K/N,
    2+(2+K)/N and (4+K)/N with our dtypes (4-byte parameters and gradients, no separate master)."""
    psi = param_count(cfg).total
    n = (dp_shard or dp) if zero > 0 else 1
    padded = sum(_padded(u, n) for u in unit_numels(cfg)) if zero > 0 else psi
    return {
        "params": 4.0 * (padded / n if zero == 3 else padded),
        "grads": 4.0 * (padded / n if zero >= 2 else padded),
        "optim": optim_bytes_per_param * (padded / n if zero >= 1 else psi),
    }


# ----------------------------------------------------------------------------- tensor parallelism


def tp_comm_bytes(cfg: ModelConfig, tp: int, sp: bool, tokens: int, grad_accum: int = 1, act_bytes: int = 4
                  ) -> dict[tuple[str, str], int]:
    """Payload bytes per rank per step on the tp axis (meshtrain/parallel/tensor.py).

    ``tokens`` is the tokens of one microbatch on this rank (rows x seq_len); S = tokens x d_model x
    act_bytes is one activation. Per microbatch, without SP: forward all-reduces after the embedding
    and after each block's attention and MLP (2L + 1), backward all-reduces the input gradients of
    each block's two column-parallel entries and of the head (2L + 1). With SP each all-reduce
    becomes a reduce-scatter plus an all-gather of the same S (the same volume, split). The loss
    adds three fp32 all-reduces of one value per token (max, sum of exp, target logit); once per step
    the replicated norm weights' gradients ((2L + 1) x d fp32) are all-reduced.
    """
    if tp == 1:
        return {}
    s = tokens * cfg.d_model * act_bytes
    per_dir = (2 * cfg.n_layers + 1) * s
    loss = 3 * 4 * tokens
    norms = (2 * cfg.n_layers + 1) * cfg.d_model * 4
    if sp:
        return {("tp", "all_gather"): grad_accum * 2 * per_dir, ("tp", "reduce_scatter"): grad_accum * 2 * per_dir,
                ("tp", "all_reduce"): grad_accum * loss + norms}
    return {("tp", "all_reduce"): grad_accum * (2 * per_dir + loss) + norms}


# ----------------------------------------------------------------------------- pipeline partitioning


def stage_part_flops(cfg: ModelConfig, seq_len: int) -> tuple[float, float, float]:
    """Forward FLOPs per token of (the embedding, one block, the final norm + head + loss).

    The embedding is a lookup (no matmul); the head is a d x V matmul plus a softmax over V.
    """
    pc = param_count(cfg)
    block = 2.0 * (pc.attention + pc.mlp) / cfg.n_layers + attention_flops_per_token(cfg, seq_len) / cfg.n_layers
    head = 2.0 * cfg.vocab_size * cfg.d_model + 5.0 * cfg.vocab_size
    return 0.0, block, head
