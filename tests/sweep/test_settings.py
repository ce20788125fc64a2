"""Sweeper settings that cannot run are one line each, found before anything opens (the CLI path is tested with
the other bad settings in test_sweep)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from hydra_plugins.memfit_sweeper.config import MemfitSweeperConf
from memfit.sweep.settings import check_settings
from memfit.sweep.space import SweepConfigError


def _settings(**changes):
    settings = OmegaConf.structured(MemfitSweeperConf)
    for key, value in changes.items():
        settings[key] = value
    return settings


def test_the_default_settings_run_and_name_their_objective():
    assert check_settings(_settings()) == ["epoch_throughput"]


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"n_trials": 0}, "hydra.sweeper.n_trials=0 must be > 0"),
        ({"n_trials": -3}, "hydra.sweeper.n_trials=-3 must be > 0"),
        ({"n_jobs": 0}, "hydra.sweeper.n_jobs=0 must be > 0"),
        ({"trial_timeout_s": 0}, "hydra.sweeper.trial_timeout_s=0.0 must be > 0"),
        ({"heartbeat_s": -1}, "hydra.sweeper.heartbeat_s=-1.0 must be > 0"),
        ({"poll_s": 0}, "hydra.sweeper.poll_s=0.0 must be > 0"),
        ({"segment_micro_batches": 0}, "hydra.sweeper.segment_micro_batches=0 must be > 0"),
        ({"budgets": [16, 0]}, "hydra.sweeper.budgets=0.0 must be > 0"),
        ({"tie_band": 1.5}, "hydra.sweeper.tie_band=1.5 must be in [0, 1)"),
        ({"effective_batch": 0}, "hydra.sweeper.effective_batch=0 must be > 0"),
        ({"coverage_floor": 1.5}, "hydra.sweeper.coverage_floor=1.5 must be in [0, 1]"),
        ({"predict_margin": -1}, "hydra.sweeper.predict_margin=-1.0 must be >= 0"),
        ({"fill_budget": -1}, "hydra.sweeper.fill_budget=-1 must be >= 0"),
        ({"tie_band": -0.1}, "hydra.sweeper.tie_band=-0.1 must be in [0, 1)"),
        ({"sampler": "cmaes"}, "hydra.sweeper.sampler='cmaes': use tpe or random"),
        ({"isolation": "thread"}, "hydra.sweeper.isolation='thread'"),
        ({"objective": "throughput", "direction": "minimize"}, "hydra.sweeper.direction=minimize contradicts"),
    ],
)
def test_a_setting_that_cannot_run_is_one_line_naming_it(changes, expected):
    with pytest.raises(SweepConfigError) as err:
        check_settings(_settings(**changes))
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)


def test_optional_timeouts_may_be_off():
    assert check_settings(_settings(trial_timeout_s=None, heartbeat_s=None))


@pytest.mark.parametrize(
    ("budgets", "job_gib", "expected"),
    [
        ([0.4, 16], 24, "budget.margin_gib=0.5 leaves nothing of hydra.sweeper.budgets=0.4"),
        (None, 0.5, "budget.margin_gib=0.5 leaves nothing of budget.gib=0.5"),
    ],
)
def test_a_swept_budget_the_margin_leaves_nothing_of_is_one_line(budgets, job_gib, expected):
    job_budget = OmegaConf.create({"gib": job_gib, "margin_gib": 0.5})
    with pytest.raises(SweepConfigError) as err:
        check_settings(_settings(budgets=budgets), job_budget)
    assert expected in str(err.value)
    assert check_settings(_settings(budgets=[1, 16]), job_budget) == ["epoch_throughput"]
