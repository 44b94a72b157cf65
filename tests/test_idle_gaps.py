"""Where the device sat idle inside profiled steps (train/profiling.idle_gaps): the arithmetic on known kernel spans,
and the step windows and device spans read from a real profile (on this CPU machine: the windows, and no device
spans). On a GPU, benchmarks/gpu_single.py --profile and a run's train.profile_steps print the result."""

from itertools import pairwise

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from meshtrain.train.profiling import STEP_MARK, device_spans, gaps_line, idle_gaps, step_windows


def test_idle_gaps_counts_the_device_free_time_inside_each_step_and_names_its_neighbours():
    # two steps of 100 us; step 1: 10 us before the first kernel, a kernel on a second stream inside the first
    # one (no gap: the device is busy until k1 ends), a 20 us gap, a kernel to 95 and 5 us idle at the end;
    # step 2: a kernel started before the window (clipped) and one running past its end, with 30 us between them
    spans = [(10, 50, "k1"), (30, 40, "k2"), (70, 95, "k3"),
             (190, 220, "k4"), (250, 320, "k5")]
    idle, lead, largest = idle_gaps(spans, [(0, 100), (200, 300)], top=3)
    assert idle == pytest.approx((10 + 20 + 5 + 30) / 2 / 1e3)
    assert lead == pytest.approx(10 / 2 / 1e3)  # step 2 starts busy: nothing before its first kernel
    assert largest == [(pytest.approx(0.030), "k4", "k5"), (pytest.approx(0.020), "k1", "k3"),
                       (pytest.approx(0.010), "(step start)", "k1")]
    assert "0.03 ms after k4, before k5; 0.02 ms after k1, before k3" in gaps_line(idle, lead, largest)


def test_a_step_without_kernels_is_idle_throughout_and_kernels_outside_the_windows_do_not_count():
    idle, lead, largest = idle_gaps([(500, 600, "elsewhere")], [(0, 100)])
    assert (idle, lead) == (pytest.approx(0.1), pytest.approx(0.1))
    assert largest == [(pytest.approx(0.1), "(step start)", "(step end)")]


def test_the_step_marks_of_a_real_profile_are_its_windows():
    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for s in range(3):
            with record_function(f"{STEP_MARK} {s}"):
                x = x @ x / 64
    windows = step_windows(prof)
    assert len(windows) == 3 and all(a < b for a, b in windows)
    assert windows == sorted(windows) and all(b1 <= a2 for (_, b1), (a2, _) in pairwise(windows))
    assert device_spans(prof) == []  # a CPU profile has no device kernels
