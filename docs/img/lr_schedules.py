"""Draws lr_schedules.png for docs/training.md: each train.lr_schedule over 1,000 steps with 50 of warmup, from
the trainer's own lr_at, and a wsd run extended to 1,500 steps. Run: python docs/img/lr_schedules.py"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from meshtrain.config import TrainConfig  # noqa: E402
from meshtrain.train.optim import lr_at  # noqa: E402

runs = {
    "cosine": TrainConfig(steps=1000, warmup_steps=50, lr=1.0, lr_schedule="cosine"),
    "linear": TrainConfig(steps=1000, warmup_steps=50, lr=1.0, lr_schedule="linear"),
    "wsd, decay_shape=sqrt": TrainConfig(steps=1000, warmup_steps=50, lr=1.0, lr_schedule="wsd"),
    "wsd, decay_shape=linear": TrainConfig(steps=1000, warmup_steps=50, lr=1.0, lr_schedule="wsd",
                                           decay_shape="linear"),
    "wsd extended: steps=1500, decay_steps=200": TrainConfig(steps=1500, warmup_steps=50, lr=1.0,
                                                             lr_schedule="wsd", decay_steps=200),
}
fig, ax = plt.subplots(figsize=(10, 3.6))
for (name, cfg), style in zip(runs.items(), ["-", "-", "-", "--", ":"], strict=True):
    ax.plot(range(1, cfg.steps + 1), [lr_at(s, cfg) for s in range(cfg.steps)], style, label=name)
ax.set_xlabel("step")
ax.set_ylabel("lr / train.lr")
ax.set_title("train.lr_schedule (warmup_steps=50, min_lr_ratio=0.1)")
ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
fig.tight_layout()
fig.savefig(Path(__file__).with_name("lr_schedules.png"), dpi=110)
