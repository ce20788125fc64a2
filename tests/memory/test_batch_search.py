"""The largest-batch search's order of probes: from a prediction it probes near the boundary."""

from __future__ import annotations

import pytest

from memfit.memory.batch_search import BatchSearch, search_largest


def _search(threshold: int, first: int, step: int, upper: int = 64) -> tuple[int | None, list[int]]:
    probed: list[int] = []

    def fits(batch: int) -> bool:
        probed.append(batch)
        return batch <= threshold

    found = BatchSearch(None)
    search_largest(fits, first, upper, step, found)
    return found.largest, probed


@pytest.mark.parametrize("threshold", [0, 1, 5, 37, 63, 64, 100])
@pytest.mark.parametrize(("first", "step"), [(1, 1), (2, 2), (32, 4), (40, 5), (8, 1), (64, 8)])
def test_the_search_finds_the_largest_batch_that_fits_from_any_start(threshold, first, step):
    largest, probed = _search(threshold, first, step)
    assert largest == (min(threshold, 64) if threshold >= 1 else None)
    assert len(probed) == len(set(probed))  # no batch probed twice


def test_a_close_prediction_costs_fewer_probes_than_doubling_from_the_configured_batch():
    assert _search(37, 1, 1) == (37, [1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37])
    assert _search(37, 32, 4) == (37, [32, 36, 44, 40, 38, 37])  # predicted a little low
    assert _search(37, 40, 5) == (37, [40, 35, 37, 38])  # predicted a little high
