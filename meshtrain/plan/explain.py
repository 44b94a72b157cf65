"""Why the best layout wins, in words: its sharding in the book's notation (seed 000), the collectives of one
layer with bytes, time and whether they sit on the critical path, what bounds the step, memory, and the book's
closed-form limits for this model and cluster; and the table of the top layouts."""

from __future__ import annotations

from meshtrain.config import ModelConfig
from meshtrain.plan.book import (
    DEFAULT_REVISION,
    MIXED_REVISIONS,
    critical_batch_per_device,
    dcn_min_batch_per_pod,
    mixed_min_batch_per_device,
    optimal_fsdp,
    split_fsdp_tp,
    tp_limit,
)
from meshtrain.plan.flops import days_for_tokens
from meshtrain.plan.network import effective_bw, group_link
from meshtrain.plan.problem import Estimate, Layout, Problem
from meshtrain.plan.queries import mixed_bandwidths
from meshtrain.plan.search import SearchResult
from meshtrain.plan.steptime import evaluate
from meshtrain.rules import Rules, for_activations, for_experts, inside_block, notation, state_rules


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB"


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f} ms" if x < 1 else f"{x:.3f} s"


def _bytes(x: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x:.0f} B"


def sharding(layout: Layout, model: ModelConfig, seq_len: int) -> list[str]:
    """Per-tensor sharding in the book's notation (seed 000), read from the logical-axis rules the runtime
    executes (``meshtrain/rules.py``): mesh axes X = data/FSDP (dp), Y = tensor (tp), Z = pipeline (pp),
    S = context (cp), EP = experts; a subscript shards that dimension over the axis; {U_X} marks an
    unreduced partial sum."""
    params, grads, optim = (state_rules(layout, k) for k in ("params", "grads", "optim"))
    acts, experts = for_activations(params), for_experts(params)
    inside = inside_block(acts)

    def w(axes: str, rules: Rules = params) -> str:
        return notation(tuple(axes.split()), rules)

    hsdp = (f" (HSDP: X = shard groups of {layout.dp_shard}, replicated over the other "
            f"{layout.dp // layout.dp_shard})") if layout.dp_shard else ""
    unreduced = " {U_X} until reduced" if not grads["embed"] and layout.dp > 1 else ""
    lines = [
        f"axes: X = dp {layout.dp}{hsdp}, Y = tp {layout.tp}, Z = pp {layout.pp}, S = cp {layout.cp}",
        f"activations between blocks  In{w('batch seq embed', acts)}   (B = sequences, T = {seq_len} tokens)",
        f"attention                   Wq{w('layers embed heads head_dim')}  Wk,Wv{w('layers embed kv_heads head_dim')}"
        f"  Wo{w('layers heads head_dim embed')}"
        + (f"  (K = {model.kv_heads} < Y: each kv head replicated on {layout.tp // model.kv_heads} ranks)"
           if model.kv_heads < layout.tp else ""),
        f"gated MLP                   Win,Wgate{w('layers embed mlp')}  Wout{w('layers mlp embed')}",
        f"inside the MLP              Tmp{w('batch seq mlp', inside)}",
        f"embedding / head            E{w('vocab embed')}  Head{w('embed vocab')}",
        f"gradients                   dW{w('layers embed mlp', grads)}" + unreduced,
        f"optimizer state (AdamW)     m,v{w('layers embed mlp', optim)}",
    ]
    if layout.cp > 1 and layout.cp_attention == "ulysses":
        lines.append(f"ulysses attention           Q,K,V{w('batch seq heads head_dim', inside)} all-to-all over S: "
                     f"every position, 1/S of the heads")
    elif layout.cp > 1:
        how = "passed round S" if layout.cp_attention == "ring" else "all-gathered over S"
        lines.append(f"{layout.cp_attention + ' attention':<28}K,V{w('batch seq kv_heads head_dim', inside)} {how}")
    if model.moe_experts:  # experts are whole per rank (not split by tp), sharded over ep inside dp x cp
        # The router's expert dimension indexes scores every rank computes for all experts: never sharded.
        router = w("layers embed")[:-1] + ", E]"
        lines[3] = (f"MoE experts                 Win,Wgate{w('layers experts embed expert_mlp', experts)}  "
                    f"Wout{w('layers experts expert_mlp embed', experts)}  router{router}  (E = {model.moe_experts}, "
                    f"top-{model.moe_top_k}" + (f"; EP = ep {layout.ep}, inside X x S" if layout.ep > 1 else "") + ")")
        lines[4] = "inside an expert            Tmp[rows routed to it, F]  (tokens x top_k / E rows on average)"
        if layout.ep > 1:
            b, t, _ = w("batch seq embed", acts)[1:-1].split(", ")
            lines.append(f"dispatch / combine          rows[{b} x {t} x top_k, D] all-to-all over EP")
    return lines


def explain(problem: Problem, result: SearchResult, top: int = 3, why: bool = True) -> str:
    """The best layout, why: one sentence against the runner-up (``why``; the CLI prints it above the table
    instead), sharding, collectives of one layer, what bounds the step, memory; then the book's analysis
    for this model and cluster."""
    best = result.best
    if result.tried == 0:
        rules = result.rejected or ("dp must divide the sequence count and tp x pp x cp the rest",)
        shown = "; ".join(rules[:3]) + (f"; and {len(rules) - 3} more" if len(rules) > 3 else "")
        return (f"No layout splits {problem.sequences} sequences of {problem.seq_len} tokens over {problem.devices} "
                f"devices: {shown}. Change the sizes asked for (--tp, --pp, --cp, --schedules), the batch, or the "
                f"devices.")
    if best is None:
        lean = result.leanest
        need = (f"; the leanest, {lean.layout.describe()}, needs {_gb(lean.memory_total)} per device "
                f"({lean.memory_total / problem.memory_budget:.2f}x the budget)" if lean else "")
        return (f"No layout fits in {_gb(problem.memory_budget)} per device{need}. Add nodes, lower the batch "
                f"or raise --memory-fraction.")
    est = evaluate(problem, best.layout, with_collectives=True)
    est.runnable, est.not_runnable_reason = best.runnable, best.not_runnable_reason
    lay, st = est.layout, est.step
    out = [f"Best layout: {lay.describe()}  ({problem.devices} devices = dp {lay.dp} x tp {lay.tp} x "
           f"pp {lay.pp} x cp {lay.cp})"]
    sentence = why_best(problem, result) if why else None
    if sentence:
        out.append(sentence)
    if est.runnable is False:
        out.append(f"  (not runnable by meshtrain today: {est.not_runnable_reason})")
    out.append("")
    out.append("Sharding (book notation, seed 000):")
    out += ["  " + s for s in sharding(lay, problem.model, problem.seq_len)]
    out.append("")
    t = problem.sequences // lay.dp // lay.microbatches * problem.seq_len // lay.cp
    out.append(f"Collectives ({t:,} tokens per microbatch per rank; per-layer ones are one block's):")
    out.append(f"  {'axis':<13}{'op':<15}{'what':<46}{'bytes/call':>11}{'time/call':>11}{'calls/step':>11}"
               f"  critical path")
    for c in est.collectives:
        out.append(f"  {c.axis:<13}{c.op:<15}{c.what[:45]:<46}{_bytes(c.bytes):>11}{_ms(c.seconds):>11}"
                   f"{c.calls:>11}  {c.critical}")
    out.append("")
    total = st.total
    parts = [("compute (matmuls, attention, recompute)", st.compute), ("TP/SP collectives", st.tp),
             ("CP exchanges (not hidden)", st.cp), ("pipeline p2p waits", st.p2p), ("pipeline bubble", st.bubble),
             ("DP/ZeRO comm (exposed)", st.dp), ("optimizer step", st.optimizer)]
    days = (f"; {problem.train_tokens:.3g} tokens in "
            f"{days_for_tokens(problem.train_tokens, problem.batch_tokens, total):.1f} days"
            if problem.train_tokens else "")
    out.append(f"Step: {_ms(total)} predicted, MFU {est.mfu:.1%}, {est.tokens_per_s:,.0f} tokens/s{days}")
    for name, val in parts:
        if val > 0:
            out.append(f"  {name:<42}{_ms(val):>11}  {val / total:6.1%}")
    out.append(f"Bound by: {_bound_text(problem, est, result)}")
    out.append("")
    out.append(f"Memory per device: {_gb(est.memory_total)} of {_gb(problem.memory_budget)} usable "
               f"({problem.memory_fraction:.0%} of {_gb(problem.hw.hbm_bytes)})")
    out.append("  " + ", ".join(f"{k} {_gb(v)}" for k, v in est.memory.items()))
    out.append("")
    out.append("The book's analysis for this model and cluster:")
    out += ["  " + s for s in book_summary(problem)]
    return "\n".join(out)


_PARTS = (("compute", "compute"), ("tp", "TP/SP collectives"), ("cp", "CP exchanges"), ("ep", "expert all-to-alls"),
          ("p2p", "pipeline sends"), ("bubble", "pipeline bubble"), ("dp", "exposed DP/ZeRO communication"),
          ("optimizer", "optimizer step"))


def _layout_diff(a: Layout, b: Layout) -> str:
    """The settings in which layout ``a`` differs from ``b``, e.g. ``tp 4 (not 8), sp on (not off)``."""
    def show(field: str, v: object) -> str:
        if isinstance(v, bool):
            return "on" if v else "off"
        return "all of dp" if field == "dp_shard" and v == 0 else str(v)

    out = []
    for field in ("dp", "tp", "pp", "cp", "cp_attention", "ep", "zero", "dp_shard", "sp", "schedule", "virtual",
                  "microbatches", "recompute"):
        va, vb = getattr(a, field), getattr(b, field)
        if field in ("schedule", "virtual") and a.pp == 1 and b.pp == 1:
            continue
        if field == "cp_attention" and a.cp == 1 and b.cp == 1:
            continue
        if va != vb:
            out.append(f"{field} {show(field, va)} (not {show(field, vb)})")
    return ", ".join(out) or "the same settings"


def why_best(problem: Problem, result: SearchResult) -> str | None:
    """One sentence: why the best layout beats the runner-up, from their step-time parts (or memory on a tie)."""
    if len(result.ranked) < 2:
        return None
    a, b = result.ranked[0], result.ranked[1]
    diff = _layout_diff(a.layout, b.layout)
    gap = b.step_s - a.step_s
    if round(a.step_s, 9) == round(b.step_s, 9):  # the search's own tie rule: then memory ranks them
        if a.memory_total < b.memory_total:
            return (f"Why #1: it ties #2 ({b.layout.describe()}) on step time ({_ms(a.step_s)}) and needs less "
                    f"memory, {_gb(a.memory_total)} against {_gb(b.memory_total)} per device, with {diff}.")
        return (f"Why #1: nothing: #2 ({b.layout.describe()}) is predicted the same, {_ms(a.step_s)} and "
                f"{_gb(a.memory_total)} per device, with {diff}; either will do.")
    name, label = max(_PARTS, key=lambda p: getattr(b.step, p[0]) - getattr(a.step, p[0]))
    va, vb = getattr(a.step, name), getattr(b.step, name)
    return (f"Why #1: it is {_ms(gap)} ({gap / b.step_s:.2%}) faster than #2 ({b.layout.describe()}), mostly in "
            f"{label}: {_ms(va)} against {_ms(vb)}, with {diff}.")


def _bound_text(problem: Problem, est: Estimate, result: SearchResult) -> str:
    st = est.step
    kind = st.bound()
    share = {"compute": st.compute, "communication": st.communication, "bubble": st.bubble}[kind] / st.total
    text = f"{kind} ({share:.0%} of the step)"
    if kind == "compute":
        text += (f"; communication {st.communication / st.total:.0%} exposed, bubble {st.bubble / st.total:.0%}")
    fast = result.fastest_any
    if fast is not None and not fast.fits and fast.step_s < est.step_s * 0.999:
        text += (f". Memory binds too: the fastest layout overall ({fast.layout.describe()}, {_ms(fast.step_s)}) "
                 f"needs {_gb(fast.memory_total)} > {_gb(problem.memory_budget)}")
    elif est.memory_total > 0.9 * problem.memory_budget:
        text += f". Memory is nearly full ({est.memory_total / problem.memory_budget:.0%} of the budget)"
    return text


def book_summary(problem: Problem) -> list[str]:
    """The book's closed-form limits (seed 000 / 003) evaluated for this problem's model and hardware."""
    hw, cfg, n = problem.hw, problem.model, problem.devices
    c = hw.bf16_flops
    f = cfg.hidden_dim
    batch = problem.batch_tokens
    dp_link = group_link(hw, n, 1, len(hw.mesh_axes) or 1)
    w_dp = effective_bw(dp_link)
    w_tp = hw.intra_bw
    lines = [
        f"DP/FSDP critical batch per device C/W = {critical_batch_per_device(c, w_dp):,.0f} tokens "
        f"(W = {w_dp / 1e9:.1f} GB/s effective over all {n}); this batch gives {batch / n:,.0f} per device",
        f"TP limit F*W/C = {tp_limit(f, c, w_tp):.1f}-way on the fast fabric (F = {f}, "
        f"W = {w_tp / 1e9:.0f} GB/s)",
    ]
    # The book's mixed bound takes W of ONE axis: it already puts FSDP on two axes and TP on one. Passing it the
    # all-axes DP bandwidth above counted the axes twice (LLaMA-2 13B on v5p x 4096: 105 instead of 940 / 235).
    x, y = split_fsdp_tp(batch, n, f, hw.tp_max)
    w_x, w_y, how = mixed_bandwidths(hw, n, max(2, y))
    for rev in MIXED_REVISIONS:
        # the one --revision chose, and the default (it labelled the chosen one "default", whichever it was)
        parts = [p for p, on in (("this plan's", rev == problem.revision), ("the default", rev == DEFAULT_REVISION))
                 if on]
        tag = f" ({', '.join(parts)})" if parts else ""
        bound = mixed_min_batch_per_device(f, c, hw.intra_bw, rev, fsdp_bw=w_x, tp_bw=w_y)
        lines.append(f"mixed FSDP+TP bound, revision {rev}{tag}: B/N > {bound:,.0f} tokens per device "
                     f"({how})")
    lines.append(f"optimal split X = sqrt(2BN/F) = {optimal_fsdp(batch, n, f):,.0f} -> X (FSDP) {x} x "
                 f"Y (TP) {y}")
    if n > hw.domain and hw.torus:
        per_pod = batch / (n / hw.domain)
        lines.append(f"cross-pod DCN limit C/W_dcn = {dcn_min_batch_per_pod(c, hw.inter_bw):,.0f} tokens per "
                     f"pod; this batch gives {per_pod:,.0f}")
    return lines


def format_table(problem: Problem, estimates: list[Estimate]) -> str:
    """The top layouts as a text table."""
    head = (f"{'#':>2}  {'layout':<52}{'step':>10}{'MFU':>7}{'mem/dev':>10}{'compute':>9}{'comm':>8}"
            f"{'bubble':>8}  runs")
    rows = [head]
    for i, e in enumerate(estimates, 1):
        st = e.step
        runs = {True: "yes", False: "no", None: "?"}[e.runnable]
        rows.append(f"{i:>2}  {e.layout.describe():<52}{_ms(e.step_s):>10}{e.mfu:>7.1%}"
                    f"{e.memory_total / 1e9:>8.1f}GB{st.compute / e.step_s:>9.0%}"
                    f"{st.communication / e.step_s:>8.0%}{st.bubble / e.step_s:>8.0%}  {runs}")
    return "\n".join(rows)
