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


def largest_fitting_near(fits: Callable[[int], bool], guess: int, upper: int) -> int:
    """largest_fitting where each `fits` is costly and `guess` lies near the answer: steps of 1, 2, 4… away from
    the guess bracket the answer, then bisection inside the bracket (a handful of calls where the guess is close)."""
    step = 1
    if guess > 0 and not fits(guess):  # downwards: low fits (0 rows always do), high + 1 does not
        high, low = guess - 1, max(0, guess - 1)
        while low > 0 and not fits(low):
            high, step = low - 1, step * 2
            low = max(0, guess - step)
    else:  # upwards: low fits, the answer is below the first `high` that does not
        low, high = guess, min(upper, guess + 1)
        while high > low and fits(high):
            low, step = high, step * 2
            high = min(upper, guess + step)
        if high == low:
            return low
        high -= 1
    return largest_fitting(fits, high, low)
