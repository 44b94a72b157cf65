"""``meshtrain schedule``: build a pipeline schedule, simulate it, print its chart, bubble and in-flight peaks.

    meshtrain schedule --pp 4 --microbatches 8 --schedule 1f1b [--virtual 2] [--png out.png]
                       [--f 1 --b 2 --w 1 --p2p 0] [--width 100]
"""

from __future__ import annotations

import math

from meshtrain.config import SCHEDULES, ArgumentParser, check_output_file
from meshtrain.plan.schedules import DEFAULT_VIRTUAL, build_schedule
from meshtrain.plan.simulator import check_schedule, png_chart, simulate, text_chart

# build_schedule's errors name the training config's keys; here the user typed these options
_OPTIONS = {"parallel.virtual_stages": "--virtual", "parallel.microbatches": "--microbatches",
            "parallel.schedule": "--schedule", "parallel.pp": "--pp"}


def main(argv: list[str]) -> int:
    """Parse ``argv`` (without the command name), print the simulated schedule, write the PNG if asked; return 0."""
    ap = ArgumentParser(prog="meshtrain schedule",
                                 description="Simulate a pipeline schedule and draw its timeline.")
    ap.add_argument("--pp", type=int, default=4, help="pipeline ranks")
    ap.add_argument("--microbatches", type=int, default=8, help="microbatches per step")
    ap.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(SCHEDULES)}")
    ap.add_argument("--virtual", type=int, default=None,
                    help="model chunks per rank (default: 2 for interleaved and dualpipev, else 1)")
    ap.add_argument("--f", type=float, default=1.0, help="forward cost of one stage action")
    ap.add_argument("--b", type=float, default=2.0, help="full backward cost (I = b - w when split)")
    ap.add_argument("--w", type=float, default=None, help="backward-weight cost for split schedules (default b/2)")
    ap.add_argument("--p2p", type=float, default=0.0, help="latency added to every cross-rank dependency")
    ap.add_argument("--width", type=int, default=100, help="columns of the text chart")
    ap.add_argument("--png", help="also write a Gantt chart to this PNG file")
    args = ap.parse_args(argv)

    virtual = args.virtual if args.virtual is not None else DEFAULT_VIRTUAL.get(args.schedule, 1)
    w = args.b / 2 if args.w is None else args.w
    # The generated orders (zb-h1, dualpipev) are built for the costs they will be simulated with.
    gen_costs = (args.f, args.b, w)
    if not (all(math.isfinite(x) for x in (args.f, args.b, w, args.p2p))
            and args.f > 0 and args.b > 0 and 0 <= w <= args.b and args.p2p >= 0):
        raise ValueError(f"--f and --b must be > 0, --w in [0, b] and --p2p >= 0 (got f={args.f}, b={args.b}, "
                         f"w={w}, p2p={args.p2p})")
    if args.width < 10:
        raise ValueError(f"--width must be at least 10 columns, got {args.width}")
    if args.png is not None:
        check_output_file("--png", args.png, ".png")
    try:
        sched = build_schedule(args.schedule, args.pp, args.microbatches, virtual, gen_costs=gen_costs)
    except ValueError as e:
        message = str(e)
        for key, option in _OPTIONS.items():
            message = message.replace(f"{key}=", f"{option} ").replace(key, option)
        raise ValueError(message) from None
    if args.w is not None and not sched.split_backward:
        raise ValueError(f"--w is the weight half of a split backward (zb-h1, dualpipev); {sched.name} runs the "
                         f"whole backward (--b): leave --w out.")
    check_schedule(sched)
    res = simulate(sched, args.f, args.b, w, args.p2p)

    costs = f"F={args.f:g} I={args.b - w:g} W={w:g}" if sched.split_backward else f"F={args.f:g} B={args.b:g}"
    print(f"{sched.name}: pp={sched.pp} microbatches={sched.microbatches} virtual={sched.virtual} "
          f"stages={sched.n_stages}; per-stage costs {costs}, p2p={args.p2p:g}")
    print(text_chart(res, args.width))
    print(f"makespan {res.makespan:.6g}, bubble {res.bubble:.4f} ({res.bubble:.2%}), "
          f"idle per rank {res.idle_time:.6g}")
    print("peak in-flight per rank (F done, " + ("W" if sched.split_backward else "B") + " not done): "
          + ", ".join(f"rank {r}: {p}" for r, p in enumerate(res.peak_inflight)))
    if sched.split_backward:
        print("peak awaiting I per rank (full activations): "
              + ", ".join(f"rank {r}: {p}" for r, p in enumerate(res.peak_before_input)))
    if args.png:
        png_chart(res, args.png, f"{sched.name} pp={sched.pp} m={sched.microbatches} v={sched.virtual}")
        print(f"wrote {args.png}")
    return 0
