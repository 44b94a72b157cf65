"""``meshtrain plan``'s planner in one import: the problem and a layout (``problem``), the estimate of a layout
(``steptime``), the search and a layout as a run config (``search``), the explanation and table (``explain``) and
the book's figure (``figure``).

For a model, a global batch (tokens) and a cluster, ``search`` enumerates the layouts the runtime's shape rules
allow, predicts each one's memory per device and step time with the shared cost model (``plan/costs.py``), keeps
those that fit and ranks them by step time. ``explain`` says why the best one wins. Each name is defined once in
the module named beside it; this module only gathers them.
"""

from __future__ import annotations

from meshtrain.plan.explain import (
    book_summary,
    explain,
    format_table,
    sharding,
)
from meshtrain.plan.figure import (
    plot_comm_vs_compute,
)
from meshtrain.plan.pipeline_cost import (
    pipeline_sim_fast,
)
from meshtrain.plan.problem import (
    Collective,
    Estimate,
    Layout,
    Problem,
)
from meshtrain.plan.search import (
    DEFAULT_SCHEDULES,
    PARALLEL_AXES,
    SearchOptions,
    SearchResult,
    candidate_layouts,
    check_runnable,
    emit_yaml,
    parse_tokens,
    runtime_supports,
    search,
    to_config,
)
from meshtrain.plan.steptime import (
    evaluate,
)

__all__ = [
    "Collective",
    "DEFAULT_SCHEDULES",
    "Estimate",
    "Layout",
    "PARALLEL_AXES",
    "Problem",
    "SearchOptions",
    "SearchResult",
    "book_summary",
    "candidate_layouts",
    "check_runnable",
    "emit_yaml",
    "evaluate",
    "explain",
    "format_table",
    "parse_tokens",
    "pipeline_sim_fast",
    "plot_comm_vs_compute",
    "runtime_supports",
    "search",
    "sharding",
    "to_config",
]
