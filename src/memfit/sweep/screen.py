"""What the data alone decides before any GPU trial: the share of label tokens each max_label_length keeps, and
the worst padded batch each configuration can produce.

Both depend only on the training data and the lengths (with over-length samples truncated, not dropped), so the
sweeper reads the tokenized lengths once, as every trial's audit sees them, and tells a configuration below the
coverage floor without launching it; the memory model (sweep.predict) uses the worst batches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from omegaconf import DictConfig

from memfit.data.audit import BatchShape, label_coverage, worst_batches

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


@dataclass(frozen=True)
class DataLengths:
    """Raw token lengths of the training split, as every trial's length audit sees them."""

    task: str
    source: np.ndarray
    label: np.ndarray

    def worst_batches(self, batch: int, max_source: int, max_label: int, multiple: int | None) -> list[BatchShape]:
        """The audit's worst padded batches for these settings (over-length samples truncated)."""
        source, label = np.minimum(self.source, max_source), np.minimum(self.label, max_label)
        return worst_batches(source, label, batch, self.task, multiple)


def data_lengths(space: dict[str, Any], config: DictConfig) -> DataLengths | None:
    """The data's lengths, or None where they are not the data's alone (the space changes the data, the model's
    tokenizer or the over-length policy; samples are dropped) or the data cannot be read here (the trials then
    report why)."""
    varies_labels = any(key.startswith(CHANGES_LABELS) for key in space)
    if varies_labels or config.memory.overlength != "truncate":
        return None
    from memfit.data import load_and_tokenize
    from memfit.models import build_tokenizer

    started = time.perf_counter()
    try:
        tokenizer = build_tokenizer(config.model)
        built = time.perf_counter()
        prepared = load_and_tokenize(config, tokenizer)
    except Exception as err:  # noqa: BLE001 - every trial reports this data problem itself, with its run
        log.warning(
            "the data's lengths were not read before the trials: %s", str(err).splitlines()[0] if str(err) else err
        )
        return None
    done = time.perf_counter()
    log.info(
        "data screen: %d samples' lengths read in %.1f s (tokenizer %.1f s, data %.1f s)",
        len(prepared.label_raw),
        done - started,
        built - started,
        done - built,
    )
    return DataLengths(config.model.task, prepared.source_raw, prepared.label_raw)


def coverage_screen(
    lengths: DataLengths | None, space: dict[str, Any], config: DictConfig, floor: float
) -> CoverageScreen | None:
    """The coverage screen for this sweep, or None without a floor or without the data's lengths."""
    if floor <= 0 or lengths is None:
        return None
    fixed = None if LABEL in space else config.memory.max_label_length
    return CoverageScreen(lambda length: label_coverage(lengths.label, length), floor, fixed)
