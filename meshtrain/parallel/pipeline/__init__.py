"""Pipeline parallelism: schedules as data (``schedules``), a simulator and charts (``simulator``)."""

from meshtrain.parallel.pipeline.schedules import (
    KINDS,
    SCHEDULES,
    Action,
    PipelineSchedule,
    build_schedule,
    check_schedule,
    dependencies,
)
from meshtrain.parallel.pipeline.simulator import (
    SimResult,
    bubble_of_timelines,
    inflight_peaks,
    png_chart,
    simulate,
    text_chart,
)

__all__ = [
    "KINDS",
    "SCHEDULES",
    "Action",
    "PipelineSchedule",
    "SimResult",
    "bubble_of_timelines",
    "build_schedule",
    "check_schedule",
    "dependencies",
    "inflight_peaks",
    "png_chart",
    "simulate",
    "text_chart",
]
