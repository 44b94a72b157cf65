"""Fixtures shared by test modules."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is fastest (two threads spin against each other on a busy 2-core box).
    A module opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
