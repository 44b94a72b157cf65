"""``meshtrain plan --plot``: the book's communication-against-compute figure for this model and cluster."""

from __future__ import annotations

from pathlib import Path

from meshtrain.plan.book import MIXED_REVISIONS, book_layer_times, critical_batch_per_device, optimal_fsdp
from meshtrain.plan.network import effective_bw, group_link
from meshtrain.plan.problem import Problem


def plot_comm_vs_compute(problem: Problem, path: str | Path, batches: list[float] | None = None) -> Path:
    """The book's figure (seed 000, 'comms-flops-time'): one layer's matmul time and each strategy's
    communication time as the global batch varies, on this cluster. A strategy is compute-bound where its
    curve is under the matmul line. Bandwidths: DP/FSDP over all devices (effective, hierarchical), TP on
    the fast fabric; mixed FSDP+TP at the optimal X (2 <= Y <= the fast fabric's TP limit), both revisions.
    Compute is at the datasheet peak, as in the book."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    hw, cfg, n = problem.hw, problem.model, problem.devices
    d, f, c = cfg.d_model, cfg.hidden_dim, hw.bf16_flops  # the book's roofline: peak FLOP/s
    axes = len(hw.mesh_axes) or 1
    w_fsdp = effective_bw(group_link(hw, n, 1, axes))
    w_mixed_x = effective_bw(group_link(hw, n // min(hw.tp_max, n), min(hw.tp_max, n), max(1, axes - 1)))
    w_tp = hw.intra_bw
    batches = batches or [10 ** (3 + k / 8) for k in range(0, 8 * 6 + 1)]
    compute, fsdp, tp_curve, mixed = [], [], [], {r: [] for r in MIXED_REVISIONS}
    for b in batches:
        tm, tc = book_layer_times("fsdp", b, n, d, f, c, w_fsdp)
        compute.append(tm)
        fsdp.append(tc)
        tp_curve.append(book_layer_times("tp", b, n, d, f, c, w_fsdp, w_tp)[1])
        # TP between 2-way and the fast fabric's limit (Y = 1 would be the FSDP curve)
        x = min(max(optimal_fsdp(b, n, f), n / min(hw.tp_max, n)), n / 2)
        for r in MIXED_REVISIONS:
            mixed[r].append(book_layer_times("fsdp+tp", b, n, d, f, c, w_mixed_x, w_tp, x, r)[1])
    fig = Figure(figsize=(9, 5.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.loglog(batches, compute, "k--", lw=2, label="matmul time (compute)")
    ax.loglog(batches, fsdp, label=f"DP / FSDP over {n} (W {w_fsdp / 1e9:.0f} GB/s)")
    ax.loglog(batches, tp_curve, label=f"TP over all {n} (W {w_tp / 1e9:.0f} GB/s)")
    for r in MIXED_REVISIONS:
        style = "-" if r == problem.revision else ":"
        ax.loglog(batches, mixed[r], style, label=f"FSDP + TP, optimal X (revision {r}"
                                                   f"{', default' if r == problem.revision else ''})")
    crit = n * critical_batch_per_device(c, w_fsdp)
    ax.axvline(crit, color="grey", lw=0.8)
    ax.text(crit, ax.get_ylim()[0] * 2, f" FSDP critical batch\n {crit:,.0f}", fontsize=8, color="grey")
    ax.set_xlabel("global batch (tokens)")
    ax.set_ylabel("seconds per layer (forward)")
    ax.set_title(f"{problem.model_name} on {n} x {hw.name}: communication vs compute per layer")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)
