"""The largest batch whose worst case fits (preflight_only, preflight.find_max_batch): doubling then bisection on
the worst shape, with a bound on the time it may take (on CPU a probe of hundreds of rows takes minutes)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from memfit.data.audit import BatchShape
from memfit.memory.preflight import fits
from memfit.memory.probe import Probe, ProbeSetup, probe


@dataclass
class BatchSearch:
    """What the largest-batch search found, and where a time bound stopped it before the batch it would try next."""

    largest: int | None
    untried: int | None = None  # the next batch it would have probed
    untried_seconds: float = 0.0  # what that probe was expected to take


class _OutOfTime(Exception):
    """The next probe of the largest-batch search would end it past its time bound."""


@dataclass
class _BatchProbes:
    """The largest-batch search's probes of one worst shape: what each batch measured and how long it took."""

    setup: ProbeSetup
    shape: BatchShape
    limit: int
    on_probe: Callable[[int], None] | None
    measured: dict[int, Probe]
    max_seconds: float | None
    search: BatchSearch
    seconds: dict[int, float] = field(default_factory=dict)
    start: float = field(default_factory=time.perf_counter)

    def expected_seconds(self, batch: int) -> float:
        below = [b for b in self.seconds if b <= batch]
        base = max(below) if below else min(self.seconds, default=0)
        return self.seconds[base] * batch / base if base else 0.0

    def fits(self, batch: int) -> bool:
        fitting = [b for b, p in self.measured.items() if b < batch and not p.oom and p.judged_bytes <= self.limit]
        if fitting:
            base = self.measured[max(fitting)]
            activations = max(base.judged_bytes - base.static_bytes, 0)
            if base.static_bytes + activations * batch / max(fitting) > 1.1 * self.limit:
                return False
        expected = self.expected_seconds(batch)
        if self.max_seconds is not None and time.perf_counter() - self.start + expected > self.max_seconds:
            self.search.untried, self.search.untried_seconds = batch, expected
            raise _OutOfTime
        if self.on_probe is not None:
            self.on_probe(batch)
        began = time.perf_counter()
        probes = probe(self.setup, BatchShape(batch, self.shape.source, self.shape.label))
        self.seconds[batch] = time.perf_counter() - began
        self.measured[batch] = probes[0]
        return fits(probes, self.limit)


def _double_then_bisect(batch_fits: Callable[[int], bool], first: int, upper: int, found: BatchSearch) -> None:
    """Doubling from `first` up to `upper`, then bisection below the first batch that does not fit; the largest
    that fits so far is kept in `found` as it goes (a time bound may stop the search at any probe)."""
    good, bad, batch = 0, None, first
    while batch <= upper:
        if not batch_fits(batch):
            bad = batch
            break
        good = found.largest = batch
        batch *= 2
    if bad is None and 0 < good < upper:  # doubling stepped past the cap: the cap itself is the last to try
        if batch_fits(upper):
            found.largest = upper
            return
        bad = upper
    while bad is not None and bad - good > 1:  # bisect between the last fit (or nothing) and the first failure
        middle = (good + bad) // 2
        if batch_fits(middle):
            good = found.largest = middle
        else:
            bad = middle


def find_max_batch(
    setup: ProbeSetup,
    shape: BatchShape,
    limit: int,
    upper: int,
    on_probe: Callable[[int], None] | None = None,
    measured: dict[int, Probe] | None = None,
    max_seconds: float | None = None,
) -> BatchSearch:
    """The largest batch whose worst case fits: doubling from the shape's batch, then bisection below the first
    that does not fit (down to 1), always on the worst shape. `on_probe` is told each batch size before it is
    probed (the progress bar); `measured` collects each batch's train probe.

    A batch that the last fitting probe, scaled linearly in batch size, puts well over the limit is taken as not
    fitting without being run: on CPU nothing caps the allocator, so such a probe could take the whole host down.
    With `max_seconds`, a probe expected (the largest probe so far, its time scaled by batch size) to end the
    search past that many seconds is not run: on CPU a probe of hundreds of rows takes minutes.
    """
    found = BatchSearch(None)
    probes = _BatchProbes(setup, shape, limit, on_probe, {} if measured is None else measured, max_seconds, found)
    with contextlib.suppress(_OutOfTime):
        _double_then_bisect(probes.fits, max(1, shape.batch), upper, found)
    return found
