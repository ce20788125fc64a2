"""`estimate_only=true`: what the memory model predicts for the configured run, without training.

With a calibration (on CUDA) it predicts the worst batch's peak and the largest batch predicted to fit the budget at
the worst-case lengths; without one (CPU) it gives the analytic part, exact, and says what it cannot know.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memfit.config import GIB
from memfit.data.audit import BatchShape
from memfit.memory.model import PeakEstimate
from memfit.memory.preflight import growth_note
from memfit.memory.state import ModelStateBytes


def size(count: float) -> str:
    """Bytes for people: GiB from 1 GiB up, else MiB."""
    return f"{count / GIB:.2f} GiB" if abs(count) >= GIB else f"{count / 1024**2:.1f} MiB"


@dataclass
class Estimate:
    task: str
    shape: BatchShape  # the worst batch the data can produce at the configured batch size
    limit: int  # budget minus margin
    budget: int
    state: ModelStateBytes
    logits: int  # one float32 copy of the worst batch's logits
    peak: PeakEstimate | None = None  # None without a calibration
    largest_batch: int | None = None
    largest_cap: str | None = None  # where the largest-batch prediction stopped at the search's own cap
    calibration: str | None = None  # "<key> on <device>, cached | fitted from N probes; reserved by <how>"
    lengths: tuple[int, int] | None = None  # (source, label) the largest batch is judged at
    budget_label: str = "budget"  # what the budget is: budget.gib, or without it the device's memory
    # what each memory knob left off would hold less at the worst batch (memory.savings.knob_savings)
    savings: dict[str, int] = field(default_factory=dict)
    cache_growth: int = 0  # kept below the limit for a long run's allocator cache (memory.meter)

    @property
    def fits(self) -> bool | None:
        return None if self.peak is None else self.peak.reserved <= self.limit

    def metrics(self) -> dict[str, float]:
        out = {f"estimate/{name}_gib": value / GIB for name, value in self._parts().items()}
        out["estimate/limit_gib"] = self.limit / GIB
        if self.peak is not None:
            out["estimate/peak_allocated_gib"] = self.peak.allocated / GIB
            out["estimate/peak_reserved_gib"] = self.peak.reserved / GIB
            out["estimate/largest_batch"] = float(self.largest_batch or 0)
        from memfit.memory.savings import KNOB_WAYS

        for knob, saving in self.savings.items():
            out[KNOB_WAYS[knob].metric] = saving / GIB
        return out

    def _saving_lines(self) -> list[str]:
        from memfit.memory.savings import KNOB_WAYS

        return [
            f"  {KNOB_WAYS[knob].setting} would hold ~{size(saving)} less at this batch ({KNOB_WAYS[knob].why})"
            for knob, saving in self.savings.items()
        ]

    def _parts(self) -> dict[str, int]:
        if self.peak is not None:
            return self.peak.breakdown()
        return {"weights": self.state.weights, "gradients": self.state.gradients, "optimizer": self.state.optimizer}

    def _largest(self) -> str:
        return _largest_text(self.largest_batch, self.largest_cap)

    def summary(self) -> str:
        what = self.shape.describe(self.task)
        parts = ", ".join(f"{name} {size(value)}" for name, value in self._parts().items())
        growth = growth_note(self.cache_growth)
        limit = f"limit {size(self.limit)} ({self.budget_label} {size(self.budget)} minus margin{growth})"
        if self.peak is None:
            return "\n".join(
                [
                    "estimate: analytic part only (activations are fitted from probes on the CUDA device; "
                    "calibration.enabled=true fits them from host RSS here, roughly)",
                    f"  model state: {parts}; total {size(self.state.total)}",
                    f"  worst {what}: its float32 logits alone hold {size(self.logits)}; activations not estimated",
                    f"  {limit}",
                    *self._saving_lines(),
                ]
            )
        verdict = "fits" if self.fits else "does NOT fit"
        source, label = self.lengths or (self.shape.source, self.shape.label)
        at = f"{source} tokens" if self.task == "causal" else f"source {source} × labels {label}"
        return "\n".join(
            [
                f"estimate (memory model {self.calibration}):",
                f"  worst {what}: peak allocated {size(self.peak.allocated)}, "
                f"reserved {size(self.peak.reserved)}: {verdict} the {limit}",
                f"  breakdown: {parts}",
                f"  largest batch predicted to fit at {at}: {self._largest()}",
                *self._saving_lines(),
            ]
        )


def _largest_text(largest: int | None, cap: str | None) -> str:
    if not largest:
        return "none (not even batch 1)"
    return f">= {largest} ({cap})" if cap else str(largest)


def estimate(
    task: str,
    worst: list[BatchShape],
    state: ModelStateBytes,
    arch: Any,
    calibration: Any,
    budget: int,
    limit: int,
    upper: int,
    savings: Callable[[BatchShape], dict[str, int]] | None = None,
) -> Estimate:
    """The estimate for the audit's worst batches: the one with most tokens, and for the largest batch, the longest
    source and the longest label together (what any batch of two or more rows can hold)."""
    from memfit.memory.model import logits_bytes

    shape = max(worst, key=lambda s: s.tokens)
    if calibration is not None:  # the worst is the one predicted highest
        shape = max(worst, key=lambda s: calibration.estimate(s).reserved)
    result = Estimate(task, shape, limit, budget, state, logits_bytes(shape.batch, shape.source, shape.label, arch))
    if savings is not None:
        result.savings = savings(shape)
    if calibration is None:
        return result
    result.peak = calibration.estimate(shape)
    source, label = max(s.source for s in worst), max(s.label for s in worst)
    result.lengths = (source, label)
    result.largest_batch = calibration.largest_batch(source, label, limit, upper)
    how = "reused from its cache" if calibration.from_cache else f"fitted from {len(calibration.probes)} probes"
    device = calibration.identity["device"]
    result.calibration = f"{calibration.key} on {device}, {how}"
    return result
