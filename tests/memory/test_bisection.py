"""The largest batch that fits, searched from a guess near the answer: the same answer as plain bisection, in few
calls where the guess is close."""

from __future__ import annotations

import random

from memfit.memory.bisection import largest_fitting, largest_fitting_near


def test_a_search_from_any_guess_finds_what_bisection_finds_and_asks_little_near_the_answer():
    rng = random.Random(0)
    for _ in range(2000):
        answer, upper = rng.randint(0, 300), rng.randint(0, 400)
        guess = rng.randint(0, upper)
        asked: list[int] = []

        def fits(batch: int, answer: int = answer, asked: list[int] = asked) -> bool:
            asked.append(batch)
            return batch <= answer

        assert largest_fitting_near(fits, guess, upper) == largest_fitting(lambda b, answer=answer: b <= answer, upper)
        assert all(0 < batch <= upper for batch in asked)  # never 0 rows (they always fit), never past the cap
        if 0 < answer < upper and abs(guess - answer) <= 2:
            assert len(asked) <= 5
