"""Telling a study's trials: a run trial's outcome, a trial whose outcome is known without running it, and the
sweeper's own proposals (an unexplored configuration, the fullest predicted fit) queued for the next ask. The
decisions are sweep.proposals'; this module applies them to the study and its MLflow runs."""

from __future__ import annotations

import logging
import threading
from typing import Any

from omegaconf import DictConfig

from memfit.config import limit_gib
from memfit.sweep import proposals, runs, storage
from memfit.sweep.outcome import TrialOutcome, constrain, directions, is_feasible, outcome_of
from memfit.sweep.space import configurations, relevant

log = logging.getLogger("memfit.sweep")


class TrialTeller:
    """One per study: its budget, the data's screen and the memory model (which learns from every trial told)."""

    def __init__(
        self,
        settings: DictConfig,
        config: DictConfig | None,
        objectives: list[str],
        budget_gib: float | None = None,
        screen: Any = None,
        predictor: Any = None,
        lock: threading.Lock | None = None,
    ) -> None:
        self.settings = settings
        self.config = config
        self.objectives = objectives
        self.budget_gib = budget_gib
        self.screen = screen
        self.predictor = predictor
        self.lock = lock or threading.Lock()  # device threads of one sweeper share it

    @property
    def limit_gib(self) -> float | None:
        return limit_gib(self.budget_gib, self.config.budget.margin_gib) if self.budget_gib else None

    def knowledge(self) -> proposals.Knowledge:
        """What is known without running anything (proposals.Knowledge)."""
        return proposals.Knowledge(self.screen, self.predictor, self.budget_gib, self.settings.coverage_floor)

    def known_outcome(self, study: Any, params: dict[str, Any], number: int = -1) -> proposals.KnownOutcome | None:
        import optuna

        complete, running = optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING
        # one read of both: a trial another worker completes between two reads would be in neither
        current = storage.trials_in(study, complete, running)
        finished = [t for t in current if t.state == complete]
        measuring = [t for t in current if t.state == running]
        return proposals.known_outcome(params, finished, measuring, self.knowledge(), number)

    def tell(self, study: Any, trial: Any, result: Any, child: Any) -> TrialOutcome | None:
        """Tell a trial's outcome, unless another worker has already failed it as stale: its heartbeat came late
        (an overloaded host can starve the beating thread), it was failed and queued again, and its retry runs
        it. This worker goes on with the study instead of stopping on Optuna's refusal."""
        from optuna.exceptions import UpdateFinishedTrialError

        try:
            return self._tell(study, trial, result, child)
        except UpdateFinishedTrialError:
            log.warning(
                "trial %d: another worker failed it as stale while it ran (no heartbeat for %g s); "
                "its result is dropped and its retry runs it again",
                trial.number,
                3 * (self.settings.heartbeat_s or 0),
            )
            return None

    def _tell(self, study: Any, trial: Any, result: Any, child: Any) -> TrialOutcome:
        import optuna

        s = self.settings
        outcome = outcome_of(result.report, result.error, self.limit_gib, self.objectives, s.coverage_floor)
        outcome.attrs["device_seconds"] = result.seconds
        for key, value in outcome.attrs.items():
            if key != "run_id" or value:
                trial.set_user_attr(key, value)
        if self.predictor is not None:
            self.predictor.learn(trial.params, outcome.attrs.get("calibration"), trial.number)
        constrain(trial, outcome.constraints)
        if outcome.state == "complete":
            study.tell(trial, outcome.values)
        else:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        if outcome.attrs.get("status") == "interrupted":  # stopped by a signal, not by what it measured: run it again
            storage.requeue(study, trial, outcome.attrs.get("reason") or "interrupted")
        if child is not None:
            runs.record_outcome(child, outcome, self.objectives)
        state = "feasible" if outcome.feasible else outcome.attrs.get("status")
        phases = ", ".join(f"{name} {sec:.1f}" for name, sec in (outcome.attrs.get("phase_seconds") or {}).items())
        cost = f"{result.seconds:.1f} s in its process" + (f" (seconds: {phases})" if phases else "")
        if (spread := outcome.attrs.get("tokens_per_s_spread")) is not None:
            cost += f"; tokens/s ±{100 * spread:.0f}% over its steps"
        log.info("trial %d %s: %s; %s", trial.number, state, dict(trial.params), cost)
        return outcome

    def told_without_running(self, study: Any, trial: Any, parent: Any) -> bool:
        """Tell a trial whose outcome is already known (proposals.known_outcome) instead of launching it."""
        import optuna

        known = self.known_outcome(study, trial.params, trial.number)
        if known is None:
            return False
        attrs = {**known.attrs, "not_run": True, "device_seconds": 0.0}  # bookkeeping: not part of n_trials
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        constrain(trial, known.constraints)
        note = attrs["reason"].removeprefix("not run: ")
        if attrs["status"] == "surplus":  # another worker measures it: nothing to tell the sampler, no MLflow run
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            log.info("trial %d not run: %s", trial.number, note)
            return True
        child = runs.child_run(self.config, parent, trial)  # before tell: a finished trial takes no more attributes
        study.tell(trial, known.values or [0.0 if d == "maximize" else 1e9 for d in directions(self.objectives)])
        if child is not None:
            runs.record_not_run(child, attrs["status"], is_feasible(study.trials[trial.number]), attrs["reason"])
        log.info("trial %d not run: %s", trial.number, note)
        return True

    # --- queueing the sweeper's own proposals ---------------------------------------------------------------------
    def queue_unexplored(self, study: Any, space: dict[str, Any]) -> bool:
        """Queue a configuration drawn at random whose outcome is not known yet (proposals.unexplored): the next ask
        takes it (another worker's ask may take it first: then that worker runs it). False: none left."""
        import optuna

        seed = None if self.settings.seed is None else self.settings.seed + len(study.trials)
        draw = optuna.samplers.RandomSampler(seed=seed).sample_independent

        def draws() -> dict[str, Any]:
            params = {name: draw(study, None, name, distribution) for name, distribution in space.items()}
            return relevant(params, self.config.trainer.batching, self.settings.effective_batch)

        params = proposals.unexplored(draws, storage.pending(study), lambda p: self.known_outcome(study, p) is not None)
        if params is None:
            return False
        log.info("the sampler keeps proposing configurations whose outcome is known: trying %s next", params)
        study.enqueue_trial(params, user_attrs={"explored": True})
        return True

    def _predicted_gib(self, params: dict[str, Any]) -> float | None:
        predicted = self.predictor.predicted_gib(params)
        return None if predicted is None else predicted[0]

    def queue_fullest_fit(self, study: Any, space: dict[str, Any]) -> bool:
        """For a throughput objective, once the memory model can predict every configuration whose outcome is not
        known yet: queue the one predicted to fill the most of the limit without passing it (proposals.fullest_fit),
        up to `fill_budget` such trials per study. The sampler learns from them as from its own."""
        s = self.settings
        if not s.fill_budget or self.predictor is None or not self.budget_gib:
            return False
        if len(self.objectives) != 1 or self.objectives[0] not in proposals.FILLING_OBJECTIVES:
            return False
        with self.lock:  # device threads of one sweeper queue one each at most, never the same one twice
            # a smaller budget's fill trial, carried over by the ladder, does not count against this study's
            fills = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("fills_budget")]
            if len([t for t in fills if "reused_from" not in t.user_attrs]) >= s.fill_budget:
                return False
            pending = storage.pending(study)
            every = configurations(space, batching=self.config.trainer.batching, effective_batch=s.effective_batch)
            candidates = [p for p in every or [] if p not in pending]
            limit = self.limit_gib
            found = proposals.fullest_fit(
                candidates,
                self._predicted_gib,
                limit,
                lambda p: self.known_outcome(study, p) is not None,
            )
            if found is None:
                return False
            gib, params = found
            note = f"the fullest predicted fit ({gib:.2f} of the {limit:.2f} GiB limit)"
            log.info("memory model: trying %s next, %s", params, note)
            study.enqueue_trial(params, user_attrs={"fills_budget": True})
            return True
