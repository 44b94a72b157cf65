"""The cost model in one import: FLOPs and parameters (``flops``), sharding units (``units``), communication bytes
(``comm_bytes``) and times (``network``), memory (``memory``), the pipeline's simulated time (``pipeline_cost``),
one layer's compute time (``steptime``), the scaling book's closed forms (``book``, ``book_batch``,
``book_memory``, ``book_roofline``) and the Megatron-LM paper's (``megatron``).

Each name is defined once in the module named beside it; this module only gathers them for the trainer's MFU, the
tests and scripts that read several at once.
"""

from __future__ import annotations

from meshtrain.plan.book import (
    DEFAULT_REVISION,
    MIXED_REVISIONS,
    book_checkpoint_bytes,
    book_layer_comm,
    book_layer_times,
    book_param_count,
    book_step_time,
    chips_for_batch,
    critical_batch_per_device,
    days_to_train,
    dcn_min_batch_per_pod,
    mixed_min_batch_per_device,
    optimal_fsdp,
    split_fsdp_tp,
    tp_limit,
    tp_min_ffw,
    training_flops,
)
from meshtrain.plan.book_batch import (
    dcn_critical_batch,
    dp_critical_batch,
    pipeline_comm_time,
    pipeline_critical_batch,
)
from meshtrain.plan.book_memory import (
    checkpoint_bytes,
    checkpoint_factor,
    largest_model,
    min_devices,
    remat_flops_per_token,
)
from meshtrain.plan.book_roofline import decode_roofline, hbm_critical_batch, matmul_roofline
from meshtrain.plan.comm_bytes import (
    cp_comm_bytes,
    cp_ring_bytes,
    dp_comm_bytes,
    dp_family_bytes,
    ep_all_to_all_bytes,
    ep_comm_bytes,
    pp_p2p_bytes,
    tp_comm_bytes,
    tp_layer_collectives,
)
from meshtrain.plan.flops import (
    ParamCount,
    attention_flops_per_token,
    days_for_tokens,
    flops_per_token,
    layer_flops,
    matmul_params,
    mfu,
    moe_param_count,
    param_count,
    stage_part_flops,
    step_mfu,
)
from meshtrain.plan.megatron import megatron_flops_per_iteration, megatron_params, megatron_training_days
from meshtrain.plan.memory import (
    DTYPE_BYTES,
    MESHTRAIN_BF16,
    MIXED_16BIT,
    PRECISIONS,
    Precision,
    activation_bytes,
    activation_elems_per_token,
    dp_state_bytes,
    run_precision,
    state_bytes,
    tp_forward_saved_bytes,
)
from meshtrain.plan.network import (
    Link,
    collective_time,
    exposed,
    wire_factor,
)
from meshtrain.plan.pipeline_cost import (
    bubble_fraction,
    pipeline_sim,
)
from meshtrain.plan.problem import (
    StepTime,
)
from meshtrain.plan.steptime import (
    layer_compute_time,
)
from meshtrain.plan.units import (
    block_params,
    expert_params_per_rank,
    unit_numels,
)

__all__ = [
    "DEFAULT_REVISION",
    "DTYPE_BYTES",
    "Link",
    "MESHTRAIN_BF16",
    "MIXED_16BIT",
    "MIXED_REVISIONS",
    "PRECISIONS",
    "ParamCount",
    "Precision",
    "StepTime",
    "activation_bytes",
    "activation_elems_per_token",
    "attention_flops_per_token",
    "block_params",
    "book_checkpoint_bytes",
    "book_layer_comm",
    "book_layer_times",
    "book_param_count",
    "book_step_time",
    "bubble_fraction",
    "checkpoint_bytes",
    "checkpoint_factor",
    "chips_for_batch",
    "collective_time",
    "cp_comm_bytes",
    "cp_ring_bytes",
    "critical_batch_per_device",
    "days_for_tokens",
    "days_to_train",
    "dcn_critical_batch",
    "dcn_min_batch_per_pod",
    "decode_roofline",
    "dp_comm_bytes",
    "dp_critical_batch",
    "dp_family_bytes",
    "dp_state_bytes",
    "ep_all_to_all_bytes",
    "ep_comm_bytes",
    "expert_params_per_rank",
    "exposed",
    "flops_per_token",
    "hbm_critical_batch",
    "largest_model",
    "layer_compute_time",
    "layer_flops",
    "matmul_params",
    "matmul_roofline",
    "megatron_flops_per_iteration",
    "megatron_params",
    "megatron_training_days",
    "mfu",
    "min_devices",
    "mixed_min_batch_per_device",
    "moe_param_count",
    "optimal_fsdp",
    "param_count",
    "pipeline_comm_time",
    "pipeline_critical_batch",
    "pipeline_sim",
    "pp_p2p_bytes",
    "remat_flops_per_token",
    "run_precision",
    "split_fsdp_tp",
    "stage_part_flops",
    "state_bytes",
    "step_mfu",
    "tp_comm_bytes",
    "tp_forward_saved_bytes",
    "tp_layer_collectives",
    "tp_limit",
    "tp_min_ffw",
    "training_flops",
    "unit_numels",
    "wire_factor",
]
