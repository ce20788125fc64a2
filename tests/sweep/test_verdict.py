"""When nothing is feasible, the sweep says which constraint binds and by how much, and what would let one through."""

from __future__ import annotations

import optuna
import pytest

from memfit.sweep.verdict import nothing_feasible

LABELS = [64, 128, 256, 512]


def coverage_of(length: int) -> float:
    """A long-tail data set: 512 keeps 94.9% of label tokens, 1024 all but a sliver."""
    return {64: 0.60, 128: 0.80, 256: 0.90, 512: 0.949, 1024: 0.999}.get(length, 1.0 if length > 1024 else 0.5)


def trial(number: int, label: int, memory_gib: float, coverage: float, **attrs) -> optuna.trial.FrozenTrial:
    made = optuna.trial.create_trial(
        params={"trainer.batch_size": 4, "memory.max_label_length": label},
        distributions={
            "trainer.batch_size": optuna.distributions.CategoricalDistribution([1, 4]),
            "memory.max_label_length": optuna.distributions.CategoricalDistribution(LABELS),
        },
        values=[0.0],
        user_attrs=attrs,
        constraints={"memory_gib": memory_gib, "coverage": coverage},
    )
    made.number = number
    return made


def test_coverage_alone_binds_the_longest_label_and_the_two_ways_out_are_named():
    trials = [trial(0, 512, -3.0, 0.99 - 0.949), trial(1, 256, 0.0, 0.09, status="below_coverage_floor")]
    line = nothing_feasible(trials, LABELS, coverage_of, 0.99, 23.5, 1024)
    assert line == (
        "coverage binds: the longest memory.max_label_length searched, 512, keeps 94.9% of label tokens, under "
        "hydra.sweeper.coverage_floor=0.99: add 1024 (keeps 99.9%) to memory.max_label_length's choices or set "
        "hydra.sweeper.coverage_floor=0.94"
    )


def test_memory_alone_binds_the_configuration_least_over_the_limit_and_by_how_much():
    trials = [trial(0, 512, 2.5, -0.01), trial(1, 256, 0.75, -0.01, predicted=True), trial(2, 128, 1.5, -0.01)]
    line = nothing_feasible(trials, [128, 256, 512], lambda length: 1.0, 0.99, 23.5, 1024)
    assert line.startswith("memory binds: every configuration that kept enough labels needs more than the 23.50 GiB")
    assert "trial 1 ({'trainer.batch_size': 4, 'memory.max_label_length': 256}), predicted 24.25 GiB" in line
    assert "over by 0.75 GiB: raise budget.gib to at least 24.8" in line
    assert "keep less of the labels" not in line


def test_both_bind_where_short_labels_keep_too_little_and_the_long_ones_do_not_fit():
    trials = [trial(0, 512, 1.0, -0.001), trial(1, 256, 0.0, 0.09, status="below_coverage_floor")]
    line = nothing_feasible(trials, LABELS, coverage_of, 0.94, 23.5, 1024)
    assert line.startswith("memory binds:") and "trial 0" in line
    assert "(and memory.max_label_length 64, 128, 256 keep less of the labels than coverage_floor=0.94)" in line


@pytest.mark.parametrize("floor", [0.0, 0.5])
def test_trials_that_only_failed_name_their_reasons_not_a_constraint(floor):
    failed = [trial(0, 64, 0.0, -1.0, reason="failed: injected crash"), trial(1, 128, 0.0, -1.0, reason="nan_loss: x")]
    line = nothing_feasible(failed, [64, 128], coverage_of, floor, 23.5, 1024)
    assert line == "no trial ended feasible (reasons: failed, nan_loss): see each trial's reason"
