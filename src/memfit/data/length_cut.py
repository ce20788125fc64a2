"""The longest max lengths whose worst batch a judge accepts: what `auto` lengths become where the budget cannot hold
every token up to the model's limit. Lengths alone; the judge (a memory model, or probes) is the caller's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from memfit.data.audit import BatchShape, padded, worst_batches

LEVELS = 200  # sample shares tried, from every sample's length down: a cut within half a percent of the best
STEPS = 128  # lengths tried between two neighbouring shares' cuts: within 1% of their gap


@dataclass(frozen=True)
class Lengths:
    """Raw token lengths of every sample a batch can hold, and the max lengths they are cut to now."""

    source: np.ndarray
    label: np.ndarray
    max_source: int
    max_label: int


def shapes_at(lengths: Lengths, cut: tuple[int, int], batch: int, task: str, multiple: int | None) -> list[BatchShape]:
    """The padded shapes bounding every batch of `batch` rows once sources and labels are cut to `cut`."""
    source = np.minimum(lengths.source, cut[0])
    label = np.minimum(lengths.label, cut[1])
    return worst_batches(source, label, batch, task, multiple)


def _cut_one(raw: np.ndarray, current: int, share: float, multiple: int | None) -> int:
    """The length that `share` of the samples fit within, rounded up to the padding multiple, never past `current`."""
    if len(raw) == 0:
        return current
    return min(current, max(padded(int(np.quantile(raw, share, method="higher")), multiple), multiple or 8))


def _cut_at(lengths: Lengths, share: float, which: tuple[bool, bool], multiple: int | None) -> tuple[int, int]:
    """Both max lengths cut at `share` of the samples; a length not in `which` keeps its max."""
    source = _cut_one(lengths.source, lengths.max_source, share, multiple) if which[0] else lengths.max_source
    label = _cut_one(lengths.label, lengths.max_label, share, multiple) if which[1] else lengths.max_label
    return source, label


def _bisect(count: int, accepted: Callable[[int], bool]) -> int:
    """The largest i in [0, count] that `accepted`, given that 0 is and count is not, and that acceptance only ever
    stops as i grows (a longer cut never holds less memory)."""
    low, high = 0, count
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if accepted(middle) else (low, middle)
    return low


def longest_cut(
    lengths: Lengths,
    which: tuple[bool, bool],
    batch: int,
    task: str,
    multiple: int | None,
    accepts: Callable[[list[BatchShape]], bool],
) -> tuple[int, int] | None:
    """The longest (source, label) max lengths whose worst batches `accepts`, cutting only where `which` allows:
    today's max lengths where those are accepted, None where not even the shortest cut is. First the share of
    samples both lengths keep whole is bisected, then the lengths between that share's cut and the next one's, so
    that a long tail of a few samples is cut where the budget ends, not at the length of the samples below it.
    About 15 judgements."""
    full = (lengths.max_source, lengths.max_label)

    def accepted(cut: tuple[int, int]) -> bool:
        return accepts(shapes_at(lengths, cut, batch, task, multiple))

    if accepted(full):
        return full
    shares = np.linspace(0.0, 1.0, LEVELS + 1)
    if not accepted(_cut_at(lengths, shares[0], which, multiple)):
        return None
    share = _bisect(LEVELS, lambda i: accepted(_cut_at(lengths, shares[i], which, multiple)))
    low = _cut_at(lengths, shares[share], which, multiple)
    high = _cut_at(lengths, shares[share + 1], which, multiple) if share < LEVELS else full
    step = multiple or 1

    def between(i: int) -> tuple[int, int]:
        """The cut i/STEPS of the way from `low` to `high`, each length rounded down to the padding multiple."""
        return tuple(max(a, (a + (b - a) * i // STEPS) // step * step) for a, b in zip(low, high, strict=True))

    return between(_bisect(STEPS, lambda i: accepted(between(i))))
