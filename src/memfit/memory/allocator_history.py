"""A probe's CUDA allocator events, recorded as memory.allocator.Events for the replay of the caching allocator.

torch's allocator history (`torch.cuda.memory._record_memory_history`, no public API yet in torch 2.13) records
each allocation and free with its innermost Python frames; `record` turns it into Events: each event's action,
address and size, each allocation's call site (its innermost SITE_DEPTH frames, as an index into a table shared by
a calibration's probes, so the same site gets the same index at every shape) and the allocator's segments when
recording began. The recording costs host time per allocation, never device memory: the probe's peaks are the same.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from memfit.memory.allocator import Events

T = TypeVar("T")

# the trace's actions (torch's TraceEntry), in the order their indices are stored; any other is stored as -1
ACTIONS = (
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "snapshot",
    "oom",
)
SITE_DEPTH = 8  # frames that name a call site: enough to tell one layer's allocations apart from another's
MAX_ENTRIES = 2_000_000  # a checkpointed pegasus_large probe makes ~0.1 M events (H100, benchmarks "Run 19")
FRAMELESS = 0  # the call-site index of allocations without Python frames (autograd's backward) in a site_table


def site_table() -> dict[str, int]:
    """A new call-site table for one calibration's probes (name -> index), the frameless site at FRAMELESS."""
    return {"": FRAMELESS}


def site_name(frames: list[dict], depth: int = SITE_DEPTH) -> str:
    """Where an allocation was made, the same at every shape: the innermost `depth` Python frames, file name and
    line ("" for an allocation without Python frames, autograd's backward)."""
    return "|".join(f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in frames[:depth])


def segments(snapshot: dict, device: int) -> list[dict]:
    """The allocator's segments on `device` and their blocks, without stack frames."""
    keep = ("address", "total_size", "stream", "segment_type", "is_expandable")
    return [
        {
            **{k: s[k] for k in keep if k in s},
            "blocks": [{k: b[k] for k in ("address", "size", "state") if k in b} for b in s.get("blocks", [])],
        }
        for s in snapshot.get("segments", [])
        if s.get("device", device) == device
    ]


def events_from(trace: list[dict], start: list[dict], sites: dict[str, int]) -> Events:
    """Events from a device trace (a snapshot's `device_traces[i]`) and the segments when it began (`start`); each
    allocation's call site is looked up in (and added to) `sites`."""
    index = {name: i for i, name in enumerate(ACTIONS)}
    return Events(
        [index.get(e["action"], -1) for e in trace],
        [int(e.get("addr", 0)) for e in trace],  # none on an OOM
        [int(e.get("size", 0)) for e in trace],
        [sites.setdefault(site_name(e.get("frames", [])), len(sites)) if e["action"] == "alloc" else -1 for e in trace],
        start,
    )


def replayable(trace: list[dict], start: list[dict]) -> str | None:
    """Why the replay (one stream, expandable segments, the whole probe) cannot follow this trace; None where it
    can."""
    if any(not s.get("is_expandable", False) for s in start) or any(e["action"] == "segment_alloc" for e in trace):
        return "the allocator's segments are not expandable (memory.expandable_segments)"
    if len({e.get("stream", 0) for e in trace if e["action"] == "alloc"}) > 1:
        return "allocations on more than one CUDA stream"
    if len(trace) >= MAX_ENTRIES:
        return f"more than {MAX_ENTRIES} allocator events in one probe"
    if any(e["action"] == "oom" for e in trace):
        return "the probe ran out of memory"
    return None


def record(run: Callable[[], T], sites: dict[str, int]) -> tuple[T, Events | None, str | None]:
    """`run()`'s result with the allocator's events while it ran (from an emptied cache), or None and why the replay
    cannot follow them."""
    import gc

    import torch

    gc.collect()  # what is garbage now would be freed, and its pages unmapped, inside the recording
    torch.cuda.empty_cache()  # the events start from what lives (the weights), not from an earlier shape's cache
    device = torch.cuda.current_device()
    history: Any = torch.cuda.memory
    # stopped first, which clears the trace: a recording still on (an earlier run's OOM forensics) would put its
    # events before the probe's
    history._record_memory_history(enabled=None)
    history._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=MAX_ENTRIES)
    try:
        start = segments(history._snapshot(), device)
        result = run()
        snapshot = history._snapshot()
    finally:
        history._record_memory_history(enabled=None)
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    if not trace:
        return result, None, "the allocator recorded no events"
    if (why := replayable(trace, start)) is not None:
        return result, None, why
    return result, events_from(trace, start, sites), None
