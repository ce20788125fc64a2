"""The budget ladder: a larger budget starts from what smaller budgets measured.

A trial's worst-case peak and throughput do not depend on the budget it ran under (the cap only decides whether it
fits), so a measurement carries over: a configuration that fit a smaller budget fits a larger one, with the same
peak and tokens/s; one whose measured peak (a lower bound when it hit the cap) is above the larger budget's limit
does not fit there either. Only the rest has to be run again.
"""

from __future__ import annotations

import logging
from typing import Any

from memfit.sweep.outcome import WORST, constraint_attrs, directions
from memfit.sweep.space import INFEASIBLE_STATUSES

log = logging.getLogger("memfit.sweep")


def carried_over(trial: Any, limit_gib: float) -> bool | None:
    """True: fits under limit_gib; False: certainly does not; None: unknown, run it again."""
    peak = trial.user_attrs.get("worst_case_peak_gib")
    status = trial.user_attrs.get("status")
    if peak is None:
        return None
    if status == "ok":  # it fit under its cap, so its measured peak is the true one
        return peak <= limit_gib
    if status in INFEASIBLE_STATUSES and peak > limit_gib:
        return False
    return None


def reuse_measurements(study: Any, earlier: list[Any], limit_gib: float | None, objectives: list[str]) -> int:
    """Add earlier budgets' conclusive measurements to `study` as finished trials, marked reused_from."""
    import optuna

    if limit_gib is None:
        return 0
    seen = {t.user_attrs.get("reused_from") for t in study.trials}
    added = 0
    for source in earlier:
        for trial in source.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            origin = f"{source.study_name}#{trial.number}"
            verdict = carried_over(trial, limit_gib)
            if verdict is None or origin in seen or "reused_from" in trial.user_attrs:
                continue
            peak = trial.user_attrs["worst_case_peak_gib"]
            values = trial.values if verdict else [WORST[d] for d in directions(objectives)]
            constraints = {"memory_gib": peak - limit_gib}
            if "coverage" in trial.constraints:
                constraints["coverage"] = trial.constraints["coverage"]
            study.add_trial(
                optuna.trial.create_trial(
                    params=trial.params,
                    distributions=trial.distributions,
                    values=values,
                    user_attrs={
                        **trial.user_attrs,
                        **constraint_attrs(constraints),
                        "reused_from": origin,
                        "device_seconds": 0.0,
                    },
                    constraints=constraints,
                )
            )
            seen.add(origin)
            added += 1
    if added:
        log.info("study %s starts from %d measurements of smaller budgets", study.study_name, added)
    return added


def write_ladder(config: Any, rows: list[tuple[float, Any]], effective_batch: int | None, ladder_run: Any) -> None:
    """The ladder's table (budget → best configuration) in the sweep dir, the log, stdout and the ladder's run."""
    from pathlib import Path

    from memfit.sweep.results import ladder_table

    fixed = {
        "trainer.batch_size": config.trainer.batch_size,
        "memory.max_source_length": config.memory.max_source_length,
        "memory.max_label_length": config.memory.max_label_length,
    }
    table = ladder_table(rows, effective_batch, fixed)
    (Path(config.hydra.sweep.dir) / "ladder.md").write_text(table)
    log.info("budget ladder:\n%s", table)
    print(table)
    if ladder_run is not None:
        ladder_run.log_text(table, "ladder.md")
        ladder_run.finish("FINISHED")
