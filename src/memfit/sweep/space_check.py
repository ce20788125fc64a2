"""Every searched value checked as a run checks its config, before any trial: a value that no trial could run
(a batch of 0, a length past the model's positions, a knob this machine cannot run) is a one-line SweepConfigError
naming it, not a failed trial found minutes later."""

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
    (`fixed`: the sweep's fixed overrides, which every trial applies). `trials_elsewhere`: trials run on other
    machines (Hydra's launcher), so a knob that needs CUDA is not judged by this one's."""
    from memfit.config import ConfigError, validate

    base = _job_config(config, fixed)
    for key, distribution in space.items():
        for value in searched_values(distribution):
            cfg = base.copy()
            OmegaConf.update(cfg, key, value, merge=False)
            try:
                validate(cfg, cuda_available=True if trials_elsewhere else None)
            except ConfigError as err:
                mine = [problem for problem in err.problems if f"{key}=" in problem]
                if mine:
                    raise SweepConfigError(f"{key}={value} is searched, but no trial can run it: {mine[0]}") from None


def _job_config(config: DictConfig, fixed: list[str]) -> DictConfig:
    """The job's config as a trial composes it, less what the search draws."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    cfg = config.copy()
    with_hydra = "hydra" in cfg
    OmegaConf.set_struct(cfg, False)
    if with_hydra:
        cfg.pop("hydra")
    for override in OverridesParser.create().parse_overrides(fixed):
        key = override.get_key_element().lstrip("+~")
        # a group's choice (model=..., tracking=...) is composed into the config already; a value may not be
        if not override.is_delete() and not OmegaConf.is_config(OmegaConf.select(cfg, key)):
            OmegaConf.update(cfg, key, override.value(), merge=False)
    return cfg
