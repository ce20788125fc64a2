"""Every searched value checked as a run checks its config, before any trial: a value that no trial could run
(a batch of 0, a length past the model's positions, a knob this machine cannot run), or a fixed setting that every
trial would stop on, is a one-line SweepConfigError naming it, not failed trials found minutes later."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from memfit.sweep.space import SweepConfigError


def searched_values(distribution: Any) -> list[Any]:
    """The values a distribution can draw that a check can stand for: every choice, a range's two ends."""
    from optuna.distributions import CategoricalDistribution

    if isinstance(distribution, CategoricalDistribution):
        return list(distribution.choices)
    return [distribution.low, distribution.high]


def check_searched_values(
    space: dict[str, Any], fixed: list[str], config: DictConfig, trials_elsewhere: bool = False
) -> None:
    """Raise on the first searched value the run's validation rejects, with the other settings as configured
    (`fixed`: the sweep's fixed overrides, which every trial applies), then on a problem no searched value touches.
    `trials_elsewhere`: trials run on other machines (Hydra's launcher), so a knob that needs CUDA is not judged by
    this one's. A config group's options (memory=choice(balanced,tight)) are left to the trials that compose them."""
    base = _job_config(config, fixed)
    values = {key: searched_values(d) for key, d in space.items() if not _composed_by_trials(base, key)}
    for key, choices in values.items():
        for value in choices:
            mine = [p for p in _problems(base, {key: value}, trials_elsewhere) if f"{key}=" in p]
            if mine:
                raise SweepConfigError(f"{key}={value} is searched, but no trial can run it: {mine[0]}")
    if len(values) < len(space):
        return  # a group's options may change any setting: what every trial shares is not known here
    first = {key: choices[0] for key, choices in values.items()}
    shared = [p for p in _problems(base, first, trials_elsewhere) if not any(f"{k}=" in p for k in values)]
    if shared:
        raise SweepConfigError(f"{shared[0]} (every trial would stop on it)")


def _composed_by_trials(base: DictConfig, key: str) -> bool:
    return key.startswith(("+", "~", "hydra")) or OmegaConf.is_config(OmegaConf.select(base, key))


def _problems(base: DictConfig, values: dict[str, Any], trials_elsewhere: bool) -> list[str]:
    from memfit.config import ConfigError, validate

    cfg = base.copy()
    for key, value in values.items():
        OmegaConf.update(cfg, key, value, merge=False)
    try:
        validate(cfg, cuda_available=True if trials_elsewhere else None)
    except ConfigError as err:
        return list(err.problems)
    return []


def _job_config(config: DictConfig, fixed: list[str]) -> DictConfig:
    """The job's config as a trial composes it, less what the search draws."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    cfg = config.copy()
    OmegaConf.set_struct(cfg, False)
    if "hydra" in cfg:
        cfg.pop("hydra")
    absent = object()
    for override in OverridesParser.create().parse_overrides(fixed):
        key = override.get_key_element()
        current = OmegaConf.select(cfg, key, default=absent)
        # a setting's value; not a group's choice (model=..., sweep=budget), composed into the config already
        if not override.is_delete() and current is not absent and not OmegaConf.is_config(current):
            OmegaConf.update(cfg, key, override.value(), merge=False)
    return cfg
