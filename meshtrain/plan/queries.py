"""The book's analyses as queries about one model and cluster: each returns a JSON-able dict whose ``lines`` are
the text answer. ``meshtrain plan <query>`` (``plan/query_cli.py``) prints one; the closed forms live in
``book.py``, ``book_batch.py``, ``book_memory.py``, ``book_roofline.py`` and ``megatron.py``.

Bandwidths follow the book's conventions, so its figures come out: on a TPU torus W is one ICI axis
(``intra_bw``), DP/FSDP over every axis gets axes x W, mixed FSDP + TP puts FSDP on all axes but one and TP
on one; between pods W is the DCN share per chip. On GPUs, W is a GPU's NVLink egress inside a node and the
node's InfiniBand egress (``inter_bw`` x GPUs per node) across nodes (the book's GPU chapter, W_collective).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.config import ModelConfig
from meshtrain.plan.book import (
    MIXED_REVISIONS,
    book_layer_comm,
    critical_batch_per_device,
    days_to_train,
    mixed_min_batch_per_device,
    optimal_fsdp,
    split_fsdp_tp,
    tp_limit,
)
from meshtrain.plan.book_batch import dcn_critical_batch, dp_critical_batch, pipeline_critical_batch
from meshtrain.plan.book_memory import (
    REMAT_POLICIES,
    STRATEGIES,
    checkpoint_bytes,
    checkpoint_factor,
    largest_model,
    min_devices,
    remat_flops_per_token,
)
from meshtrain.plan.book_roofline import decode_roofline, hbm_critical_batch, matmul_roofline
from meshtrain.plan.flops import flops_per_token, param_count
from meshtrain.plan.generation import generation_layouts
from meshtrain.plan.hardware import Hardware
from meshtrain.plan.megatron import SOURCE as MEGATRON
from meshtrain.plan.megatron import megatron_flops_per_iteration, megatron_params, megatron_training_days
from meshtrain.plan.network import effective_bw, group_link

SEED_000 = "scaling book ch. 5 (seed 000)"
SEED_003 = "scaling book ch. 5, later revision (seed 003)"
BOOK_GPU = "scaling book ch. 12 'How to Think About GPUs'"
BOOK_PART4 = "scaling book ch. 4 'Gradient checkpointing'"
OURS = "meshtrain (plan/flops.py, exact for the model)"


@dataclass(frozen=True)
class Setting:
    """What every query reads: the model, the cluster and the global batch in tokens."""

    model: ModelConfig
    model_name: str
    hw: Hardware
    devices: int
    batch_tokens: int
    seq_len: int

    @property
    def axes(self) -> int:
        return len(self.hw.mesh_axes) or 1

    def dp_bandwidth(self, devices: int | None = None) -> tuple[float, str, int]:
        """W of a DP/FSDP group over ``devices`` (all by default), where it runs, and the ring's size X for
        the (X-1)/X factor (across GPU nodes: the nodes, as the book's GPU chapter counts)."""
        n, hw = devices or self.devices, self.hw
        if n <= hw.domain:
            if hw.torus:
                return hw.intra_bw * self.axes, f"{self.axes} ICI axes x {hw.intra_bw:.3g} B/s", n
            return hw.intra_bw, f"NVLink {hw.intra_bw:.3g} B/s", n
        if hw.torus:  # the pod boundary: the book does pure DP over DCN there (the `dcn` line)
            return hw.intra_bw * self.axes, f"{self.axes} ICI axes inside each pod", hw.domain
        node = hw.inter_bw * hw.devices_per_node
        return node, f"node egress {hw.devices_per_node} x {hw.inter_bw:.3g} B/s", -(-n // hw.devices_per_node)

    def tp_bandwidth(self) -> float:
        return self.hw.intra_bw


def mixed_bandwidths(hw: Hardware, devices: int, tp: int) -> tuple[float, float, str]:
    """(W_X, W_Y, how) for mixed FSDP + TP with ``tp``-way TP: on a torus the book's layout, FSDP on every axis
    but one (W_X = (axes - 1) W) and TP on one (W_Y = W); on a switched fabric TP on the fast fabric and FSDP
    over the group of ranks ``tp`` apart, as the planner's link model times it (across nodes each GPU's NIC
    carries its 1/tp of the weights)."""
    if hw.torus:
        axes = len(hw.mesh_axes)
        return hw.intra_bw * max(1, axes - 1), hw.intra_bw, f"FSDP on {max(1, axes - 1)} ICI axes, TP on 1"
    w_x = effective_bw(group_link(hw, max(1, devices // tp), tp))
    return w_x, hw.intra_bw, f"FSDP over {devices // tp} ranks {tp} apart at {w_x:.3g} B/s, TP on NVLink"


def _fmt(x: float | None) -> str:
    return "no" if x is None else f"{x:,.0f}"


def _tb(x: float) -> str:
    return f"{x / 1e12:,.2f} TB" if x >= 1e12 else f"{x / 1e9:,.1f} GB"


def min_devices_query(s: Setting, remat: str = "ffw", bytes_per_param: float = 10.0, memory_fraction: float = 1.0
                      ) -> dict:
    """The fewest devices that can train the model at all (memory), and under each strategy."""
    cfg, hbm = s.model, s.hw.hbm_bytes * memory_fraction
    p = param_count(cfg).total
    act = checkpoint_bytes(remat, s.batch_tokens, cfg.d_model, cfg.hidden_dim, cfg.n_layers)
    need = min_devices(p, act, hbm, bytes_per_param, s.hw.tp_max, cfg.n_layers)
    lines = [f"{s.model_name}: {p:,} parameters x {bytes_per_param:g} bytes = {_tb(p * bytes_per_param)} of state, "
             f"checkpoints ({remat}) at {s.batch_tokens:,} tokens = {_tb(act)}; {_tb(hbm)} per {s.hw.name}",
             f"  fewest devices at all: {need['any']:,}  ({SEED_000}: state and checkpoints over HBM)"]
    why = {"dp": "state on every device", "fsdp": "everything sharded", "tp": f"at most {s.hw.tp_max}-way",
           "pp": f"at most {cfg.n_layers} stages", "fsdp+tp": "everything sharded"}
    lines += [f"  {k:<8}{_fmt(need[k]):>10}  ({why[k]})" for k in STRATEGIES]
    return {"query": "min-devices", "params": p, "state_bytes": p * bytes_per_param, "checkpoint_bytes": act,
            "hbm_bytes": hbm, "remat": remat, "devices": need, "source": SEED_000, "lines": lines}


def max_model_query(s: Setting, bytes_per_param: float = 10.0, memory_fraction: float = 1.0,
                    with_activations: bool = False) -> dict:
    """The largest model the slice trains with pure DP, FSDP and FSDP + TP (memory), and the batch each needs."""
    cfg, hbm = s.model, s.hw.hbm_bytes * memory_fraction
    act = checkpoint_bytes("ffw", s.batch_tokens, cfg.d_model, cfg.hidden_dim, cfg.n_layers) if with_activations \
        else 0.0
    most = largest_model(hbm, s.devices, act, bytes_per_param)
    w, where, _ = s.dp_bandwidth()
    fsdp_batch = s.devices * critical_batch_per_device(s.hw.bf16_flops, w)
    lines = [f"{s.devices:,} x {s.hw.name} ({_tb(hbm)} each), {bytes_per_param:g} bytes per parameter"
             + (f", minus {s.model_name}'s checkpoints at {s.batch_tokens:,} tokens" if with_activations else
                " (no activations: the book's lower bound)"),
             f"  pure DP  {most['dp'] / 1e9:>12,.1f}B parameters  (HBM per device / {bytes_per_param:g}, {SEED_000})",
             f"  FSDP     {most['fsdp'] / 1e9:>12,.1f}B parameters  (all HBM / {bytes_per_param:g}); compute-bound "
             f"from a global batch of {fsdp_batch:,.0f} tokens (W = {where})",
             f"  FSDP+TP  {most['fsdp+tp'] / 1e9:>12,.1f}B parameters  (same memory; lower batch bound, see "
             f"critical-batch)"]
    return {"query": "max-model", "params": most, "hbm_bytes": hbm, "fsdp_min_batch": fsdp_batch,
            "source": SEED_000, "lines": lines}


def train_time_query(s: Setting, train_tokens: float, mfu: float) -> dict:
    """Days to train on ``train_tokens`` tokens at ``mfu`` on this slice: the book's 6 P T, block remat's
    8 P T, and meshtrain's own FLOPs per token (attention included)."""
    p = param_count(s.model).total
    peak = s.hw.bf16_flops
    book = days_to_train(remat_flops_per_token(p, "none") * train_tokens, s.devices, peak, mfu)
    remat = days_to_train(remat_flops_per_token(p, "block") * train_tokens, s.devices, peak, mfu)
    ours = days_to_train(flops_per_token(s.model, s.seq_len) * train_tokens, s.devices, peak, mfu)
    lines = [f"{s.model_name} ({p / 1e9:.1f}B) on {train_tokens:.3g} tokens, {s.devices:,} x {s.hw.name} at "
             f"{mfu:.0%} MFU:",
             f"  {book:10.1f} days  6 P T FLOPs ({SEED_000})",
             f"  {remat:10.1f} days  8 P T with block remat ({BOOK_PART4}; {MEGATRON}: 8 T P / (n X))",
             f"  {ours:10.1f} days  {OURS}, attention at seq {s.seq_len}"]
    return {"query": "train-time", "days": {"book_6PT": book, "remat_8PT": remat, "meshtrain": ours},
            "params": p, "lines": lines}


def critical_batch_query(s: Setting, pods: int = 0, stages: int = 1, microbatches: int = 1,
                         zero3: bool = False) -> dict:
    """The per-device batch each strategy needs to stay compute-bound, in its general form."""
    hw, cfg, n = s.hw, s.model, s.devices
    c = hw.bf16_flops
    w_dp, where, ring = s.dp_bandwidth()
    e, k = (cfg.moe_experts, cfg.moe_top_k) if cfg.moe_experts else (1, 1)
    have = s.batch_tokens / n
    out: dict = {"query": "critical-batch", "batch_per_device": have, "dp_bandwidth": w_dp}
    one_axis = critical_batch_per_device(c, hw.intra_bw)
    out["dp_one_axis"] = one_axis
    out["dp"] = dp_critical_batch(c, w_dp, degree=ring)
    def row(label: str, value: float, source: str) -> str:
        return f"  {label:<58}{value:>9,.0f}  {source}"

    lines = [f"{s.model_name} on {n:,} x {hw.name}: this batch gives {have:,.0f} tokens per device; "
             f"each strategy is compute-bound above (tokens per device):",
             row("DP/FSDP on one fast axis/link, C/W", one_axis, SEED_000),
             row(f"DP/FSDP over all, W = {where}, x (X-1)/X, X = {ring:,}", out["dp"], f"{SEED_000}; {BOOK_GPU}")]
    if e > 1:
        out["moe"] = dp_critical_batch(c, w_dp, degree=ring, experts=e, top_k=k)
        lines.append(row(f"  mixture of experts: x E/k = {e}/{k}", out["moe"], BOOK_GPU))
    f = cfg.expert_hidden if e > 1 else cfg.hidden_dim
    w = hw.intra_bw
    x, y = split_fsdp_tp(s.batch_tokens, n, f, hw.tp_max)
    w_x, w_y, how = mixed_bandwidths(hw, n, max(2, y))
    for rev in MIXED_REVISIONS:
        book_w = mixed_min_batch_per_device(f, c, w, rev)
        here = mixed_min_batch_per_device(f, c, w, rev, fsdp_bw=w_x, tp_bw=w_y)
        out[f"mixed_{rev}"] = {"book": book_w, "this_cluster": here}
        src = SEED_000 if rev == "000" else SEED_003
        form = "2 (C/W)^2 / F" if rev == "000" else "(C/W)^2 / (2F)"
        lines.append(row(f"FSDP+TP, revision {rev}: {form}, F = {f}, W of one axis", book_w, src))
        lines.append(row(f"  general {'4' if rev == '000' else '1'} C^2 / (F W_X W_Y) on this cluster", here, how))
    out["optimal_split"] = {"x": optimal_fsdp(s.batch_tokens, n, f), "fsdp": x, "tp": y}
    out["tp_limit"] = tp_limit(f, c, w)
    lines.append(f"  optimal split X = sqrt(2BN/F) = {out['optimal_split']['x']:,.0f} -> {x} x {y}; TP is "
                 f"compute-bound up to F W / C = {out['tp_limit']:.1f}-way ({SEED_000})")
    n_pods = pods or (-(-n // hw.domain) if n > hw.domain and hw.torus else 0)
    if n_pods:
        dcn = dcn_critical_batch(c, hw.inter_bw, n_pods)
        out["dcn"] = dcn
        lines.append(row(f"DP between {n_pods} pods over DCN: C / W_dcn per POD", dcn["per_pod"], SEED_003))
    if stages > 1:
        out["pipeline"] = pipeline_critical_batch(c, w_dp, stages, microbatches, zero3)
        label = f"with {stages} pipeline stages: C / (Z W)" + (f" x M, ZeRO-3, M = {microbatches}" if zero3 else "")
        lines.append(row(label, out["pipeline"], BOOK_GPU))
    out["lines"] = lines
    return out


def roofline_query(s: Setting, tokens_per_chip: float | None = None, decode_batch: int = 1) -> dict:
    """Where the model's MLP matmul and a decode step become HBM-bandwidth-bound on this chip."""
    hw, cfg = s.hw, s.model
    crit = hbm_critical_batch(hw.bf16_flops, hw.hbm_bw)
    crit8 = hbm_critical_batch(hw.bf16_flops, hw.hbm_bw, weight_bytes=1)
    b = tokens_per_chip if tokens_per_chip is not None else s.batch_tokens / s.devices
    mm = matmul_roofline(b, cfg.d_model, cfg.hidden_dim, hw.bf16_flops, hw.hbm_bw)
    kv = 2.0 * 2 * cfg.n_layers * cfg.kv_heads * cfg.head_dim * s.seq_len  # bf16 K and V of one full sequence
    p = param_count(cfg).total
    dec = decode_roofline(p, decode_batch, kv, hw.bf16_flops, hw.hbm_bw)
    lines = [f"{hw.name}: C / W_hbm = {hw.bf16_flops:.3g} / {hw.hbm_bw:.3g}",
             f"  a bf16 matmul is compute-bound above {crit:,.0f} tokens per chip (int8 weights: {crit8:,.0f}) "
             f"(scaling book ch. 1 and 7; {SEED_000}: '> 240 tokens' on v5e)",
             f"  MLP in [{b:,.0f}, {cfg.d_model}] x [{cfg.d_model}, {cfg.hidden_dim}]: intensity {mm['intensity']:,.0f}"
             f" FLOPs/byte, {mm['bound']}-bound ({mm['flops_s'] * 1e6:,.1f} us FLOPs, {mm['hbm_s'] * 1e6:,.1f} us HBM)",
             f"  decode step, {decode_batch} sequence(s) with {s.seq_len}-token KV caches: {dec['bound']}-bound, "
             f"{dec['seconds'] * 1e3:,.2f} ms, {dec['tokens_per_s']:,.0f} tokens/s per chip holding the model"]
    return {"query": "roofline", "hbm_critical_batch": crit, "hbm_critical_batch_int8": crit8, "matmul": mm,
            "decode": dec, "lines": lines}


def generate_query(s: Setting, batch: int, context: int, dtype_bytes: int, memory_fraction: float,
                   top: int = 5) -> dict:
    """The generation layouts (tp x pp) on at most ``s.devices`` devices whose weights and KV cache fit, fastest
    decode step first (``plan/generation.py``); where none fits, the leanest and by how much it is over."""
    hw, cfg = s.hw, s.model
    layouts = generation_layouts(cfg, hw, s.devices, batch, context, dtype_bytes, memory_fraction)
    fitting = [e for e in layouts if e.fits]
    budget = memory_fraction * hw.hbm_bytes
    dtype = {2: "bf16", 4: "fp32"}[dtype_bytes]
    lines = [f"{s.model_name}: generation of {batch} sequence(s) at {context:,} positions, {dtype} weights and KV "
             f"cache, on up to {s.devices:,} x {hw.name} ({budget / 1e9:.1f} GB usable each)"]
    lines.append(f"  {'tp':>3} {'pp':>3} {'devices':>7} {'weights':>10} {'KV cache':>10} {'per device':>11} "
                 f"{'step':>10} {'tokens/s':>10}")
    for e in (fitting or layouts)[:top]:
        r = e.row()
        lines.append(f"  {e.tp:>3} {e.pp:>3} {e.devices:>7} {r['weights_bytes'] / 1e9:>8.1f}GB "
                     f"{r['kv_bytes'] / 1e9:>8.1f}GB {e.per_device / 1e9:>9.1f}GB {e.step_s * 1e3:>8.2f}ms "
                     f"{e.tokens_per_s:>10,.0f}" + ("" if e.fits else "  (does not fit)"))
    if fitting:
        fewest = min(fitting, key=lambda e: (e.devices, e.step_s))
        best = fitting[0]
        lines.append(f"fastest: tp={best.tp} pp={best.pp} ({best.devices} devices, {best.step_s * 1e3:.2f} ms a step); "
                     f"fewest devices: tp={fewest.tp} pp={fewest.pp} ({fewest.devices}, {fewest.step_s * 1e3:.2f} ms)")
        launch = f"--nproc {best.devices}" if best.devices <= hw.devices_per_node else \
            f"under torchrun over {-(-best.devices // hw.devices_per_node)} nodes (docs/generation.md)"
        lines.append(f"  meshtrain generate parallel.tp={best.tp} parallel.pp={best.pp} train.dtype={dtype} {launch}")
    else:
        lean = min(layouts, key=lambda e: e.per_device)
        lines.append(f"nothing fits on {s.devices:,} devices: the leanest, tp={lean.tp} pp={lean.pp}, needs "
                     f"{lean.per_device / 1e9:.1f} GB per device ({lean.per_device / budget:.2f}x the budget): "
                     f"give more --devices or --nodes, a smaller --decode-batch or --context")
    lines.append("  (weights exact as meshtrain generate holds them; a step's time from the HBM roofline, stages in "
                 "turn: a model not yet measured on a GPU)")
    return {"query": "generate", "batch": batch, "context": context, "dtype": dtype, "budget_bytes": budget,
            "layouts": [e.row() for e in layouts], "fits": bool(fitting), "lines": lines}


def layer_comm_query(s: Setting) -> dict:
    """One layer's forward matmul time and each axis's communication time, by strategy, with the summed
    (revision 000) and overlapped (003) totals."""
    hw, cfg, n, b = s.hw, s.model, s.devices, s.batch_tokens
    w_dp, _, _ = s.dp_bandwidth()
    x, y = split_fsdp_tp(b, n, cfg.hidden_dim, hw.tp_max)
    if y < 2 <= n:  # the optimum wants no TP; the mixed row keeps the smallest real TP axis (as --plot does)
        x, y = n // 2, 2
    w_x, w, _ = mixed_bandwidths(hw, n, y)
    rows = {}
    for strat, bw_x in (("fsdp", w_dp), ("tp", w_dp), ("fsdp+tp", w_x)):
        t = book_layer_comm(strat, b, n, cfg.d_model, cfg.hidden_dim, hw.bf16_flops, bw_x, w,
                            x if strat == "fsdp+tp" else None)
        rows[strat] = {**t, "sum_000": t["x"] + t["y"], "overlap_003": max(t["x"], t["y"])}
    lines = [f"{s.model_name}, one layer forward at {b:,} tokens on {n:,} x {hw.name} ({SEED_000} per-strategy "
             f"algebra; FSDP+TP at {x} x {n // x}):",
             f"  {'strategy':<9}{'matmuls':>11}{'X axes (weights)':>18}{'Y axis (acts)':>15}{'sum (000)':>11}"
             f"{'max (003)':>11}"]
    for strat, t in rows.items():
        lines.append(f"  {strat:<9}" + "".join(f"{t[k] * 1e3:>{wd}.3f}ms" for k, wd in
                                                (("math", 9), ("x", 16), ("y", 13), ("sum_000", 9),
                                                 ("overlap_003", 9))))
    return {"query": "layer-comm", "fsdp_tp_split": [x, n // x], "layers": rows, "lines": lines}


def activations_query(s: Setting) -> dict:
    """Checkpoint memory in the book's c x [B, D] form for each remat policy, whole batch and per device."""
    cfg, b = s.model, s.batch_tokens
    rows = {}
    lines = [f"{s.model_name}: bf16 checkpoints of c x [B, D] per layer, B = {b:,}, D = {cfg.d_model}, "
             f"L = {cfg.n_layers} ({BOOK_PART4}; {SEED_000} Q2 for ffw)"]
    for pol in REMAT_POLICIES:
        c = checkpoint_factor(pol, cfg.d_model, cfg.hidden_dim)
        tot = checkpoint_bytes(pol, b, cfg.d_model, cfg.hidden_dim, cfg.n_layers)
        rows[pol] = {"c": c, "bytes": tot, "per_device": tot / s.devices,
                     "flops_per_param_token": remat_flops_per_token(1.0, pol)}
        lines.append(f"  {pol:<12} c = {c:5.2f}  {_tb(tot):>12}  {_tb(tot / s.devices):>10} per device of "
                     f"{s.devices:,}  {rows[pol]['flops_per_param_token']:.0f} N FLOPs per token")
    return {"query": "activations", "policies": rows, "lines": lines}


def megatron_query(s: Setting, train_tokens: float, tflops: float) -> dict:
    """The Megatron-LM paper's closed forms beside meshtrain's own counts, each labelled."""
    cfg = s.model
    seqs = max(1, s.batch_tokens // s.seq_len)
    mp = megatron_params(cfg.n_layers, cfg.d_model, cfg.vocab_size, s.seq_len)
    ours_p = param_count(cfg).total
    mf = megatron_flops_per_iteration(seqs, s.seq_len, cfg.n_layers, cfg.d_model, cfg.vocab_size)
    ours_f = flops_per_token(cfg, s.seq_len) * seqs * s.seq_len * 4.0 / 3.0  # + one forward: full recompute
    achieved = tflops * 1e12
    m_days = megatron_training_days(train_tokens, mp, s.devices, achieved)
    o_days = ours_f / (seqs * s.seq_len) * train_tokens / (s.devices * achieved) / 86400.0
    lines = [f"{s.model_name}: l = {cfg.n_layers}, h = {cfg.d_model}, V = {cfg.vocab_size}, s = {s.seq_len}, "
             f"B = {seqs} sequences",
             f"  parameters            {mp:>12.4g}  {MEGATRON}: 12 l h^2 (1 + 13/12h + (V+s)/12lh) (GPT block)",
             f"                        {ours_p:>12.4g}  {OURS}",
             f"  FLOPs per iteration   {mf:>12.4g}  {MEGATRON}: 96 B s l h^2 (1 + s/6h + V/16lh), with recompute",
             f"                        {ours_f:>12.4g}  {OURS}: 4/3 x (6N + attention) x tokens, full recompute",
             f"  days for {train_tokens:.3g} tokens on {s.devices:,} at {tflops:g} TFLOP/s each",
             f"                        {m_days:>12.1f}  {MEGATRON}: 8 T P / (n X)",
             f"                        {o_days:>12.1f}  {OURS}"]
    return {"query": "megatron", "params": {"megatron": mp, "meshtrain": ours_p},
            "flops_per_iteration": {"megatron": mf, "meshtrain": ours_f},
            "days": {"megatron": m_days, "meshtrain": o_days}, "lines": lines}
