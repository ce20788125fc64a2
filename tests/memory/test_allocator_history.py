"""Torch's allocator history turned into the replay's events: actions, sizes, call sites shared across probes."""

from __future__ import annotations

from memfit.memory.allocator import ALLOC, FREE_COMPLETED, LARGE_PAGE
from memfit.memory.allocator_history import events_from, replayable, site_table

FRAME = {"filename": "/site/transformers/models/t5/modeling_t5.py", "line": 42, "name": "forward"}
SEGMENT = {"address": 1 << 40, "total_size": LARGE_PAGE, "segment_type": "large", "is_expandable": True}
SEGMENT["blocks"] = [{"address": 1 << 40, "size": LARGE_PAGE, "state": "inactive"}]


def _trace(size: int) -> list[dict]:
    """What torch records for one probe: an allocation with a Python frame, one without (autograd), their frees."""
    return [
        {"action": "alloc", "addr": 1 << 40, "size": size, "stream": 0, "frames": [FRAME]},
        {"action": "alloc", "addr": (1 << 40) + size, "size": 512, "stream": 0, "frames": []},
        {"action": "free_requested", "addr": 1 << 40, "size": size, "stream": 0, "frames": [FRAME]},
        {"action": "free_completed", "addr": 1 << 40, "size": size, "stream": 0, "frames": [FRAME]},
        {"action": "segment_unmap", "addr": 1 << 40, "size": LARGE_PAGE, "stream": 0},
    ]


def test_probes_share_one_table_of_call_sites():
    sites = site_table()
    first = events_from(_trace(4096), [SEGMENT], sites)
    second = events_from(_trace(8192), [SEGMENT], sites)
    assert first.action[:4] == [ALLOC, ALLOC, 1, FREE_COMPLETED]
    assert first.allocations() == ([1, 0], [4096, 512])  # the frameless one at index 0
    assert second.allocations() == ([1, 0], [8192, 512])  # the same site at another shape: the same index
    assert len(sites) == 2 and first.state == [SEGMENT]


def test_what_the_replay_cannot_follow_is_named():
    trace = _trace(4096)
    assert replayable(trace, [SEGMENT]) is None
    assert "expandable" in replayable(trace, [{**SEGMENT, "is_expandable": False}])
    assert "expandable" in replayable([{"action": "segment_alloc", "addr": 0, "size": 1}, *trace], [])
    assert "stream" in replayable([*trace, {**trace[0], "stream": 7}], [SEGMENT])
    assert "out of memory" in replayable([*trace, {"action": "oom", "size": 1 << 40}], [SEGMENT])
