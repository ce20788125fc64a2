"""`trainer.batch_size: fits` in a recipe's params: batch choices sized by the memory model before the first trial.

A fixed list of batch sizes is wrong for every model but the one it was written for: too small where memory is
plentiful, mostly over budget where it is not. So the sweeper runs one `estimate_only` job before the study (in a
trial's process, as trials run) at the space's shortest lengths, with the config's other settings and a fixed
batch: its memory model predicts the largest batch that fits the budget there, the most any configuration of the
space can afford. The choices are the powers of two up to that prediction and one past it (the preflight of that
trial decides the boundary; the model may under-predict), never past the job's cap (preflight.max_batch_limit and
the number of training samples: a larger batch repeats samples). The job steps as a batch-1 trial does (its
accumulation held), so the calibration it caches is the one the first trial looks up, not fitted again.

A searched memory knob that changes what a step holds (its Knob.step: checkpointing, precision, the optimizer...)
is varied too: one job per combination of their choices (MAX_JOBS at most; beyond, one job at the config's own
values, said in the log), and the choices reach the largest batch any combination affords: a knob that saves
memory may afford more than the config's own setting. Each job's calibration is cached for the trials of its policy.

A study records its choices. A rerun, or a worker joining a shared study, searches those rather than sizing again:
a calibration on another device may predict a little differently, and a study's choices cannot change. The command
line's `trainer.batch_size=choice(...)` wins, as for every key.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.sweep.space import BATCH, BATCHING, SweepConfigError, held_step
from memfit.sweep.verdict import NothingFeasible

log = logging.getLogger("memfit.sweep")

FITS = "fits"  # trainer.batch_size's params value: choices sized by the memory model
LENGTHS = ("memory.max_source_length", "memory.max_label_length")
MAX_JOBS = 4  # sizing jobs at most: one per combination of the searched knobs that change what a step holds


@dataclass(frozen=True)
class Sizing:
    """What the sizing jobs found: the largest batch predicted to fit (0: not even batch 1) at these lengths (and
    searched knobs' values), and the cap its search stopped at."""

    largest: int
    cap: int | None
    at: dict[str, Any]

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
        at = ", ".join(f"{key}={value}" for key, value in self.at.items()) or "the configured lengths"
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


def step_knob_choices(space: dict[str, Any]) -> dict[str, list[Any]]:
    """The searched memory knobs that change what a step holds for a given shape (Knob.step), with their choices."""
    from memfit.memory.calibration import POLICY_KNOBS

    step = {f"memory.{name}" for name in POLICY_KNOBS}
    return {key: list(dist.choices) for key, dist in space.items() if key in step and hasattr(dist, "choices")}


@dataclass(frozen=True)
class SizingJob:
    overrides: list[str]
    at: dict[str, str]  # the lengths and the searched knobs' values it sizes at


def sizing_jobs(
    space: dict[str, Any], fixed: list[str], budget_gib: float | None, effective_batch: int | None
) -> list[SizingJob]:
    """The sizing jobs: sizing_overrides, once per combination of the searched step knobs' choices."""
    base = sizing_overrides(space, fixed, budget_gib, effective_batch)
    lengths = {key: value for key, value in (o.split("=", 1) for o in base) if key in LENGTHS}
    varied = step_knob_choices(space)
    combinations = list(itertools.product(*varied.values()))
    if len(combinations) > MAX_JOBS:
        log.warning(
            "%s: %d combinations of %s: sized at the config's own values only (give trainer.batch_size=choice(...) "
            "to search larger batches)",
            BATCH,
            len(combinations),
            ", ".join(varied),
        )
        return [SizingJob(base, lengths)]
    jobs = []
    for values in combinations:
        knobs = {key: _override_value(value) for key, value in zip(varied, values, strict=True)}
        jobs.append(SizingJob([*base, *(f"{key}={value}" for key, value in knobs.items())], {**lengths, **knobs}))
    return jobs


def _override_value(value: Any) -> str:
    """A choice as a Hydra override writes it (true, null, 0.5, bf16)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def size_batches(runner: Any, jobs: list[SizingJob], first_job: int) -> Sizing:
    """Run the sizing jobs on `runner` (the sweep's trials) one after another, numbered from `first_job`; the
    largest batch any of them predicts (a combination whose job fails is left to its trials to report), or a
    SweepConfigError saying why there is none where every job failed."""
    found, failed = [], []
    for offset, job in enumerate(jobs):
        try:
            found.append(_size(runner, job, first_job + offset))
        except SweepConfigError as err:
            failed.append(err)
            log.warning("%s: sizing at %s failed: %s", BATCH, job.at, err)
    if not found and all(isinstance(err, NothingFitsHere) for err in failed):
        raise NothingFeasible(failed[0].why)  # no batch is a way out (the weights alone exceed the limit)
    if not found:
        raise failed[0]
    return max(found, key=lambda sizing: sizing.largest)


class NothingFitsHere(SweepConfigError):
    """A sizing job whose run failed its preflight before any batch: at its settings nothing fits the budget."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


def _size(runner: Any, job: SizingJob, number: int) -> Sizing:
    (result,) = runner.launch([job.overrides], number)
    report = result.report or {}
    if report.get("status") != "ok":
        why = (report.get("reason") or result.error or "no report").splitlines()[0]
        message = f"trainer.batch_size={FITS}: the memory model's sizing run failed ({why})"
        if report.get("status") == "preflight_failed":
            raise NothingFitsHere(message, why.removeprefix("preflight: "))
        if report.get("status") == "invalid":  # the job's config, which its trials share: no batch choice helps
            raise SweepConfigError(f"{why} (said by the batch-sizing job, trainer.batch_size={FITS}, at {job.at})")
        raise SweepConfigError(f"{message}: give trainer.batch_size=choice(...)")
    sizing = Sizing(int(report.get("max_batch") or 0), report.get("max_batch_cap"), job.at)
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


def settle(
    searched: Any, recorded: dict[str, Any] | None, measured: Callable[[Any], dict[str, Any]], name: str
) -> None:
    """Read back after this sweep recorded what study `name` measures (`recorded`): workers that create a shared
    study at the same instant each size and record their own choices, and the study keeps the last written. A worker
    whose own choices differ from it adopts the study's before its first trial, so that every trial of the study
    searches one space. Optuna's storages have no compare-and-set on a study's attrs: two workers that each read back
    before the other writes still differ; that window is the milliseconds between the two writes."""
    if not searched.sized_here or recorded is None or recorded == measured(searched):
        return
    if adopt_recorded(searched, recorded, measured, name):
        log.warning("%s: another worker sized study %s at the same time; its choices are searched", BATCH, name)
