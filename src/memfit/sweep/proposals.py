"""Proposal rules: pure decisions over a study's finished and running trials, with no I/O. Which configurations
have an outcome known without running them, which are pending, which unexplored one to try when the sampler circles,
and which predicted fit fills the budget most. The loop (sweep.study) asks, applies these, and tells."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memfit.sweep.outcome import constraint_dict
from memfit.sweep.screen import LABEL
from memfit.sweep.space import dominated_by, repeat_of

# Known configurations the sampler may propose in a row before the sweeper queues one it has not measured. TPE with
# few feasible trials keeps proposing where it has already been told "infeasible" (dominated, below the coverage
# floor, predicted over budget): replayed over measured tables at 16 GiB, 3 of 20 sweeps stopped that way after
# one trial run, with feasible configurations never tried (benchmarks/results/sweep_strategies_replay.json).
EXPLORE_AFTER = 3
EXPLORE_DRAWS = 200  # random draws looking for a configuration whose outcome is not known yet

# Objectives for which a configuration that fills the budget is worth trying early (fill_budget): tokens/s grows with
# the work a step does, and that work is what fills memory. In six measured tables (pegasus_large and qwen2.5-1.5B at
# 16, 24 and 40 GiB) the fitting configuration with the largest worst case was the fastest, or within 0.5% of it
# (benchmarks/results/sweep_strategies_replay_fill.json).
FILLING_OBJECTIVES = ("throughput", "epoch_throughput")

# what a trial's repeat does not copy: it has no MLflow run of its own, held no device, and the sampler proposed it
# what belongs to the trial that ran, not to its configuration's outcome: a repeat told from it copies none of these
MEASURED_ONLY = ("run_id", "device", "explored", "fills_budget", "phase_seconds")


@dataclass(frozen=True)
class Knowledge:
    """What the sweeper knows before running anything: the data's coverage screen (sweep.screen), the memory model's
    predictions once a trial calibrated it (sweep.predict), the budget and the coverage floor."""

    screen: Any = None  # CoverageScreen | None
    predictor: Any = None  # MemoryPredictor | None
    budget_gib: float | None = None
    coverage_floor: float = 0.0


@dataclass(frozen=True)
class KnownOutcome:
    attrs: dict[str, Any]
    values: list[float] | None = None
    constraints: dict[str, float] = field(default_factory=dict)


def counts_as_run(trial: Any) -> bool:
    """A trial that ran, runs, or ran and died: not bookkeeping (told without running, carried over from a smaller
    budget of the ladder, or over n_trials)."""
    return "reused_from" not in trial.user_attrs and "not_run" not in trial.user_attrs


def known_outcome(
    params: dict[str, Any], finished: list[Any], running: list[Any], know: Knowledge, number: int = -1
) -> KnownOutcome | None:
    """The outcome of a configuration known without running it: another worker measures it now (the lower trial
    number of two asked at once measures), an earlier trial measured it, it certainly cannot fit (it dominates a
    measured infeasible trial), its label length keeps less than the coverage floor (from the data alone), or the
    memory model predicts it far over the budget. None: it must run."""
    measuring = [t for t in running if counts_as_run(t) and t.params == params and t.number < number]
    if measuring:
        reason = f"not run: trial {measuring[0].number} (another worker) is measuring this configuration now"
        return KnownOutcome({"status": "surplus", "reason": reason})
    if (source := repeat_of(params, finished)) is not None:
        reason = f"not run: the same configuration as trial {source.number}, whose measurement it repeats"
        if source.user_attrs.get("reason"):
            reason = f"{reason}; {source.user_attrs['reason']}"
        attrs = {**source.user_attrs, "repeat_of": source.number, "reason": reason}
        for key in MEASURED_ONLY:
            attrs.pop(key, None)
        return KnownOutcome(attrs, source.values, constraint_dict(source))
    if (blocker := dominated_by(params, finished)) is not None:
        reason = f"not run: at least as large as trial {blocker.number}, which did not fit"
        return KnownOutcome({"status": "predicted_infeasible", "reason": reason}, None, constraint_dict(blocker))
    screen = know.screen
    if screen is not None and (coverage := screen.below_floor(params)) is not None:
        reason = (
            f"not run: max_label_length={params.get(LABEL, screen.fixed_label)} keeps {coverage:.2%} of label"
            f" tokens, below coverage_floor={know.coverage_floor:g} (length audit of the data)"
        )
        attrs = {"status": "below_coverage_floor", "reason": reason, "label_coverage": coverage}
        return KnownOutcome(attrs, None, {"memory_gib": 0.0, "coverage": know.coverage_floor - coverage})
    if know.predictor is not None and (over := know.predictor.over_budget(params, know.budget_gib)) is not None:
        attrs, constraints = over
        if screen is not None:  # the same constraints as measured trials carry
            label = params.get(LABEL, screen.fixed_label)
            constraints["coverage"] = know.coverage_floor - screen.coverage_of(int(label))
        return KnownOutcome(attrs, None, constraints)
    return None


def pending_params(waiting_or_running: list[Any]) -> list[dict[str, Any]]:
    """Configurations queued (WAITING: their params are still the fixed ones) or running now."""
    return [t.params or t.system_attrs.get("fixed_params", {}) for t in waiting_or_running]


def unexplored(
    draws: Callable[[], dict[str, Any]], pending: list[dict[str, Any]], is_known: Callable[[dict[str, Any]], bool]
) -> dict[str, Any] | None:
    """A configuration from up to EXPLORE_DRAWS random draws whose outcome is not known yet and which is not queued or
    running; None when none was found: the space is (all but) exhausted."""
    for _ in range(EXPLORE_DRAWS):
        params = draws()
        if params not in pending and not is_known(params):
            return params
    return None


def fullest_fit(
    candidates: list[dict[str, Any]],
    predicted_gib: Callable[[dict[str, Any]], float | None],
    limit_gib: float,
    is_known: Callable[[dict[str, Any]], bool],
) -> tuple[float, dict[str, Any]] | None:
    """The candidate predicted to fill the most of the limit without passing it, whose outcome is not known yet.
    None where some candidate whose outcome is unknown has no prediction yet: a part of the space no calibration
    predicts (another policy, or a step without accumulation) may hold a fuller fit, so the sampler proposes until a
    trial there has calibrated it too."""
    fitting, unpredicted = [], []
    for params in candidates:
        gib = predicted_gib(params)
        if gib is None:
            unpredicted.append(params)
        elif gib <= limit_gib and not is_known(params):
            fitting.append((gib, params))
    if any(not is_known(params) for params in unpredicted):
        return None
    return max(fitting, key=lambda row: row[0], default=None)


def measured(trials: list[Any]) -> list[Any]:
    """The trials that count toward n_trials: those run (counts_as_run) and not superseded by a retry, since a
    killed or interrupted trial whose configuration was queued again is measured by that retry, not by itself."""
    retried = {t.user_attrs["retry_of"] for t in trials if "retry_of" in t.user_attrs}
    return [t for t in trials if counts_as_run(t) and t.number not in retried]


def over_quota(trial: Any, started: list[Any], n_trials: int) -> bool:
    """Trials are numbered in the order the storage created them: a trial with n_trials run (or running) trials
    before it is one too many, asked by one of several workers at the same moment. A retry of a killed trial never
    is: its configuration would otherwise be lost. `started`: the study's trials (a retry queued is among them)."""
    if "retry_of" in trial.user_attrs:
        return False
    return len([t for t in measured(started) if t.number < trial.number]) >= n_trials
