"""The largest batch that fits, by bisection: every peak grows with the rows, so one boundary splits the batches
that fit from those that do not."""

from __future__ import annotations

from collections.abc import Callable


def largest_fitting(fits: Callable[[int], bool], upper: int, lower: int = 0) -> int:
    """The largest batch in [lower, upper] that fits, `lower` taken to fit: bisection, since every peak grows with
    the rows."""
    low, high = lower, upper
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low
