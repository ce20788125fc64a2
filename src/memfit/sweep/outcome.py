"""What a trial's run report means to Optuna: objective values, constraints, state and reason.

The memory constraint is the measured worst-case peak minus the limit the run's preflight judged by (budget minus
margin); > 0 is infeasible. A trial that does not fit (preflight, or an OOM in training) is an infeasible COMPLETE
trial carrying its measured or attempted size, so the sampler learns from it; crashes, NaN losses and killed trials
are FAIL with their reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memfit.sweep.space import INFEASIBLE_STATUSES

FEASIBLE_STATUSES = ("ok",)

# objective name → (report field, direction)
OBJECTIVES = {
    "throughput": ("tokens_per_s", "maximize"),  # tokens/s of the timed training segment
    # a whole epoch's tokens/s: the segment's step times applied to the epoch's batch plan (memfit.training.throughput)
    "epoch_throughput": ("epoch_tokens_per_s", "maximize"),
    "loss": ("eval_loss", "minimize"),  # eval loss after the run's fixed token budget (train loss without eval data)
    "coverage": ("label_coverage", "maximize"),  # share of label tokens kept by truncation
    "peak": ("worst_case_peak_gib", "minimize"),  # measured worst-case peak
}
WORST = {"maximize": 0.0, "minimize": 1e9}

ATTRS = (
    "status",
    "reason",
    "worst_case_peak_gib",
    "worst_case_shape",
    "tokens_per_s",
    "tokens_per_s_spread",  # the segment's steady steps' tokens/s: standard deviation over mean
    "epoch_tokens_per_s",  # the epoch's tokens/s estimated from the segment and the epoch's batch plan
    "label_coverage",
    "source_coverage",  # a tie on throughput goes to the trial keeping more label, then source tokens (sweep.ties)
    "final_loss",
    "eval_loss",
    "train_tokens",
    "run_id",
    "max_batch",
    "predicted_peak_gib",  # the memory model's prediction for the worst batch, beside the measured peak
    "calibration",  # the memory model's calibration file: later trials are predicted from it
    "alloc_retries",  # > 0: the segment ran against the cap, its tokens/s includes the allocator's waits
    "phase_seconds",  # what the trial's time went to: start-up phases, preflight (or batch plan), training
)


def objective_names(objective: str, pareto: list[str] | None) -> list[str]:
    """One objective, or the two (or more) of `pareto` for objective=pareto."""
    names = list(pareto or []) if objective == "pareto" else [objective]
    unknown = [n for n in names if n not in OBJECTIVES]
    if unknown or not names:
        from memfit.sweep.space import SweepConfigError

        raise SweepConfigError(
            f"hydra.sweeper.objective={objective} pareto={pareto}: objectives are {', '.join(OBJECTIVES)}"
            " (objective=pareto takes hydra.sweeper.pareto=[throughput,loss], for example)"
        )
    return names


def directions(names: list[str]) -> list[str]:
    return [OBJECTIVES[n][1] for n in names]


@dataclass
class TrialOutcome:
    """What the sweeper tells Optuna about one trial."""

    state: str  # complete | fail
    values: list[float] | None
    constraints: dict[str, float]
    attrs: dict[str, Any]

    @property
    def value(self) -> float | None:
        return self.values[0] if self.values else None

    @property
    def feasible(self) -> bool:
        return self.state == "complete" and all(v <= 0 for v in self.constraints.values())


def _objective_value(report: dict[str, Any], name: str) -> float | None:
    value = report.get(OBJECTIVES[name][0])
    if name == "loss" and value is None:
        value = report.get("final_loss")  # no validation data: the last training loss
    if name == "epoch_throughput" and value is None:
        value = report.get("tokens_per_s")  # too few steps to fit the step-time model: the segment's own rate
    return None if value is None else float(value)


def outcome_of(
    report: dict[str, Any] | None,
    error: str | None,
    limit_gib: float | None,
    objectives: list[str],
    coverage_floor: float,
) -> TrialOutcome:
    """Turn a run's report (or why it has none) into values + constraints. Infeasible trials get the worst value of
    each objective, so that the sampler keeps them as COMPLETE and learns from their constraint."""
    worst = [WORST[d] for d in directions(objectives)]
    if report is None or report.get("status") not in FEASIBLE_STATUSES + INFEASIBLE_STATUSES:
        reason = (report or {}).get("reason") or error or "no report"
        return TrialOutcome("fail", None, {}, {"status": (report or {}).get("status", "failed"), "reason": reason})
    status = report["status"]
    peak = report.get("worst_case_peak_gib")
    attrs = {k: report.get(k) for k in ATTRS}
    limit_gib = report.get("limit_gib") or limit_gib  # the limit the run's own preflight judged by, when it has one
    memory = (peak - limit_gib) if (peak is not None and limit_gib) else (0.0 if status == "ok" else 1.0)
    if status != "ok":
        memory = max(memory, 1e-3)  # an OOM is infeasible even when no size could be measured
    constraints = {"memory_gib": memory}
    coverage = report.get("label_coverage")
    if coverage_floor > 0 and coverage is not None:
        constraints["coverage"] = coverage_floor - coverage
    if status != "ok":
        return TrialOutcome("complete", worst, constraints, attrs)
    values = [_objective_value(report, name) for name in objectives]
    values = [w if v is None else v for v, w in zip(values, worst, strict=True)]
    return TrialOutcome("complete", values, constraints, attrs)


def constraint_dict(trial: Any) -> dict[str, float]:
    """A finished trial's constraints by name (Optuna 5 keeps them so)."""
    constraints = trial.constraints or {}
    return dict(constraints) if isinstance(constraints, dict) else {f"c{i}": v for i, v in enumerate(constraints)}


def constraint_attrs(constraints: dict[str, float]) -> dict[str, float]:
    """The constraints again as user attributes (`constraint_memory_gib`, ...): optuna-dashboard (0.21) reads only
    the list that samplers' constraints_func wrote, not Optuna 5's named constraints, so it would show none."""
    return {f"constraint_{key}": value for key, value in constraints.items()}


def constrain(trial: Any, constraints: dict[str, float]) -> None:
    """Tell a running trial its constraints (> 0: infeasible), for the sampler and for the dashboard."""
    for key, value in constraints.items():
        trial.set_constraint(key, value)
    for key, value in constraint_attrs(constraints).items():
        trial.set_user_attr(key, value)


def is_feasible(trial: Any) -> bool:
    import optuna

    return trial.state == optuna.trial.TrialState.COMPLETE and all(c <= 0 for c in constraint_dict(trial).values())
