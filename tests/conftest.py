"""Fixtures shared by test modules."""

import os

import pytest
import torch

# The JAX tests (test_jax.py) run on a mesh of 8 CPU devices. XLA reads this flag once, when JAX first starts, and
# pytest imports every test module before running any: set here, it is in place whichever module imports JAX first.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is fastest (two threads spin against each other on a busy 2-core box).
    A module opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
