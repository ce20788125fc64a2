"""The sweeper's settings checked once, before anything opens: each setting that cannot run is a one-line
SweepConfigError naming it and the fix (exit 2)."""

from __future__ import annotations

from omegaconf import DictConfig

from memfit.config.validate import margin_problem
from memfit.sweep.outcome import directions, objective_names
from memfit.sweep.space import SweepConfigError

ISOLATIONS = ("process", "launcher", "none")
SAMPLERS = ("tpe", "random")


def _positive(name: str, value: float | None, fix: str, optional: bool = False) -> None:
    if value is None and optional:
        return
    if value is None or value <= 0:
        raise SweepConfigError(f"hydra.sweeper.{name}={value} must be > 0: {fix}")


def check_settings(s: DictConfig, job_budget: DictConfig | None = None) -> list[str]:
    """Raise on the first setting that cannot run; return the objectives the settings name. `job_budget`, the job's
    `budget` section: every budget swept (the ladder's, else budget.gib) must exceed its margin_gib."""
    objectives = objective_names(s.objective, list(s.pareto or []))
    if s.direction and len(objectives) == 1 and s.direction != directions(objectives)[0]:
        raise SweepConfigError(
            f"hydra.sweeper.direction={s.direction} contradicts objective={s.objective}, which is "
            f"{directions(objectives)[0]}d: drop hydra.sweeper.direction or set it to match"
        )
    _positive("n_trials", s.n_trials, "set hydra.sweeper.n_trials=8 or another number of trials to run")
    _positive("n_jobs", s.n_jobs, "set hydra.sweeper.n_jobs=1 (trials launched together)")
    _positive("trial_timeout_s", s.trial_timeout_s, "give seconds, or null for no timeout", optional=True)
    _positive("heartbeat_s", s.heartbeat_s, "give seconds, or null for no heartbeat", optional=True)
    _positive("poll_s", s.poll_s, "give seconds, e.g. 5")
    _positive("segment_micro_batches", s.segment_micro_batches, "give a micro-batch count, e.g. 40, or null", True)
    _positive("effective_batch", s.effective_batch, "give samples per optimizer step, e.g. 32, or null", True)
    if not 0 <= s.coverage_floor <= 1:
        raise SweepConfigError(
            f"hydra.sweeper.coverage_floor={s.coverage_floor} must be in [0, 1]: a share of label tokens, e.g. 0.99"
        )
    if s.predict_margin is not None and s.predict_margin < 0:
        raise SweepConfigError(
            f"hydra.sweeper.predict_margin={s.predict_margin} must be >= 0: e.g. 0.1 (tell without running what is "
            "predicted over budget × 1.1), or null to run every configuration"
        )
    if s.fill_budget < 0:
        raise SweepConfigError(f"hydra.sweeper.fill_budget={s.fill_budget} must be >= 0: e.g. 2, or 0 for none")
    if s.tie_band is not None and not 0 <= s.tie_band < 1:
        raise SweepConfigError(
            f"hydra.sweeper.tie_band={s.tie_band} must be in [0, 1): a share of the fastest trial's value, e.g. 0.1;"
            " 0 picks the fastest, null ties within its measured spread"
        )
    for budget in s.budgets or []:
        _positive("budgets", budget, "give each budget of the ladder in GiB, e.g. [16, 24, 40]")
    _check_margin(s, job_budget)
    if s.sampler not in SAMPLERS:
        raise SweepConfigError(f"hydra.sweeper.sampler={s.sampler!r}: use tpe or random")
    if s.isolation not in ISOLATIONS:
        raise SweepConfigError(
            f"hydra.sweeper.isolation={s.isolation!r}: use process (fresh process per trial) or launcher "
            "(Hydra's configured launcher, e.g. hydra/launcher=submitit_slurm)"
        )
    if s.devices and s.isolation != "process":
        raise SweepConfigError(
            "hydra.sweeper.devices pins each trial's process to a GPU: it needs hydra.sweeper.isolation=process"
        )
    if s.pin_cores and not s.devices:
        raise SweepConfigError(
            "hydra.sweeper.pin_cores gives each device's trials their own cores: it needs hydra.sweeper.devices"
        )
    return objectives


def _check_margin(s: DictConfig, job_budget: DictConfig | None) -> None:
    if job_budget is None:
        return
    swept = [("hydra.sweeper.budgets", b) for b in s.budgets or []] or [("budget.gib", job_budget.gib)]
    for key, gib in swept:
        if gib and (problem := margin_problem(key, gib, job_budget.margin_gib)):
            raise SweepConfigError(problem)
