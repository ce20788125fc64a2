"""The budget sweep behind hydra/sweeper=memfit: Optuna 5 ask/tell, one trial per fresh process by default.

Every trial is told to Optuna with its measured worst-case peak minus the budget as a constraint
(`Trial.set_constraint`; > 0 is infeasible), so the sampler learns where memory runs out instead of ignoring OOM
trials as FAIL. The study lives in a storage URL, so rerunning the same command resumes it: trials a killed sweeper
left RUNNING are failed as interrupted, their configuration is queued again, and the MLflow runs are continued,
never duplicated. With `budgets` (the ladder recipe) one command searches several budgets, smallest first, and
each budget starts from what the smaller ones measured.

This module is the loop (ask, decide, run, tell); the decisions are sweep.proposals', the storage and its recovery
sweep.storage's, the MLflow runs sweep.runs', and what a study leaves behind sweep.results'.
"""

from __future__ import annotations

import logging
import threading
import warnings
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from memfit.config import limit_gib
from memfit.progress import progress_bar
from memfit.sweep import naming, proposals, runs, sizing, storage, verdict
from memfit.sweep.derive import SearchSpace, search_space
from memfit.sweep.ladder import write_ladder
from memfit.sweep.outcome import directions, is_feasible
from memfit.sweep.predict import screen_data
from memfit.sweep.results import SweepView, log_pareto_plot, summarise
from memfit.sweep.settings import check_settings
from memfit.sweep.space import held_step, segment_steps, suggest
from memfit.sweep.space_check import check_searched_values
from memfit.sweep.telling import TrialTeller
from memfit.sweep.trials import InProcessTrials, ProcessTrials, app_argv, core_sets, trial_env
from memfit.tracking import mask_credentials

log = logging.getLogger("memfit.sweep")


def _best_text(study: Any, objectives: list[str]) -> str:
    feasible = [t for t in study.trials if is_feasible(t)]
    if not feasible:
        return "no feasible trial yet"
    pick = max if directions(objectives)[0] == "maximize" else min
    return f"best {objectives[0]} {pick(t.values[0] for t in feasible):.4g}"


def _value_text(value: Any) -> str:
    return str(value) if not isinstance(value, str) else value


class BudgetSweep:
    def __init__(self, **settings: Any) -> None:
        self.settings = DictConfig(settings) if not isinstance(settings, DictConfig) else settings
        self.config: DictConfig | None = None
        self.trials: Any = None
        self.job_idx = 0
        self.objectives: list[str] = []
        self.budget_gib: float | None = None
        self.studies: list[Any] = []  # finished studies of this command (a ladder's smaller budgets)
        self.ladder_run: Any = None
        self.screen: Any = None  # label coverage per max_label_length, from the data alone (sweep.screen)
        self.predictor: Any = None  # the memory model's predictions, once a trial calibrated it (sweep.predict)
        self.screened = False  # the data is screened once per command, even where it does not apply (None)
        self.searched = SearchSpace({}, [])  # the space, and the data's lengths where derived from them
        self.lock = threading.Lock()
        self.runners: dict[str, Any] = {}
        # trials this sweeper has told after running: a device slot waiting for the others' last trials wakes on it
        self.told = threading.Condition()
        self.told_count = 0
        self.stopping = False  # a stop signal arrived: no trial is launched from now on
        self.verdict: str | None = None  # why the last study found nothing feasible

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.config = config
        s = self.settings
        self.objectives = check_settings(s, config.budget)
        if s.isolation == "process":
            sweep_dir = Path(config.hydra.sweep.dir)
            self.trials = ProcessTrials(app_argv(config), sweep_dir, s.trial_timeout_s, trial_env(), s.fork_trials)
        else:
            launcher = Plugins.instance().instantiate_launcher(
                hydra_context=hydra_context, task_function=task_function, config=config
            )
            self.trials = InProcessTrials(launcher)
        # one runner per device: a device's trials see only that GPU (and its cores)
        devices = [str(d) for d in s.devices or []]
        cores = core_sets(len(devices)) if s.pin_cores else None
        if s.pin_cores and cores is None:
            log.warning("hydra.sweeper.pin_cores: fewer cores than devices (or no affinity here): trials not pinned")
        self.runners = {d: self.trials.pinned(d, cores=cores[i] if cores else None) for i, d in enumerate(devices)}

    # --- what the sweeper knows without running -------------------------------------------------------------------
    def _limit_gib(self) -> float | None:
        return limit_gib(self.budget_gib, self.config.budget.margin_gib) if self.budget_gib else None

    def _screen_data(self) -> None:
        """Read the data's lengths once per command (after the storage opened, so that a bad storage URL is reported
        first)."""
        if not self.screened:
            self.screened = True
            searched = self.searched
            self.screen, self.predictor = screen_data(searched.space, self.config, self.settings, searched.lengths)

    def _learn_calibrations(self, study: Any) -> None:
        """Calibrations earlier trials of this study reported (a resumed sweep predicts from them too)."""
        if self.predictor is None:
            return
        for trial in study.trials:
            if trial.state.is_finished() and trial.user_attrs.get("calibration"):
                self.predictor.learn(trial.params, trial.user_attrs["calibration"], trial.number)

    # --- the study, its storage and its recovery ------------------------------------------------------------------
    def _study_name(self) -> str:
        s, cfg = self.settings, self.config
        budget = f"{self.budget_gib:g}GiB" if self.budget_gib else "nobudget"
        if s.study_name:
            return f"{s.study_name}-{budget}" if s.budgets else s.study_name
        return f"memfit-{cfg.model.name}-{cfg.data.name}-{budget}"

    def _measured(self, searched: SearchSpace) -> dict[str, Any]:
        s = self.settings
        judged = (s.effective_batch, s.coverage_floor, s.segment_micro_batches)
        return naming.what_it_measures(searched, self.objectives, *judged)

    def _open(self) -> tuple[Any, Any]:
        url = storage.storage_url(self.settings, self.config)
        s, name = self.settings, self._study_name()

        def choose(opened: Any) -> str:
            existing = naming.recorded(opened, name)
            if self.searched.sized_here:  # a worker that sized the shared study first: its choices win
                sizing.adopt_recorded(self.searched, existing, self._measured, name)
            return naming.choose(name, existing, self._measured(self.searched), named_by_user=bool(s.study_name))

        study, store = storage.open_study(
            name, url, s, directions(self.objectives), self._stale_trial, choose_name=choose
        )
        naming.record(study, self._measured(self.searched))
        sizing.settle(self.searched, study.user_attrs.get(naming.MEASURES_ATTR), self._measured, study.study_name)
        log.info("study %s in %s: %d trials so far", study.study_name, mask_credentials(url), len(study.trials))
        return study, store

    def _stale_trial(self, study: Any, frozen: Any) -> None:
        """Optuna failed a trial whose worker stopped beating: close its MLflow run and queue it again (once)."""
        reason = (
            f"killed: its worker stopped (no heartbeat for {3 * self.settings.heartbeat_s:g} s); "
            "its configuration is queued again"
        )
        log.warning("trial %d: %s", frozen.number, reason)
        runs.close_trial_run(self.config, frozen, "KILLED", reason)
        storage.requeue(study, frozen, reason)

    def _recover_interrupted(self, study: Any, store: Any) -> None:
        """A RUNNING trial whose sweeper process (on this host) is gone was interrupted: FAIL it with that reason,
        close its MLflow run as KILLED, and queue its configuration again so that it is measured after all."""
        reason = "interrupted: the sweeper stopped during this trial; its configuration is queued again"
        for frozen in storage.interrupted(study):
            storage.fail_and_requeue(study, store, frozen, reason)
            runs.close_trial_run(self.config, frozen, "KILLED", reason)
            log.warning("trial %d was interrupted by a stopped sweeper: marked FAIL, queued again", frozen.number)

    def _stop(self, study: Any, store: Any, err: BaseException) -> None:
        """A stop signal (or Ctrl-C): SIGTERM the running trials (each ends its MLflow run KILLED), then record
        this sweeper's trials as interrupted and queue their configurations again, for the rerun that resumes."""
        self.stopping = True
        for runner in [self.trials, *self.runners.values()]:
            runner.close()
        reason = f"interrupted: the sweeper was {err or 'stopped by SIGINT'} during this trial; queued again"
        for frozen in storage.running_here(study):
            storage.fail_and_requeue(study, store, frozen, reason)
            runs.close_trial_run(self.config, frozen, "KILLED", reason)
            log.warning("trial %d: %s", frozen.number, reason)

    # --- one trial ------------------------------------------------------------------------------------------------
    def _trial_overrides(self, trial: Any, fixed: list[str], parent: Any) -> list[str]:
        overrides = list(fixed) + [f"{k}={_value_text(v)}" for k, v in trial.params.items()]
        held = held_step(trial.params, self.settings.effective_batch, batching=self.config.trainer.batching)
        held |= segment_steps(trial.params, held, self.settings.segment_micro_batches, self.config.trainer)
        overrides += [f"{key}={value}" for key, value in held.items()]
        if self.settings.coverage_floor > 0:  # its preflight's ways out keep what the sweep requires
            overrides.append(f"preflight.min_coverage={self.settings.coverage_floor:g}")
        if self.settings.budgets:
            overrides.append(f"budget.gib={self.budget_gib:g}")
        overrides.append(f"tracking.run_name=trial-{trial.number}")
        overrides.append("trainer.save_model=none")  # a trial measures; the preset it exports trains the model
        if parent is not None:
            overrides.append(f"tracking.parent_run_id={parent.run_id}")
            overrides.append(f"tracking.run_id={trial.user_attrs['run_id']}")
        return overrides

    # --- the loop -------------------------------------------------------------------------------------------------
    def _run_study(self, space: dict[str, Any], fixed: list[str], earlier: list[Any]) -> dict[str, Any] | None:
        study, store = self._open()
        self._screen_data()
        self._learn_calibrations(study)
        teller = TrialTeller(
            self.settings, self.config, self.objectives, self.budget_gib, self.screen, self.predictor, self.lock
        )
        parent = runs.parent_run(self.config, study, self.budget_gib, self.objectives, self.ladder_run)
        if parent is not None:
            parent.log_text(self.searched.describe(), "search_space.txt")
        try:
            self._recover_interrupted(study, store)
            if earlier:
                from memfit.sweep.ladder import reuse_measurements

                reuse_measurements(study, earlier, teller.limit_gib, self.objectives)
            with progress_bar(f"sweep {study.study_name}", self.settings.n_trials) as show:
                if self.settings.devices:
                    self._run_on_devices(study, teller, space, fixed, parent, show)
                else:
                    self.run_trials(study, teller, space, fixed, parent, show, self.trials)
            view = SweepView.of(self.config, self.objectives, self.budget_gib, self.searched.fixed, self.settings)
            best = summarise(study, view, parent)
            if best is None:
                floor, limit, space = self.settings.coverage_floor, self._limit_gib(), self.searched.space
                self.verdict = verdict.for_study(study.trials, space, self.screen, floor, limit, self.config)
                log.warning("no feasible trial in %d: %s", len(study.trials), self.verdict)
            if parent is not None:
                log_pareto_plot(study, view, parent)
        except BaseException as err:
            if isinstance(err, KeyboardInterrupt):
                self._stop(study, store, err)
            if parent is not None:
                parent.finish("KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED", f"sweep: {err}")
            raise
        if parent is not None:
            parent.finish("FINISHED")
        self.studies.append(study)
        return best

    def run_trials(
        self,
        study: Any,
        teller: TrialTeller,
        space: dict[str, Any],
        fixed: list[str],
        parent: Any,
        show: Any,
        runner: Any,
        device: str | None = None,
    ) -> None:
        """Ask, run and tell until the study (with every worker sharing it) has run n_trials trials, or until the
        sampler only proposes configurations whose outcome is known (it has converged, or the space is
        exhausted). While the rest are other workers' running trials, wait: one whose worker dies is queued again."""
        n_trials = self.settings.n_trials
        patience, told_in_a_row = max(10, n_trials), 0
        while not self.stopping:
            seen = self.told_count
            storage.fail_stale(study, self.settings.heartbeat_s)
            done = storage.trials_run(study)
            show(completed=done, note=_best_text(study, self.objectives))
            retries = storage.waiting_retries(study)  # a killed trial's configuration runs even past n_trials
            if done >= n_trials and not retries:
                break
            running = storage.running(study) if (self.settings.heartbeat_s or self.settings.devices) else 0
            if done + running >= n_trials and not retries:
                self._wait_for_a_trial(seen)
                continue
            free = max(n_trials - done - running, retries)
            count = 1 if device is not None else min(self.settings.n_jobs, free)
            # queued right before the ask that takes it, so that no exit from this loop leaves it WAITING
            filling = teller.queue_fullest_fit(study, space)
            if not filling and told_in_a_row >= proposals.EXPLORE_AFTER and not teller.queue_unexplored(study, space):
                log.info("stopping after %d trials run: every configuration left to try is measured or known", done)
                break
            trials = []
            for trial in [self._ask(study, space) for _ in range(count)]:
                if storage.over_quota(study, trial, n_trials):
                    storage.tell_surplus(study, trial)
                elif not teller.told_without_running(study, trial, parent):
                    trials.append(trial)
            told_in_a_row = 0 if trials else told_in_a_row + count
            if told_in_a_row >= patience:
                log.info(
                    "stopping after %d trials run: the sampler proposed %d known configurations in a row",
                    done,
                    told_in_a_row,
                )
                break
            if trials:
                self._launch_and_tell(study, teller, trials, fixed, parent, runner, device)
        show(completed=storage.trials_run(study), note=_best_text(study, self.objectives))

    def _ask(self, study: Any, space: dict[str, Any]) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Optuna: "heartbeat is supposed to be used with Study.optimize"
            trial = study.ask()
            suggest(trial, space, self.config.trainer.batching, self.settings.effective_batch)
        storage.mark_owner(trial)
        return trial

    def _wait_for_a_trial(self, seen: int) -> None:
        """Wait until this sweeper tells another trial (one that could have been the last, or one killed and queued
        again) or poll_s passes: other workers' trials end without telling this process."""
        with self.told:
            self.told.wait_for(lambda: self.told_count != seen, timeout=self.settings.poll_s)

    def _run_on_devices(
        self, study: Any, teller: TrialTeller, space: dict[str, Any], fixed: list[str], parent: Any, show: Any
    ) -> None:
        """One trial per device at a time, each in a fresh process pinned with CUDA_VISIBLE_DEVICES. A thread per
        device asks, runs and tells on the shared study like a worker of its own, so a device never waits for a
        slower trial on another (no batches)."""
        errors: list[BaseException] = []

        def slot(device: str) -> None:
            try:
                self.run_trials(study, teller, space, fixed, parent, show, self.runners[device], device)
            except BaseException as err:  # noqa: BLE001 - re-raised in the sweeper's thread
                errors.append(err)

        # daemon threads: Ctrl-C ends the sweep, and the trial processes die with it (PR_SET_PDEATHSIG)
        threads = [
            threading.Thread(target=slot, args=(str(d),), name=f"memfit-device-{d}", daemon=True)
            for d in self.settings.devices
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]

    def _launch_and_tell(
        self,
        study: Any,
        teller: TrialTeller,
        trials: list[Any],
        fixed: list[str],
        parent: Any,
        runner: Any,
        device: str | None,
    ) -> None:
        """Run trials (their heartbeats beating meanwhile) and tell each its outcome."""
        if device is not None:
            for trial in trials:
                trial.set_user_attr("device", device)
        children = [runs.child_run(self.config, parent, t) for t in trials]
        batch = [self._trial_overrides(t, fixed, parent) for t in trials]
        with self.lock:  # job directories are numbered across device threads
            first_job, self.job_idx = self.job_idx, self.job_idx + len(batch)
        with storage.beating(trials, self.settings.heartbeat_s):
            results = runner.launch(batch, first_job)
        for trial, result, child in zip(trials, results, children, strict=True):
            teller.tell(study, trial, result, child)
        with self.told:
            self.told_count += len(trials)
            self.told.notify_all()

    def sweep(self, arguments: list[str]) -> list[Any]:
        self.searched = search_space(arguments, dict(self.settings.params or {}), self.config)
        space, fixed = self.searched.space, self.searched.fixed
        check_searched_values(space, fixed, self.config, trials_elsewhere=self.settings.isolation == "launcher")
        self.trials.start()  # the fork server imports while the sweeper opens the study and screens the data
        try:
            if self.searched.to_size:
                self._size_batches()
            log.info("search space:\n%s", self.searched.describe())
            summaries = self._sweep_budgets(space, fixed)
            if not any(summaries) and self.verdict:
                raise verdict.NothingFeasible(self.verdict)
            return summaries
        finally:
            for runner in [self.trials, *self.runners.values()]:
                runner.close()

    def _size_batches(self) -> None:
        """trainer.batch_size: fits: a continued study's choices, else a sizing job at the top budget (sweep.sizing)."""
        budgets = self.settings.budgets
        self.budget_gib = max(budgets) if budgets else self.config.budget.gib
        name = self._study_name()
        recorded = naming.recorded(storage.peek(storage.storage_url(self.settings, self.config)), name)
        if sizing.adopt_recorded(self.searched, recorded, self._measured, name):
            return
        top, held = self.budget_gib if budgets else None, self.settings.effective_batch
        jobs = sizing.sizing_jobs(self.searched.space, self.searched.fixed, top, held)
        first, self.job_idx = self.job_idx, self.job_idx + len(jobs)  # before any trial: no other thread numbers jobs
        self.searched.sized(sizing.size_batches(self.trials, jobs, first))

    def _sweep_budgets(self, space: dict[str, Any], fixed: list[str]) -> list[Any]:
        budgets = sorted(float(b) for b in self.settings.budgets or [])
        if not budgets:
            self.budget_gib = self.config.budget.gib
            return [self._run_study(space, fixed, earlier=[])]
        self.ladder_run = runs.ladder_run(self.config, budgets)
        rows = []
        for budget in budgets:
            self.budget_gib = budget
            rows.append((budget, self._run_study(space, fixed, earlier=list(self.studies))))
        write_ladder(self.config, rows, self.settings.effective_batch, self.ladder_run)
        return [summary for _, summary in rows]
