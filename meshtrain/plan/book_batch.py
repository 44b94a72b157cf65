"""Critical batches in their general form: the per-device batch (tokens) below which a strategy's
communication outlasts its matmuls, by strategy.

Every form is the book's ratio of per-device compute to per-device bytes, C / W, multiplied by what the
strategy changes (notation of seed 000: C FLOP/s per chip, W bandwidth of the group, B tokens, N chips):

- DP / FSDP over X devices: the ring moves (X-1)/X of the weights, so B/N > C/W x (X-1)/X; over a axes the
  bandwidth is a W (seed 000: 2,550 per chip on one v5p axis, 850 on three; the book's GPU chapter: 2-node
  DP needs only half the per-GPU batch, 1,237 instead of 2,475).
- a mixture of experts with E experts, k active per token: weights move E/k times the FLOPs' share, so
  B/N > E/k x C/W (GPU chapter: E = 128, k = 4 across H100 nodes: 32 x 2,475 = 79,200).
- between pods over DCN: pure DP per pod, B_pod > C/W_dcn with W_dcn per chip (seed 003: 71,360).
- with Z pipeline stages, each device holds 1/Z of the weights for its replica's whole batch, so the
  per-device batch may be Z times smaller, unless ZeRO-3 gathers the weights again for each of M
  microbatches (M times larger) (GPU chapter, Question 2: 8-way pipelining on H100s, 990e12 / 3200e9 = 309).

Mixed FSDP + TP (seeds 000 / 003) is ``book.mixed_min_batch_per_device``; the HBM roofline (a matmul or a
decode step bound by memory, not network) is ``book_roofline``.
"""

from __future__ import annotations


def dp_critical_batch(flops: float, bandwidth: float, degree: int | None = None, n_axes: int = 1,
                      experts: int = 1, top_k: int = 1) -> float:
    """Tokens per device above which DP / FSDP is compute-bound: C / (n_axes W) x (X-1)/X x E/k.

    ``degree`` X is the data-parallel group size (None: large, factor 1); ``experts`` / ``top_k`` the
    MoE's sparsity (1 / 1 for a dense model)."""
    if not 1 <= top_k <= experts:
        raise ValueError(f"need 1 <= top_k <= experts, got top_k={top_k}, experts={experts}")
    ring = 1.0 if degree is None else (degree - 1) / degree
    return flops / (bandwidth * max(1, n_axes)) * ring * experts / top_k


def dcn_critical_batch(flops: float, dcn_bandwidth: float, pods: int = 1) -> dict[str, float]:
    """Pure DP between ``pods`` pods over DCN (FSDP or anything inside each): tokens each pod needs,
    C / W_dcn with W_dcn per chip (seed 003: 4.46e14 / 6.25e9 = 71,360), and the global batch that makes."""
    per_pod = flops / dcn_bandwidth
    return {"per_pod": per_pod, "global": per_pod * max(1, pods)}


def pipeline_critical_batch(flops: float, bandwidth: float, stages: int, microbatches: int = 1,
                            zero3: bool = False) -> float:
    """Tokens per device above which the data-parallel traffic of a pipelined model (Z = ``stages``) is
    hidden: C / (Z W), or with ZeRO-3, which gathers each stage's weights again for every microbatch,
    M C / (Z W). ``bandwidth`` is the DP group's per-device W (for GPUs across nodes, the book's node
    egress)."""
    if stages < 1 or microbatches < 1:
        raise ValueError(f"stages and microbatches must be >= 1, got {stages}, {microbatches}")
    return flops / (stages * bandwidth) * (microbatches if zero3 else 1)


def pipeline_comm_time(batch: float, d_model: int, bandwidth: float, stages: int, microbatches: int,
                       bytes_per: int = 2) -> float:
    """Seconds of pipeline sends in one pass: (M + Z - 2) hops of a microbatch's activations,
    bytes x B D / (W M) each (the book's GPU chapter, 'Pipeline Parallelism'; it is tiny next to any other
    strategy's traffic)."""
    hops = microbatches + stages - 2
    return bytes_per * batch * d_model / (bandwidth * microbatches) * max(0, hops)
