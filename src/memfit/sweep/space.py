"""The search space: Hydra sweep overrides → Optuna distributions, and which configurations certainly cannot fit."""

from __future__ import annotations

import itertools
import math
from typing import Any


class SweepConfigError(ValueError):
    """A sweep setting that cannot work, as one line naming it and the fix (the sweeper exits 2 on it)."""


def distribution_for(override: Any) -> Any:
    """An Optuna distribution from a Hydra sweep override: choice(...), range(...), interval(...), tag(log, ...)."""
    import optuna.distributions as d
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep

    value = override.value()
    line = override.input_line
    if isinstance(value, ChoiceSweep):
        if not value.list:
            raise SweepConfigError(f"{line}: the choice is empty: give at least one value")
        return d.CategoricalDistribution(list(value.list))
    if isinstance(value, RangeSweep):
        if value.step <= 0 or value.stop <= value.start:
            raise SweepConfigError(f"{line}: the range is empty or inverted: write range(low, high) with low < high")
        if all(isinstance(x, int) for x in (value.start, value.stop, value.step)):
            last = value.start + ((value.stop - 1 - value.start) // value.step) * value.step
            return d.IntDistribution(value.start, last, step=value.step)
        return d.FloatDistribution(value.start, value.stop, step=value.step)
    if isinstance(value, IntervalSweep):
        if value.end <= value.start:
            raise SweepConfigError(f"{line}: the interval is empty or inverted: write interval(low, high), low < high")
        log_scale = "log" in value.tags
        if "int" in value.tags or all(isinstance(x, int) for x in (value.start, value.end)):
            return d.IntDistribution(int(value.start), int(value.end), log=log_scale)
        return d.FloatDistribution(value.start, value.end, log=log_scale)
    raise SweepConfigError(f"{line}: use choice(...), range(...) or interval(...) to search a parameter")


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


# Parameters whose growth never lowers peak memory; every other parameter must match for a comparison.
MONOTONE_IN_MEMORY = (
    "trainer.batch_size",
    "memory.max_source_length",
    "memory.max_label_length",
    "memory.eval_batch_size",
)

INFEASIBLE_STATUSES = ("preflight_failed", "oom")


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


def repeat_of(params: dict[str, Any], finished: list[Any]) -> Any | None:
    """The finished trial that already measured exactly `params`, if any: samplers over choice() spaces propose
    a configuration again, and measuring it twice would only spend GPU time on noise."""
    return next((other for other in finished if other.params == params), None)


def held_accumulation(params: dict[str, Any], effective_batch: int | None, batch: int | None = None) -> int | None:
    """Gradient accumulation that holds the effective batch (ceil(effective / batch)) when the trial does not set
    it itself; None where nothing is held (no effective batch, or accumulation is searched)."""
    batch = params.get("trainer.batch_size", batch)
    if not effective_batch or not batch or "trainer.gradient_accumulation_steps" in params:
        return None
    return math.ceil(effective_batch / int(batch))


def configurations(space: dict[str, Any], limit: int = 20_000) -> list[dict[str, Any]] | None:
    """Every configuration of a space of choices and integer ranges; None where a parameter is continuous or the
    space holds more than `limit` configurations (too many to predict one by one)."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    values = []
    for distribution in space.values():
        if isinstance(distribution, CategoricalDistribution):
            values.append(list(distribution.choices))
        elif isinstance(distribution, IntDistribution):  # a log scale changes how it is sampled, not its values
            values.append(list(range(distribution.low, distribution.high + 1, distribution.step)))
        else:
            return None
    if math.prod(len(v) for v in values) > limit:
        return None
    return [dict(zip(space, combination, strict=True)) for combination in itertools.product(*values)]
