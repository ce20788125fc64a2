"""The host meter sees a real allocation in its window and forgets it after a reset."""

from __future__ import annotations

import sys

import pytest

from memfit.config import GIB
from memfit.memory.meter import HostMeter, MemoryPeak


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="window resets use /proc/self/clear_refs")
def test_host_meter_window_tracks_and_resets():
    import numpy as np

    meter = HostMeter()
    meter.reset_window()
    before = meter.window_peak()
    block = np.ones(300 * 1024**2 // 8)  # 300 MiB, touched
    during = meter.window_peak()
    assert during.allocated - before.allocated > 250 * 1024**2
    del block
    meter.reset_window()
    after = meter.window_peak()
    assert after.allocated < during.allocated - 250 * 1024**2  # the window forgot the freed block
    assert meter.overall.allocated >= during.allocated  # the overall peak did not


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="window resets use /proc/self/clear_refs")
def test_marks_cut_a_window_into_parts_and_a_part_outlives_a_window_reset():
    import numpy as np

    meter = HostMeter()
    meter.reset_window()
    meter.mark()
    block = np.ones(300 * 1024**2 // 8)  # 300 MiB, touched
    del block
    first = meter.mark()  # the part that held the block
    second = meter.mark()  # a part that held nothing more
    assert first.allocated - second.allocated > 250 * 1024**2
    assert meter.window_peak().allocated >= first.allocated  # the window still counts the marked part
    block = np.ones(300 * 1024**2 // 8)
    del block
    meter.reset_window()  # a window ends mid-part (a logged step): the part keeps its peak
    assert meter.mark().allocated >= first.allocated - 50 * 1024**2
    assert meter.window_peak().allocated < first.allocated - 250 * 1024**2  # the new window did not see the block


def test_the_host_meter_reaches_its_own_resident_set_and_no_more_than_the_host_has():
    meter = HostMeter()
    assert meter.current_bytes() < meter.reachable_bytes() <= meter.total_bytes()


def test_peak_arithmetic():
    a, b = MemoryPeak(2 * GIB, 3 * GIB), MemoryPeak(4 * GIB, 1 * GIB)
    assert a.max(b) == MemoryPeak(4 * GIB, 3 * GIB)
    assert a.allocated_gib == 2.0
