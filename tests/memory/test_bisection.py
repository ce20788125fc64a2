"""The largest batch that fits, by bisection: the answer a scan of every batch gives, in a logarithm of the calls."""

from __future__ import annotations

import math
import random

from memfit.memory.bisection import largest_fitting


def test_bisection_finds_what_a_scan_finds_in_few_calls():
    rng = random.Random(0)
    for _ in range(2000):
        upper = rng.randint(0, 400)
        answer, lower = rng.randint(0, upper), 0
        asked: list[int] = []

        def fits(batch: int, answer: int = answer, asked: list[int] = asked) -> bool:
            asked.append(batch)
            return batch <= answer

        assert largest_fitting(fits, upper, lower) == max(b for b in range(lower, upper + 1) if b <= answer)
        assert all(lower < batch <= upper for batch in asked)  # `lower` is taken to fit, never past the cap
        assert len(asked) <= math.ceil(math.log2(upper + 1)) + 1
