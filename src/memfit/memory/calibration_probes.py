"""The calibration's probes: each shape's measured peaks and, where the memory model predicts reserved by replay
(checkpointed models on CUDA with expandable segments), the allocator's events of each probe, recorded while it
runs (memory.allocator_history) and written as programs of the shape (memory.allocation_program)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from omegaconf import DictConfig

from memfit.config.validate import expandable_segments_on
from memfit.data.audit import BatchShape
from memfit.memory.allocation_program import ReservedByReplay
from memfit.memory.allocator import Events
from memfit.memory.allocator_history import FRAMELESS

log = logging.getLogger("memfit.memory.calibration")


@dataclass
class Measured:
    """The probes' rows (each shape with its peaks) and, where recorded, each probe's allocator events (else why
    not)."""

    rows: list[dict[str, Any]]
    events: list[Events] = field(default_factory=list)
    not_recorded: str | None = None


def measure_probes(
    setup: Any,
    shapes: list[BatchShape],
    on_probe: Callable[[BatchShape], None] | None,
    sites: dict[str, int] | None,
) -> Measured:
    """Each shape's measured forward + backward and optimizer-step peaks (and, where the setup splits them, each
    window's of preflight._BranchMarker.WINDOWS), with the allocator's events where `sites` is given (the call-site
    table the probes share); stops at the first OOM."""
    from memfit.memory.allocator_history import record
    from memfit.memory.probe import probe

    measured = Measured([], not_recorded=None if sites is not None else "not asked")
    for shape in shapes:
        if on_probe is not None:
            on_probe(shape)
        if sites is None or measured.not_recorded is not None:
            result = probe(setup, shape)[0]
        else:
            results, events, measured.not_recorded = record(lambda shape=shape: probe(setup, shape), sites)
            result = results[0]
            measured.events += [events] if events is not None else []
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
        measured.rows.append(row)
    return measured


def replays_reserved(cfg: DictConfig, device: str) -> bool:
    """Whether the calibration records its probes' allocator events to predict reserved by replay: checkpointed
    models on CUDA with expandable segments (the allocator the replay re-implements)."""
    return device == "cuda" and bool(cfg.memory.gradient_checkpointing) and expandable_segments_on(cfg.memory)


def fit_replay(probed: Measured, shapes: list[BatchShape]) -> ReservedByReplay | None:
    """The replay's programs from the probes' recorded events; None (the fitted ratio predicts reserved) where the
    events could not be recorded whole."""
    if probed.not_recorded is None and len(probed.events) < len(shapes):
        probed.not_recorded = "a probe was not recorded"
    if probed.not_recorded is None:
        shaped = [((s.batch, s.source, s.label), e) for s, e in zip(shapes, probed.events, strict=True)]
        try:
            return ReservedByReplay.fit(shaped, frameless=FRAMELESS)
        except ValueError as err:
            probed.not_recorded = str(err)
    log.warning("memory model: reserved predicted by the fitted ratio, not by replay: %s", probed.not_recorded)
    return None
