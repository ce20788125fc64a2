"""What the data alone decides before any GPU trial: the share of label tokens each max_label_length keeps.

Label coverage depends only on the training data and the label length (with over-length samples truncated, not
dropped), so the sweeper computes it once, from the same tokenized lengths every trial's audit sees, and tells a
configuration below the coverage floor without launching it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

log = logging.getLogger("memfit.sweep")

LABEL = "memory.max_label_length"
# Searching any of these changes which labels there are or how they are cut: coverage is then the trial's to measure.
CHANGES_LABELS = ("data.", "model.", "memory.overlength")


class CoverageScreen:
    """coverage_of(label_length) → share of label tokens kept; below `floor` a configuration is certainly
    infeasible."""

    def __init__(self, coverage_of: Callable[[int], float], floor: float, fixed_label: int | None) -> None:
        self.coverage_of = coverage_of
        self.floor = floor
        self.fixed_label = fixed_label

    def below_floor(self, params: dict[str, Any]) -> float | None:
        """The coverage of these params' label length when it is below the floor, else None."""
        label = params.get(LABEL, self.fixed_label)
        if label is None:
            return None
        coverage = self.coverage_of(int(label))
        return coverage if coverage < self.floor else None


def applies(space: dict[str, Any], config: DictConfig, floor: float) -> bool:
    varies_labels = any(key.startswith(CHANGES_LABELS) for key in space)
    return floor > 0 and config.memory.overlength == "truncate" and not varies_labels


def coverage_screen(space: dict[str, Any], config: DictConfig, floor: float) -> CoverageScreen | None:
    """The screen for this sweep, or None where coverage is not the data's alone (or the data cannot be read here:
    the trials then report why)."""
    if not applies(space, config, floor):
        return None
    from memfit.audit import label_coverage
    from memfit.data import load_and_tokenize
    from memfit.models import build_tokenizer

    try:
        label_raw = load_and_tokenize(config, build_tokenizer(config.model)).label_raw
    except Exception as err:  # noqa: BLE001 - every trial reports this data problem itself, with its run
        log.warning("label coverage not screened before the trials: %s", str(err).splitlines()[0] if str(err) else err)
        return None
    fixed = None if LABEL in space else config.memory.max_label_length
    return CoverageScreen(lambda length: label_coverage(label_raw, length), floor, fixed)
