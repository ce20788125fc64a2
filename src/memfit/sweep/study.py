"""The budget sweep behind hydra/sweeper=memfit: Optuna 5 ask/tell, one trial per fresh process by default.

Every trial is told to Optuna with its measured worst-case peak minus the budget as a constraint
(`Trial.set_constraint`; > 0 is infeasible), so the sampler learns where memory runs out instead of ignoring OOM
trials as FAIL. The study lives in a storage URL, so rerunning the same command resumes it: trials a killed sweeper
left RUNNING are failed as interrupted, their configuration is queued again, and the MLflow runs are continued,
never duplicated. With `budgets` (the ladder recipe) one command searches several budgets, smallest first, and
each budget starts from what the smaller ones measured.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from memfit.config import limit_gib
from memfit.progress import progress_bar
from memfit.sweep.outcome import (
    TrialOutcome,
    constrain,
    constraint_dict,
    directions,
    is_feasible,
    objective_names,
    outcome_of,
)
from memfit.sweep.owner import HOST, pid_alive
from memfit.sweep.results import ladder_table, log_pareto_plot, summarise
from memfit.sweep.screen import LABEL, coverage_screen, data_lengths
from memfit.sweep.space import (
    SweepConfigError,
    configurations,
    dominated_by,
    held_accumulation,
    parse_search,
    repeat_of,
)
from memfit.sweep.trials import InProcessTrials, ProcessTrials, app_argv, core_sets, standby_hint, trial_env

log = logging.getLogger("memfit.sweep")

# Known configurations the sampler may propose in a row before the sweeper queues one it has not measured. TPE with
# few feasible trials keeps proposing where it has already been told "infeasible" (dominated, below the coverage
# floor, predicted over budget): replayed over measured H200 tables at 16 GiB, 3 of 20 sweeps stopped that way after
# one trial run, with feasible configurations never tried (benchmarks/README.md).
EXPLORE_AFTER = 3
EXPLORE_DRAWS = 200  # random draws looking for a configuration whose outcome is not known yet

# Objectives for which a configuration that fills the budget is worth trying early (fill_budget): tokens/s grows with
# the work a step does, and that work is what fills memory. In the H200 tables of benchmarks/README.md (pegasus_large
# and qwen2.5-1.5B at 16, 24 and 40 GiB) the fitting configuration with the largest worst case was the fastest, or
# within 0.5% of it, in all six.
FILLING_OBJECTIVES = ("throughput", "epoch_throughput")


def make_sampler(name: str, seed: int | None, n_trials: int = 16, n_jobs: int = 1) -> Any:
    """TPE tuned for a few expensive trials: multivariate (batch size and lengths act on memory together), a short
    random start (Optuna's default of 10 random trials would be most of a GPU sweep), and constant liar when
    trials run in parallel, so that concurrent asks do not pile onto one point."""
    import optuna

    if name == "tpe":
        return optuna.samplers.TPESampler(
            seed=seed,
            multivariate=True,
            n_startup_trials=min(10, max(4, n_trials // 4)),
            constant_liar=n_jobs > 1,
        )
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise SweepConfigError(f"hydra.sweeper.sampler={name!r}: use tpe or random")


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
        self.fixed: list[str] = []
        self.studies: list[Any] = []  # finished studies of this command (a ladder's smaller budgets)
        self.ladder_run: Any = None
        self.screen: Any = None  # label coverage per max_label_length, from the data alone (sweep.screen)
        self.predictor: Any = None  # the memory model's predictions, once a trial calibrated it (sweep.predict)
        self.screened = False  # the data is screened once per command, even where it does not apply (None)
        self.space: dict[str, Any] = {}
        self.lock = threading.Lock()
        self.runners: dict[str, Any] = {}
        # trials this sweeper has told after running: a device slot waiting for the others' last trials wakes on it
        self.told = threading.Condition()
        self.told_count = 0

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.config = config
        s = self.settings
        self.objectives = objective_names(s.objective, list(s.pareto or []))
        if s.direction and len(self.objectives) == 1 and s.direction != directions(self.objectives)[0]:
            raise SweepConfigError(
                f"hydra.sweeper.direction={s.direction} contradicts objective={s.objective}, which is "
                f"{directions(self.objectives)[0]}d: drop hydra.sweeper.direction or set it to match"
            )
        if s.isolation == "process":
            sweep_dir = Path(config.hydra.sweep.dir)
            self.trials = ProcessTrials(app_argv(config), sweep_dir, s.trial_timeout_s, trial_env(), s.prestart)
        elif s.isolation in ("launcher", "none"):
            launcher = Plugins.instance().instantiate_launcher(
                hydra_context=hydra_context, task_function=task_function, config=config
            )
            self.trials = InProcessTrials(launcher)
        else:
            raise SweepConfigError(
                f"hydra.sweeper.isolation={s.isolation!r}: use process (fresh process per trial) or launcher "
                "(Hydra's configured launcher, e.g. hydra/launcher=submitit_slurm)"
            )
        if s.devices and s.isolation != "process":
            raise SweepConfigError(
                "hydra.sweeper.devices pins each trial's process to a GPU: it needs hydra.sweeper.isolation=process"
            )
        if s.prestart_ahead < 1:
            raise SweepConfigError(
                f"hydra.sweeper.prestart_ahead={s.prestart_ahead}: keep at least 1 process ahead per slot, or set "
                "hydra.sweeper.prestart=false for none"
            )
        if s.pin_cores and not s.devices:
            raise SweepConfigError(
                "hydra.sweeper.pin_cores gives each device's trials their own cores: it needs hydra.sweeper.devices"
            )
        # one runner per device: a device's trials (and its standby process) see only that GPU (and its cores)
        devices = [str(d) for d in s.devices or []]
        cores = core_sets(len(devices)) if s.pin_cores else None
        if s.pin_cores and cores is None:
            log.warning("hydra.sweeper.pin_cores: fewer cores than devices (or no affinity here): trials not pinned")
        self.runners = {d: self.trials.pinned(d, cores=cores[i] if cores else None) for i, d in enumerate(devices)}

    # --- study and its MLflow parent run ------------------------------------------------------------------------
    def _study_name(self) -> str:
        s, cfg = self.settings, self.config
        budget = f"{self.budget_gib:g}GiB" if self.budget_gib else "nobudget"
        if s.study_name:
            return f"{s.study_name}-{budget}" if s.budgets else s.study_name
        return f"memfit-{cfg.model.name}-{cfg.data.name}-{budget}"

    def _study(self) -> Any:
        import optuna

        from memfit.tracking import mask_credentials

        s, cfg = self.settings, self.config
        storage = s.storage or f"sqlite:///{Path(cfg.output_dir).resolve() / 'optuna.db'}"
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        name = self._study_name()
        try:
            if storage.startswith("sqlite:///"):
                Path(storage.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
            study = self._open_study(name, storage)
        except ValueError as err:  # an existing study with other directions
            raise SweepConfigError(
                f"hydra.sweeper.study_name={name}: {err}; use a new study_name for a different objective"
            ) from None
        except Exception as err:  # SQLAlchemy cannot open the URL: wrong driver, host, credentials, path
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise SweepConfigError(
                f"hydra.sweeper.storage={mask_credentials(storage)} cannot be opened ({mask_credentials(first)[:200]}):"
                " check the URL, the server and its credentials, or leave storage null for sqlite under output_dir"
            ) from None
        log.info("study %s in %s: %d trials so far", name, mask_credentials(storage), len(study.trials))
        return study

    def _open_study(self, name: str, storage: str, attempts: int = 4) -> Any:
        """Create or load the study. Workers that start together on a fresh database race to create Optuna's
        tables (PostgreSQL: duplicate key in pg_type); the losers find them made on the next attempt."""
        import optuna

        s = self.settings
        for attempt in range(attempts):
            try:
                return optuna.create_study(
                    study_name=name,
                    storage=self._storage(storage),
                    sampler=make_sampler(
                        s.sampler, self._worker_seed(storage), s.n_trials, max(s.n_jobs, len(s.devices or []))
                    ),
                    directions=directions(self.objectives),
                    load_if_exists=True,
                )
            except ValueError:
                raise
            except Exception as err:  # noqa: BLE001 - the last attempt's error goes to the caller
                if attempt == attempts - 1 or not any(
                    word in str(err).lower() for word in ("duplicate", "already exists", "unique")
                ):
                    raise
                time.sleep(0.5 + attempt)
        raise AssertionError("unreachable")

    def _worker_seed(self, storage: str) -> int | None:
        """The sampler's seed. On a storage the user named (shared by workers, possibly), each worker mixes in its
        host and process id: workers seeded alike would propose the same configurations. The default sqlite
        study, one worker's, stays reproducible."""
        seed = self.settings.seed
        if seed is None or not self.settings.storage:
            return seed
        import zlib

        return zlib.crc32(f"{seed}:{HOST}:{os.getpid()}".encode())

    def _storage(self, url: str) -> Any:
        """The study's storage. With a heartbeat, a trial whose worker dies (a killed process, a lost machine) is
        failed by any other worker once its heartbeat is `grace` seconds old, and its configuration queued again."""
        heartbeat = self.settings.heartbeat_s
        if not heartbeat:
            return url
        from optuna.storages import RDBStorage

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "experimental feature": heartbeats are Optuna's own pattern since 2.x
            return RDBStorage(
                url,
                heartbeat_interval=max(1, int(heartbeat)),
                grace_period=max(3, int(3 * heartbeat)),
                heartbeat_stale_trial_callback=self._stale_trial,
            )

    def _stale_trial(self, study: Any, frozen: Any) -> None:
        """Optuna failed a trial whose worker stopped beating: close its MLflow run and queue it again (once)."""
        reason = (
            f"killed: its worker stopped (no heartbeat for {3 * self.settings.heartbeat_s:g} s); "
            "its configuration is queued again"
        )
        log.warning("trial %d: %s", frozen.number, reason)
        run_id = frozen.user_attrs.get("run_id")
        if run_id and self.config.tracking.backend != "none":
            from memfit.tracking import open_run

            open_run(self.config, f"trial-{frozen.number}", {}, run_id=run_id).finish("KILLED", reason)
        if not frozen.user_attrs.get("retry_of"):
            study.enqueue_trial(frozen.params, user_attrs={"retry_of": frozen.number, "retry_reason": reason})

    def _parent_run(self, study: Any) -> Any:
        cfg = self.config
        if cfg.tracking.backend == "none":
            return None
        from memfit.tracking import open_run, open_shared_run

        tags = {
            "memfit.sweep": study.study_name,
            "memfit.model": cfg.model.name,
            "memfit.data": cfg.data.name,
            "memfit.budget_gib": "none" if self.budget_gib is None else f"{self.budget_gib:g}",
            "memfit.objective": ",".join(self.objectives),
        }
        if self.ladder_run is not None:
            tags["mlflow.parentRunId"] = self.ladder_run.run_id
        earlier = study.user_attrs.get("mlflow_parent_run_id")  # a resumed study continues its parent run
        if earlier:
            return open_run(cfg, f"sweep-{study.study_name}", tags, run_id=earlier)
        # workers starting together on a new study agree on one parent run
        parent = open_shared_run(cfg, f"sweep-{study.study_name}", tags, key="memfit.sweep")
        study.set_user_attr("mlflow_parent_run_id", parent.run_id)
        return parent

    def _child_run(self, parent: Any, trial: Any) -> Any:
        if parent is None:
            return None
        from memfit.tracking import open_run

        tags = {"mlflow.parentRunId": parent.run_id, "memfit.trial": str(trial.number)}
        if trial.user_attrs.get("explored"):  # queued by the sweeper, not proposed by the sampler (_queue_unexplored)
            tags["memfit.explored"] = "true"
        if trial.user_attrs.get("fills_budget"):  # queued as the fullest predicted fit (_queue_fullest_fit)
            tags["memfit.fills_budget"] = "true"
        child = open_run(self.config, f"trial-{trial.number}", tags)
        child.log_params({f"trial.{k}": v for k, v in trial.params.items()})
        trial.set_user_attr("run_id", child.run_id)
        return child

    # --- recovery: trials a killed sweeper left RUNNING ---------------------------------------------------------
    def _recover_interrupted(self, study: Any, parent: Any) -> None:
        """A RUNNING trial whose sweeper process (on this host) is gone was interrupted: FAIL it with that reason,
        close its MLflow run as KILLED, and queue its configuration again so that it is measured after all."""
        import optuna

        from memfit.tracking import open_run

        for frozen in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            owner = frozen.system_attrs.get("memfit:owner")
            if owner is None or owner[0] != HOST or pid_alive(owner[1]):
                continue  # another live worker's trial (or another host's): not ours to judge
            reason = "interrupted: the sweeper stopped during this trial; its configuration is queued again"
            trial = optuna.trial.Trial(study, frozen._trial_id)
            trial.set_user_attr("status", "interrupted")
            trial.set_user_attr("reason", reason)
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            run_id = frozen.user_attrs.get("run_id")
            if run_id and parent is not None:
                open_run(self.config, f"trial-{frozen.number}", {}, run_id=run_id).finish("KILLED", reason)
            if not frozen.user_attrs.get("retry_of"):
                study.enqueue_trial(frozen.params, user_attrs={"retry_of": frozen.number})
            log.warning("trial %d was interrupted by a stopped sweeper: marked FAIL, queued again", frozen.number)

    # --- one trial ------------------------------------------------------------------------------------------------
    def _trial_overrides(self, trial: Any, fixed: list[str], parent: Any) -> list[str]:
        overrides = list(fixed) + [f"{k}={_value_text(v)}" for k, v in trial.params.items()]
        if (accumulation := held_accumulation(trial.params, self.settings.effective_batch)) is not None:
            overrides.append(f"trainer.gradient_accumulation_steps={accumulation}")
        if self.settings.budgets:
            overrides.append(f"budget.gib={self.budget_gib:g}")
        overrides.append(f"tracking.run_name=trial-{trial.number}")
        if parent is not None:
            overrides.append(f"tracking.parent_run_id={parent.run_id}")
            overrides.append(f"tracking.run_id={trial.user_attrs['run_id']}")
        return overrides

    def _limit_gib(self) -> float | None:
        return limit_gib(self.budget_gib, self.config.budget.margin_gib) if self.budget_gib else None

    def _tell_unless_failed_as_stale(self, study: Any, trial: Any, result: Any, child: Any) -> None:
        """Tell a trial's outcome, unless another worker has already failed it as stale: its heartbeat came late
        (an overloaded host can starve the beating thread), it was failed and queued again, and its retry runs
        it. This worker goes on with the study instead of stopping on Optuna's refusal."""
        from optuna.exceptions import UpdateFinishedTrialError

        try:
            self._tell(study, trial, result, child)
        except UpdateFinishedTrialError:
            log.warning(
                "trial %d: another worker failed it as stale while it ran (no heartbeat for %g s); "
                "its result is dropped and its retry runs it again",
                trial.number,
                3 * (self.settings.heartbeat_s or 0),
            )

    def _tell(self, study: Any, trial: Any, result: Any, child: Any) -> TrialOutcome:
        import optuna

        s = self.settings
        outcome = outcome_of(result.report, result.error, self._limit_gib(), self.objectives, s.coverage_floor)
        outcome.attrs["gpu_seconds"] = result.seconds
        if result.standby_wait_s is not None:  # a prestarted trial process
            outcome.attrs["standby_wait_s"] = result.standby_wait_s
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
        if child is not None:
            self._record_in_mlflow(child, outcome)
        log.info(
            "trial %d %s: %s",
            trial.number,
            "feasible" if outcome.feasible else outcome.attrs.get("status"),
            dict(trial.params),
        )
        return outcome

    def _record_in_mlflow(self, child: Any, outcome: TrialOutcome) -> None:
        """The sweeper's view on the trial's run: objective, constraint, feasibility, status and reason."""
        status = outcome.attrs.get("status") or "failed"
        metrics = {f"trial/{k}_constraint": v for k, v in outcome.constraints.items()}
        metrics["trial/feasible"] = float(outcome.feasible)
        metrics["trial/seconds"] = outcome.attrs["gpu_seconds"]
        for name, value in zip(self.objectives, outcome.values or [], strict=False):
            metrics[f"trial/objective_{name}"] = value
        child.log_metrics(metrics, step=0)
        child.set_tags({"memfit.trial_status": status})
        reason = outcome.attrs.get("reason") or status
        # a process that died (SIGKILL, OOM-killer, timeout) could not end its run: the sweeper does
        child.finish_if_running("FINISHED" if status == "ok" else "KILLED" if "killed" in reason else "FAILED", reason)

    def _screen_data(self) -> None:
        """Read the data's lengths once per command (after the storage opened, so that a bad storage URL is reported
        first): label coverage per label length, and the worst batches the memory model predicts."""
        if self.screened:
            return
        self.screened = True
        s = self.settings
        if s.coverage_floor <= 0 and s.predict_margin is None:
            return
        lengths = data_lengths(self.space, self.config)
        self.screen = coverage_screen(lengths, self.space, self.config, s.coverage_floor)
        if lengths is not None and s.predict_margin is not None:
            from memfit.sweep.predict import MemoryPredictor

            self.predictor = MemoryPredictor(lengths, self.config, s.predict_margin, s.effective_batch)
        if self.screen is not None and LABEL not in self.space and (coverage := self.screen.below_floor({})):
            raise SweepConfigError(
                f"memory.max_label_length={self.screen.fixed_label} keeps {coverage:.2%} of label tokens, below "
                f"hydra.sweeper.coverage_floor={self.settings.coverage_floor:g}, so no trial could be feasible: "
                "search memory.max_label_length with choice(...) or lower the floor"
            )

    def _learn_calibrations(self, study: Any) -> None:
        """Calibrations earlier trials of this study reported (a resumed sweep predicts from them too)."""
        if self.predictor is None:
            return
        for trial in study.trials:
            if trial.state.is_finished() and trial.user_attrs.get("calibration"):
                self.predictor.learn(trial.params, trial.user_attrs["calibration"], trial.number)

    def _known_outcome(
        self, study: Any, params: dict[str, Any], number: int = -1
    ) -> tuple[dict, list | None, dict] | None:
        """(user attrs, values, constraints) of a configuration whose outcome is known without running it: one an
        earlier trial measured, one that certainly cannot fit (it dominates a measured infeasible trial), or one
        whose label length keeps less than the coverage floor (from the data alone), or one the memory model predicts
        far over the budget."""
        import optuna

        complete, running = optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING
        # one read of both: a trial another worker completes between two reads would be in neither
        current = study.get_trials(deepcopy=False, states=(complete, running))
        finished = [t for t in current if t.state == complete]
        # of two workers that ask the same configuration at once, the one with the lower trial number measures it
        measuring = [
            t
            for t in current
            if t.state == running and self._counts_as_run(t) and t.params == params and t.number < number
        ]
        if measuring:
            reason = f"not run: trial {measuring[0].number} (another worker) is measuring this configuration now"
            return {"status": "surplus", "reason": reason}, None, {}
        if (source := repeat_of(params, finished)) is not None:
            reason = f"not run: the same configuration as trial {source.number}, whose measurement it repeats"
            if source.user_attrs.get("reason"):
                reason = f"{reason}; {source.user_attrs['reason']}"
            attrs = {**source.user_attrs, "repeat_of": source.number, "reason": reason}
            # the repeat has no MLflow run of its own, held no device, and the sampler (not the sweeper) proposed it
            for measured_only in ("run_id", "device", "explored", "fills_budget"):
                attrs.pop(measured_only, None)
            return attrs, source.values, constraint_dict(source)
        if (blocker := dominated_by(params, finished)) is not None:
            reason = f"not run: at least as large as trial {blocker.number}, which did not fit"
            return {"status": "predicted_infeasible", "reason": reason}, None, constraint_dict(blocker)
        if self.screen is not None and (coverage := self.screen.below_floor(params)) is not None:
            floor = self.settings.coverage_floor
            reason = (
                f"not run: max_label_length={params.get(LABEL, self.screen.fixed_label)} keeps {coverage:.2%} of label"
                f" tokens, below coverage_floor={floor:g} (length audit of the data)"
            )
            attrs = {"status": "below_coverage_floor", "reason": reason, "label_coverage": coverage}
            return attrs, None, {"memory_gib": 0.0, "coverage": floor - coverage}  # memory: not measured
        if self.predictor is not None and (over := self.predictor.over_budget(params, self.budget_gib)) is not None:
            attrs, constraints = over
            if self.screen is not None:  # the same constraints as measured trials carry
                label = params.get(LABEL, self.screen.fixed_label)
                constraints["coverage"] = self.settings.coverage_floor - self.screen.coverage_of(int(label))
            return attrs, None, constraints
        return None

    def _told_without_running(self, study: Any, trial: Any, parent: Any) -> bool:
        """Tell a trial whose outcome is already known (see _known_outcome) instead of launching it."""
        known = self._known_outcome(study, trial.params, trial.number)
        if known is None:
            return False
        attrs, values, constraints = known
        attrs = {**attrs, "not_run": True, "gpu_seconds": 0.0}  # bookkeeping: not part of n_trials
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        constrain(trial, constraints)
        if attrs["status"] == "surplus":  # another worker measures it: nothing to tell the sampler, no MLflow run
            import optuna

            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            log.info("trial %d not run: %s", trial.number, attrs["reason"].removeprefix("not run: "))
            return True
        child = self._child_run(parent, trial)  # before tell: a finished trial takes no more attributes
        study.tell(trial, values or [0.0 if d == "maximize" else 1e9 for d in directions(self.objectives)])
        if child is not None:
            feasible = is_feasible(study.trials[trial.number])
            child.set_tags({"memfit.trial_status": attrs["status"]})
            child.log_metrics({"trial/feasible": float(feasible), "trial/seconds": 0.0}, step=0)
            child.finish("FINISHED" if feasible else "FAILED", attrs["reason"])
        log.info("trial %d not run: %s", trial.number, attrs["reason"].removeprefix("not run: "))
        return True

    @staticmethod
    def _counts_as_run(trial: Any) -> bool:
        """A trial that ran, runs, or ran and died: not bookkeeping (told without running, carried over from a
        smaller budget of the ladder, or over n_trials)."""
        return "reused_from" not in trial.user_attrs and "not_run" not in trial.user_attrs

    def _new_trials_done(self, study: Any) -> int:
        """Trials this study ran to the end (every worker's): n_trials counts these."""
        return len([t for t in study.trials if t.state.is_finished() and self._counts_as_run(t)])

    def _running(self, study: Any) -> int:
        import optuna

        running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
        return len([t for t in running if self._counts_as_run(t)])

    def _standbys_wanted(self, study: Any, slots: int) -> int:
        """Processes worth starting ahead for `slots` trial slots: prestart_ahead each, but no more than the trials
        still to come beyond those now running (a larger budget of the ladder after this one counts as more)."""
        wanted = slots * self.settings.prestart_ahead
        if self.settings.budgets and self.budget_gib != max(self.settings.budgets):
            return wanted
        to_come = self.settings.n_trials - self._new_trials_done(study) - self._running(study)
        return max(0, min(wanted, to_come))

    @staticmethod
    def _waiting_retries(study: Any) -> int:
        """Configurations queued again after their trial was killed or interrupted, not yet asked for."""
        import optuna

        waiting = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
        return len([t for t in waiting if "retry_of" in t.user_attrs])

    def _over_quota(self, study: Any, trial: Any) -> bool:
        """Trials are numbered in the order the storage created them: a trial with n_trials run (or running) trials
        before it is one too many, asked by one of several workers at the same moment. A retry of a killed trial
        never is: its configuration would otherwise be lost."""
        import optuna

        if "retry_of" in trial.user_attrs:
            return False

        states = (optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)
        earlier = [
            t
            for t in study.get_trials(deepcopy=False, states=states)
            if t.number < trial.number and self._counts_as_run(t)
        ]
        return len(earlier) >= self.settings.n_trials

    def _tell_surplus(self, study: Any, trial: Any) -> None:
        import optuna

        trial.set_user_attr("not_run", True)
        trial.set_user_attr("status", "surplus")
        trial.set_user_attr("reason", "not run: other workers had already taken the study's n_trials")
        study.tell(trial, state=optuna.trial.TrialState.FAIL)

    def _fail_stale(self, study: Any) -> None:
        """Fail other workers' trials whose heartbeat stopped (their configurations are queued again)."""
        if self.settings.heartbeat_s:
            from optuna.storages import fail_stale_trials

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # experimental API warning
                fail_stale_trials(study)

    def _ask(self, study: Any, space: dict[str, Any]) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Optuna: "heartbeat is supposed to be used with Study.optimize"
            trial = study.ask(space)
        trial.storage.set_trial_system_attr(trial._trial_id, "memfit:owner", [HOST, os.getpid()])
        return trial

    def _run_study(self, space: dict[str, Any], fixed: list[str], earlier: list[Any]) -> dict[str, Any] | None:
        study = self._study()
        self._screen_data()
        self._learn_calibrations(study)
        parent = self._parent_run(study)
        try:
            self._recover_interrupted(study, parent)
            if earlier:
                from memfit.sweep.ladder import reuse_measurements

                reuse_measurements(study, earlier, self._limit_gib(), self.objectives)
            with progress_bar(f"sweep {study.study_name}", self.settings.n_trials) as show:
                if self.settings.devices:
                    self._run_on_devices(study, space, fixed, parent, show)
                else:
                    self._run_trials(study, space, fixed, parent, show, self.trials)
            best = summarise(study, self, parent)
            waits = [t.user_attrs["standby_wait_s"] for t in study.trials if "standby_wait_s" in t.user_attrs]
            if hint := standby_hint(waits, self.settings.prestart_ahead):
                log.info(hint)
            if parent is not None:
                log_pareto_plot(study, self, parent)
        except BaseException as err:
            if parent is not None:
                parent.finish("KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED", f"sweep: {err}")
            raise
        if parent is not None:
            parent.finish("FINISHED")
        self.studies.append(study)
        return best

    def _run_trials(
        self,
        study: Any,
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
        while True:
            seen = self.told_count
            self._fail_stale(study)
            done = self._new_trials_done(study)
            show(completed=done, note=_best_text(study, self.objectives))
            retries = self._waiting_retries(study)  # a killed trial's configuration runs even past n_trials
            if done >= n_trials and not retries:
                break
            running = self._running(study) if (self.settings.heartbeat_s or self.settings.devices) else 0
            if done + running >= n_trials and not retries:
                self._wait_for_a_trial(seen)
                continue
            free = max(n_trials - done - running, retries)
            count = 1 if device is not None else min(self.settings.n_jobs, free)
            # queued right before the ask that takes it, so that no exit from this loop leaves it WAITING
            filling = self._queue_fullest_fit(study, space)
            if not filling and told_in_a_row >= EXPLORE_AFTER and not self._queue_unexplored(study, space):
                log.info("stopping after %d trials run: every configuration left to try is measured or known", done)
                break
            trials = []
            for trial in [self._ask(study, space) for _ in range(count)]:
                if self._over_quota(study, trial):
                    self._tell_surplus(study, trial)
                elif not self._told_without_running(study, trial, parent):
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
                self._launch_and_tell(study, trials, fixed, parent, runner, device)
        show(completed=self._new_trials_done(study), note=_best_text(study, self.objectives))

    @staticmethod
    def _pending(study: Any) -> list[dict[str, Any]]:
        """Configurations queued (WAITING: their params are still the fixed ones) or running now."""
        import optuna

        waiting = (optuna.trial.TrialState.WAITING, optuna.trial.TrialState.RUNNING)
        return [t.params or t.system_attrs.get("fixed_params", {}) for t in study.get_trials(False, states=waiting)]

    def _queue_unexplored(self, study: Any, space: dict[str, Any]) -> bool:
        """Queue a configuration drawn at random from the space whose outcome is not known yet (not measured, not
        dominated, not below the coverage floor, not predicted over budget, not queued or running): the next ask
        takes it (another worker's ask may take it first: then that worker runs it), and the sampler learns from its
        result as from any other. False when EXPLORE_DRAWS draws found none: the space is (all but) exhausted."""
        import optuna

        seed = None if self.settings.seed is None else self.settings.seed + len(study.trials)
        draw = optuna.samplers.RandomSampler(seed=seed).sample_independent
        pending = self._pending(study)
        for _ in range(EXPLORE_DRAWS):
            params = {name: draw(study, None, name, distribution) for name, distribution in space.items()}
            if params in pending or self._known_outcome(study, params) is not None:
                continue
            log.info("the sampler keeps proposing configurations whose outcome is known: trying %s next", params)
            study.enqueue_trial(params, user_attrs={"explored": True})
            return True
        return False

    def _queue_fullest_fit(self, study: Any, space: dict[str, Any]) -> bool:
        """For a throughput objective, once the memory model can predict every configuration whose outcome is not
        known yet: queue the one whose worst batch is predicted to fill the most of the budget's limit without
        passing it, for the next ask; up to `fill_budget` such trials per study (a preflight that finds the prediction
        too low makes the next one the next fullest). The sampler learns from them as from its own."""
        s = self.settings
        if not s.fill_budget or self.predictor is None or not self.budget_gib:
            return False
        if len(self.objectives) != 1 or self.objectives[0] not in FILLING_OBJECTIVES:
            return False
        with self.lock:  # device threads of one sweeper queue one each at most, never the same one twice
            # a smaller budget's fill trial, carried over by the ladder, does not count against this study's
            fills = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("fills_budget")]
            if len([t for t in fills if "reused_from" not in t.user_attrs]) >= s.fill_budget:
                return False
            pending = self._pending(study)
            limit, ranked, unpredicted = self._limit_gib(), [], []
            for params in configurations(space) or []:
                if params in pending:
                    continue
                predicted = self.predictor.predicted_gib(params)
                if predicted is None:
                    unpredicted.append(params)
                elif predicted[0] <= limit:
                    ranked.append((predicted[0], params))
            # a part of the space no calibration predicts yet (another policy, or a step without accumulation) may
            # hold a fuller fit: the sampler proposes until a trial there has calibrated it too
            if any(self._known_outcome(study, params) is None for params in unpredicted):
                return False
            ranked.sort(key=lambda row: row[0], reverse=True)
            for gib, params in ranked:
                if self._known_outcome(study, params) is not None:
                    continue
                log.info(
                    "memory model: trying %s next, the fullest predicted fit (%.2f of the %.2f GiB limit)",
                    params,
                    gib,
                    limit,
                )
                study.enqueue_trial(params, user_attrs={"fills_budget": True})
                return True
        return False

    def _wait_for_a_trial(self, seen: int) -> None:
        """Wait until this sweeper tells another trial (one that could have been the last, or one killed and queued
        again) or poll_s passes: other workers' trials end without telling this process."""
        with self.told:
            self.told.wait_for(lambda: self.told_count != seen, timeout=self.settings.poll_s)

    def _run_on_devices(self, study: Any, space: dict[str, Any], fixed: list[str], parent: Any, show: Any) -> None:
        """One trial per device at a time, each in a fresh process pinned with CUDA_VISIBLE_DEVICES. A thread per
        device asks, runs and tells on the shared study like a worker of its own, so a device never waits for a
        slower trial on another (no batches)."""
        errors: list[BaseException] = []

        def slot(device: str) -> None:
            try:
                self._run_trials(study, space, fixed, parent, show, self.runners[device], device)
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
        self, study: Any, trials: list[Any], fixed: list[str], parent: Any, runner: Any, device: str | None
    ) -> None:
        """Run trials (their heartbeats beating meanwhile) and tell each its outcome."""
        from optuna.storages._heartbeat import get_heartbeat_thread

        if device is not None:
            for trial in trials:
                trial.set_user_attr("device", device)
        children = [self._child_run(parent, t) for t in trials]
        batch = [self._trial_overrides(t, fixed, parent) for t in trials]
        beats = [get_heartbeat_thread(t._trial_id, t.storage) for t in trials]
        for beat in beats:
            beat.start()
        with self.lock:  # job directories are numbered across device threads
            first_job, self.job_idx = self.job_idx, self.job_idx + len(batch)
        try:
            results = runner.launch(batch, first_job, standby=self._standbys_wanted(study, len(batch)))
        finally:
            for beat in beats:
                beat.join()
        for trial, result, child in zip(trials, results, children, strict=True):
            self._tell_unless_failed_as_stale(study, trial, result, child)
        with self.told:
            self.told_count += len(trials)
            self.told.notify_all()

    def sweep(self, arguments: list[str]) -> list[Any]:
        space, fixed = parse_search(arguments, dict(self.settings.params or {}))
        self.fixed = fixed  # the preset carries the fixed settings the trials ran with, not only the searched ones
        if not space:
            raise SweepConfigError(
                "hydra.sweeper.params is empty and no choice(...)/range(...)/interval(...) override was given: "
                "the sweep has nothing to search"
            )
        self.space = space
        self._prestart()
        try:
            return self._sweep_budgets(space, fixed)
        finally:
            for runner in [self.trials, *self.runners.values()]:
                runner.close()

    def _prestart(self) -> None:
        """The first trials' processes start their imports now, while the sweeper opens the study and screens the
        data: prestart_ahead per device, or per trial of a batch."""
        ahead, n_trials = self.settings.prestart_ahead, self.settings.n_trials
        if self.runners:
            for runner in self.runners.values():
                runner.keep_ready(min(ahead, n_trials))
        else:
            self.trials.keep_ready(min(self.settings.n_jobs * ahead, n_trials))

    def _sweep_budgets(self, space: dict[str, Any], fixed: list[str]) -> list[Any]:
        budgets = sorted(float(b) for b in self.settings.budgets or [])
        if not budgets:
            self.budget_gib = self.config.budget.gib
            return [self._run_study(space, fixed, earlier=[])]
        self.ladder_run = self._ladder_run(budgets)
        rows = []
        for budget in budgets:
            self.budget_gib = budget
            rows.append((budget, self._run_study(space, fixed, earlier=list(self.studies))))
        table = ladder_table(rows, self.settings.effective_batch)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        (sweep_dir / "ladder.md").write_text(table)
        log.info("budget ladder:\n%s", table)
        print(table)
        if self.ladder_run is not None:
            self.ladder_run.log_text(table, "ladder.md")
            self.ladder_run.finish("FINISHED")
        return [summary for _, summary in rows]

    def _ladder_run(self, budgets: list[float]) -> Any:
        cfg = self.config
        if cfg.tracking.backend == "none":
            return None
        from memfit.tracking import open_run

        name = f"ladder-{cfg.model.name}-{cfg.data.name}-" + "-".join(f"{b:g}" for b in budgets) + "GiB"
        return open_run(cfg, name, {"memfit.ladder": ",".join(f"{b:g}" for b in budgets)})
