"""Shared pieces of the equivalence tests: the comparison with the single-device run, where each
layout's run folder goes, and the planner's byte check over those folders."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

# fp32 on CPU: only the order of floating-point sums differs between layouts.
LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-5  # relative Frobenius norm per tensor: ||a - b|| / ||b||
GRAD_RTOL = 1e-5  # the step-1 logical gradient per tensor (relative Frobenius) and every step's grad_norm


# ----------------------------------------------------------------------------- the trainer's internals
# Every test reads the trainer's internals through these helpers only, so that when they move, only this
# block changes.


def logical_params(trainer) -> dict[str, torch.Tensor]:
    """The full logical (single-device-named) parameters, on CPU, on every rank. Collective."""
    return trainer.parallel.logical_tensors()


def logical_grads(trainer) -> dict[str, torch.Tensor]:
    """The full logical gradients, on CPU, on every rank: call from a ``grad_hook`` (after the gradient sync,
    before clipping and the optimizer step). Collective."""
    return trainer.parallel.logical_tensors(grads=True)


def elements_loaded(trainer) -> tuple[int | None, int]:
    """(elements this rank read from the checkpoint it resumed, or None if it started fresh; elements of
    logical state it holds: parameters, optimizer state, buffers)."""
    from meshtrain.parallel.state import held_numel

    return trainer.elements_read, held_numel(trainer.parallel.local_state(trainer.optimizer))


@contextmanager
def counting_init_draws() -> Iterator[list[int]]:
    """``[n]``: the elements ``meshtrain.model.init`` draws inside the block (one generator output each)."""
    from meshtrain.model import init

    count, lock, raw = [0], threading.Lock(), init._Stream.raw

    def counted(stream, start: int, stop: int):
        with lock:  # pieces are drawn on several threads
            count[0] += stop - start
        return raw(stream, start, stop)

    init._Stream.raw = counted
    try:
        yield count
    finally:
        init._Stream.raw = raw


def init_share(trainer) -> int:
    """The elements of the parameters this rank holds (its logical boxes) whose initial values are drawn (not
    the norms' ones or the biases' zeros): what a fresh start should draw on this rank, no more."""
    from meshtrain.model.init import init_std
    from meshtrain.model.source import box_numel

    return sum(box_numel(r.box) for h in trainer.parallel.local_state() for r in h.regions
               if h.key in trainer.shapes and not h.key.endswith(".bias") and init_std(trainer.cfg.model, h.key))


def mesh_sizes(trainer) -> dict[str, int]:
    """The size of every mesh axis the run built (pp, dp, cp, tp, ep, dp_shard)."""
    return {axis: trainer.mesh.size(axis) for axis in ("pp", "dp", "cp", "tp", "ep", "dp_shard")}


def executed_actions(trainer) -> list | None:
    """The pipeline actions this rank executed in the last training step, in order (None without a pipeline)."""
    if trainer.parallel.schedule is None:
        return None
    return [a for _, _, a in trainer.parallel.micro.trace.actions]


def scheduled_actions(trainer) -> list | None:
    """The schedule's action list for this rank's pipeline stage (None without a pipeline)."""
    if trainer.parallel.schedule is None:
        return None
    return list(trainer.parallel.schedule.actions[trainer.mesh.coord("pp")])


def state_bytes(trainer) -> dict[str, int]:
    """This rank's live parameter, gradient and optimizer-state bytes."""
    return trainer.parallel.state_bytes(trainer.optimizer)


def state_dtypes(trainer) -> dict[str, set[str]]:
    """The dtypes of what this rank's optimizer updates: its parameters (pieces), their gradients and the
    optimizer's state tensors (step counters excluded)."""
    ops = trainer.parallel.optim_params()
    state = [v for st in trainer.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    return {"params": {str(op.tensor.dtype) for op in ops},
            "grads": {str(op.tensor.grad.dtype) for op in ops if op.tensor.grad is not None},
            "optim": {str(v.dtype) for v in state}}


def attention_flops(trainer) -> dict[str, float] | None:
    """The context-parallel attention FLOP counters of this rank (None without context parallelism)."""
    return vars(trainer.parallel.cp.flops).copy() if trainer.parallel.cp is not None else None


def forward_saved_bytes(trainer) -> int:
    """Activation bytes autograd keeps for backward in one forward of this rank's rows of the first training
    batch (buffers excluded), with its document ids under ``train.attention_mask=document``."""
    from meshtrain.parallel.recompute import saved_activation_bytes

    batch = trainer.local_batch(trainer.train_data, 0)
    kwargs = {} if batch.docs is None else {"docs": batch.docs}
    return saved_activation_bytes(lambda: trainer.model(batch.inputs, **kwargs), exclude=list(trainer.model.buffers()))


def op_bytes(run: str | Path) -> dict[int, dict[str, int]]:
    """Every rank's collective bytes per ``axis/op`` of the steady step the run metered, read from its
    ``comm.json``: {rank: {"dp_cp/all_reduce": bytes, ...}}."""
    import json

    return {int(r["rank"]): {key: int(b) for key, b in r["bytes"].items()}
            for r in json.loads((Path(run) / "comm.json").read_text())["ranks"]}


def axis_bytes(run: str | Path) -> dict[int, dict[str, int]]:
    """Every rank's collective bytes per mesh axis (summed over ops) of the steady step the run metered,
    read from its ``comm.json``: {rank: {axis: bytes}}."""
    out: dict[int, dict[str, int]] = {}
    for rank, ops in op_bytes(run).items():
        mine = out.setdefault(rank, {})
        for key, b in ops.items():
            axis = key.split("/")[0]
            mine[axis] = mine.get(axis, 0) + b
    return out


def checkpoint_params(run: str | Path) -> dict[str, torch.Tensor]:
    """The parameters (and saved buffers) of the latest checkpoint under ``run``/checkpoints."""
    from meshtrain.train.checkpoint import CheckpointReader, latest_checkpoint

    path = latest_checkpoint(Path(run) / "checkpoints")
    assert path is not None, f"{run} holds no checkpoint"
    reader = CheckpointReader(path)
    return {k: reader.read_full(k) for k in reader.keys() if "/" not in k}


# ----------------------------------------------------------------------------- comparisons


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (0 when both are zero, inf when only b is)."""
    diff, base = (a.float() - b.float()).norm().item(), b.float().norm().item()
    if base == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / base


def worst_rel(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """The largest relative Frobenius difference over the tensors of ``ref`` (for reporting a measured margin)."""
    return max(_rel(got[k], want) for k, want in ref.items())


def assert_same_tensors(name: str, what: str, got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                        rtol: float) -> None:
    """Same names, and every tensor within ``rtol`` relative Frobenius norm (with the norm ratio, which
    names a constant-factor error at a glance)."""
    assert set(got) == set(ref), f"{name}: {what} names differ: {sorted(set(got) ^ set(ref))}"
    for key, want in ref.items():
        have = got[key]
        assert tuple(have.shape) == tuple(want.shape), f"{name}: {what} {key} has shape {tuple(have.shape)} " \
                                                       f"vs {tuple(want.shape)}"
        rel = _rel(have, want)
        ratio = have.float().norm().item() / max(want.float().norm().item(), 1e-30)
        assert rel <= rtol, f"{name}: {what} {key} differs by {rel:.3g} relative (norm ratio {ratio:.6g})"


def assert_same_scalars(name: str, what: str, got: list[float], ref: list[float], rtol: float) -> None:
    assert len(got) == len(ref), f"{name}: {len(got)} {what} values vs {len(ref)}"
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"{name}: step {i + 1} {what} {a} vs {b} (ratio {a / b if b else a:.6g})"


def assert_same_run(name: str, got: dict, ref: dict) -> None:
    """Losses and grad norms over the steps within LOSS_RTOL / GRAD_RTOL, the step-1 logical gradient of
    every tensor within GRAD_RTOL and every final parameter tensor within PARAM_RTOL (relative Frobenius).
    ``got`` and ``ref`` are ``run_layout`` results."""
    assert_same_scalars(name, "loss", got["losses"], ref["losses"], LOSS_RTOL)
    # The gradients tensor by tensor first: a wrong tensor is then named, with its norm ratio.
    assert_same_tensors(name, "step-1 gradient", got["grads"], ref["grads"], GRAD_RTOL)
    assert_same_scalars(name, "grad_norm", got["grad_norms"], ref["grad_norms"], GRAD_RTOL)
    assert_same_tensors(name, "parameter", got["params"], ref["params"], PARAM_RTOL)


BF16_U = 2.0 ** -8  # bf16's unit roundoff (8 significant bits)


def assert_within_bf16_roundings(name: str, per_rank: list[dict], ref: dict, k: int) -> str:
    """Every rank's losses, grad norms, step-1 gradient and final parameters (per tensor, relative Frobenius)
    within k·u of ``ref``, u = 2^-8: a bf16 layout against the one-device run of its dtype, where k counts the
    bf16 roundings the layout makes and one device does not (the calling file's docstring derives it). Returns a
    line with the measured worst step-1 gradient and parameter, for the docs' margins (``pytest -s``)."""
    rtol = k * BF16_U
    assert rtol > LOSS_RTOL
    for rank, got in enumerate(per_rank):
        who = f"{name} (rank {rank}, {k}u = {rtol:.2g})"
        assert_same_scalars(who, "loss", got["losses"], ref["losses"], rtol)
        assert_same_scalars(who, "grad_norm", got["grad_norms"], ref["grad_norms"], rtol)
        assert_same_tensors(who, "step-1 gradient", got["grads"], ref["grads"], rtol)
        assert_same_tensors(who, "parameter", got["params"], ref["params"], rtol)
    return (f"{name}: {k}u = {rtol:.1e}; worst step-1 gradient "
            f"{max(worst_rel(r['grads'], ref['grads']) for r in per_rank):.1e}, parameter "
            f"{max(worst_rel(r['params'], ref['params']) for r in per_rank):.1e}")


def assert_same_runs(name: str, per_rank: list[dict], ref: dict) -> None:
    """``assert_same_run`` on every rank's copy of the (replicated) results, not rank 0's alone."""
    assert per_rank, f"{name}: no rank returned a result"
    for rank, got in enumerate(per_rank):
        assert_same_run(f"{name} (rank {rank} of {len(per_rank)})", got, ref)


def expected_mesh(overrides: list[str], world_size: int) -> dict[str, int]:
    """The mesh sizes a layout asks for, read from its ``parallel.*`` overrides (dp: the rest of the world)."""
    asked = {o.split("=")[0][len("parallel."):]: o.split("=")[1] for o in overrides if o.startswith("parallel.")}
    size = {axis: int(asked.get(axis, 1)) for axis in ("pp", "cp", "tp", "ep")}
    size["dp"] = int(asked.get("dp", world_size // (size["pp"] * size["cp"] * size["tp"])))
    size["dp_shard"] = int(asked.get("dp_shard", 0)) or size["dp"]
    return size


# The comm meter names the data-parallel gradient sync after its group: dp x cp, or its shard group.
_DP_SYNC = ("dp_cp", "dp_shard_cp")


def intended_axes(mesh: dict[str, int]) -> list[tuple[str, ...]]:
    """The comm-meter axes a layout with these mesh sizes must move bytes on in every step, each as the
    names it may be metered under: pp, cp, tp, ep above 1, and the gradient sync over dp x cp (HSDP: its
    shard group and the replicate axis)."""
    axes = [(a,) for a in ("pp", "cp", "tp", "ep") if mesh[a] > 1]
    if mesh["dp"] > 1 and mesh["dp_shard"] < mesh["dp"]:
        axes += [("dp_shard_cp",), ("dp_replicate",)]
    elif mesh["dp"] * mesh["cp"] > 1:
        axes += [_DP_SYNC]
    return axes


def assert_axes_moved_bytes(name: str, run: str | Path, mesh: dict[str, int], world_size: int) -> None:
    """Every rank's metered steady step (``run``/comm.json) moved bytes on every ``intended_axes`` axis."""
    per_axis = axis_bytes(run)
    assert sorted(per_axis) == list(range(world_size)), f"{name}: comm.json ranks {sorted(per_axis)}"
    for rank, b in per_axis.items():
        for names in intended_axes(mesh):
            assert sum(b.get(a, 0) for a in names) > 0, \
                f"{name}: rank {rank} moved no bytes on {' or '.join(names)} in the metered step: {b}"


def assert_layout_ran(name: str, overrides: list[str], world_size: int, per_rank: list[dict],
                      run: str | Path | None) -> None:
    """The layout really ran: every rank built the mesh the overrides ask for; each rank's steady-step comm
    meter (``run``/comm.json) moved bytes on every axis above 1 (pp, cp, tp, ep; the data-parallel sync over
    dp x cp, or both HSDP axes); pipeline ranks executed exactly their schedule's action list. And every rank's
    fresh start drew exactly the initial values of the boxes it holds (no whole rows of a column slice)."""
    want = expected_mesh(overrides, world_size)
    assert len(per_rank) == world_size, f"{name}: {len(per_rank)} ranks returned, not {world_size}"
    for rank, got in enumerate(per_rank):
        assert got["mesh"] == want, f"{name}: rank {rank} built mesh {got['mesh']}, the layout asks for {want}"
        drawn, share = got["init"]
        assert drawn == share, f"{name}: rank {rank}'s init drew {drawn} elements for the {share} it holds"
        if want["pp"] > 1:
            assert got["scheduled"], f"{name}: rank {rank} has no pipeline schedule"
            assert got["executed"] == got["scheduled"], \
                f"{name}: rank {rank} executed {[str(a) for a in got['executed']]}, its schedule lists " \
                f"{[str(a) for a in got['scheduled']]}"
        else:
            assert got["executed"] is None, f"{name}: rank {rank} ran a pipeline the layout does not ask for"
    if run is not None:
        assert_axes_moved_bytes(name, run, want, world_size)


def reference_key(overrides: list[str]) -> tuple[str, ...]:
    """The overrides that change the single-device run (model shape, optimizer, clipping, dtype); the rest
    (layout, accumulation, recompute) must not."""
    keep = ("model.", "train.optimizer=", "train.grad_clip=", "train.dtype=")
    return tuple(o for o in overrides if o.startswith(keep))


def run_dir(data: str, world_size: int, name: str) -> str:
    """Each layout's run folder next to the test data (its comm.json feeds the planner check)."""
    return str(Path(data).parent / "runs" / f"{world_size}-{re.sub('[^A-Za-z0-9]+', '_', name)}")


def planner_mismatch(run: str | Path) -> str | None:
    """None when the planner predicted the finished ``run``: every rank's bytes exactly, and its state bytes
    within 5% for flat AdamW layouts (per-tensor shards and Muon's single moment are uneven by design); else the
    side-by-side table. Raises ValueError for a layout the byte check does not model (``plan/check.check_run``)."""
    from meshtrain.plan.check import check_run

    text, exact, memory_ok = check_run(run)
    config = (Path(run) / "config.yaml").read_text()
    uneven = "per_tensor" in config or "optimizer: muon" in config
    return None if exact and (memory_ok or uneven) else text


def assert_planner_predicts_runs(data: str) -> None:
    """Every run folder next to ``data`` is predicted by the planner (``planner_mismatch``): the runs the file's
    equivalence tests wrote before it, in the same process (``make test`` runs a file's tests on one worker, in
    order: ``--dist loadfile``)."""
    folder = Path(data).parent / "runs"
    runs = sorted(folder.iterdir()) if folder.is_dir() else []
    assert runs, f"no runs in {folder}: this check reads those the file's equivalence tests write, run before it"
    for run in runs:
        mismatch = planner_mismatch(run)
        assert mismatch is None, mismatch


def run_overrides(steps: int) -> list[str]:
    """What every equivalence file trains: ``steps`` steps of 8 sequences of 32 tokens with 2 warm-up steps, and
    nothing printed or sampled beside the run's records (a nominal peak FLOP/s, so MFU is defined on any machine)."""
    return ["train.progress=false", "train.tensorboard=false", "train.peak_flops=1e11", f"train.steps={steps}",
            "train.sample_tokens=0", "train.seq_len=32", "train.global_batch=8", "train.warmup_steps=2"]


def prepared_short_documents(tmp_path_factory, name: str) -> str:
    """Short documents, prepared in a fresh temporary folder: a stdlib module cut into pieces of 4 to 60 characters,
    one JSONL document each, so that most 64-token rows hold several (``train.attention_mask=document`` at work)."""
    import json
    import random

    from meshtrain.train.prepare import default_source_dir, prepare_data

    root = tmp_path_factory.mktemp(name)
    text = (Path(default_source_dir()) / "json" / "decoder.py").read_text() * 3
    rng, pieces, i = random.Random(0), [], 0
    while i < len(text):
        n = rng.randint(4, 60)
        pieces.append(text[i:i + n])
        i += n
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in pieces))
    prepare_data(root / "docs.jsonl", root / "stdlib")
    return str(root / "stdlib")


def prepared_stdlib(tmp_path_factory, name: str) -> str:
    """The stdlib corpus prepared in a fresh temporary folder (one per test module: each module's run
    folders sit next to it, for ``assert_planner_predicts_runs``)."""
    from meshtrain.train.prepare import default_source_dir, prepare_data

    out = tmp_path_factory.mktemp(name) / "stdlib"
    prepare_data(default_source_dir(), out)
    return str(out)


def run_layout(data: str, overrides: list[str], out: str | None = None, preset: str = "tiny",
               extra=None) -> dict:
    """Train the preset on ``data`` with ``overrides`` (writing to ``out``) on this rank; return what the
    equivalence checks compare (on every rank): every step's loss and grad_norm, the first step's logical
    gradients (before clipping and the optimizer step), the final logical parameters, every step's records,
    the mesh sizes, the executed and scheduled pipeline actions, (elements the init drew, the rank's share of
    them: ``init_share``), and ``extra(trainer)`` if given (after
    training). Collective: call on every rank."""
    from meshtrain.config import load_config
    from meshtrain.train.trainer import Trainer

    first: dict[str, torch.Tensor] = {}

    def hook(step: int, trainer) -> None:
        if not first:
            first.update(logical_grads(trainer))

    with counting_init_draws() as drawn:
        trainer = Trainer(load_config(preset, [f"data.path={data}", *overrides]), out, grad_hook=hook)
    init = (drawn[0], init_share(trainer))
    records = trainer.train()
    return {"losses": [r["loss"] for r in records], "grad_norms": [r["grad_norm"] for r in records],
            "grads": first, "params": logical_params(trainer), "records": records, "mesh": mesh_sizes(trainer),
            "executed": executed_actions(trainer), "scheduled": scheduled_actions(trainer), "init": init,
            "extra": extra(trainer) if extra is not None else None}


def layouts_worker(rank: int, world_size: int, data: str, base: list[str], layouts: list[tuple[str, list[str]]],
                   measured: tuple[str, ...] = ()) -> dict[str, dict]:
    """Spawned-rank body shared by the equivalence files: train every (name, overrides) layout in turn into
    its ``run_dir``; every rank returns {name: run_layout result}, whose ``extra`` for the layouts named in
    ``measured`` is what one forward keeps for backward after training (``forward_saved_bytes``)."""
    return {name: run_layout(data, [*base, *overrides], run_dir(data, world_size, name),
                             extra=forward_saved_bytes if name in measured else None)
            for name, overrides in layouts}


def check_layouts(data: str, world_size: int, layouts: list[tuple[str, list[str]]], per_rank: list[dict],
                  reference) -> None:
    """For every (name, overrides) layout: it really ran (``assert_layout_ran``) and every rank's results equal
    ``reference(overrides)``, the single-device run (``assert_same_runs``). ``per_rank``: each rank's
    {name: result}."""
    for name, overrides in layouts:
        results = [r[name] for r in per_rank]
        assert_layout_ran(name, overrides, world_size, results, run_dir(data, world_size, name))
        assert_same_runs(name, results, reference(overrides))


def reference_runs(data: str, base: list[str], preset: str = "tiny"):
    """``get(overrides)``: the single-device ``run_layout`` result for the overrides that change it
    (``reference_key``), each trained once."""
    cache: dict[tuple[str, ...], dict] = {}

    def get(overrides: list[str]) -> dict:
        key = reference_key(overrides)
        if key not in cache:
            cache[key] = run_layout(data, [*base, *key], preset=preset)
        return cache[key]

    return get


def assert_same_checkpoint(name: str, run: str | Path, ref_run: str | Path) -> None:
    """The latest checkpoints of two runs hold the same tensors within PARAM_RTOL (relative Frobenius)."""
    assert_same_tensors(name, "checkpoint tensor", checkpoint_params(run), checkpoint_params(ref_run), PARAM_RTOL)


def assert_same_cli_run(name: str, out: str | Path, records: list[dict], ref_out: str | Path,
                        ref_records: list[dict], overrides: list[str] | None = None, nproc: int = 1) -> None:
    """A CLI run against the one-process CLI run: every step's loss (LOSS_RTOL) and grad_norm (GRAD_RTOL)
    from metrics.jsonl, and the final checkpoint's tensors (PARAM_RTOL); with ``overrides``, also that each
    rank moved bytes on every axis the layout asks for (its comm.json)."""
    assert_same_scalars(name, "loss", [r["loss"] for r in records], [r["loss"] for r in ref_records], LOSS_RTOL)
    assert_same_scalars(name, "grad_norm", [r["grad_norm"] for r in records],
                        [r["grad_norm"] for r in ref_records], GRAD_RTOL)
    assert_same_checkpoint(name, out, ref_out)
    if overrides is not None:
        assert_axes_moved_bytes(name, out, expected_mesh(overrides, nproc), nproc)


def cli_train(data: str, out: Path, overrides: list[str], timeout: float = 300) -> tuple[list[dict], str]:
    """Run ``meshtrain train --config tiny`` as a user would (``--nproc N`` among the overrides launches torchrun);
    return its metrics.jsonl records and stdout. A failed run raises with the lines of stderr that say why."""
    import json
    import subprocess
    import sys

    args = [sys.executable, "-m", "meshtrain.cli", "train", "--config", "tiny", "--out", str(out),
            f"data.path={data}", *overrides]
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    stderr = r.stderr
    if r.returncode != 0 and (log := re.search(r"full log .*?: (.+)$", stderr, re.M)):  # --nproc: every rank's
        stderr += Path(log.group(1)).read_text(errors="replace")  # stderr is in the launcher's log file
    clues = [ln for ln in stderr.splitlines() if any(w in ln for w in ("terminate", "Error", "exitcode"))]
    assert r.returncode == 0, "\n".join(clues[:20]) + "\n" + stderr[-2000:]
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return records, r.stdout
