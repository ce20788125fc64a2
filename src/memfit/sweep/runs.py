"""The sweep's MLflow runs: the parent run of a study (continued when the study resumes), one child run per trial
under it, the ladder's run above a budget ladder's studies, and the sweeper's view of each trial on its run."""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig

from memfit.sweep.outcome import TrialOutcome

log = logging.getLogger("memfit.sweep")


def parent_run(
    config: DictConfig, study: Any, budget_gib: float | None, objectives: list[str], ladder: Any = None
) -> Any:
    """The study's run: the one its user attrs name (a resumed study continues it), or a new one that workers
    starting together on a new study agree on. None with tracking=none."""
    if config.tracking.backend == "none":
        return None
    from memfit.tracking import mask_credentials, open_run, open_shared_run, run_exists, tracking_uri

    tags = {
        "memfit.sweep": study.study_name,
        "memfit.model": config.model.name,
        "memfit.data": config.data.name,
        "memfit.budget_gib": "none" if budget_gib is None else f"{budget_gib:g}",
        "memfit.objective": ",".join(objectives),
    }
    if ladder is not None:
        tags["mlflow.parentRunId"] = ladder.run_id
    earlier = study.user_attrs.get("mlflow_parent_run_id")
    if earlier and run_exists(config, earlier):
        return open_run(config, f"sweep-{study.study_name}", tags, run_id=earlier)
    if earlier:
        log.warning(
            "study %s logged to another MLflow store (its run %s is not in %s): a new sweep run there",
            study.study_name,
            earlier,
            mask_credentials(tracking_uri(config)),
        )
    parent = open_shared_run(config, f"sweep-{study.study_name}", tags, key="memfit.sweep")
    study.set_user_attr("mlflow_parent_run_id", parent.run_id)
    return parent


def child_run(config: DictConfig, parent: Any, trial: Any) -> Any:
    """A trial's run under the study's, tagged with how the trial came to be; its id goes into the trial's attrs."""
    if parent is None:
        return None
    from memfit.tracking import open_run

    tags = {"mlflow.parentRunId": parent.run_id, "memfit.trial": str(trial.number)}
    if trial.user_attrs.get("explored"):  # queued by the sweeper, not proposed by the sampler (proposals.unexplored)
        tags["memfit.explored"] = "true"
    if trial.user_attrs.get("fills_budget"):  # queued as the fullest predicted fit (proposals.fullest_fit)
        tags["memfit.fills_budget"] = "true"
    child = open_run(config, f"trial-{trial.number}", tags)
    child.log_params({f"trial.{k}": v for k, v in trial.params.items()})
    trial.set_user_attr("run_id", child.run_id)
    return child


def close_trial_run(config: DictConfig, frozen: Any, status: str, reason: str) -> None:
    """End the MLflow run of a trial whose process could not (killed, interrupted), unless it ended it itself."""
    run_id = frozen.user_attrs.get("run_id")
    if run_id and config.tracking.backend != "none":
        from memfit.tracking import end_if_running

        end_if_running(config, run_id, status, reason)


def record_outcome(child: Any, outcome: TrialOutcome, objectives: list[str]) -> None:
    """The sweeper's view on the trial's run: objective, constraint, feasibility, status and reason."""
    status = outcome.attrs.get("status") or "failed"
    metrics = {f"trial/{k}_constraint": v for k, v in outcome.constraints.items()}
    metrics["trial/feasible"] = float(outcome.feasible)
    metrics["trial/seconds"] = outcome.attrs["device_seconds"]
    for name, value in zip(objectives, outcome.values or [], strict=False):
        metrics[f"trial/objective_{name}"] = value
    child.log_metrics(metrics, step=0)
    child.set_tags({"memfit.trial_status": status})
    reason = outcome.attrs.get("reason") or status
    # a process that died (SIGKILL, OOM-killer, timeout) could not end its run: the sweeper does
    child.finish_if_running("FINISHED" if status == "ok" else "KILLED" if "killed" in reason else "FAILED", reason)


def record_not_run(child: Any, status: str, feasible: bool, reason: str) -> None:
    """A trial told without running: its run says why, and ends at once."""
    child.set_tags({"memfit.trial_status": status})
    child.log_metrics({"trial/feasible": float(feasible), "trial/seconds": 0.0}, step=0)
    child.finish("FINISHED" if feasible else "FAILED", reason)


def ladder_run(config: DictConfig, budgets: list[float]) -> Any:
    """The run above a budget ladder's studies. None with tracking=none."""
    if config.tracking.backend == "none":
        return None
    from memfit.tracking import open_run

    name = f"ladder-{config.model.name}-{config.data.name}-" + "-".join(f"{b:g}" for b in budgets) + "GiB"
    return open_run(config, name, {"memfit.ladder": ",".join(f"{b:g}" for b in budgets)})
