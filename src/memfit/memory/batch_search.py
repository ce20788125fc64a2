"""The largest batch whose worst case fits (preflight_only, preflight.find_max_batch): steps out from a first batch
then bisection, on the worst shape, with a bound on the time it may take (on CPU a probe of hundreds of rows takes
minutes). The first batch is the memory model's predicted largest where a calibration exists: a good prediction
then costs a few probes near the boundary. Without one, the search doubles from the configured batch."""

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
    probed: list[int] = field(default_factory=list)  # the batches it probed, in order


class _OutOfTime(Exception):
    """The next probe of the largest-batch search would end it past its time bound."""


@dataclass
class _BatchProbes:
    """The largest-batch search's probes of one worst shape: what each batch measured and how long it took."""

    setup: ProbeSetup
    shape_at: Callable[[int], BatchShape]
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
        bounded = self.max_seconds is not None and self.seconds  # the first probe runs: nothing yet to scale from
        if bounded and time.perf_counter() - self.start + expected > self.max_seconds:
            self.search.untried, self.search.untried_seconds = batch, expected
            raise _OutOfTime
        if self.on_probe is not None:
            self.on_probe(batch)
        self.search.probed.append(batch)
        began = time.perf_counter()
        probes = probe(self.setup, self.shape_at(batch))
        self.seconds[batch] = time.perf_counter() - began
        self.measured[batch] = probes[0]
        return fits(probes, self.limit)


def search_largest(batch_fits: Callable[[int], bool], first: int, upper: int, step: int, found: BatchSearch) -> None:
    """The largest batch in [1, `upper`] for which `batch_fits` holds (it holds for every batch below one that does):
    `first`, then steps of `step`, each twice the last, up while batches fit or down until one does, then bisection
    between the last fit and the first failure. With `step` = `first` the steps up are doubling. The largest that
    fits so far is kept in `found` as it goes (a time bound may stop the search at any probe)."""
    first = max(1, min(first, upper))
    if batch_fits(first):
        good = found.largest = first
        bad = None
        while good < upper and bad is None:
            batch = min(good + step, upper)
            if batch_fits(batch):
                good = found.largest = batch
                step *= 2
            else:
                bad = batch
        if bad is None:
            return
    else:
        good, bad = 0, first
        while good == 0 and bad > 1 and step < first:  # steps down, where the first batch was a prediction
            batch = max(bad - step, 1)
            if batch_fits(batch):
                good = found.largest = batch
            else:
                bad, step = batch, step * 2
    while bad - good > 1:  # bisect between the last fit (or nothing) and the first failure
        middle = (good + bad) // 2
        if batch_fits(middle):
            good = found.largest = middle
        else:
            bad = middle


def find_max_batch(
    setup: ProbeSetup,
    shape_at: Callable[[int], BatchShape],
    limit: int,
    upper: int,
    on_probe: Callable[[int], None] | None = None,
    measured: dict[int, Probe] | None = None,
    max_seconds: float | None = None,
    predicted: int | None = None,
    first: int = 1,
) -> BatchSearch:
    """The largest batch whose worst case fits, each batch probed at its own worst shape (`shape_at`: a batch of one
    row holds one sample, a larger one the longest source and label together): from the memory model's `predicted`
    largest batch in steps of an eighth of it, or doubling from `first` without a prediction, then bisection
    (search_largest). `on_probe` is told each batch size before it is probed (the progress bar);
    `measured` collects each batch's train probe.

    A batch that the last fitting probe, scaled linearly in batch size, puts well over the limit is taken as not
    fitting without being run: on CPU nothing caps the allocator, so such a probe could take the whole host down.
    With `max_seconds`, a probe expected (the largest probe so far, its time scaled by batch size) to end the
    search past that many seconds is not run: on CPU a probe of hundreds of rows takes minutes. The first always
    runs.
    """
    found = BatchSearch(None)
    probes = _BatchProbes(setup, shape_at, limit, on_probe, {} if measured is None else measured, max_seconds, found)
    if predicted:
        first, step = predicted, max(1, predicted // 8)
    else:
        first = step = max(1, first)
    with contextlib.suppress(_OutOfTime):
        search_largest(probes.fits, first, upper, step, found)
    return found
