"""A whole epoch's tokens/s, estimated from a short timed training segment and the epoch's batch plan.

A sweep trial times 5-10 optimizer steps; such a segment misjudged the epoch's throughput by 10-60% either way
(benchmarks/results/trial_throughput_segment.json). Two things make the steps unequal, and both are known
on CPU before training:
- Trainer's length-grouped sampler cuts the data into megabatches, each sorted longest first, so a step's padded
  size depends on where in its megabatch it falls, and a segment samples only part of that cycle;
- a micro-batch of a padded shape not trained on before costs extra (kernel selection, allocator growth).
So the segment fits a step-time model (seconds per padded token, per micro-batch, per new shape) and the model
is applied to the epoch's plan: the sampler's own order over the training data's lengths, padded as the collator
pads, which gives the epoch's padded tokens, micro-batches and distinct shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from omegaconf import DictConfig

from memfit.data.packing import (
    Capacity,
    dataset_lengths,
    epoch_micro_batches,
    epoch_order,
    padded_tokens,
    step_micro_batches,
)


@dataclass(frozen=True)
class Window:
    """One logged optimizer step of the timed segment."""

    tokens: int  # real tokens trained on (what tokens/s counts)
    seconds: float
    padded_tokens: int  # tokens with padding: what the device computes
    micro_batches: int
    new_shapes: int  # micro-batches of a padded shape not trained on before


@dataclass(frozen=True)
class EpochPlan:
    """One epoch's batches as the sampler orders them and the collator pads them."""

    real_tokens: int
    padded_tokens: int
    micro_batches: int
    distinct_shapes: int


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds of a step = per padded token × padded tokens + per micro-batch × micro-batches + per new shape ×
    new shapes, every coefficient ≥ 0."""

    per_padded_token_s: float
    per_micro_batch_s: float
    per_new_shape_s: float

    def seconds(self, padded_tokens: int, micro_batches: int, new_shapes: int) -> float:
        return (
            self.per_padded_token_s * padded_tokens
            + self.per_micro_batch_s * micro_batches
            + self.per_new_shape_s * new_shapes
        )

    @classmethod
    def fit(cls, windows: Sequence[Window]) -> StepTimeModel | None:
        """Least squares over the windows, dropping a term whose coefficient comes out negative (noise, or a term
        the segment cannot tell apart, such as new shapes when every step met one); None with fewer windows than
        two, or when nothing fits."""
        if len(windows) < 2:
            return None
        columns = np.array([[w.padded_tokens, w.micro_batches, w.new_shapes] for w in windows], dtype=float)
        seconds = np.array([w.seconds for w in windows], dtype=float)
        active = [i for i in range(3) if columns[:, i].any()]
        while active:
            coef, *_ = np.linalg.lstsq(columns[:, active], seconds, rcond=None)
            if (coef >= 0).all():
                full = [0.0, 0.0, 0.0]
                for i, c in zip(active, coef, strict=True):
                    full[i] = float(c)
                return cls(*full) if any(full) else None
            active.pop(int(np.argmin(coef)))
        return None


def epoch_plan(
    source_lengths: Sequence[int],
    label_lengths: Sequence[int],
    *,
    batch: int,
    accumulation: int,
    multiple: int | None,
    task: str,
    group_by_length: bool,
    seed: int = 0,
    capacity: Capacity | None = None,
    steps: Sequence[Sequence[int]] | None = None,
) -> EpochPlan:
    """The epoch's micro-batches in the order Trainer's sampler draws them (memfit.data.packing.epoch_order,
    megabatches of batch × accumulation), each padded as the collator pads: source and labels each to their longest,
    rounded up to `multiple`. With a batch plan's `capacity` (trainer.batching=budget) each optimizer step's
    batch × accumulation samples are packed into budget-shaped micro-batches, as the collator packs them; `steps`
    (trainer.effective_batch=tokens): the steps memfit.data.packing.TokenStepSampler drew instead. A causal LM's
    labels are its inputs: only the inputs count."""
    source = np.asarray(source_lengths, dtype=np.int64)
    label = np.asarray(label_lengths, dtype=np.int64)
    if capacity and steps is not None:
        micro = step_micro_batches(source, label, steps, capacity, multiple)
    else:
        order = epoch_order(source, batch * accumulation, group_by_length, seed)
        step = batch * accumulation if capacity else batch
        micro = epoch_micro_batches(source, label, order, step, capacity, multiple)
    shapes = {(rows, s, lab if task == "seq2seq" else 0) for rows, s, lab in micro}
    real = int(source.sum() + (label.sum() if task == "seq2seq" else 0))
    return EpochPlan(real, padded_tokens(micro, task), len(micro), len(shapes))


def run_epoch_plan(
    cfg: DictConfig,
    train_dataset: Any,
    capacity: Capacity | None = None,
    steps: Sequence[Sequence[int]] | None = None,
) -> EpochPlan:
    """The epoch plan of a run's config over its tokenized training data, packed by the batch plan's `capacity`
    where batches are budget-shaped."""
    source, label = dataset_lengths(train_dataset, cfg.model.task)
    return epoch_plan(
        source,
        label,
        batch=cfg.trainer.batch_size,
        accumulation=cfg.trainer.gradient_accumulation_steps,
        multiple=cfg.memory.pad_to_multiple_of,
        task=cfg.model.task,
        group_by_length=cfg.memory.group_by_length,
        seed=cfg.trainer.seed,
        capacity=capacity,
        steps=steps,
    )


def epoch_tokens_per_s(model: StepTimeModel, plan: EpochPlan) -> float:
    """Real tokens over the modelled seconds of one epoch, every distinct shape paid once."""
    seconds = model.seconds(plan.padded_tokens, plan.micro_batches, plan.distinct_shapes)
    return plan.real_tokens / seconds if seconds > 0 else 0.0
