"""Budget-shaped micro-batches (trainer.batching=budget): one optimizer step's samples cut into micro-batches, each
holding as many rows as the batch plan allows for its padded lengths.

The packing knows nothing of memory: it is given `capacity(source, label)`, the most rows a micro-batch padded to
those lengths may hold (memfit.memory.plan proves that every such micro-batch fits). It is a pure function of the
samples' lengths, so the collator, the epoch's throughput plan and the tests all pack the same way.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from memfit.data.audit import padded

Capacity = Callable[[int, int], int]  # (padded source, padded label) -> the most rows such a micro-batch may hold


def sample_lengths(feature: dict, task: str) -> tuple[int, int]:
    """A tokenized sample's (source, label) lengths as the collator pads them: a causal LM's labels are its inputs."""
    source = len(feature["input_ids"])
    return (source, source) if task == "causal" else (source, len(feature["labels"]))


# what one more micro-batch costs, in padded tokens: a micro-batch of pegasus_large took as long as ~20k padded tokens
# (a least-squares fit of seconds = a·micro-batches + b·padded tokens over four one-epoch runs at 24 and 40 GiB,
# benchmarks/results/packing_cost_fit.txt): kernel launches and small-batch inefficiency outweigh the padding
# that splitting a step would save, so the packing pads rather than splits unless the padding is that large
MICRO_BATCH_COST = 16384


def pack(
    lengths: Sequence[tuple[int, int]],
    capacity: Capacity,
    multiple: int | None,
    shuffle: np.random.Generator | None = None,
    tolerance: float | None = None,
) -> list[list[int]]:
    """The step's samples (their (source, label) lengths) as micro-batches of indices into `lengths`.

    The samples are ordered most constrained first (the fewest rows allowed at their own lengths, then the most
    tokens) and cut into consecutive micro-batches that minimise the step's cost: MICRO_BATCH_COST per micro-batch
    plus its padded tokens (rows × longest source and label), no micro-batch holding more rows than the capacity of
    its own padded shape. So a step trains in as few micro-batches as the plan allows, and long samples share them
    with long ones. A sample that fits no micro-batch even alone (capacity 0) raises: the batch plan never allows one.
    `shuffle` (token_steps, the only caller, shuffles the samples before): within a capacity the samples keep their
    shuffled order, so micro-batches are new draws every epoch, not the same length-sorted neighbours; with a
    `tolerance` (trainer.pad_tolerance) they are shuffled by `shuffle` within the fewest bands of like length whose
    random micro-batches pad at most that share of their tokens (`band_width`).
    """
    size = [(padded(source, multiple), padded(label, multiple)) for source, label in lengths]
    allowed = functools.lru_cache(maxsize=None)(capacity)
    for i, (source, label) in enumerate(lengths):
        if allowed(*size[i]) < 1:
            raise ValueError(f"no micro-batch fits a sample of source {source} × label {label} tokens")
    longest_first = shuffle is None or tolerance is not None  # else the samples keep their shuffled order
    order = sorted(range(len(lengths)), key=lambda i: (allowed(*size[i]), -sum(lengths[i]) if longest_first else 0, i))
    if shuffle is not None and tolerance is not None:  # bands are cut from the length order
        tokens = [sum(size[i]) for i in order]
        order = _shuffled_in_bands(order, [allowed(*size[i]) for i in order], tokens, shuffle, tolerance)
    # best[k]: the least cost of packing order[:k]; cut[k]: where its last micro-batch starts
    best, cut = [0.0] + [float("inf")] * len(order), [0] * (len(order) + 1)
    for start in range(len(order)):
        source = label = 0
        for end in range(start, len(order)):
            source, label = max(source, size[order[end]][0]), max(label, size[order[end]][1])
            rows = end - start + 1
            if allowed(source, label) < rows:
                break  # longer micro-batches only grow in lengths and rows
            cost = best[start] + MICRO_BATCH_COST + rows * (source + label)
            if cost < best[end + 1]:
                best[end + 1], cut[end + 1] = cost, start
    groups, end = [], len(order)
    while end:
        groups.append(order[cut[end] : end])
        end = cut[end]
    return groups[::-1]


def _shuffled_in_bands(
    order: list[int], capacities: list[int], tokens: list[int], rng: np.random.Generator, tolerance: float
) -> list[int]:
    """`order` (most constrained, then longest first) with each capacity's samples shuffled in the fewest bands
    whose random micro-batches pad within `tolerance` (`band_width`), the first band's width drawn at random.
    `tokens`: each sample's padded tokens (source + label), in `order`."""
    key = dict(zip(order, rng.random(len(order)), strict=True))
    band_of: dict[int, tuple[int, int]] = {}
    start = 0
    for rows, run in itertools.groupby(capacities):
        count = len(list(run))
        width = band_width(np.asarray(tokens[start : start + count]), rows, tolerance)
        offset = int(rng.integers(width)) if width < count else 0  # one band: all of the capacity
        for rank, i in enumerate(order[start : start + count]):
            band_of[i] = (rows, (rank + offset) // width)
        start += count
    return sorted(order, key=lambda i: (band_of[i], key[i]))


def band_width(tokens: np.ndarray, rows: int, tolerance: float) -> int:
    """How many consecutive samples of `tokens` (sorted longest first, all allowed `rows` a micro-batch) one band
    holds: the widest, of the fewest bands (halved until they do), whose micro-batches of `rows` random draws each
    pad their samples by at most `tolerance` of their tokens (expected padding, each padded to its longest draw)."""
    count, total = len(tokens), float(tokens.sum())
    bands = 1
    while True:
        width = math.ceil(count / bands)
        padded = sum(
            len(band) * _expected_longest(band, min(rows, len(band)))
            for band in np.split(tokens, range(width, count, width))
        )
        if padded <= (1 + tolerance) * total or width <= rows:
            return width
        bands *= 2


def _expected_longest(tokens: np.ndarray, draws: int) -> float:
    """The expected longest of `draws` samples drawn without replacement from `tokens` (sorted longest first): the
    j-th is the longest of the draw with probability C(n-1-j, draws-1) / C(n, draws)."""
    n = len(tokens)
    after = np.arange(1, n)
    step = np.maximum(n - draws - after + 1, 0) / (n - after)  # P(j-th longest) / P((j-1)-th)
    chance = draws / n * np.concatenate(([1.0], np.cumprod(step)))
    return float(np.dot(chance, tokens))


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


def step_micro_batches(
    source: np.ndarray,
    label: np.ndarray,
    steps: Iterable[Sequence[int]],
    capacity: Capacity | None,
    multiple: int | None,
) -> list[tuple[int, int, int]]:
    """Optimizer steps (sample indices each) as micro-batches (rows, padded source, padded label), each step packed
    as the collator packs it (without a capacity: the step is one micro-batch)."""
    out = []
    for rows in steps:
        lengths = [(int(source[i]), int(label[i])) for i in rows]
        groups = pack(lengths, capacity, multiple) if capacity else [list(range(len(rows)))]
        for group in groups:
            longest_source = max(lengths[i][0] for i in group)
            longest_label = max(lengths[i][1] for i in group)
            out.append((len(group), padded(longest_source, multiple), padded(longest_label, multiple)))
    return out


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
    steps = (order[start : start + step] for start in range(0, len(order), step))
    return step_micro_batches(source, label, steps, capacity, multiple)


# trainer.effective_batch=tokens packs this many optimizer steps' samples at once (transformers' length grouping
# draws megabatches of 50 batches): a wider window fills micro-batches closer to their capacity, a narrower one
# changes a sample's companions more from epoch to epoch
TOKEN_STEP_WINDOW = 50


def token_steps(
    source: np.ndarray,
    label: np.ndarray,
    *,
    step_samples: int,
    capacity: Capacity,
    multiple: int | None,
    seed: int | Sequence[int],
    tolerance: float | None = None,
) -> list[list[int]]:
    """One epoch of trainer.effective_batch=tokens as optimizer steps (sample indices each).

    The samples are shuffled with `seed` and packed, TOKEN_STEP_WINDOW steps' samples at a time, into micro-batches
    as full as the plan allows, each a random draw among samples of like capacity (`pack(shuffle=rng)`: on a set
    that fits in one window, length-sorted micro-batches would repeat every epoch, which trained to a higher eval
    loss, benchmarks/results/token_steps_convergence_cpu_sorted_window50.json); the micro-batches are dealt into as many
    steps as fixed batches of `step_samples` take (ceil(samples / step_samples)), balanced in label tokens (`balance`),
    and the steps are shuffled. So a step
    holds about the label tokens of `step_samples` average samples, and no micro-batch is cut short to end a step
    at a sample count; a micro-batch that alone holds more than a step's share (long labels) is a step of its own.
    `label`: the tokens a step counts (a causal LM's whole sequence). `tolerance` (trainer.pad_tolerance): draw each
    micro-batch among samples of like length too, where drawing among all of a capacity would pad more than that.
    """
    count = len(source)
    rng = np.random.default_rng(seed)
    order = rng.permutation(count)
    window = TOKEN_STEP_WINDOW * step_samples
    micro: list[list[int]] = []
    for start in range(0, count, window):
        rows = order[start : start + window]
        lengths = [(int(source[i]), int(label[i])) for i in rows]
        micro += [[int(rows[i]) for i in group] for group in pack(lengths, capacity, multiple, rng, tolerance)]
    micro = [micro[i] for i in rng.permutation(len(micro))]
    steps = balance([int(np.sum(label[m])) for m in micro], math.ceil(count / step_samples))
    return [[i for j in steps[k] for i in micro[j]] for k in rng.permutation(len(steps))]


def padded_tokens(micro: Iterable[tuple[int, int, int]], task: str) -> int:
    """The tokens these micro-batches (rows, padded source, padded label) compute, padding included: a causal LM's
    labels are its inputs, so only the inputs count."""
    return sum(rows * (source + (label if task == "seq2seq" else 0)) for rows, source, label in micro)


def epoch_cost(micro: Sequence[tuple[int, int, int]], task: str) -> float:
    """What an epoch of these micro-batches costs in padded tokens: MICRO_BATCH_COST a micro-batch plus their
    padded tokens."""
    return len(micro) * MICRO_BATCH_COST + padded_tokens(micro, task)


def cheaper_step_count(
    token_micro: Sequence[tuple[int, int, int]], sample_micro: Sequence[tuple[int, int, int]], task: str
) -> str:
    """trainer.effective_batch=auto: `tokens` or `samples`, whichever epoch (its micro-batches) costs less
    (`epoch_cost`). Token steps fill micro-batches that steps of samples leave part empty where memory binds; where
    a micro-batch may hold a whole step (roomy budgets) they fill no better, and steps of samples, which
    memory.group_by_length draws among like lengths, pad less (pegasus_large at 40 GiB: 1.22x the
    tokens/s; at 24 GiB token steps were the faster:
    benchmarks/results/budget_batching_pegasus_large_*_seed1_*h200.json)."""
    return "samples" if epoch_cost(sample_micro, task) < epoch_cost(token_micro, task) else "tokens"


def balance(tokens: Sequence[int], steps: int) -> list[list[int]]:
    """These micro-batches (their token counts) dealt into `steps` non-empty steps of about equal tokens: the largest
    first, each to the step with the fewest tokens so far (longest-processing-time scheduling: no step exceeds the
    mean by more than its smallest micro-batch, unless one micro-batch alone does). Needs steps <= micro-batches."""
    import heapq

    if not 0 < steps <= len(tokens):
        raise ValueError(f"cannot deal {len(tokens)} micro-batches into {steps} steps")
    heap = [(0, k) for k in range(steps)]
    dealt: list[list[int]] = [[] for _ in range(steps)]
    for j in sorted(range(len(tokens)), key=lambda j: -tokens[j]):  # stable: ties keep the shuffled order
        total, k = heapq.heappop(heap)
        dealt[k].append(j)
        heapq.heappush(heap, (total + tokens[j], k))
    return dealt


class TokenStepSampler:
    """Trainer's batch sampler under trainer.effective_batch=tokens: one optimizer step's sample indices per batch
    (token_steps), shuffled anew each epoch. Trainer sets the epoch before iterating, on a resumed run too (before
    skipping the steps already trained), so a resumed run continues at the same place in the same epoch."""

    def __init__(
        self,
        source: np.ndarray,
        label: np.ndarray,
        *,
        step_samples: int,
        capacity: Capacity,
        multiple: int | None,
        seed: int,
        tolerance: float | None = None,
    ):
        self.source, self.label, self.step_samples = source, label, step_samples
        self.capacity, self.multiple, self.seed, self.epoch = capacity, multiple, seed, 0
        self.tolerance = tolerance
        self._drawn: tuple[int, list[list[int]]] | None = None  # the last epoch drawn: the plan table's is training's

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def steps(self) -> list[list[int]]:
        """This epoch's steps (drawn once per epoch)."""
        if self._drawn is None or self._drawn[0] != self.epoch:
            steps = token_steps(
                self.source,
                self.label,
                step_samples=self.step_samples,
                capacity=self.capacity,
                multiple=self.multiple,
                seed=(self.seed, self.epoch),
                tolerance=self.tolerance,
            )
            self._drawn = (self.epoch, steps)
        return self._drawn[1]

    def __len__(self) -> int:
        return math.ceil(len(self.source) / self.step_samples)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.steps())
