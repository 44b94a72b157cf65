"""Pipeline parallelism on devices: the engine that runs a rank's actions (``engine``) and the deferred weight
gradients of split-backward schedules (``wgrad``).

The device-free parts live in the plan layer, which the planner shares: schedules as data
(``meshtrain/plan/schedules.py``), the simulator, its charts and ``check_schedule`` (``meshtrain/plan/simulator.py``)
and the cost-balanced layer partition (``meshtrain/plan/partition.py``).
"""
