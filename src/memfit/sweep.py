"""The budget sweep behind hydra/sweeper=memfit: Optuna 5 ask/tell over Hydra's launcher.

Every trial is told to Optuna with its measured worst-case peak minus the budget as a constraint
(`Trial.set_constraint`; > 0 is infeasible), so the sampler learns where memory runs out instead of ignoring
OOM trials as FAIL. A trial that does not fit (preflight, or an OOM in training) is an infeasible COMPLETE trial
carrying its measured or attempted size; only crashes are FAIL. The study lives in a storage URL, so rerunning
the same command resumes it and several workers can share it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("memfit.sweep")

FEASIBLE_STATUSES = ("ok",)
INFEASIBLE_STATUSES = ("preflight_failed", "oom")


def distribution_for(override: Any) -> Any:
    """An Optuna distribution from a Hydra sweep override: choice(...), range(...), interval(...), tag(log, ...)."""
    import optuna.distributions as d
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep

    value = override.value()
    if isinstance(value, ChoiceSweep):
        return d.CategoricalDistribution(list(value.list))
    if isinstance(value, RangeSweep):
        if all(isinstance(x, int) for x in (value.start, value.stop, value.step)):
            last = value.start + ((value.stop - 1 - value.start) // value.step) * value.step
            return d.IntDistribution(value.start, last, step=value.step)
        return d.FloatDistribution(value.start, value.stop, step=value.step)
    if isinstance(value, IntervalSweep):
        log_scale = "log" in value.tags
        if "int" in value.tags or all(isinstance(x, int) for x in (value.start, value.end)):
            return d.IntDistribution(int(value.start), int(value.end), log=log_scale)
        return d.FloatDistribution(value.start, value.end, log=log_scale)
    raise ValueError(f"{override.input_line}: use choice(...), range(...) or interval(...) to search a parameter")


def parse_search(arguments: list[str], params: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
    """(search space, fixed overrides) from the recipe's params and the command line (the command line wins)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    space: dict[str, Any] = {}
    fixed: dict[str, str] = {}
    lines = [f"{k}={v}" for k, v in params.items()] + list(arguments)
    for override in parser.parse_overrides(lines):
        key = override.get_key_element()
        if override.is_sweep_override():
            space[key] = distribution_for(override)
            fixed.pop(key, None)
        else:
            fixed[key] = override.input_line
            space.pop(key, None)
    return space, list(fixed.values())


@dataclass
class TrialOutcome:
    """What the sweeper tells Optuna about one trial."""

    state: str  # complete | fail
    value: float | None
    constraints: dict[str, float]
    attrs: dict[str, Any]

    @property
    def feasible(self) -> bool:
        return self.state == "complete" and all(v <= 0 for v in self.constraints.values())


def outcome_of(
    report: dict[str, Any] | None,
    error: str | None,
    limit_gib: float | None,
    objective: str,
    coverage_floor: float,
    maximize: bool,
) -> TrialOutcome:
    """Turn a run's report (or its exception) into value + constraints. The memory constraint is the measured
    worst-case peak minus the limit the preflight judges by (budget minus margin). Infeasible trials still get a
    value (the worst possible) so that the sampler keeps them as COMPLETE and learns from their constraint."""
    worst_value = 0.0 if maximize else 1e9
    if report is None or report.get("status") not in FEASIBLE_STATUSES + INFEASIBLE_STATUSES:
        reason = error or (report or {}).get("reason") or "no report"
        return TrialOutcome("fail", None, {}, {"status": (report or {}).get("status", "failed"), "reason": reason})
    status = report["status"]
    peak = report.get("worst_case_peak_gib")
    attrs = {
        k: report.get(k)
        for k in (
            "status",
            "reason",
            "worst_case_peak_gib",
            "worst_case_shape",
            "tokens_per_s",
            "label_coverage",
            "final_loss",
            "run_id",
            "max_batch",
        )
    }
    limit_gib = report.get("limit_gib") or limit_gib  # the limit the run's own preflight judged by, when it has one
    memory = (peak - limit_gib) if (peak is not None and limit_gib) else (0.0 if status == "ok" else 1.0)
    if status != "ok":
        memory = max(memory, 1e-3)  # an OOM is infeasible even when no size could be measured
    constraints = {"memory_gib": memory}
    coverage = report.get("label_coverage")
    if coverage_floor > 0 and coverage is not None:
        constraints["coverage"] = coverage_floor - coverage
    if status != "ok":
        return TrialOutcome("complete", worst_value, constraints, attrs)
    value = report.get("tokens_per_s") if objective == "throughput" else report.get("final_loss")
    return TrialOutcome("complete", worst_value if value is None else float(value), constraints, attrs)


def make_sampler(name: str, seed: int | None) -> Any:
    import optuna

    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"hydra.sweeper.sampler={name!r}: use tpe or random")


def _constraint_dict(trial: Any) -> dict[str, float]:
    """A finished trial's constraints by name (Optuna 5 keeps them so)."""
    constraints = trial.constraints or {}
    return dict(constraints) if isinstance(constraints, dict) else {f"c{i}": v for i, v in enumerate(constraints)}


def _constraint_values(trial: Any) -> list[float]:
    return list(_constraint_dict(trial).values())


# Parameters whose growth never lowers peak memory; every other parameter must match for a comparison.
MONOTONE_IN_MEMORY = (
    "trainer.batch_size",
    "memory.max_source_length",
    "memory.max_label_length",
    "memory.eval_batch_size",
)


def dominated_by(params: dict[str, Any], finished: list[Any]) -> Any | None:
    """The measured infeasible trial that `params` is at least as large as in every memory-monotone parameter
    (and equal in all others), if any: such a configuration certainly does not fit either."""
    for other in finished:
        if other.user_attrs.get("status") not in INFEASIBLE_STATUSES or set(other.params) != set(params):
            continue
        if all(
            params[k] >= other.params[k] if k in MONOTONE_IN_MEMORY else params[k] == other.params[k] for k in params
        ):
            return other
    return None


def _value_text(value: Any) -> str:
    return str(value) if not isinstance(value, str) else value


class BudgetSweep:
    def __init__(self, **settings: Any) -> None:
        self.settings = DictConfig(settings) if not isinstance(settings, DictConfig) else settings
        self.config: DictConfig | None = None
        self.launcher: Any = None
        self.job_idx = 0

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    # --- study -----------------------------------------------------------------------------------------------
    def _study(self) -> Any:
        import optuna

        s, cfg = self.settings, self.config
        storage = s.storage or f"sqlite:///{Path(cfg.output_dir).resolve() / 'optuna.db'}"
        if storage.startswith("sqlite:///"):
            Path(storage.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        budget = f"{cfg.budget.gib:g}GiB" if cfg.budget.gib else "nobudget"
        name = s.study_name or f"memfit-{cfg.model.name}-{cfg.data.name}-{budget}"
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(
            study_name=name,
            storage=storage,
            sampler=make_sampler(s.sampler, s.seed),
            direction=s.direction,
            load_if_exists=True,
        )
        from memfit.tracking import mask_credentials

        log.info("study %s in %s: %d trials so far", name, mask_credentials(storage), len(study.trials))
        return study

    def _parent_run(self, study: Any) -> Any:
        cfg = self.config
        if cfg.tracking.backend == "none":
            return None
        from memfit.tracking import open_run

        tags = {
            "memfit.sweep": study.study_name,
            "memfit.model": cfg.model.name,
            "memfit.data": cfg.data.name,
            "memfit.budget_gib": "none" if cfg.budget.gib is None else f"{cfg.budget.gib:g}",
        }
        return open_run(cfg, f"sweep-{study.study_name}", tags)

    # --- one batch of trials ------------------------------------------------------------------------------------
    def _trial_overrides(self, trial: Any, fixed: list[str], parent: Any) -> list[str]:
        overrides = list(fixed) + [f"{k}={_value_text(v)}" for k, v in trial.params.items()]
        effective = self.settings.effective_batch
        batch = trial.params.get("trainer.batch_size")
        if effective and batch and "trainer.gradient_accumulation_steps" not in trial.params:
            overrides.append(f"trainer.gradient_accumulation_steps={math.ceil(effective / batch)}")
        overrides.append(f"tracking.run_name=trial-{trial.number}")
        if parent is not None:
            overrides.append(f"tracking.parent_run_id={parent.run_id}")
        return overrides

    def _tell(self, study: Any, trial: Any, job_return: Any) -> TrialOutcome:
        import optuna
        from hydra.core.utils import JobStatus

        report, error = None, None
        if job_return.status == JobStatus.COMPLETED:
            report = job_return.return_value
        else:
            error = f"{type(job_return._return_value).__name__}: {job_return._return_value}"
        s, budget = self.settings, self.config.budget
        limit = budget.gib - budget.margin_gib if budget.gib else None  # what the preflight judges by
        outcome = outcome_of(report, error, limit, s.objective, s.coverage_floor, s.direction == "maximize")
        for key, value in outcome.attrs.items():
            trial.set_user_attr(key, value)
        for key, value in outcome.constraints.items():
            trial.set_constraint(key, value)
        state = optuna.trial.TrialState.COMPLETE if outcome.state == "complete" else optuna.trial.TrialState.FAIL
        study.tell(trial, outcome.value if outcome.state == "complete" else None, state=state)
        log.info(
            "trial %d %s: %s",
            trial.number,
            "feasible" if outcome.feasible else outcome.attrs.get("status"),
            {k: trial.params[k] for k in trial.params},
        )
        return outcome

    def _told_without_running(self, study: Any, trial: Any) -> bool:
        """A trial that certainly cannot fit (it dominates a measured infeasible trial) is told, not run."""
        import optuna

        blocker = dominated_by(
            trial.params, study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        )
        if blocker is None:
            return False
        trial.set_user_attr("status", "predicted_infeasible")
        trial.set_user_attr("reason", f"at least as large as trial {blocker.number}, which did not fit: not run")
        for key, value in _constraint_dict(blocker).items():
            trial.set_constraint(key, value)
        study.tell(trial, 0.0 if self.settings.direction == "maximize" else 1e9)
        log.info("trial %d not run: it is at least as large as infeasible trial %d", trial.number, blocker.number)
        return True

    def sweep(self, arguments: list[str]) -> list[Any]:
        space, fixed = parse_search(arguments, dict(self.settings.params or {}))
        if not space:
            raise ValueError("the sweep has no search space: give hydra.sweeper.params or choice(...) overrides")
        study = self._study()
        parent = self._parent_run(study)
        done = len([t for t in study.trials if t.state.is_finished()])
        results = []
        try:
            while done < self.settings.n_trials:
                count = min(self.settings.n_jobs, self.settings.n_trials - done)
                trials = [study.ask(space) for _ in range(count)]
                done += count
                trials = [t for t in trials if not self._told_without_running(study, t)]
                if not trials:
                    continue
                batch = [self._trial_overrides(t, fixed, parent) for t in trials]
                returns = self.launcher.launch(batch, initial_job_idx=self.job_idx)
                self.job_idx += len(returns)
                for trial, job_return in zip(trials, returns, strict=True):
                    results.append(self._tell(study, trial, job_return))
            best = self._summarise(study, parent)
        except BaseException as err:
            if parent is not None:
                parent.finish("KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED", f"sweep: {err}")
            raise
        if parent is not None:
            parent.finish("FINISHED")
        return [best]

    # --- results ----------------------------------------------------------------------------------------------
    def _summarise(self, study: Any, parent: Any) -> dict[str, Any] | None:
        import optuna

        feasible = [
            t
            for t in study.trials
            if t.state == optuna.trial.TrialState.COMPLETE and all(c <= 0 for c in _constraint_values(t))
        ]
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        counts = {
            "trials": len(study.trials),
            "feasible": len(feasible),
            "infeasible": len([t for t in study.trials if any(c > 0 for c in _constraint_values(t))]),
            "failed": len([t for t in study.trials if t.state == optuna.trial.TrialState.FAIL]),
        }
        if parent is not None:
            parent.log_metrics({f"sweep/{k}": v for k, v in counts.items()}, step=0)
            self._log_pareto_plot(study, parent)
        if not feasible:
            log.warning(
                "no feasible trial in %d: nothing fits budget.gib=%s in this search space",
                len(study.trials),
                self.config.budget.gib,
            )
            OmegaConf.save(
                OmegaConf.create({"name": study.study_name, **counts, "best": None}),
                sweep_dir / "optimization_results.yaml",
            )
            return None
        pick = max if self.settings.direction == "maximize" else min
        best = pick(feasible, key=lambda t: t.value)
        preset = self._export_preset(study, best)
        summary = {
            "name": study.study_name,
            **counts,
            "best_trial": best.number,
            "best_value": best.value,
            "best_params": best.params,
            "worst_case_peak_gib": best.user_attrs.get("worst_case_peak_gib"),
            "label_coverage": best.user_attrs.get("label_coverage"),
            "preset": str(preset),
        }
        OmegaConf.save(OmegaConf.create(summary), sweep_dir / "optimization_results.yaml")
        if parent is not None:
            parent.log_metrics(
                {
                    "best/value": best.value,
                    "best/worst_case_peak_gib": best.user_attrs.get("worst_case_peak_gib") or 0.0,
                },
                step=0,
            )
            parent.set_tags({"memfit.best_trial": str(best.number), "memfit.preset": str(preset)})
        log.info(
            "best feasible trial %d: %s = %.1f, worst-case peak %.2f GiB, label coverage %.1f%%, params %s; "
            "preset written to %s (load it with: python train.py +preset=%s)",
            best.number,
            self.settings.objective,
            best.value,
            best.user_attrs.get("worst_case_peak_gib") or float("nan"),
            100 * (best.user_attrs.get("label_coverage") or 0),
            best.params,
            preset,
            preset.stem,
        )
        return summary

    def _log_pareto_plot(self, study: Any, parent: Any) -> None:
        """Worst-case peak vs tokens/s for every measured trial, the budget line, label coverage as colour."""
        import tempfile

        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        points = [
            (
                t.user_attrs.get("worst_case_peak_gib"),
                t.user_attrs.get("tokens_per_s") or 0.0,
                t.user_attrs.get("label_coverage") or 0.0,
                t.user_attrs.get("status"),
            )
            for t in study.trials
        ]
        points = [p for p in points if p[0] is not None]
        if not points:
            return
        fig, ax = plt.subplots(figsize=(7, 4.5))
        fits = [p for p in points if p[3] == "ok"]
        misses = [p for p in points if p[3] != "ok"]
        if fits:
            dots = ax.scatter(
                [p[0] for p in fits],
                [p[1] for p in fits],
                c=[p[2] for p in fits],
                cmap="viridis",
                vmin=min(p[2] for p in points),
                vmax=1.0,
                label="trained",
            )
            fig.colorbar(dots, ax=ax, label="label coverage")
        if misses:
            ax.scatter(
                [p[0] for p in misses],
                [0.0] * len(misses),
                marker="x",
                color="#c44e52",
                label="did not fit (no training)",
            )
        budget = self.config.budget
        if budget.gib:
            ax.axvline(budget.gib, color="black", linestyle="--", label=f"budget {budget.gib:g} GiB")
            ax.axvline(budget.gib - budget.margin_gib, color="grey", linestyle=":", label="budget − margin")
        ax.set_xlabel("measured worst-case peak (GiB, reserved)")
        ax.set_ylabel("tokens/s")
        ax.set_title(study.study_name)
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        with tempfile.TemporaryDirectory() as tmp:
            path = f"{tmp}/pareto.png"
            fig.savefig(path, dpi=100)
            parent.log_artifact(path)
        plt.close(fig)

    def _export_preset(self, study: Any, best: Any) -> Path:
        """`# @package _global_` YAML with the best params (and the accumulation it implies) for +preset=<name>."""
        cfg = self.config
        settings = dict(best.params)
        effective = self.settings.effective_batch
        if effective and "trainer.batch_size" in settings and "trainer.gradient_accumulation_steps" not in settings:
            settings["trainer.gradient_accumulation_steps"] = math.ceil(effective / settings["trainer.batch_size"])
        settings["budget.gib"] = cfg.budget.gib
        node = OmegaConf.create()
        for key, value in settings.items():
            OmegaConf.update(node, key, value, force_add=True)
        root = Path(cfg.hydra.runtime.cwd)
        directory = Path(self.settings.preset_dir)
        directory = directory if directory.is_absolute() else root / directory
        directory.mkdir(parents=True, exist_ok=True)
        budget = f"{cfg.budget.gib:g}gib" if cfg.budget.gib else "nobudget"
        path = directory / f"{cfg.model.name}-{cfg.data.name}-{budget}.yaml"
        header = (
            f"# @package _global_\n# Best feasible configuration of study {study.study_name} (trial {best.number}, "
            f"{self.settings.objective} {best.value:.1f}, worst-case peak "
            f"{best.user_attrs.get('worst_case_peak_gib') or float('nan'):.2f} GiB).\n"
            f"# Use: python train.py model={cfg.model.name} data={cfg.data.name} +preset={path.stem}\n"
        )
        path.write_text(header + OmegaConf.to_yaml(node))
        return path
