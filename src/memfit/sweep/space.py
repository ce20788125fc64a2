"""The search space: Hydra sweep overrides → Optuna distributions, and which configurations certainly cannot fit."""

from __future__ import annotations

import itertools
import math
from typing import Any


class SweepConfigError(ValueError):
    """A sweep setting that cannot work, as one line naming it and the fix (the sweeper exits 2 on it)."""


def distribution_for(override: Any) -> Any:
    """An Optuna distribution from a Hydra sweep override: choice(...), range(...), interval(...), tag(log, ...)."""
    try:
        return _distribution(override)
    except ValueError as err:  # Optuna's own checks, e.g. a log scale over values <= 0
        if isinstance(err, SweepConfigError):
            raise
        raise SweepConfigError(f"{override.input_line}: {str(err).rstrip('.')}: fix the bounds") from None


def _distribution(override: Any) -> Any:
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

INFEASIBLE_STATUSES = ("preflight_failed", "oom", "over_budget")


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


BATCH, ACCUMULATION, BATCHING = "trainer.batch_size", "trainer.gradient_accumulation_steps", "trainer.batching"
# the batch plan's knobs: they change a trial only where its batches are budget-shaped (trainer.batching=budget)
PLAN_KNOBS = (
    "trainer.micro_batch_fill",
    "trainer.max_micro_batch",
    "trainer.length_buckets",
    "trainer.pad_tolerance",
    "trainer.effective_batch",
)


def budget_shaped(params: dict[str, Any], batching: str = "fixed") -> bool:
    """Whether a trial packs budget-shaped micro-batches: searched, or the configured `batching`."""
    return str(params.get(BATCHING, batching)) == "budget"


def applies(key: str, drawn: dict[str, Any], batching: str, effective_batch: int | None) -> bool:
    """Whether a searched parameter changes a trial, given those drawn before it: the plan's knobs only where
    batches are budget-shaped, and the batch size only where they are fixed or no effective batch is held (a
    budget-shaped step is the effective batch, which the plan cuts into micro-batches itself)."""
    shaped = budget_shaped(drawn, batching)
    if key in PLAN_KNOBS:
        return shaped
    if key == BATCH:
        return not (shaped and effective_batch)
    return True


def search_order(space: dict[str, Any]) -> list[str]:
    """The space's keys, the batching mode first: what applies depends on it."""
    return sorted(space, key=lambda key: key != BATCHING)


def relevant(params: dict[str, Any], batching: str, effective_batch: int | None) -> dict[str, Any]:
    """`params` without the ones that do not change the trial (`applies`): one configuration, one set of params."""
    drawn: dict[str, Any] = {}
    for key in search_order(params):
        if applies(key, drawn, batching, effective_batch):
            drawn[key] = params[key]
    return drawn


def suggest(trial: Any, space: dict[str, Any], batching: str, effective_batch: int | None) -> dict[str, Any]:
    """Draw the searched parameters that apply to this trial (define-by-run: a fixed trial is not given the plan's
    knobs, a budget-shaped one not the batch size), the batching mode first. Enqueued values are taken as given."""
    import optuna.distributions as d

    drawn: dict[str, Any] = {}
    for key in search_order(space):
        if not applies(key, drawn, batching, effective_batch):
            continue
        dist = space[key]
        if isinstance(dist, d.CategoricalDistribution):
            try:
                drawn[key] = trial.suggest_categorical(key, dist.choices)
            except ValueError as err:  # a study from before studies recorded their space (sweep.naming)
                raise SweepConfigError(
                    f"{key}: study {trial.study.study_name} searched other choices for it ({err}): give "
                    "hydra.sweeper.study_name a new name, or rerun with the study's own choices"
                ) from None
        elif isinstance(dist, d.IntDistribution):
            drawn[key] = trial.suggest_int(key, dist.low, dist.high, step=dist.step, log=dist.log)
        else:
            step = None if dist.log else dist.step
            drawn[key] = trial.suggest_float(key, dist.low, dist.high, step=step, log=dist.log)
    return drawn


def held_step(
    params: dict[str, Any], effective_batch: int | None, batch: int | None = None, batching: str = "fixed"
) -> dict[str, int]:
    """The settings that hold the effective batch where a trial does not set them itself: a budget-shaped trial that
    does not search the batch size steps over the effective batch as one Trainer batch (its plan cuts it into
    micro-batches); otherwise accumulation = ceil(effective / batch). Empty where nothing is held (no effective
    batch, or accumulation is searched)."""
    if not effective_batch or ACCUMULATION in params:
        return {}
    if BATCH not in params and budget_shaped(params, batching):
        return {BATCH: effective_batch, ACCUMULATION: 1}
    batch = params.get(BATCH, batch)
    return {ACCUMULATION: math.ceil(effective_batch / int(batch))} if batch else {}


MAX_STEPS = "trainer.max_steps"
MIN_SEGMENT_STEPS = 3  # the first step warms up; the step-time model and the rate's spread need two more


def segment_steps(
    params: dict[str, Any], held: dict[str, int], micro_batches: int | None, trainer: Any
) -> dict[str, int]:
    """hydra.sweeper.segment_micro_batches: a fixed-batch trial's timed segment as the optimizer steps that hold
    about that many micro-batches (at least MIN_SEGMENT_STEPS, at most the configured trainer.max_steps), so that
    a small batch with many accumulation steps does not time ten steps of them. `held`: what held_step sets;
    `trainer`: the trainer config (max_steps, gradient_accumulation_steps, batching). Empty where not set, where
    the trial sets trainer.max_steps itself, or where batches are budget-shaped (a step's micro-batches are the
    plan's)."""
    if not micro_batches or MAX_STEPS in params or budget_shaped(params, trainer.batching) or trainer.max_steps <= 0:
        return {}
    per_step = int(params.get(ACCUMULATION, held.get(ACCUMULATION, trainer.gradient_accumulation_steps)))
    return {MAX_STEPS: min(trainer.max_steps, max(MIN_SEGMENT_STEPS, math.ceil(micro_batches / per_step)))}


def configurations(
    space: dict[str, Any], limit: int = 20_000, batching: str = "fixed", effective_batch: int | None = None
) -> list[dict[str, Any]] | None:
    """Every configuration of a space of choices and integer ranges, each with only the params that apply to it
    (`relevant`); None where a parameter is continuous or the space holds more than `limit` configurations (too
    many to predict one by one)."""
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
    found: dict[tuple, dict[str, Any]] = {}  # insertion-ordered, one entry per configuration
    for combination in itertools.product(*values):
        params = relevant(dict(zip(space, combination, strict=True)), batching, effective_batch)
        found.setdefault(tuple(params.items()), params)
    return list(found.values())
