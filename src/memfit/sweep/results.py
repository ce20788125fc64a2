"""What a finished budget sweep leaves behind: optimization_results.yaml, the best configuration as a preset,
the Pareto plot on the parent MLflow run, and for a ladder one summary table over all budgets."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from memfit.config import limit_gib
from memfit.sweep import ties
from memfit.sweep.outcome import constraint_dict, directions, is_feasible
from memfit.sweep.space import ACCUMULATION, BATCH, held_step

log = logging.getLogger("memfit.sweep")

# Near the limit, the worst case measured in separate processes varies: by up to ±0.2 GiB of a 23.5 GiB limit on a
# GPU (benchmarks/results/sweep_live_qwen2_5_1_5b_24_efficient.json), by a few MB of host RSS on CPU. A best trial
# closer to its limit than this share of it may be refused by the preflight of a later run from its preset.
NEAR_LIMIT_SHARE = 0.01


@dataclass(frozen=True)
class SweepView:
    """What a study's results are read against, fixed when it ends (the sweeper's state is not read)."""

    config: DictConfig
    objectives: tuple[str, ...]
    budget_gib: float | None
    fixed: tuple[str, ...]  # the fixed overrides the trials ran with, which the preset carries
    effective_batch: int | None
    preset_dir: str | None  # null: the sweep directory's preset/
    export_to: str | None = None  # also copied here (sweeps/preset: +preset=<name> from the launch directory)
    tie_band: float | None = None  # hydra.sweeper.tie_band (sweep.ties)

    @classmethod
    def of(cls, config: DictConfig, objectives: Any, budget_gib: float | None, fixed: Any, s: Any) -> SweepView:
        """The view of a study run with the sweeper settings `s` (hydra.sweeper)."""
        return cls(
            config,
            tuple(objectives),
            budget_gib,
            tuple(fixed),
            s.effective_batch,
            s.preset_dir,
            s.export_to,
            s.tie_band,
        )


def _dominates(a: list[float], b: list[float], dirs: list[str]) -> bool:
    better = [(x >= y) if d == "maximize" else (x <= y) for x, y, d in zip(a, b, dirs, strict=True)]
    strictly = [(x > y) if d == "maximize" else (x < y) for x, y, d in zip(a, b, dirs, strict=True)]
    return all(better) and any(strictly)


def pareto_front(trials: list[Any], dirs: list[str]) -> list[Any]:
    """The feasible trials no other feasible trial beats in every objective."""
    return [t for t in trials if not any(_dominates(o.values, t.values, dirs) for o in trials if o is not t)]


def _counts(study: Any) -> dict[str, int]:
    import optuna

    return {
        "trials": len(study.trials),
        "feasible": len([t for t in study.trials if is_feasible(t)]),
        "infeasible": len([t for t in study.trials if any(c > 0 for c in constraint_dict(t).values())]),
        "failed": len([t for t in study.trials if t.state == optuna.trial.TrialState.FAIL]),
    }


def _describe(trial: Any, names: list[str]) -> dict[str, Any]:
    return {
        "trial": trial.number,
        "values": dict(zip(names, trial.values, strict=True)),
        "params": trial.params,
        "worst_case_peak_gib": trial.user_attrs.get("worst_case_peak_gib"),
        "tokens_per_s": trial.user_attrs.get("tokens_per_s"),
        "epoch_tokens_per_s": trial.user_attrs.get("epoch_tokens_per_s"),
        "label_coverage": trial.user_attrs.get("label_coverage"),
    }


def _headroom_gib(trial: Any) -> float | None:
    """How far under the limit it was judged by a trial's measured worst case lies (GiB); None where not measured."""
    gap = constraint_dict(trial).get("memory_gib")
    if trial.user_attrs.get("worst_case_peak_gib") is None or gap is None:
        return None
    return -gap


def near_limit_warning(best: Any, feasible: list[Any], dirs: list[str]) -> str | None:
    """A warning where the best trial's worst case lies within NEAR_LIMIT_SHARE of its limit, naming the best trial
    with more headroom; None otherwise."""
    headroom = _headroom_gib(best)
    if headroom is None:
        return None
    peak = best.user_attrs["worst_case_peak_gib"]
    enough = NEAR_LIMIT_SHARE * (peak + headroom)  # of the limit
    if headroom >= enough:
        return None
    text = (
        f"trial {best.number}'s worst case ({peak:.3f} GiB) is {headroom:.3f} GiB under its {peak + headroom:.2f} GiB "
        f"limit, within {NEAR_LIMIT_SHARE:.0%} of it: measured again in another process it can come out over, and a "
        "run from this preset then stops at its preflight"
    )
    safer = [t for t in feasible if (h := _headroom_gib(t)) is not None and h >= enough]
    if safer:
        alternative = (max if dirs[0] == "maximize" else min)(safer, key=lambda t: t.values[0])
        text += (
            f"; the best with more headroom is trial {alternative.number} ({alternative.params}, worst case "
            f"{alternative.user_attrs['worst_case_peak_gib']:.3f} GiB, objective {alternative.values[0]:.4g})"
        )
    return text


def _log_best(best: Any, names: list[str], preset: Preset, results_path: Path, front: int, why: str) -> None:
    """The line a user reads at the end of a sweep."""
    log.info(
        "best feasible trial %d: %s = %s, worst-case peak %.2f GiB, %.0f tokens/s, label coverage %.1f%%, "
        "params %s%s; preset written to %s (train from it with: %s)%s",
        best.number,
        names[0],
        f"{best.values[0]:.4g}",
        best.user_attrs.get("worst_case_peak_gib") or float("nan"),
        best.user_attrs.get("tokens_per_s") or 0.0,
        100 * (best.user_attrs.get("label_coverage") or 0),
        best.params,
        why,
        preset.path,
        preset.use,
        f"; Pareto front of {front} trials in {results_path}" if len(names) > 1 else "",
    )


def summarise(study: Any, view: SweepView, parent: Any) -> dict[str, Any] | None:
    """optimization_results.yaml, the preset of the best feasible trial, the log line a user reads at the end."""
    names = list(view.objectives)
    dirs = directions(names)
    feasible = [t for t in study.trials if is_feasible(t)]
    sweep_dir = Path(view.config.hydra.sweep.dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    counts = _counts(study)
    results_path = sweep_dir / f"optimization_results-{study.study_name}.yaml"
    if parent is not None:
        parent.log_metrics({f"sweep/{k}": v for k, v in counts.items()}, step=0)
    if not feasible:  # the sweeper says which constraint binds (sweep.verdict)
        OmegaConf.save(OmegaConf.create({"name": study.study_name, **counts, "best": None}), results_path)
        _link_latest(results_path)
        return None
    front = pareto_front(feasible, dirs)
    # one objective: the fastest, or a tie keeping more of the data; pareto mode: the front's best in the first
    chosen = ties.pick(feasible if len(names) == 1 else front, names, view.tie_band)
    best = chosen.best
    preset = export_preset(study, best, view)
    summary = {
        "name": study.study_name,
        "budget_gib": view.budget_gib,
        "objectives": names,
        **counts,
        "best_trial": best.number,
        "best_value": best.values[0],
        "best_params": best.params,
        "fastest_trial": chosen.fastest.number,  # the best value measured; sweep.ties says why another may be picked
        "tie_band": chosen.band,
        "worst_case_peak_gib": best.user_attrs.get("worst_case_peak_gib"),
        "headroom_gib": _headroom_gib(best),
        "tokens_per_s": best.user_attrs.get("tokens_per_s"),
        "epoch_tokens_per_s": best.user_attrs.get("epoch_tokens_per_s"),
        "label_coverage": best.user_attrs.get("label_coverage"),
        "preset": str(preset.path),
        "use": preset.use,
    }
    if len(names) > 1:
        summary["pareto_front"] = [_describe(t, names) for t in front]
    OmegaConf.save(OmegaConf.create(summary), results_path)
    _link_latest(results_path)
    if parent is not None:
        parent.log_metrics(
            {
                "best/value": best.values[0],
                "best/worst_case_peak_gib": best.user_attrs.get("worst_case_peak_gib") or 0.0,
            },
            step=0,
        )
        parent.set_tags({"memfit.best_trial": str(best.number), "memfit.preset": str(preset.path)})
        parent.log_artifact(str(results_path))
    _log_best(best, names, preset, results_path, len(front), chosen.describe())
    if warning := near_limit_warning(best, feasible, dirs):
        log.warning(warning)
    return summary


def _link_latest(path: Path) -> None:
    """optimization_results.yaml: the name Hydra's Optuna sweeper users look for, for the last study."""
    (path.parent / "optimization_results.yaml").write_text(path.read_text())


# Fixed overrides that shape memory and belong in a preset; how long a trial trained does not.
PRESET_PREFIXES = ("memory.", "trainer.", "model.", "budget.", "preflight.")
NOT_IN_PRESET = (
    "trainer.max_steps",
    "trainer.num_train_epochs",
    "trainer.max_train_tokens",
    "trainer.device",
    "trainer.seed",
    "budget.gib",
)


NOT_ON_USE_LINE = ("sweep", "output_dir", "preflight_only", "tracking")


def preset_settings(fixed: list[str]) -> tuple[dict[str, Any], list[str]]:
    """(dotted settings for the preset, group choices and data settings for its Use line) from the sweep's fixed
    overrides."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    settings, groups = {}, []
    for override in OverridesParser.create().parse_overrides(fixed):
        key = override.key_or_group
        if key in NOT_ON_USE_LINE or key.startswith("hydra"):
            continue  # where results go and how trials launch: not the configuration the preset holds
        if "." not in key:
            groups.append(override.input_line)  # model=..., memory=tight: named on the Use line
        elif key.startswith("data.") and key not in ("data.max_train_samples", "data.max_eval_samples"):
            groups.append(override.input_line)  # data.path=...: the data the sweep measured
        elif key.startswith(PRESET_PREFIXES) and key not in NOT_IN_PRESET:
            settings[key] = override.value()
    return settings, groups


@dataclass(frozen=True)
class Preset:
    path: Path  # where it was written (beside the sweep's outputs)
    use: str  # the command that trains from it, as printed


def write_keeping_other(path: Path, text: str) -> None:
    """Write `text` at `path`; a different file already there is kept under its date, and said."""
    if path.exists() and path.read_text() != text:
        stamp = datetime.fromtimestamp(path.stat().st_mtime).strftime("%Y%m%d-%H%M%S")
        kept = path.with_name(f"{path.stem}-{stamp}{path.suffix}")
        path.rename(kept)
        log.warning("%s held another preset: kept as %s", path, kept.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def use_command(path: Path, groups: list[str], cfg: Any) -> str:
    """`python train.py <model, data> +preset=<name>`: from the launch directory where the preset is in its
    sweeps/preset/ (train.yaml's search path), else with --config-dir naming where it is."""
    root = Path(cfg.hydra.runtime.cwd)
    named = " ".join(_use_groups(groups, cfg))
    if path.parent.resolve() == (root / "sweeps" / "preset").resolve():
        return f"python train.py {named} +preset={path.stem}"
    return f"python train.py --config-dir {path.parent.parent} {named} +{path.parent.name}={path.stem}"


def _under(root: Path, directory: str) -> Path:
    return Path(directory) if Path(directory).is_absolute() else root / directory


def export_preset(study: Any, best: Any, view: SweepView) -> Preset:
    """`# @package _global_` YAML with the settings the best trial ran with: the fixed memory settings of the
    command line, the searched params and the accumulation they imply, and the budget; for +preset=<name>. Written
    to the sweep directory's preset/ (or hydra.sweeper.preset_dir), and copied to hydra.sweeper.export_to where set."""
    cfg = view.config
    settings, groups = preset_settings(list(view.fixed))
    settings.update(best.params)
    settings.update(held_step(settings, view.effective_batch, batching=cfg.trainer.batching))
    settings["budget.gib"] = view.budget_gib
    node = OmegaConf.create()
    for key, value in settings.items():
        OmegaConf.update(node, key, value, force_add=True)
    root = Path(cfg.hydra.runtime.cwd)
    budget = f"{view.budget_gib:g}gib" if view.budget_gib else "nobudget"
    name = f"{cfg.model.name}-{cfg.data.name}-{budget}.yaml"
    path = _under(root, view.preset_dir or f"{cfg.hydra.sweep.dir}/preset") / name
    exported = _under(root, view.export_to) / name if view.export_to else None
    use = use_command(exported or path, groups, cfg)
    header = (
        f"# @package _global_\n# Best feasible configuration of study {study.study_name} (trial {best.number}, "
        f"{view.objectives[0]} {best.values[0]:.4g}, worst-case peak "
        f"{best.user_attrs.get('worst_case_peak_gib') or float('nan'):.2f} GiB).\n"
        f"# Use: {use}\n"
    )
    text = header + OmegaConf.to_yaml(node)
    write_keeping_other(path, text)
    if exported is not None:
        write_keeping_other(exported, text)
    return Preset(path, use)


def _use_groups(groups: list[str], cfg: Any) -> list[str]:
    """model=..., data=..., then the rest of the groups and data settings the sweep ran with."""
    named = {g.split("=", 1)[0]: g for g in groups}
    first = [named.get("model", f"model={cfg.model.name}"), named.get("data", f"data={cfg.data.name}")]
    return first + [g for g in groups if g.split("=", 1)[0] not in ("model", "data")]


def ladder_table(
    rows: list[tuple[float, dict[str, Any] | None]], effective_batch: int | None, fixed: dict[str, Any] | None = None
) -> str:
    """Markdown: budget → batch, accumulation, lengths, worst-case peak, tokens/s, coverage, preset. `fixed`: the
    values of settings the sweep did not search (a fixed max source length is a column too)."""
    lines = [
        "| budget GiB | batch | accumulation | max source | max label | worst-case peak GiB | tokens/s "
        "| label coverage | preset |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for budget, summary in rows:
        if summary is None:
            lines.append(f"| {budget:g} | nothing fits | | | | | | | |")
            continue
        params = {**(fixed or {}), **summary["best_params"]}
        params.update(held_step(params, effective_batch))
        batch, accumulation = params.get(BATCH, ""), params.get(ACCUMULATION)
        lines.append(
            f"| {budget:g} | {batch} | {accumulation or ''} | {params.get('memory.max_source_length', '')} "
            f"| {params.get('memory.max_label_length', '')} | {summary['worst_case_peak_gib'] or float('nan'):.2f} "
            f"| {summary['tokens_per_s'] or 0:.0f} | {100 * (summary['label_coverage'] or 0):.1f}% "
            f"| {Path(summary['preset']).stem} |"
        )
    return "\n".join(lines) + "\n"


def log_pareto_plot(study: Any, view: SweepView, parent: Any) -> None:
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
            [p[0] for p in misses], [0.0] * len(misses), marker="x", color="#c44e52", label="did not fit (no training)"
        )
    if view.budget_gib:
        limit = limit_gib(view.budget_gib, view.config.budget.margin_gib)
        ax.axvline(view.budget_gib, color="black", linestyle="--", label=f"budget {view.budget_gib:g} GiB")
        ax.axvline(limit, color="grey", linestyle=":", label="budget − margin")
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
