"""`trainer.batch_size: fits` in a recipe's params: batch choices sized by the memory model before the first trial.

A fixed list of batch sizes is wrong for every model but the one it was written for: too small where memory is
plentiful, mostly over budget where it is not. So the sweeper runs one `estimate_only` job before the study (in a
trial's process, as trials run) at the space's shortest lengths, with the config's other settings and a fixed
batch: its memory model predicts the largest batch that fits the budget there, the most any configuration of the
space can afford. The choices are the powers of two up to that prediction and one past it (the preflight of that
trial decides the boundary; the model may under-predict), never past the job's cap (preflight.max_batch_limit and
the number of training samples: a larger batch repeats samples). The job steps as a batch-1 trial does (its
accumulation held), so the calibration it caches is the one the first trial looks up, not fitted again.

A study records its choices. A rerun, or a worker joining a shared study, searches those rather than sizing again:
a calibration on another device may predict a little differently, and a study's choices cannot change. Searched
knobs other than the lengths are not varied: a knob that saves memory (checkpointing, say) may afford more than
the choices reach. The command line's `trainer.batch_size=choice(...)` wins, as for every key.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.sweep.space import BATCH, BATCHING, SweepConfigError, held_step

log = logging.getLogger("memfit.sweep")

FITS = "fits"  # trainer.batch_size's params value: choices sized by the memory model
LENGTHS = ("memory.max_source_length", "memory.max_label_length")


@dataclass(frozen=True)
class Sizing:
    """What the sizing job found: the largest batch predicted to fit (0: not even batch 1) at these lengths, and
    the cap its search stopped at."""

    largest: int
    cap: int | None
    lengths: dict[str, int]

    def choices(self) -> list[int]:
        """Powers of two up to the largest predicted batch, then one choice past it: the next power of two, or the cap
        where that is nearer."""
        cap = self.cap or 2 * max(self.largest, 1)
        choices, batch = [], 1
        while batch <= min(self.largest, cap):
            choices.append(batch)
            batch *= 2
        if not choices or choices[-1] < cap:
            choices.append(min(batch, cap))
        return choices

    def describe(self) -> str:
        at = ", ".join(f"{key}={value}" for key, value in self.lengths.items()) or "the configured lengths"
        largest = f"{self.largest}" if self.largest else "none (not even batch 1)"
        capped = f", the cap {self.cap}" if self.cap and self.largest >= self.cap else ""
        return f"sized by the memory model: largest batch predicted to fit at {at}: {largest}{capped}"


def sizing_overrides(
    space: dict[str, Any], fixed: list[str], budget_gib: float | None, effective_batch: int | None
) -> list[str]:
    """The sizing job's overrides: the sweep's fixed settings, the space's shortest lengths, a fixed batch of 1 with
    the accumulation a trial of batch 1 holds (so that the calibration it caches is the one trials look up: an
    accumulating step holds gradients during the forward) and the memory model's estimate only, recorded nowhere
    (its findings are in the sweep's log and on its run)."""
    shortest = {key: min(space[key].choices) for key in LENGTHS if key in space and hasattr(space[key], "choices")}
    overrides = [*fixed, *(f"{key}={value}" for key, value in shortest.items())]
    overrides += [f"{BATCH}=1", f"{BATCHING}=fixed", "estimate_only=true", "calibration.enabled=true"]
    held = held_step({BATCH: 1, BATCHING: "fixed"}, effective_batch)
    overrides += [f"{key}={value}" for key, value in held.items()]
    overrides.append("tracking.backend=none")
    if budget_gib is not None:
        overrides.append(f"budget.gib={budget_gib:g}")
    return overrides


def size_batches(runner: Any, overrides: list[str], job: int) -> Sizing:
    """Run the sizing job on `runner` (the sweep's trials) as job number `job`; its finding, or a SweepConfigError
    saying why there is none."""
    (result,) = runner.launch([overrides], job)
    report = result.report or {}
    if report.get("status") != "ok":
        why = report.get("reason") or result.error or "no report"
        raise SweepConfigError(
            f"trainer.batch_size={FITS}: the memory model's sizing run failed ({why.splitlines()[0]}): give "
            "trainer.batch_size=choice(...)"
        )
    lengths = {key: int(o.split("=", 1)[1]) for o in overrides for key in LENGTHS if o.startswith(f"{key}=")}
    sizing = Sizing(int(report.get("max_batch") or 0), report.get("max_batch_cap"), lengths)
    calibration = Path(report.get("calibration") or "none").stem  # the one trials that step alike reuse
    log.info("%s: %s (%.0f s; memory model calibration %s)", BATCH, sizing.describe(), result.seconds, calibration)
    return sizing


def adopt_recorded(
    searched: Any, recorded: dict[str, Any] | None, measured: Callable[[Any], dict[str, Any]], name: str
) -> bool:
    """Take the batch choices study `name` recorded (`recorded`: what it measures, sweep.naming) where, with them,
    this sweep measures exactly what it does: a rerun, or a worker joining a shared study, then searches that study's
    choices whatever its own sizing would find now, and pays no sizing job. `searched`: the sweep's SearchSpace."""
    from optuna.distributions import json_to_distribution

    batch = (recorded or {}).get("space", {}).get(BATCH)
    if batch is None:
        return False
    own = searched.space.get(BATCH)
    searched.space[BATCH] = json_to_distribution(json.dumps(batch))
    if measured(searched) != recorded:
        if own is None:
            del searched.space[BATCH]
        else:
            searched.space[BATCH] = own
        return False
    searched.notes[BATCH] = f"as study {name} recorded them"
    searched.to_size = searched.sized_here = False
    log.info("%s: the choices study %s recorded", BATCH, name)
    return True
