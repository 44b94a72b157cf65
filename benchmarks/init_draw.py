"""The seeded init's cost per rank: our counter-based draw (``model/init.py``) against the per-row generators it
replaced (one torch generator per row, seeded by ``sha256(seed:name:row)``), on the boxes a rank holds.

Two boxes of one ``--rows x --cols`` weight: the whole tensor (one device, or any row shard) and a tensor-parallel
column slice of ``1/--tp`` (``wo`` and ``w2``), which per-row generators can only get by drawing whole rows. Each
side is timed at 1 thread and at ``torch.get_num_threads()``; rounds alternate ours/theirs/theirs/ours. Reported per
case: elements drawn against the elements held, and the median (min-max) over rounds of the time per element
held, with the ratio ours/theirs. The two sides draw different numbers by design (other generators); both must
give the box's shape and standard-normal moments (within 1% on the whole tensor), or the script fails.

    python benchmarks/init_draw.py [--rows 4096] [--cols 4096] [--tp 8] [--rounds 6]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import torch

from meshtrain.config import ModelConfig
from meshtrain.model.init import init_box
from meshtrain.testing.equivalence import counting_init_draws

NAME = "layers.0.attention.wq.weight"  # init_std applies as is: the values are N(0, std^2)


def per_row(seed: int, shape: tuple[int, int], rows: tuple[int, int], cols: tuple[int, int]) -> tuple[torch.Tensor,
                                                                                                          int]:
    """The replaced init: one generator per row, the whole row drawn, then its columns kept; (box, drawn)."""
    out = torch.empty(rows[1] - rows[0], cols[1] - cols[0])
    for i in range(*rows):
        digest = hashlib.sha256(f"{seed}:{NAME}:{i}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        out[i - rows[0]] = torch.randn(shape[1], generator=g)[cols[0]:cols[1]]
    return out, (rows[1] - rows[0]) * shape[1]


def ours(cfg: ModelConfig, seed: int, shape: tuple[int, int], rows: tuple[int, int], cols: tuple[int, int]
         ) -> tuple[torch.Tensor, int]:
    with counting_init_draws() as drawn:
        box = init_box(cfg, seed, NAME, shape, (rows, cols)) / cfg.init_std
    return box, drawn[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    cfg, shape = ModelConfig(), (args.rows, args.cols)
    cases = {"whole tensor": ((0, args.rows), (0, args.cols)),
             f"tp column slice 1/{args.tp}": ((0, args.rows), (0, args.cols // args.tp))}
    cores = torch.get_num_threads()
    print(f"init of one {args.rows} x {args.cols} weight, {args.rounds} rounds, torch {torch.__version__}, "
          f"{cores} threads available")
    print(f"{'box':<24} {'threads':>7} {'held':>10} {'drawn: ours':>12} {'theirs':>10} "
          f"{'ns/elt held: ours':>24} {'theirs':>24} {'ours/theirs':>22}")
    for label, (rows, cols) in cases.items():
        held = (rows[1] - rows[0]) * (cols[1] - cols[0])
        for threads in sorted({1, cores}):
            torch.set_num_threads(threads)
            times: dict[str, list[float]] = {"ours": [], "theirs": []}
            drawn: dict[str, int] = {}
            for r in range(args.rounds):
                order = ["ours", "theirs", "theirs", "ours"] if r % 2 == 0 else ["theirs", "ours", "ours", "theirs"]
                for side in order:
                    t0 = time.perf_counter()
                    box, drawn[side] = (ours(cfg, 0, shape, rows, cols) if side == "ours"
                                        else per_row(0, shape, rows, cols))
                    times[side].append((time.perf_counter() - t0) / held * 1e9)
                    assert tuple(box.shape) == (rows[1] - rows[0], cols[1] - cols[0]), (side, box.shape)
                    if label == "whole tensor":
                        assert abs(box.mean()) < 0.01 and abs(box.std() - 1) < 0.01, (side, box.mean(), box.std())
            ratios = [a / b for a, b in zip(times["ours"], times["theirs"], strict=True)]
            fmt = lambda v: f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"  # noqa: E731
            print(f"{label:<24} {threads:>7} {held:>10,} {drawn['ours']:>12,} {drawn['theirs']:>10,} "
                  f"{fmt(times['ours']):>24} {fmt(times['theirs']):>24} {fmt(ratios):>22}")
    torch.set_num_threads(cores)


if __name__ == "__main__":
    main()
