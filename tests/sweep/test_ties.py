"""Which feasible trial a sweep picks (memfit.sweep.ties): the fastest, unless trials within its measured spread
keep more of the data."""

from __future__ import annotations

import optuna
import pytest

from memfit.sweep.ties import pick

LABELS = optuna.distributions.CategoricalDistribution([256, 512, 1024])
SOURCES = optuna.distributions.CategoricalDistribution([512, 1024])


def _trial(number: int, value: float, label: int, source: int = 1024, spread: float | None = 0.1):
    """A feasible trial at these lengths: coverage grows with each max length, as on real data."""
    made = optuna.trial.create_trial(
        params={"memory.max_label_length": label, "memory.max_source_length": source},
        distributions={"memory.max_label_length": LABELS, "memory.max_source_length": SOURCES},
        values=[value],
        user_attrs={
            "tokens_per_s_spread": spread,
            "label_coverage": {256: 0.95, 512: 0.99, 1024: 1.0}[label],
            "source_coverage": {512: 0.9, 1024: 1.0}[source],
        },
    )
    made.number = number
    return made


def test_a_trial_within_the_fastest_trials_spread_that_keeps_more_labels_is_picked():
    fastest, longer = _trial(0, 70_000.0, 256), _trial(1, 65_000.0, 512)  # 7% slower, within ±10%
    chosen = pick([fastest, longer], ["epoch_throughput"], None)
    assert chosen.best is longer and chosen.fastest is fastest and chosen.band == pytest.approx(0.1)
    assert "picked over trial 0 (7e+04: this one is 7% behind it, within the ±10% tie band)" in chosen.describe()


def test_the_pick_is_the_same_whichever_tied_trial_measured_faster():
    """What the band is for: two runs of one sweep whose noise reorders the top two pick the same configuration."""
    for short_rate, long_rate in ((70_000.0, 66_000.0), (66_000.0, 70_000.0)):
        short, long = _trial(0, short_rate, 512, source=512), _trial(1, long_rate, 512, source=1024)
        assert pick([short, long], ["throughput"], None).best.params["memory.max_source_length"] == 1024


def test_equal_coverage_goes_to_the_fastest_and_a_trial_outside_the_band_is_not_a_tie():
    fastest, same, slow_longer = _trial(0, 70_000.0, 512), _trial(1, 68_000.0, 512), _trial(2, 60_000.0, 1024)
    chosen = pick([slow_longer, same, fastest], ["epoch_throughput"], None)  # 60k is 14% behind: outside ±10%
    assert chosen.best is fastest and chosen.describe() == ""


def test_tie_band_zero_picks_the_fastest_and_a_set_band_overrides_the_measured_spread():
    fastest, longer = _trial(0, 70_000.0, 256, spread=0.3), _trial(1, 60_000.0, 1024)
    assert pick([fastest, longer], ["epoch_throughput"], 0.0).best is fastest
    assert pick([fastest, longer], ["epoch_throughput"], None).best is longer  # within its own ±30%
    assert pick([fastest, longer], ["epoch_throughput"], 0.05).best is fastest
    assert pick([_trial(0, 70_000.0, 256, spread=None), longer], ["throughput"], None).best.number == 0  # no spread


def test_objectives_without_a_measured_spread_have_no_ties():
    low, high = _trial(0, 2.0, 256), _trial(1, 2.1, 1024)  # eval losses: 5% apart, the longer labels worse
    assert pick([high, low], ["loss"], None).best is low
    assert pick([high, low], ["throughput", "coverage"], None).best is high  # pareto: the first objective's best
