"""The full check of a run's layout before anything launches: ``config.validate`` plus what only the plan layer
knows, whether the pipeline schedule can be built for these options and the model has a block for each of its
stages. ``config.py`` is the bottom layer and imports nothing from meshtrain, so the schedule check lives here;
the CLI, the trainer and the planner call ``validate_layout`` wherever a layout must be refused before launch."""

from __future__ import annotations

from meshtrain.config import Config, ConfigError, validate
from meshtrain.plan.schedules import build_schedule


def validate_layout(cfg: Config, world_size: int | None = None) -> None:
    """``validate(cfg, world_size)``, then the pipeline schedule's own rules when ``parallel.pp > 1``;
    raises ``ConfigError`` naming the option and the fix."""
    validate(cfg, world_size)
    m, p = cfg.model, cfg.parallel
    if p.pp <= 1:
        return
    try:
        sched = build_schedule(p.schedule, p.pp, p.microbatches, p.virtual_stages)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if m.n_layers < sched.n_stages:
        raise ConfigError(f"{sched.n_stages} pipeline stages (parallel.pp x virtual stages) need at least as many "
                          f"layers; model.n_layers={m.n_layers}.")
