"""Where step metrics go: a JSONL file (one object per optimizer step), TensorBoard, a progress bar."""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch

# Set by the `meshtrain train --nproc` launcher in its workers' environment: the log file their stderr goes to.
LAUNCHER_LOG_ENV = "MESHTRAIN_LAUNCHER_LOG"


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a GPU; on CPU the process's peak resident set (Linux reports KiB)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class MetricsLogger:
    """Writes metrics on the logging rank only; every other rank gets a logger that does nothing."""

    def __init__(self, out_dir: Path | None, total_steps: int, start_step: int = 0, enabled: bool = True,
                 progress: bool = True, tensorboard: bool = True) -> None:
        self.enabled = enabled  # the logging rank prints; files are written only with an out_dir
        self._jsonl = None
        self._tb = None
        self._bar = None
        if self.enabled and out_dir is not None:
            path = out_dir / "metrics.jsonl"
            kept = []
            if start_step > 0 and path.exists():  # resuming: keep the lines of steps already done
                kept = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= start_step]
            path.write_text("".join(ln + "\n" for ln in kept))
            self._jsonl = path.open("a")
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self._tb = SummaryWriter(str(out_dir / "tb"))
                except ImportError:
                    print("tensorboard is not installed: TensorBoard logs are off.", file=sys.stderr)
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
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
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
        for sink in (self._jsonl, self._tb, self._bar):
            if sink is not None:
                sink.close()
