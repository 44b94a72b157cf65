"""Where step metrics go: a JSONL file (one object per optimizer step), TensorBoard, Weights & Biases, a progress
bar."""

from __future__ import annotations

import json
import math
import os
import resource
import secrets
import sys
from pathlib import Path
from typing import Any

import torch

from meshtrain.config import ConfigError

# Set by the `meshtrain train --nproc` launcher in its workers' environment: the log file their stderr goes to.
LAUNCHER_LOG_ENV = "MESHTRAIN_LAUNCHER_LOG"
# In the run folder: the W&B run id, so that a resumed run goes on logging into the same W&B run.
WANDB_ID_FILE = "wandb_run_id"


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a GPU; on CPU the process's peak resident set (Linux reports KiB)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def alloc_retries(device: torch.device) -> int | None:
    """How many times so far the CUDA caching allocator retried an allocation (``num_alloc_retries``: a cudaMalloc
    failed, so it freed its cache, synchronising the device, and tried again); None off CUDA."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def retries_line(step: int, retries: int) -> str:
    """What the log says the first time a step's allocations were retried (torchtitan warns likewise)."""
    return (f"step {step}: the CUDA caching allocator retried {retries} allocation(s) on this rank: each frees its "
            f"cache and synchronises the device, which then idles while the host queues again. The step runs at "
            f"the edge of the device's memory: a smaller train.global_batch (with train.grad_accum), "
            f"train.recompute=selective, or PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True usually ends it "
            f"(metrics.jsonl: alloc_retries per step).")


def import_wandb() -> Any:
    """The ``wandb`` module, or an ImportError that names the extra to install (asked before launch)."""
    try:
        import wandb
    except ImportError as e:
        raise ImportError("train.wandb=true needs wandb, which is not installed: pip install 'meshtrain[wandb]' "
                          "(or pip install wandb), or set train.wandb=false.", name="wandb") from e
    return wandb


def wandb_mode() -> str:
    """``$WANDB_MODE`` when set; otherwise ``online`` only with ``$WANDB_API_KEY``, so that a run never needs the
    network unless asked (offline runs are uploaded later with ``wandb sync``)."""
    return os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")


class WandbSink:
    """One W&B run per run folder: the scalars of each record, at its step."""

    def __init__(self, out_dir: Path | None, project: str, run_config: dict[str, Any] | None) -> None:
        wandb = import_wandb()
        run_id = None
        if out_dir is not None:
            id_file = out_dir / WANDB_ID_FILE
            if id_file.is_file():
                run_id = id_file.read_text().strip() or None
            if run_id is None:
                run_id = secrets.token_hex(4)  # W&B ids are [a-z0-9]; wandb's own helper moved
                id_file.write_text(run_id + "\n")
        # console="off": the bar and the launcher's log file own stdout/stderr; W&B wrapping them adds nothing.
        mode = wandb_mode()
        try:
            self.run = wandb.init(project=project, dir=str(out_dir) if out_dir is not None else None, id=run_id,
                                  resume="allow" if run_id else None,
                                  name=out_dir.name if out_dir is not None else None, config=run_config, mode=mode,
                                  settings=wandb.Settings(console="off"))
        except Exception as e:  # W&B's error classes differ between versions; any failure to start is the same to us
            raise ConfigError(f"train.wandb=true: W&B could not start a run in {mode} mode ({e}): check WANDB_API_KEY "
                              f"and the network, or set WANDB_MODE=offline (or train.wandb=false).") from e

    def log(self, record: dict[str, Any]) -> None:
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        # commit: a record is a whole step, so W&B need not hold it open until the next step's arrives.
        self.run.log(scalars, step=int(record["step"]), commit=True)

    def close(self) -> None:
        self.run.finish()


def _finite_or_null(v: Any) -> Any:
    """``v`` with every non-finite float, in lists and dicts too, replaced by None (JSON null)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite_or_null(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite_or_null(x) for x in v]
    return v


def _step_of(line: str, path: Path) -> float:
    """A metrics.jsonl line's step; inf (dropped on resume) for one a crash cut off or left blank, said once."""
    try:
        record = json.loads(line)
        return int(record["step"]) if isinstance(record, dict) else math.inf
    except (ValueError, KeyError, TypeError):
        if line.strip():
            print(f"{path}: dropped a line that does not read (cut off by a crash?): {line[:60]!r}", file=sys.stderr)
        return math.inf


class MetricsLogger:
    """Writes metrics on the logging rank only; every other rank gets a logger that does nothing."""

    def __init__(self, out_dir: Path | None, total_steps: int, start_step: int = 0, enabled: bool = True,
                 progress: bool = True, tensorboard: bool = True, wandb_project: str | None = None,
                 run_config: dict[str, Any] | None = None) -> None:
        """``wandb_project``: also log to Weights & Biases (``train.wandb``), with ``run_config`` as the run's
        config; like every sink, only on the logging rank."""
        self.enabled = enabled  # the logging rank prints; files are written only with an out_dir
        self._jsonl = None
        self._tb = None
        self._bar = None
        self._wandb: WandbSink | None = None
        if self.enabled and out_dir is not None:
            path = out_dir / "metrics.jsonl"
            kept = []
            if start_step > 0 and path.exists():  # resuming: keep the lines of steps already done
                kept = [ln for ln in path.read_text().splitlines() if _step_of(ln, path) <= start_step]
            path.write_text("".join(ln + "\n" for ln in kept))
            self._jsonl = path.open("a")
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self._tb = SummaryWriter(str(out_dir / "tb"))
                except ImportError:
                    print("tensorboard is not installed: TensorBoard logs are off.", file=sys.stderr)
        if self.enabled and wandb_project:
            self._wandb = WandbSink(out_dir, wandb_project, run_config)
        if enabled and progress:
            from tqdm import tqdm

            # Under `meshtrain train --nproc` the workers' stderr goes to the run's log file (every rank's
            # tracebacks, torchrun's report) and only stdout reaches the terminal: draw the bar there.
            stream = sys.stdout if os.environ.get(LAUNCHER_LOG_ENV) else sys.stderr
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                             mininterval=0.5, file=stream)

    def log(self, record: dict[str, Any]) -> None:
        """Append one step's record ({"step": int, ...}) to every sink."""
        if self._jsonl is not None:
            # A skipped step's NaN or inf is written as null: Python's json would write a bare NaN, which strict
            # JSON readers (jq, most languages' parsers) refuse. ``report.RunFiles`` reads null back as NaN.
            self._jsonl.write(json.dumps(_finite_or_null(record), allow_nan=False) + "\n")
            self._jsonl.flush()
        if self._wandb is not None:
            self._wandb.log(record)
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, record["step"])
        if self._bar is not None and "loss" in record:
            self._bar.n = record["step"]
            post = {"loss": f"{record['loss']:.4f}", "tok/s": f"{record.get('tokens_per_s', 0):,.0f}"}
            if "val_loss" in record:
                post["val"] = f"{record['val_loss']:.4f}"
            if "moe_imbalance" in record:  # the busiest expert's tokens over the mean, worst layer
                post["moe max/mean"] = f"{record['moe_imbalance']:.2f}"
            self._bar.set_postfix(post, refresh=True)

    def write(self, text: str) -> None:
        """Print a line without breaking the progress bar."""
        if self._bar is not None:
            self._bar.write(text, file=sys.stdout)
        elif self.enabled:
            print(text, flush=True)

    def close(self) -> None:
        for sink in (self._jsonl, self._tb, self._wandb, self._bar):
            if sink is not None:
                sink.close()
