"""The space a sweep searches: the recipe's params with the command line's overrides, where a max length given as
`quantiles` becomes choices at the data's own length quantiles (p90, p99, p99.9 and the longest, padded as the
collator pads and capped at the model's limit; a causal LM's prompt and response at half of it each), so that a
sweep on data it has never seen searches lengths that keep its labels. The command line wins, key by key: an
explicit choice(...) or a fixed value is searched or kept as given.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from omegaconf import DictConfig

from memfit.sweep.sizing import FITS
from memfit.sweep.space import BATCH, BATCHING, SweepConfigError, budget_shaped, parse_search

log = logging.getLogger("memfit.sweep")

DERIVED = "quantiles"  # a params value: choices at the data's quantiles
# trainer.batching's params value `auto`: both kinds of batches where trials train on a GPU, where budget-shaped ones
# beat the fixed batch that the worst case allows at every budget measured (1.2-4.9x tokens/s,
# benchmarks/results/budget_batching_*_session46_h200.json); fixed on CPU, where host-memory budgets make a plan of
# probes for little gain
BATCHING_AUTO = "auto"
QUANTILES = (0.9, 0.99, 0.999, 1.0)
RAW = {"memory.max_source_length": "source", "memory.max_label_length": "label"}


@dataclass
class SearchSpace:
    space: dict[str, Any]
    fixed: list[str]
    lengths: Any = None  # sweep.screen.DataLengths, where they were read to derive the space
    derived: dict[str, list[int]] = field(default_factory=dict)
    to_size: bool = False  # trainer.batch_size: fits, its choices still to be sized (sweep.sizing)
    sized_here: bool = False  # sized by this sweep's own job (a shared study's recorded choices win over them)
    notes: dict[str, str] = field(default_factory=dict)  # how a key's choices were made, where the data made them

    def sized(self, sizing: Any) -> None:
        """Batch choices from the memory model's sizing (a sweep.sizing.Sizing)."""
        from optuna.distributions import CategoricalDistribution

        self.space[BATCH] = CategoricalDistribution(sizing.choices())
        self.notes[BATCH] = sizing.describe()
        self.to_size, self.sized_here = False, True

    def describe(self) -> str:
        """The space as the log and the sweep's MLflow run show it, one parameter a line."""
        lines = []
        for key, distribution in self.space.items():
            values = getattr(distribution, "choices", None)
            shown = list(values) if values is not None else repr(distribution)
            how = f" ({self.notes[key]})" if key in self.notes else ""
            lines.append(f"{key}: {shown}{how}")
        return "\n".join(lines)


def length_choices(raw: np.ndarray, multiple: int | None, cap: int) -> list[int]:
    """The data's p90, p99, p99.9 and longest length, each padded up to `multiple` and capped at `cap`."""
    from memfit.data.audit import padded

    values = np.quantile(raw, QUANTILES, method="higher") if len(raw) else [cap]
    return sorted({min(padded(int(v), multiple), cap) for v in values})


def _batching_choice(params: dict[str, Any], config: DictConfig) -> dict[str, Any]:
    """`trainer.batching: auto` in the recipe: choice(fixed,budget) where trials train on a GPU with expandable
    segments (config.validate.expandable_segments_problem), else not searched."""
    if str(params.get(BATCHING)) != BATCHING_AUTO:
        return params
    from memfit.config.validate import expandable_segments_on
    from memfit.memory.policy import resolve_device

    searched = {key: value for key, value in params.items() if key != BATCHING}
    if resolve_device(config) == "cuda" and expandable_segments_on(config.memory):
        searched[BATCHING] = "choice(fixed,budget)"
    else:
        log.info(
            "trainer.batching: %s (budget-shaped batches are searched where trials train on a GPU with "
            "memory.expandable_segments=true)",
            config.trainer.batching,
        )
    return searched


def search_space(arguments: list[str], params: dict[str, Any], config: DictConfig) -> SearchSpace:
    """The recipe's params and the command line (which wins), `quantiles` lengths derived from the data."""
    from omegaconf import read_write
    from optuna.distributions import CategoricalDistribution

    from memfit.config.local_model import resolve_local_model
    from memfit.memory.policy import resolve_batching, resolve_device

    with read_write(config.model):  # model=local: the checkpoint's task and positions, as each trial reads them
        resolve_local_model(config)
    with read_write(config.trainer):  # trainer.batching=auto: what each trial resolves it to where it trains
        resolve_batching(config, resolve_device(config))
    params = _batching_choice(params, config)

    from memfit.sweep.screen import data_lengths

    wanted = [key for key, value in params.items() if str(value) == DERIVED]
    unknown = [key for key in wanted if key not in RAW]
    if unknown:
        raise SweepConfigError(f"{unknown[0]}={DERIVED}: only {' and '.join(RAW)} are derived from the data")
    sized = [key for key, value in params.items() if str(value) == FITS]
    for key in sized:
        if key != BATCH:
            raise SweepConfigError(f"{key}={FITS}: only {BATCH} is sized by the memory model")
    space, fixed = parse_search(arguments, {k: v for k, v in params.items() if k not in wanted and k not in sized})
    given = {line.split("=", 1)[0].lstrip("+~") for line in fixed}
    wanted = [key for key in wanted if key not in space and key not in given]
    found = SearchSpace(space, fixed)
    found.to_size = bool(sized) and BATCH not in space and BATCH not in given and _fixed_batches(space, config)
    if not space and not wanted and not found.to_size:
        raise SweepConfigError(
            "hydra.sweeper.params is empty and no choice(...)/range(...)/interval(...) override was given: "
            "the sweep has nothing to search"
        )
    if not wanted:
        return found
    found.lengths = lengths = data_lengths(space, config)
    if lengths is None:
        raise SweepConfigError(
            f"{wanted[0]}={DERIVED} needs the data's token lengths, which could not be read here (see above): "
            f"give {wanted[0]}=choice(...)"
        )
    positions = config.model.max_positions
    cap = positions if config.model.task == "seq2seq" else positions // 2  # a causal LM's prompt and response share
    for key in wanted:
        choices = length_choices(getattr(lengths, RAW[key]), config.memory.pad_to_multiple_of, cap)
        found.derived[key] = choices
        found.notes[key] = "the data's p90, p99, p99.9, longest"
        space[key] = CategoricalDistribution(choices)
    return found


def _fixed_batches(space: dict[str, Any], config: DictConfig) -> bool:
    """Whether some trial trains fixed batches (budget-shaped ones take the effective batch, not a batch size)."""
    batching = space.get(BATCHING)
    if batching is not None:
        return "fixed" in getattr(batching, "choices", ())
    return not budget_shaped({}, config.trainer.batching)
