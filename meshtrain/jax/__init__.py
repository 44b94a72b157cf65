"""The JAX executor (optional extra ``meshtrain[jax]``): the same Llama, placed on a device mesh by the same
logical-axis rules table (``meshtrain/rules.py``) as the PyTorch runtime, but executed by XLA's GSPMD partitioner
under ``jax.jit`` (seed 002). See docs/jax.md.

Nothing in meshtrain imports this package except the CLI (lazily) and the tests: JAX is optional.

- ``sharding.py``: the rules table -> ``NamedSharding`` / ``with_sharding_constraint`` on a (dp, tp) mesh;
- ``model.py``: the Llama forward and its loss in ``jax.numpy``, weights from a meshtrain checkpoint;
- ``train.py``: one AdamW training step, the trainer's schedule and clipping, under ``jax.jit``;
- ``hlo.py``: the seed's sharded-matmul cases compiled, their HLO collectives counted against the planner.
"""

from __future__ import annotations

import os
import sys

HOST_DEVICES = 8  # the CPU mesh the docs and tests use (seed 002's 2 x 4 mesh)
_FLAG = "--xla_force_host_platform_device_count"


def use_host_devices(n: int = HOST_DEVICES) -> None:
    """Ask XLA for ``n`` CPU devices. It reads the flag once, when JAX first starts a backend, so this must run
    before anything touches ``jax.devices()``; called later with too few devices it raises, naming the fix."""
    flags = os.environ.get("XLA_FLAGS", "")
    if _FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={n}".strip()
    if "jax" in sys.modules:
        import jax

        have = len(jax.devices())
        if have < n:
            raise RuntimeError(f"JAX started with {have} device(s), {n} needed: set XLA_FLAGS={_FLAG}={n} before "
                               f"JAX is first used.")


def require_jax() -> None:
    """Raise one clear line when the optional extra is not installed."""
    try:
        import jax  # noqa: F401
    except ImportError as e:
        raise RuntimeError("the JAX executor needs the optional extra: pip install -e '.[jax]'") from e
