"""Trials the memory model predicts far over the budget are told without running: predicted, never measured.

The first trial of a sweep calibrates the memory model on the device (memfit.memory.calibration; cached, so later trials
reuse it) and reports where the calibration lies. From then on the sweeper predicts each proposed configuration's
worst batch (the data's lengths, cut as the trial would cut them) and tells those whose predicted peak is over the
budget by more than a safety margin, marking them `predicted`. A calibration holds for one memory policy: where the
search space varies policy knobs, each combination is predicted only from a trial that ran with it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from memfit.config import GIB, limit_gib, resolve_lengths
from memfit.sweep.screen import DataLengths, coverage_screen, data_lengths
from memfit.sweep.space import ACCUMULATION, BATCH, BATCHING, PLAN_KNOBS, SweepConfigError, budget_shaped, held_step

log = logging.getLogger("memfit.sweep")

SOURCE, LABEL = "memory.max_source_length", "memory.max_label_length"
SHAPE_KEYS = (BATCH, ACCUMULATION, SOURCE, LABEL, "trainer.seed")  # what a calibration predicts over
# how batches are cut changes which shapes run, not what a shape needs: one calibration serves them all (whether a
# step accumulates is in the signature)
NOT_POLICY = (*SHAPE_KEYS, BATCHING, *PLAN_KNOBS)


class MemoryPredictor:
    def __init__(self, lengths: DataLengths, config: DictConfig, margin: float, effective_batch: int | None) -> None:
        self.lengths = lengths
        self.config = config
        self.margin = margin
        self.effective_batch = effective_batch
        self.calibrations: dict[tuple, tuple[Any, int]] = {}  # policy signature → (calibration, trial that made it)

    def _accumulation(self, params: dict[str, Any]) -> int:
        """The accumulation the trial runs with: searched, held by the sweeper, or the config's."""
        if ACCUMULATION in params:
            return int(params[ACCUMULATION])
        trainer = self.config.trainer
        held = held_step(params, self.effective_batch, trainer.batch_size, trainer.batching).get(ACCUMULATION)
        return held if held is not None else int(trainer.gradient_accumulation_steps)

    def _budget_shaped(self, params: dict[str, Any]) -> bool:
        return budget_shaped(params, self.config.trainer.batching)

    def signature(self, params: dict[str, Any]) -> tuple:
        """What must match for a calibration to apply: the searched knobs that are not shapes, and whether the step
        accumulates gradients (a forward then runs with the previous micro-batch's gradients held; budget-shaped
        steps run several micro-batches too: config.step_accumulates)."""
        policy = tuple(sorted((k, str(v)) for k, v in params.items() if k not in NOT_POLICY))
        accumulates = self._accumulation(params) > 1 or self._budget_shaped(params)
        return (*policy, ("accumulates", accumulates))

    def learn(self, params: dict[str, Any], path: str | None, trial_number: int) -> None:
        """Take the calibration a trial reported (the first one per policy signature)."""
        from memfit.memory.calibration import Calibration

        key = self.signature(params)
        if not path or key in self.calibrations:
            return
        try:
            calibration = Calibration.load(Path(path))
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning(
                "trial %d's calibration %s could not be read (%s): not predicting from it", trial_number, path, err
            )
            return
        self.calibrations[key] = (calibration, trial_number)
        log.info("memory model: trials like %d are now predicted from calibration %s", trial_number, calibration.key)

    def worst_batches(self, params: dict[str, Any]) -> list[Any]:
        """The worst padded batches a trial with these params can produce, as its length audit finds them."""
        memory, model = self.config.memory, self.config.model
        source, label = resolve_lengths(
            params.get(SOURCE, memory.max_source_length),
            params.get(LABEL, memory.max_label_length),
            model.task,
            model.max_positions,
        )
        # a budget-shaped trial's plan shrinks its longest micro-batches down to one row before it gives up
        batch = 1 if self._budget_shaped(params) else int(params.get(BATCH, self.config.trainer.batch_size))
        return self.lengths.worst_batches(batch, source, label, memory.pad_to_multiple_of)

    def predicted_gib(self, params: dict[str, Any]) -> tuple[float, Any, int] | None:
        """(peak reserved GiB of the worst batch, calibration, trial it came from), or None without a calibration."""
        found = self.calibrations.get(self.signature(params))
        if found is None:
            return None
        calibration, source_trial = found
        shapes = self.worst_batches(params)
        if not shapes:
            return None
        peak = max(calibration.estimate(shape).reserved for shape in shapes)
        return peak / GIB, calibration, source_trial

    def over_budget(self, params: dict[str, Any], budget_gib: float | None) -> tuple[dict, dict] | None:
        """(user attrs, constraints) for a configuration predicted over budget × (1 + margin); else None."""
        if not budget_gib:
            return None
        predicted = self.predicted_gib(params)
        if predicted is None:
            return None
        gib, calibration, source_trial = predicted
        if gib <= budget_gib * (1 + self.margin):
            return None
        limit = limit_gib(budget_gib, self.config.budget.margin_gib)
        reason = (
            f"not run: predicted {gib:.2f} GiB for the worst batch, over the {budget_gib:g} GiB budget by more than "
            f"the {self.margin:.0%} safety margin (memory model {calibration.key}, calibrated in trial {source_trial})"
        )
        attrs = {
            "status": "predicted_infeasible",
            "reason": reason,
            "predicted": True,
            "predicted_peak_gib": gib,
            "calibration_from": source_trial,
        }
        return attrs, {"memory_gib": gib - limit}


def screen_data(
    space: dict[str, Any], config: DictConfig, settings: DictConfig, lengths: DataLengths | None = None
) -> tuple[Any, Any]:
    """(coverage screen, memory predictor) from the data's lengths, either None where it does not apply: label
    coverage per label length, and the worst batches the memory model predicts. A fixed label length below the
    coverage floor is a SweepConfigError: no trial could be feasible."""
    if settings.coverage_floor <= 0 and settings.predict_margin is None:
        return None, None
    lengths = lengths if lengths is not None else data_lengths(space, config)
    screen = coverage_screen(lengths, space, config, settings.coverage_floor)
    predictor = None
    if lengths is not None and settings.predict_margin is not None:
        predictor = MemoryPredictor(lengths, config, settings.predict_margin, settings.effective_batch)
    if screen is not None and LABEL not in space and (coverage := screen.below_floor({})):
        raise SweepConfigError(
            f"memory.max_label_length={screen.fixed_label} keeps {coverage:.2%} of label tokens, below "
            f"hydra.sweeper.coverage_floor={settings.coverage_floor:g}, so no trial could be feasible: "
            "search memory.max_label_length with choice(...) or lower the floor"
        )
    return screen, predictor
