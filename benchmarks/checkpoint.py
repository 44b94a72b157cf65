"""Checkpoints and the state path (issue 12): peak memory per rank, save and load seconds, async save.

Every run goes through the ``Trainer`` on spawned gloo processes (one process per rank, as ``meshtrain train
--nproc`` would run them), on synthetic byte data (``data.source=synthetic``, vocabulary 257), fp32, AdamW.

- ``issue``: the run issue 12 measured: 72M parameters (d_model 768, 10 layers, 12 heads), the trainer's default
  batch (8 sequences of 128 tokens), ``parallel.dp=4 parallel.zero=3 train.ckpt_every=1``, against the same run in
  one process: each rank's peak resident memory over the whole run (construction, steps, saves) and the ratio
  rank peak / one-process peak (target <= 0.5). ``Trainer.train`` runs it, as the CLI does; a second pass
  drives the same steps and saves phase by phase to show where each peak comes from.
- ``layouts``: ~100M parameters (d_model 768, 14 layers) at 1, 2 and 4 ranks, under ZeRO-3 and tp x dp: save
  seconds, load seconds (resuming into the same layout and into a different one), per-rank peak memory while
  training, saving and loading, and save peak / training peak per rank (target <= 1.3).
- ``async``: the step-loop time a save costs, sync vs ``train.ckpt_async=true`` vs no checkpoint, same run, as
  (loop time with saves - loop time without) / saves; the variants' order rotates from round to round. Also each
  variant's peak memory, and the three interleaved step by step in one run (robust to a shared machine's drift).
- ``malloc``: the issue's run with meshtrain's allocator policy (ZeRO-3 fixes glibc's mmap threshold at its unit
  buffers, ``meshtrain/host_memory.py``), with every buffer up to 32 MiB from the heap (what glibc's dynamic
  threshold gives) and with a 1 MiB threshold, alternating: how much of a rank's resident peak is freed memory the
  heap keeps, and what returning it costs. (``--mmap-threshold`` runs any part with a fixed threshold of your
  choice, which turns the policy off.)

Checks (the script fails if one does not hold): the compared runs computed the same thing (the same losses with
and without saves, sync or async; dp4 ZeRO-3 against one process within 1e-5 relative), and every run's latest
checkpoint loads back: a resumed process reads exactly the elements it holds and its next step's loss is the
saving run's (bitwise in the same layout, within 1e-5 relative in another).

Memory is the resident set's high-water mark of each process (VmHWM in /proc/self/status: what the kernel had
to give it, shared libraries and torch's own footprint included, ~0.24 GB per process). A phase's own peak is
measured by resetting the mark at the phase's start (writing "5" to /proc/self/clear_refs, Linux), so it is the
largest resident set during that phase; the whole-run peak is the largest of all phases. Times are the slowest
rank's, each phase starting after a barrier; checkpoint files land in the page cache, so a load right after a
save reads memory rather than disk.

    python benchmarks/checkpoint.py [--parts issue,layouts,async,malloc] [--rounds 3] [--cycles 6]
        [--mmap-threshold BYTES] [--dir DIR] [--json FILE] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist

from meshtrain import host_memory
from meshtrain.config import load_config
from meshtrain.testing.spawn import spawn

COMMON = ["data.source=synthetic", "model.vocab_size=257", "train.device=cpu", "train.progress=false",
          "train.tensorboard=false", "train.sample_tokens=0", "train.peak_flops=1e11", "train.ckpt_keep=2"]
ISSUE_MODEL = ["model.d_model=768", "model.n_layers=10", "model.n_heads=12"]
# ~100M parameters with the issue's width; a small batch, since a step of 100M parameters on 2 cores takes
# seconds and the state, not the activations, is what this measures. train.steps fixes the lr schedule (the
# same in every session of a run); no session reaches it.
BIG = ["model.d_model=768", "model.n_layers=14", "model.n_heads=12", "model.max_seq_len=64", "train.seq_len=64",
       "train.global_batch=4", "train.steps=100", "train.ckpt_every=0"]
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "1 rank": (1, []),
    "zero3 dp2": (2, ["parallel.zero=3"]),
    "tp2": (2, ["parallel.tp=2"]),
    "zero3 dp4": (4, ["parallel.zero=3"]),
    "tp2 dp2": (4, ["parallel.tp=2"]),
}
# Each layout's checkpoint is also loaded by another layout: every world-size change between 1, 2 and 4,
# and ZeRO-3 <-> tensor parallel.
CROSS = {"1 rank": "tp2 dp2", "zero3 dp2": "1 rank", "tp2": "zero3 dp4", "zero3 dp4": "tp2",
         "tp2 dp2": "zero3 dp2"}
SAVE_STEP = 2  # layouts: train 2 steps, save, train step 3; the resumed sessions train step 3 again


# ----------------------------------------------------------------------------- memory of this process


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE).group(1))


def peak_rss() -> int:
    """This process's resident-set high-water mark (bytes) since it started or since the last reset."""
    return _status_kb("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Reset the high-water mark to the current resident set (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def check_peak_reset() -> None:
    """Fail early where the high-water mark cannot be reset (the per-phase peaks would be wrong)."""
    import torch

    big = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    del big
    before = peak_rss()
    reset_peak_rss()
    if peak_rss() > before - (32 << 20):
        raise SystemExit("writing 5 to /proc/self/clear_refs did not reset VmHWM here: per-phase peaks would be "
                         "wrong (Linux >= 4.0 needed)")


class Phases:
    """Per-phase peak resident memory and seconds on this rank. Each phase starts after a barrier (so the
    slowest rank's time is the phase's time) with the high-water mark reset."""

    def __init__(self) -> None:
        self.peak: dict[str, int] = {}
        self.grow: dict[str, int] = {}  # the most a phase raised the resident set above its start
        self.seconds: dict[str, list[float]] = {}
        self.whole = 0  # the whole session's peak: the largest mark seen before any reset

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        dist.barrier()
        self.whole = max(self.whole, peak_rss())
        reset_peak_rss()
        start = peak_rss()  # right after the reset: the resident set now
        t0 = time.perf_counter()
        yield
        dt = time.perf_counter() - t0
        peak = peak_rss()
        self.whole = max(self.whole, peak)
        self.peak[name] = max(self.peak.get(name, 0), peak)
        self.grow[name] = max(self.grow.get(name, 0), peak - start)
        self.seconds.setdefault(name, []).append(dt)

    def result(self) -> dict[str, Any]:
        self.whole = max(self.whole, peak_rss())
        return {"peak": self.peak, "grow": self.grow, "seconds": self.seconds, "whole": self.whole}


# ----------------------------------------------------------------------------- one session, on every rank


def _trainer(overrides: list[str], out: str, resume: bool):
    from meshtrain.train.trainer import Trainer

    return Trainer(load_config(None, [*COMMON, *overrides, f"train.resume={str(resume).lower()}"]), out)


def _loaded(trainer) -> tuple[int | None, int]:
    from meshtrain.testing.equivalence import elements_loaded

    return elements_loaded(trainer)


def phases_session(rank: int, world: int, overrides: list[str], out: str, resume: bool, steps: int,
                   save_at: tuple[int, ...]) -> dict[str, Any]:
    """Build a trainer (fresh: from the seeded init; ``resume``: from the latest checkpoint in ``out``), train
    ``steps`` steps, saving (synchronously, to completion) after the steps numbered in ``save_at``. Phases:
    build, first step, steps, save, step after save."""
    ph = Phases()
    with ph("build"):
        trainer = _trainer(overrides, out, resume)
    read, held = _loaded(trainer)
    start, losses, saved = trainer.step, [], False
    for i in range(steps):
        with ph("first step" if i == 0 else "step after save" if saved else "steps"):
            rec = trainer.train_step(trainer.step)
            trainer.step += 1
        losses.append(rec["loss"])
        if trainer.step in save_at:
            with ph("save"):
                trainer.save()
                trainer.checkpointer.wait()
            saved = True
    return {**ph.result(), "losses": losses, "start": start, "read": read, "held": held}


def train_session(rank: int, world: int, overrides: list[str], out: str, until: int) -> dict[str, Any]:
    """The run as the CLI runs it: build, then ``Trainer.train(until)`` (its steps, saves and logging)."""
    ph = Phases()
    with ph("build"):
        trainer = _trainer(overrides, out, False)
    with ph("train"):
        records = trainer.train(until=until)
    return {**ph.result(), "losses": [r["loss"] for r in records], "start": 0, "read": None, "held": 0,
            "mmap_threshold": host_memory.mmap_threshold()}


def timed_session(rank: int, world: int, overrides: list[str], out: str, steps: int, save: bool) -> dict[str, Any]:
    """One warm-up step (it allocates gradients and optimizer state), then ``steps`` timed steps with a save
    after each but the last (``save``), as ``Trainer.train`` calls them. The loop's time ends with the last
    step's optimizer step, so an async save is waited for by the step after it, as in training, and no save is
    left outside the loop. Returns the loop's seconds and peak memory (reset after the warm-up step)."""
    trainer = _trainer(overrides, out, False)
    losses = [trainer.train_step(0)["loss"]]
    trainer.step = 1
    dist.barrier()
    before = peak_rss()  # construction and the warm-up step
    reset_peak_rss()
    t0 = time.perf_counter()
    for i in range(steps):
        losses.append(trainer.train_step(trainer.step)["loss"])
        trainer.step += 1
        if save and i < steps - 1:
            trainer.save()
    loop = time.perf_counter() - t0
    peak = peak_rss()
    trainer.checkpointer.wait()
    dist.barrier()
    return {"loop": loop, "loop_peak": peak, "whole": max(before, peak, peak_rss()), "losses": losses}


def interleaved_session(rank: int, world: int, overrides: list[str], out: str, cycles: int) -> dict[str, Any]:
    """The three variants interleaved step by step in one run, so that load on a shared machine hits them alike:
    after a warm-up step, each cycle times, in rotated order, (no save | a sync save | an async save) followed by
    the next step. An async write is joined before that step's optimizer step (``wait_for_reads``), so all the
    time a save costs the loop falls inside its unit."""
    trainer = _trainer(overrides, out, False)
    trainer.train_step(0)
    trainer.step = 1
    times: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
    names = list(times)
    for c in range(cycles):
        for v in names[c % 3:] + names[:c % 3]:
            dist.barrier()
            t0 = time.perf_counter()
            if v != "none":
                trainer.checkpointer.async_save = v == "async"
                trainer.save()
            trainer.train_step(trainer.step)
            trainer.step += 1
            times[v].append(time.perf_counter() - t0)
    trainer.checkpointer.wait()
    return times


# ----------------------------------------------------------------------------- the parent


def _threads(world: int) -> int:
    return max(1, 2 // world)  # 2 cores: one process gets both, 2 or 4 ranks one thread each


def _run(fn, world: int, *args: Any) -> list[dict[str, Any]]:
    return spawn(fn, world, args=args, timeout=3000, threads=_threads(world))


def _mb(b: float) -> str:
    return f"{b / 1e6:,.0f}"


def _spread(xs: list[float], fmt: str = "{:.2f}") -> str:
    """Median (min-max) of per-round values."""
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def _rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _check(ok: bool, what: str, failures: list[str]) -> None:
    print(f"  check: {what}: {'ok' if ok else 'FAILED'}")
    if not ok:
        failures.append(what)


def _check_resume(res: list[dict[str, Any]], want: list[float], exact: bool, what: str,
                  failures: list[str]) -> float:
    """A resumed session read exactly what each rank holds and its losses continue the saving run's."""
    got = res[0]["losses"]
    _check(all(r["read"] == r["held"] for r in res), f"{what}: every rank read exactly the elements it holds",
           failures)
    diff = _rel(got, want)
    _check(got == want if exact else diff <= 1e-5,
           f"{what}: loss {got} continues the run {want} ({'bitwise' if exact else f'rel diff {diff:.1e}'})",
           failures)
    return diff


def part_issue(args, root: Path, failures: list[str]) -> dict[str, Any]:
    """72M, dp4 ZeRO-3, ckpt_every=1 against one process: whole-run peak per rank, and where it comes from."""
    over = [*ISSUE_MODEL, "train.ckpt_every=1", "train.steps=4"]  # 3 steps saved, the 4th resumed
    runs = {"one process": (1, over), "dp4 zero3": (4, [*over, "parallel.dp=4", "parallel.zero=3"])}
    out: dict[str, Any] = {}
    for name, (world, ov) in runs.items():
        d = root / f"issue-{name.replace(' ', '-')}"
        res = _run(train_session, world, ov, str(d), 3)
        resumed = _run(phases_session, world, ov, str(d), True, 1, ())
        # The same run phase by phase, one step further: step 4 uninterrupted, for the resumed session.
        brk = _run(phases_session, world, ov, str(root / f"{d.name}-phases"), False, 4, (1, 2, 3))
        out[name] = {"train": res, "resumed": resumed, "phases": brk}
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(root / f"{d.name}-phases", ignore_errors=True)
    one, dp4 = out["one process"], out["dp4 zero3"]
    base = one["train"][0]["whole"]
    print("\n## 1. The issue's run: 72M parameters, batch 8 x 128, dp4 ZeRO-3, ckpt_every=1, 3 steps "
          "(Trainer.train), against one process\n")
    print("| run | rank | whole-run peak (MB) | / one process | build (init) | first step | later steps | saves "
          "(+ own growth) | resume: load | resume: next step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in out.items():
        for rank, (t, p, q) in enumerate(zip(r["train"], r["phases"], r["resumed"], strict=True)):
            pk = p["peak"]
            later = max(pk.get("steps", 0), pk.get("step after save", 0))
            print(f"| {name} | {rank} | {_mb(t['whole'])} | {t['whole'] / base:.2f} | {_mb(pk['build'])} | "
                  f"{_mb(pk['first step'])} | {_mb(later)} | {_mb(pk['save'])} (+{_mb(p['grow']['save'])}) | "
                  f"{_mb(q['peak']['build'])} | {_mb(q['peak']['first step'])} |")
    print("\n(whole-run peak: Trainer.train, saves after every step; the phase columns: the same steps and saves "
          "driven one phase at a time in a separate run, 4 steps; resume: a new process loading its step-3 "
          "checkpoint, then step 4.)")
    worst = max(r["whole"] for r in dp4["train"])
    print(f"\nworst rank / one process: {worst / 1e9:.2f} GB / {base / 1e9:.2f} GB = {worst / base:.2f} "
          f"(target <= 0.5); mmap threshold fixed by ZeRO-3 (host_memory.py): "
          f"{dp4['train'][0]['mmap_threshold']} bytes, one process: {one['train'][0]['mmap_threshold']}")
    _check(_rel(dp4["train"][0]["losses"], one["train"][0]["losses"]) <= 1e-5,
           f"dp4 ZeRO-3 losses {dp4['train'][0]['losses']} equal one process's {one['train'][0]['losses']} "
           f"within 1e-5", failures)
    for name, r in out.items():
        _check(r["phases"][0]["losses"][:3] == r["train"][0]["losses"],
               f"{name}: the phase-by-phase pass computed the same losses as Trainer.train", failures)
        _check_resume(r["resumed"], r["phases"][0]["losses"][3:], True,
                      f"{name}: its step-3 checkpoint resumed (step 4)", failures)
    return {name: {k: v for k, v in r.items()} for name, r in out.items()}


def part_layouts(args, root: Path, failures: list[str]) -> dict[str, Any]:
    """~100M at 1, 2, 4 ranks (ZeRO-3, tp x dp): save / load seconds and per-phase peaks per rank."""
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in LAYOUTS}
    for r in range(args.rounds):
        for name, (world, ov) in LAYOUTS.items():
            d = root / f"layout-{name.replace(' ', '-')}-{r}"
            fresh = _run(phases_session, world, [*BIG, *ov], str(d), False, SAVE_STEP + 1, (SAVE_STEP,))
            same = _run(phases_session, world, [*BIG, *ov], str(d), True, 1, ())
            other_world, other_ov = LAYOUTS[CROSS[name]]
            other = _run(phases_session, other_world, [*BIG, *other_ov], str(d), True, 1, ())
            results[name].append({"fresh": fresh, "same": same, "other": other})
            shutil.rmtree(d, ignore_errors=True)
            print(f"  round {r + 1}: {name} done", flush=True)
    print(f"\n## 2. ~100M parameters (d_model 768, 14 layers), batch 4 x 64; {args.rounds} rounds\n")
    print("| layout | ranks | save s | load s, same layout | load s, into | build from init s |")
    print("|---|---|---|---|---|---|")
    for name, rounds in results.items():
        world = LAYOUTS[name][0]
        save = [max(x["seconds"]["save"][0] for x in rd["fresh"]) for rd in rounds]
        load = [max(x["seconds"]["build"][0] for x in rd["same"]) for rd in rounds]
        other = [max(x["seconds"]["build"][0] for x in rd["other"]) for rd in rounds]
        build = [max(x["seconds"]["build"][0] for x in rd["fresh"]) for rd in rounds]
        print(f"| {name} | {world} | {_spread(save)} | {_spread(load)} | {CROSS[name]}: {_spread(other)} | "
              f"{_spread(build)} |")
    print("\nPeak resident memory per rank (MB; the last round; loads: the same layout's resume, and the other "
          "layout's resume of this checkpoint, worst rank):\n")
    print("| layout | rank | build (init) | training | save | save / training | load, same layout | "
          "load into other (worst rank) |")
    print("|---|---|---|---|---|---|---|---|")
    worst_ratio = 0.0
    for name, rounds in results.items():
        last = rounds[-1]
        other = max(x["peak"]["build"] for x in last["other"])
        for rank, (f, s) in enumerate(zip(last["fresh"], last["same"], strict=True)):
            train = max(f["peak"]["first step"], f["peak"].get("steps", 0))
            ratio = f["peak"]["save"] / train
            worst_ratio = max(worst_ratio, max(x["peak"]["save"] / max(x["peak"]["first step"],
                                                                       x["peak"].get("steps", 0))
                                               for rd in rounds for x in rd["fresh"]))
            print(f"| {name} | {rank} | {_mb(f['peak']['build'])} | {_mb(train)} | {_mb(f['peak']['save'])} | "
                  f"{ratio:.2f} | {_mb(s['peak']['build'])} | {_mb(other) if rank == 0 else ''} |")
    print(f"\nlargest save peak / training peak over every rank and round: {worst_ratio:.2f} (target <= 1.3)")
    ref = results["1 rank"][0]["fresh"][0]["losses"]
    for name, rounds in results.items():
        for i, rd in enumerate(rounds):
            losses = rd["fresh"][0]["losses"]
            _check(_rel(losses, ref) <= 1e-5, f"{name} round {i + 1}: losses {losses} equal one rank's within 1e-5",
                   failures)
            _check_resume(rd["same"], losses[-1:], True, f"{name} round {i + 1}: resumed in the same layout",
                          failures)
            _check_resume(rd["other"], losses[-1:], False, f"{name} round {i + 1}: resumed as {CROSS[name]}",
                          failures)
    return results


def part_async(args, root: Path, failures: list[str]) -> dict[str, Any]:
    """The step-loop time lost per save: none vs sync vs async, rotating the order across rounds."""
    world, ov = LAYOUTS[args.async_layout]
    variants = {"none": False, "sync": True, "async": True}
    rows: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    names = list(variants)
    for r in range(args.rounds):
        order = names[r % 3:] + names[:r % 3]
        for v in order:
            d = root / f"async-{v}-{r}"
            over = [*BIG, *ov, f"train.ckpt_async={str(v == 'async').lower()}"]
            res = _run(timed_session, world, over, str(d), args.async_steps, variants[v])
            if v != "none" and r == 0:  # its latest checkpoint (step N, written while step N+1 ran) loads back
                resumed = _run(phases_session, world, over, str(d), True, 1, ())
                _check_resume(resumed, res[0]["losses"][-1:], True, f"{v}: the latest checkpoint resumed", failures)
            shutil.rmtree(d, ignore_errors=True)
            rows[v].append({"loop": max(x["loop"] for x in res), "peak": [x["loop_peak"] for x in res],
                            "losses": res[0]["losses"]})
        print(f"  round {r + 1} done ({', '.join(order)})", flush=True)
    d = root / "async-interleaved"
    inter = _run(interleaved_session, world, [*BIG, *ov], str(d), args.cycles)
    shutil.rmtree(d, ignore_errors=True)
    # A unit ends when the slowest rank's does; each cycle's own difference to its no-save unit.
    unit = {v: [max(x[v][c] for x in inter) for c in range(args.cycles)] for v in variants}
    saves = args.async_steps - 1
    print(f"\n## 3. Async save: {args.async_layout} ({world} ranks), ~100M parameters, {args.async_steps} timed steps, "
          f"a save after each of the first {saves}; {args.rounds} rounds, order rotated\n")
    print("| variant | loop s | per step s | lost per save s | peak per rank (MB, worst) | peak / none |")
    print("|---|---|---|---|---|---|")
    none = [x["loop"] for x in rows["none"]]
    peak_none = statistics.median(max(x["peak"]) for x in rows["none"])
    for v in variants:
        loops = [x["loop"] for x in rows[v]]
        lost = [(x - n) / saves for x, n in zip(loops, none, strict=True)]
        peak = statistics.median(max(x["peak"]) for x in rows[v])
        print(f"| {v} | {_spread(loops)} | {_spread([x / args.async_steps for x in loops])} | "
              f"{_spread(lost) if v != 'none' else '-'} | {_mb(peak)} | {peak / peak_none:.2f} |")
    print(f"\nThe same three interleaved step by step in one run ({args.cycles} cycles, order rotated; a unit is the "
          f"save, if any, and the next step):\n")
    print("| variant | unit s | lost per save s (each cycle against its no-save unit) |")
    print("|---|---|---|")
    for v in variants:
        lost = [x - n for x, n in zip(unit[v], unit["none"], strict=True)]
        print(f"| {v} | {_spread(unit[v])} | {_spread(lost) if v != 'none' else '-'} |")
    rows["interleaved"] = unit  # type: ignore[assignment]
    ref = rows["none"][0]["losses"]
    _check(all(x["losses"] == ref for v in variants for x in rows[v]),
           f"no-checkpoint, sync and async runs have bitwise the same losses ({len(ref)} steps, every round)",
           failures)
    return rows


def part_malloc(args, root: Path, failures: list[str]) -> dict[str, Any]:
    """The issue's run (72M, batch 8 x 128, a save after every step) with meshtrain's allocator policy (ZeRO-3
    fixes glibc's mmap threshold at its unit buffers: host_memory.py), with every buffer up to 32 MiB from the
    heap (the threshold glibc's dynamic adjustment climbs to; what ZeRO-3 got before the policy) and with a 1 MiB
    threshold (nearly everything mapped), alternating: how much of each peak is freed memory the heap keeps, and
    what returning it costs the step loop. A ``MALLOC_MMAP_THRESHOLD_`` in the environment turns the policy off."""
    over = [*ISSUE_MODEL, "train.ckpt_every=1", "train.steps=100"]
    runs = {"one process": (1, over), "dp4 zero3": (4, [*over, "parallel.dp=4", "parallel.zero=3"])}
    settings = ["meshtrain", str(32 << 20), str(args.compare_threshold)]
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {(s, n): [] for s in settings for n in runs}
    for r in range(args.rounds):
        for setting in (settings if r % 2 == 0 else settings[::-1]):
            if setting == "meshtrain":
                os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
            else:
                os.environ["MALLOC_MMAP_THRESHOLD_"] = setting  # each rank's glibc reads it when it starts
            for name, (world, ov) in runs.items():
                d = root / f"malloc-{setting}-{name.replace(' ', '-')}-{r}"
                res = _run(timed_session, world, ov, str(d), args.async_steps, True)
                shutil.rmtree(d, ignore_errors=True)
                rows[(setting, name)].append({"loop": max(x["loop"] for x in res), "whole": [x["whole"] for x in res],
                                              "losses": res[0]["losses"]})
        print(f"  round {r + 1} done", flush=True)
    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    if args.mmap_threshold:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    print(f"\n## 4. glibc's heap retention: the issue's run (72M, batch 8 x 128, dp4 ZeRO-3 vs one process), a "
          f"warm-up step then {args.async_steps} steps with a save after each but the last; {args.rounds} rounds, "
          f"the settings alternating\n")
    print("| MALLOC_MMAP_THRESHOLD_ | run | whole-run peak, worst rank (MB) | / one process | loop s | "
          "loop / meshtrain |")
    print("|---|---|---|---|---|---|")
    for setting in settings:
        one = statistics.median(max(x["whole"]) for x in rows[(setting, "one process")])
        for name in runs:
            xs = rows[(setting, name)]
            peak = statistics.median(max(x["whole"]) for x in xs)
            ratio = [x["loop"] / d["loop"] for x, d in zip(xs, rows[("meshtrain", name)], strict=True)]
            print(f"| {setting} | {name} | {_mb(peak)} | {peak / one:.2f} | {_spread([x['loop'] for x in xs])} | "
                  f"{_spread(ratio)} |")
    ref = rows[("meshtrain", "one process")][0]["losses"]
    _check(all(_rel(x["losses"], ref) <= 1e-5 for xs in rows.values() for x in xs),
           "every run of this part computed the same losses (within 1e-5 of one process's)", failures)
    _check(all(x["losses"] == xs[0]["losses"] for xs in rows.values() for x in xs)
           and all(rows[("meshtrain", n)][0]["losses"] == rows[(s, n)][0]["losses"] for n in runs for s in settings),
           "the allocator setting does not change the losses (bitwise, each run)", failures)
    return {f"{s} {n}": v for (s, n), v in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="issue,layouts,async,malloc",
                    help="comma-separated: issue, layouts, async, malloc")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--async-layout", default="zero3 dp4", choices=list(LAYOUTS))
    ap.add_argument("--async-steps", type=int, default=6)
    ap.add_argument("--cycles", type=int, default=6, help="async: cycles of the interleaved run")
    ap.add_argument("--dir", default="", help="where checkpoints are written (default: a temporary folder)")
    ap.add_argument("--json", default="", help="also write every rank's raw figures here")
    ap.add_argument("--mmap-threshold", type=int, default=0,
                    help="set glibc's MALLOC_MMAP_THRESHOLD_ (bytes) in the ranks: buffers above it are mapped and "
                         "returned to the kernel when freed (0: meshtrain's policy, host_memory.py)")
    ap.add_argument("--compare-threshold", type=int, default=1 << 20,
                    help="malloc: a small fixed MALLOC_MMAP_THRESHOLD_ compared with meshtrain's policy")
    ap.add_argument("--smoke", action="store_true", help="tiny models: check the script itself in seconds")
    args = ap.parse_args()
    if args.smoke:
        global ISSUE_MODEL, BIG
        ISSUE_MODEL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "train.global_batch=8",
                       "train.seq_len=32"]
        BIG = [*BIG, "model.d_model=64", "model.n_layers=2", "model.n_heads=4"]
    if args.mmap_threshold:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)  # read by each rank's glibc at start
    policy = f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}" if args.mmap_threshold else "meshtrain's policy"
    print(f"2-core CPU, gloo; allocator: glibc, {policy}")
    check_peak_reset()
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="meshtrain-ckptbench-"))
    root.mkdir(parents=True, exist_ok=True)
    parts = {"issue": part_issue, "layouts": part_layouts, "async": part_async, "malloc": part_malloc}
    failures: list[str] = []
    raw = {}
    try:
        for part in args.parts.split(","):
            raw[part] = parts[part](args, root, failures)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))
    if failures:
        raise SystemExit(f"{len(failures)} checks failed: {failures}")


if __name__ == "__main__":
    main()
