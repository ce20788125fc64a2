"""The calibration's probes: each shape's measured peaks, through the preflight's own probe."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from memfit.data.audit import BatchShape


def measure_probes(
    setup: Any, shapes: list[BatchShape], on_probe: Callable[[BatchShape], None] | None
) -> list[dict[str, Any]]:
    """Each shape's measured forward + backward and optimizer-step peaks (and, where the setup splits them, each
    window's of probe._BranchMarker.WINDOWS); stops at the first OOM."""
    from memfit.memory.probe import probe

    rows = []
    for shape in shapes:
        if on_probe is not None:
            on_probe(shape)
        result = probe(setup, shape)[0]
        if result.oom:
            break
        row = {
            **asdict(shape),
            "allocated": result.backward_peak.allocated,
            "reserved": result.backward_peak.reserved,
            "step_allocated": result.step_peak.allocated,
            "step_reserved": result.step_peak.reserved,
        }
        for window, peak in (result.branch_peaks or {}).items():
            row[f"{window}_allocated"], row[f"{window}_reserved"] = peak.allocated, peak.reserved
        rows.append(row)
    return rows
