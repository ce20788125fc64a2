"""A whole epoch's tokens/s, estimated from a short timed training segment and the epoch's batch plan.

A sweep trial times 5-10 optimizer steps; on the H200 such a segment misjudged the epoch's throughput by 10-60%
either way (benchmarks/README.md, trial_throughput_gpu.py). Two things make the steps unequal, and both are known
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

from memfit.data.audit import padded


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
) -> EpochPlan:
    """The epoch's micro-batches in the order Trainer's sampler draws them (transformers' own length-grouped
    ordering over source lengths, megabatches of batch × accumulation; a random permutation otherwise), each padded
    as the collator pads: source and labels each to their longest, rounded up to `multiple`. A causal LM's labels
    are its inputs: only the inputs count. Another seed gives another order with the same statistics."""
    import torch
    from transformers.trainer_pt_utils import get_length_grouped_indices

    source = np.asarray(source_lengths, dtype=np.int64)
    label = np.asarray(label_lengths, dtype=np.int64)
    generator = torch.Generator().manual_seed(seed)
    if group_by_length:
        order = np.asarray(get_length_grouped_indices(source.tolist(), batch * accumulation, generator=generator))
    else:
        order = torch.randperm(len(source), generator=generator).numpy()
    padded_tokens, shapes = 0, set()
    for start in range(0, len(order), batch):
        rows = order[start : start + batch]
        shape = (len(rows), padded(int(source[rows].max()), multiple))
        if task == "seq2seq":
            shape += (padded(int(label[rows].max()), multiple),)
        padded_tokens += shape[0] * sum(shape[1:])
        shapes.add(shape)
    real = int(source.sum() + (label.sum() if task == "seq2seq" else 0))
    return EpochPlan(real, padded_tokens, -(-len(order) // batch), len(shapes))


def run_epoch_plan(cfg: DictConfig, train_dataset: Any) -> EpochPlan:
    """The epoch plan of a run's config over its tokenized training data (input_ids, and labels where present)."""
    source = _lengths(train_dataset, "input_ids")
    return epoch_plan(
        source,
        _lengths(train_dataset, "labels") if "labels" in train_dataset.column_names else source,
        batch=cfg.trainer.batch_size,
        accumulation=cfg.trainer.gradient_accumulation_steps,
        multiple=cfg.memory.pad_to_multiple_of,
        task=cfg.model.task,
        group_by_length=cfg.memory.group_by_length,
        seed=cfg.trainer.seed,
    )


def _lengths(dataset: Any, column: str) -> np.ndarray:
    """Each row's sequence length, read from the Arrow column (no Python list per row: a large dataset's
    token ids would otherwise be materialised at the end of every run)."""
    import pyarrow.compute as pc

    return pc.list_value_length(dataset.with_format("arrow")[column]).to_numpy(zero_copy_only=False)


def epoch_tokens_per_s(model: StepTimeModel, plan: EpochPlan) -> float:
    """Real tokens over the modelled seconds of one epoch, every distinct shape paid once."""
    seconds = model.seconds(plan.padded_tokens, plan.micro_batches, plan.distinct_shapes)
    return plan.real_tokens / seconds if seconds > 0 else 0.0
