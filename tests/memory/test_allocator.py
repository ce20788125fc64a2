"""The caching allocator's replay places blocks as the CUDA allocator does with expandable segments."""

from __future__ import annotations

import json
from pathlib import Path

from memfit.memory.allocator import LARGE_PAGE, SMALL_PAGE, Events, ExpandableSegments, replay

MIB = 1 << 20
TRACE = Path(__file__).parent / "data" / "t5_base_ckpt_trace.npz"


def empty(base: int = 1 << 40) -> ExpandableSegments:
    """An allocator whose large pool holds one mapped page (a live 1 MiB block and a free rest) at `base`."""
    page = {"address": base, "total_size": LARGE_PAGE, "segment_type": "large"}
    page["blocks"] = [{"size": 2 * MIB, "state": "active_allocated"}, {"size": 18 * MIB, "state": "inactive"}]
    return ExpandableSegments([page], address_space=1 << 36)


def test_requests_are_rounded_and_served_from_the_free_block_before_mapping_pages():
    allocator = empty()
    first = allocator.malloc(5 * MIB + 1)  # rounded to 512 bytes, fits the free 18 MiB
    assert first == (1 << 40) + 2 * MIB
    assert allocator.reserved == LARGE_PAGE
    assert allocator.allocated == 2 * MIB + 5 * MIB + 512


def test_a_request_past_the_cache_maps_whole_pages_merged_with_the_free_block_before_them():
    allocator = empty()
    ptr = allocator.malloc(30 * MIB)  # the free 18 MiB at the end plus one more 20 MiB page
    assert ptr == (1 << 40) + 2 * MIB
    assert allocator.reserved == 2 * LARGE_PAGE
    assert allocator.peak_reserved == 2 * LARGE_PAGE


def test_small_requests_map_two_mib_pages_of_their_own_pool():
    allocator = empty()
    allocator.malloc(4096)
    assert allocator.reserved == LARGE_PAGE + SMALL_PAGE


def test_best_fit_takes_the_smallest_free_block_that_fits_and_freed_neighbours_merge():
    allocator = empty()
    a, b, c = (allocator.malloc(size) for size in (4 * MIB, 6 * MIB, 2 * MIB))
    allocator.free(a)  # 4 MiB hole, then b, then a 2 MiB block and the 6 MiB rest of the page
    assert allocator.malloc(3 * MIB) == a  # the 4 MiB hole, not the 6 MiB rest
    allocator.free(a)
    allocator.free(b)  # the 4 and 6 MiB holes merge into 10 MiB
    assert allocator.malloc(9 * MIB) == a
    assert allocator.reserved == LARGE_PAGE
    assert c == a + 10 * MIB


def test_a_probes_recorded_events_replay_to_its_measured_peak_and_addresses():
    import numpy as np

    arrays = np.load(TRACE)
    events = Events.from_trace(arrays, "probe")
    measured = json.loads(str(arrays["peaks"]))
    replayed = replay(events)
    traced = [addr for addr, action in zip(events.addr, events.action, strict=True) if action == 0]
    assert replayed.addresses == traced
    assert replayed.peak_reserved == measured["reserved"]
    # sizes changed: the same program replayed with every allocation 10% larger reserves more
    larger = replay(events, [round(size * 1.1) for size in events.allocations()[1]])
    assert larger.peak_reserved > measured["reserved"]
