"""Budget-shaped micro-batches (trainer.batching=budget): one optimizer step's samples cut into micro-batches, each
holding as many rows as the batch plan allows for its padded lengths.

The packing knows nothing of memory: it is given `capacity(source, label)`, the most rows a micro-batch padded to
those lengths may hold (memfit.memory.plan proves that every such micro-batch fits). It is a pure function of the
samples' lengths, so the collator, the epoch's throughput plan and the tests all pack the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from memfit.data.audit import padded

Capacity = Callable[[int, int], int]  # (padded source, padded label) -> the most rows such a micro-batch may hold


def sample_lengths(feature: dict, task: str) -> tuple[int, int]:
    """A tokenized sample's (source, label) lengths as the collator pads them: a causal LM's labels are its inputs."""
    source = len(feature["input_ids"])
    return (source, source) if task == "causal" else (source, len(feature["labels"]))


# a sample joins a micro-batch only if that costs at most this many times the padded tokens it would cost alone:
# a short sample padded to a long label in spare rows of a long micro-batch would cost more compute than it saves
MAX_PADDING_COST = 2.0


def pack(lengths: Sequence[tuple[int, int]], capacity: Capacity, multiple: int | None) -> list[list[int]]:
    """The step's samples (their (source, label) lengths) as micro-batches of indices into `lengths`.

    The most constrained samples go first (the fewest rows allowed at their own lengths, then the most tokens). A
    micro-batch takes the next sample while its padded lengths, that sample included, still allow one more row and
    the sample adds at most MAX_PADDING_COST times its own padded tokens: long samples share micro-batches with long
    ones, short with short, and no micro-batch exceeds the capacity of its own padded shape. A sample that fits no
    micro-batch even alone (capacity 0) raises: the batch plan never allows one.
    """

    def cost(rows: int, source: int, label: int) -> int:
        return rows * (padded(source, multiple) + padded(label, multiple))

    def own_capacity(i: int) -> int:
        return capacity(padded(lengths[i][0], multiple), padded(lengths[i][1], multiple))

    order = sorted(range(len(lengths)), key=lambda i: (own_capacity(i), -sum(lengths[i]), i))
    groups: list[list[int]] = []
    current: list[int] = []
    longest = (0, 0)
    for i in order:
        source, label = lengths[i]
        wide = (max(longest[0], source), max(longest[1], label))
        rows = len(current) + 1
        if current and capacity(padded(wide[0], multiple), padded(wide[1], multiple)) >= rows:
            added = cost(rows, *wide) - cost(rows - 1, *longest)
            if added <= MAX_PADDING_COST * cost(1, source, label):
                current.append(i)
                longest = wide
                continue
        if own_capacity(i) < 1:
            raise ValueError(f"no micro-batch fits a sample of source {source} × label {label} tokens")
        if current:
            groups.append(current)
        current, longest = [i], (source, label)
    if current:
        groups.append(current)
    return groups


class MicroBatches(list):
    """One optimizer step's collated micro-batches (a list, so that accelerate moves each to the device)."""


def dataset_lengths(dataset: Any, task: str) -> tuple[np.ndarray, np.ndarray]:
    """Each tokenized row's (source, label) lengths, read from the Arrow columns (no Python list per row: a large
    dataset's token ids would otherwise be materialised); a causal LM's labels are its inputs."""
    import pyarrow.compute as pc

    def lengths(column: str) -> np.ndarray:
        return pc.list_value_length(dataset.with_format("arrow")[column]).to_numpy(zero_copy_only=False)

    source = lengths("input_ids")
    return source, (source if task == "causal" or "labels" not in dataset.column_names else lengths("labels"))


def epoch_order(source_lengths: Sequence[int], group: int, group_by_length: bool, seed: int) -> np.ndarray:
    """The order in which Trainer's sampler draws one epoch's samples: transformers' own length-grouped ordering
    over source lengths (megabatches of `group`), or a random permutation. Another seed gives another order with the
    same statistics."""
    import torch
    from transformers.trainer_pt_utils import get_length_grouped_indices

    generator = torch.Generator().manual_seed(seed)
    if group_by_length:
        return np.asarray(get_length_grouped_indices(list(map(int, source_lengths)), group, generator=generator))
    return torch.randperm(len(source_lengths), generator=generator).numpy()


def epoch_micro_batches(
    source: np.ndarray,
    label: np.ndarray,
    order: np.ndarray,
    step: int,
    capacity: Capacity | None,
    multiple: int | None,
) -> list[tuple[int, int, int]]:
    """One epoch's micro-batches as (rows, padded source, padded label): the order cut into optimizer steps of
    `step` samples, each packed as the collator packs it (without a capacity: `step` rows per micro-batch)."""
    out = []
    for start in range(0, len(order), step):
        rows = order[start : start + step]
        lengths = [(int(source[i]), int(label[i])) for i in rows]
        groups = pack(lengths, capacity, multiple) if capacity else [list(range(len(rows)))]
        for group in groups:
            longest_source = max(lengths[i][0] for i in group)
            longest_label = max(lengths[i][1] for i in group)
            out.append((len(group), padded(longest_source, multiple), padded(longest_label, multiple)))
    return out
