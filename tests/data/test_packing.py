"""Packing one optimizer step's samples into budget-shaped micro-batches (memfit.data.packing)."""

from __future__ import annotations

import itertools

import numpy as np

from memfit.data.audit import padded
from memfit.data.packing import (
    TokenStepSampler,
    balance,
    band_width,
    cheaper_step_count,
    epoch_cost,
    epoch_micro_batches,
    epoch_order,
    pack,
    step_micro_batches,
    token_steps,
)


def _capacity(source: int, label: int) -> int:
    """Rows allowed by a made-up budget of 4096 padded tokens per micro-batch, at most 16."""
    return min(16, 4096 // (source + label))


def test_every_sample_is_packed_once_and_no_micro_batch_exceeds_its_capacity():
    rng = np.random.default_rng(0)
    lengths = [(int(s), int(lab)) for s, lab in zip(rng.integers(5, 300, 64), rng.integers(2, 900, 64), strict=True)]
    groups = pack(lengths, _capacity, multiple=8)
    assert sorted(i for g in groups for i in g) == list(range(64))
    for group in groups:
        source = padded(max(lengths[i][0] for i in group), 8)
        label = padded(max(lengths[i][1] for i in group), 8)
        assert 1 <= len(group) <= _capacity(source, label)


def test_long_samples_share_micro_batches_with_long_ones_and_short_with_short():
    lengths = [(40, 10)] * 30 + [(40, 800)] * 2
    groups = pack(lengths, _capacity, multiple=8)
    long_groups = [g for g in groups if any(i >= 30 for i in g)]
    assert all(all(i >= 30 for i in g) for g in long_groups)  # no short sample padded to a long label
    assert sorted(len(g) for g in groups if g not in long_groups) == [14, 16]  # the short ones at full capacity
    assert len(groups) == 2 + len(long_groups)


def test_a_step_trains_in_one_micro_batch_where_its_capacity_allows_rather_than_saving_padding():
    lengths = [(1000, 40)] * 16 + [(100, 30)] * 16  # the short ones cost 10x their own tokens padded to the long

    def roomy(source: int, label: int) -> int:
        return 32

    assert [len(g) for g in pack(lengths, roomy, multiple=8)] == [32]


def test_the_fewest_micro_batches_the_capacities_allow():
    # at most 4 rows up to label 200, 2 beyond: the two mid samples with the two short ones padded to them, the long
    # one alone; splitting the short ones off to spare their padding would cost a third micro-batch
    lengths = [(64, 400), (64, 200), (64, 200), (64, 8), (64, 8)]

    def capacity(source: int, label: int) -> int:
        return 4 if label <= 200 else 2

    groups = pack(lengths, capacity, multiple=8)
    assert sorted(i for g in groups for i in g) == list(range(5))
    assert sorted(len(g) for g in groups) == [1, 4]
    assert all(len(g) <= capacity(0, max(lengths[i][1] for i in g)) for g in groups)


def _roomy(source: int, label: int) -> int:
    return 16


def _padding(lengths: list[tuple[int, int]], groups: list[list[int]]) -> float:
    """The micro-batches' padded tokens over their samples' tokens."""
    padded_tokens = sum(len(g) * (max(lengths[i][0] for i in g) + max(lengths[i][1] for i in g)) for g in groups)
    return padded_tokens / sum(s + lab for s, lab in lengths)


def test_with_a_pad_tolerance_shuffled_micro_batches_are_drawn_among_samples_of_like_length():
    # one capacity for 640 samples of 16-1024 tokens: 16 random ones pad to near the longest of all
    rng = np.random.default_rng(3)
    lengths = [(int(s), 8) for s in rng.integers(16, 1024, 640)]
    loose = pack(lengths, _roomy, multiple=None, shuffle=np.random.default_rng(0))
    assert _padding(lengths, loose) > 1.6
    draws = [pack(lengths, _roomy, None, np.random.default_rng(seed), tolerance=0.1) for seed in (0, 1)]
    for groups in draws:
        assert sorted(i for g in groups for i in g) == list(range(640))
        assert _padding(lengths, groups) < 1.15  # the tolerance bounds the expected padding, not each draw's
    assert {frozenset(g) for g in draws[0]}.isdisjoint(frozenset(g) for g in draws[1])  # new companions


def test_a_pad_tolerance_keeps_draws_among_the_whole_capacity_where_they_pad_little():
    rng = np.random.default_rng(4)
    lengths = [(int(s), 8) for s in rng.integers(500, 540, 640)]
    rank = {i: r for r, i in enumerate(sorted(range(640), key=lambda i: -lengths[i][0]))}
    groups = pack(lengths, _roomy, None, np.random.default_rng(0), tolerance=0.1)
    assert _padding(lengths, groups) < 1.1
    assert np.mean([max(rank[i] for i in g) - min(rank[i] for i in g) for g in groups]) > 400  # from all 640


def test_band_width_is_the_widest_whose_random_draws_pad_within_the_tolerance():
    tokens = np.arange(1024, 0, -1)  # uniform lengths: one band's random draws of 16 pad to ~1.9x their tokens
    width = band_width(tokens, 16, 0.1)
    assert 16 < width < 1024 and 1024 % width == 0
    assert band_width(tokens, 16, 0.1 * 2) >= width and band_width(np.full(300, 50), 16, 0.1) == 300


def test_an_epoch_packs_each_sample_once_in_the_same_order_for_a_seed():
    rng = np.random.default_rng(1)
    source, label = rng.integers(5, 200, 100), rng.integers(2, 600, 100)
    first = epoch_order(source, 16, group_by_length=True, seed=3)
    assert sorted(first.tolist()) == list(range(100))
    assert (epoch_order(source, 16, group_by_length=True, seed=3) == first).all()
    assert not (epoch_order(source, 16, group_by_length=True, seed=4) == first).all()
    micro = epoch_micro_batches(source, label, first, 16, _capacity, 8)
    assert sum(rows for rows, _, _ in micro) == 100
    assert all(rows <= _capacity(s, lab) for rows, s, lab in micro)
    fixed = epoch_micro_batches(source, label, first, 4, None, 8)
    assert [rows for rows, _, _ in fixed] == [4] * 25


def _long_tail(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sources of 20-200 tokens, labels of 4-40 with 2% of 300-600: a long tail like the GPU benchmark's."""
    rng = np.random.default_rng(seed)
    label = np.where(rng.random(count) < 0.02, rng.integers(300, 600, count), rng.integers(4, 40, count))
    return rng.integers(20, 200, count), label


def test_token_steps_see_each_sample_once_in_as_many_steps_as_fixed_batches_and_shuffle_by_epoch():
    source, label = _long_tail(300, 0)
    steps = token_steps(source, label, step_samples=16, capacity=_capacity, multiple=8, seed=(5, 0))
    assert sorted(i for step in steps for i in step) == list(range(300))
    assert len(steps) == 19 and all(steps)  # ceil(300 / 16), none empty
    again = token_steps(source, label, step_samples=16, capacity=_capacity, multiple=8, seed=(5, 0))
    assert again == steps
    sampler = TokenStepSampler(source, label, step_samples=16, capacity=_capacity, multiple=8, seed=5)
    assert list(sampler) == steps and len(sampler) == 19
    sampler.set_epoch(1)
    assert list(sampler) != steps and len(sampler) == 19


def test_token_steps_fill_micro_batches_that_a_step_of_fixed_samples_leaves_half_full():
    source, label = _long_tail(400, 1)

    def capacity(source: int, label: int) -> int:
        return 12 if label <= 40 else 2  # a step of 16 short samples takes two micro-batches of 8

    order = epoch_order(source, 16, group_by_length=False, seed=0)
    by_samples = epoch_micro_batches(source, label, order, 16, capacity, 8)
    steps = token_steps(source, label, step_samples=16, capacity=capacity, multiple=8, seed=(0, 0))
    by_tokens = step_micro_batches(source, label, steps, capacity, 8)
    assert sum(r for r, _, _ in by_tokens) == sum(r for r, _, _ in by_samples) == 400
    assert all(rows <= capacity(s, lab) for rows, s, lab in by_tokens)
    assert len(by_tokens) < 0.8 * len(by_samples)  # fewer, fuller micro-batches
    tokens = [int(label[step].sum()) for step in steps]
    longest_micro = max(int(label[step].max()) * 2 for step in steps)
    assert max(tokens) <= np.mean(tokens) + longest_micro  # balanced: no step past the mean by more than a micro-batch


def test_balance_deals_every_micro_batch_once_into_nonempty_steps_of_near_equal_tokens():
    tokens = [400, 30, 30, 30, 30, 30, 30, 30, 30, 100, 100, 100]
    steps = balance(tokens, 4)
    assert sorted(j for step in steps for j in step) == list(range(12)) and all(steps)
    totals = sorted(sum(tokens[j] for j in step) for step in steps)
    assert totals[-1] == 400  # the long micro-batch alone: nothing is added to the largest step
    assert totals[0] >= 100 and totals[2] - totals[0] <= 30  # the rest within one small micro-batch of each other


def test_token_steps_draw_new_micro_batches_each_epoch_on_a_set_within_one_window():
    # 200 samples: one window of 50 steps of 16. Sorted by length, the same micro-batches would repeat every epoch
    # (74% of the pairs of samples sharing a step did so again the next epoch; drawn at random within a capacity, 7%)
    source, label = _long_tail(200, 4)

    def pairs(epoch: int) -> set[frozenset[int]]:
        steps = token_steps(source, label, step_samples=16, capacity=_capacity, multiple=8, seed=(7, epoch))
        return {frozenset(pair) for step in steps for pair in itertools.combinations(step, 2)}

    first = pairs(0)
    assert len(first & pairs(1)) < 0.2 * len(first)


def test_token_steps_with_a_pad_tolerance_pad_less_and_still_see_each_sample_once():
    rng = np.random.default_rng(5)
    source, label = rng.integers(16, 1024, 800), rng.integers(4, 40, 800)  # one capacity spans short and long

    def capacity(source: int, label: int) -> int:
        return 32

    def padded_tokens(tolerance: float | None) -> int:
        steps = token_steps(
            source, label, step_samples=32, capacity=capacity, multiple=8, seed=(1, 0), tolerance=tolerance
        )
        assert sorted(i for step in steps for i in step) == list(range(800)) and len(steps) == 25
        return sum(rows * (s + lab) for rows, s, lab in step_micro_batches(source, label, steps, capacity, 8))

    assert padded_tokens(0.1) < 0.75 * padded_tokens(None)


def _both_epochs(source, label, capacity, step: int) -> tuple[list, list]:
    """One epoch in token steps and in length-grouped steps of `step` samples (memory.group_by_length)."""
    steps = token_steps(source, label, step_samples=step, capacity=capacity, multiple=8, seed=(0, 0))
    by_tokens = step_micro_batches(source, label, steps, capacity, 8)
    order = epoch_order(source, step, group_by_length=True, seed=0)
    return by_tokens, epoch_micro_batches(source, label, order, step, capacity, 8)


def test_auto_counts_steps_in_samples_where_a_micro_batch_holds_a_whole_step_and_in_tokens_where_memory_binds():
    rng = np.random.default_rng(5)
    source, label = rng.integers(16, 1024, 800), rng.integers(4, 40, 800)
    # roomy: every length allows the step's 32 rows, so token steps fill no better and pad to random longest ones
    by_tokens, by_samples = _both_epochs(source, label, lambda s, lab: 32, 32)
    assert len(by_tokens) == len(by_samples) == 25
    assert epoch_cost(by_samples, "seq2seq") < epoch_cost(by_tokens, "seq2seq")
    assert cheaper_step_count(by_tokens, by_samples, "seq2seq") == "samples"
    # binding: 20 rows at most, so a step of 32 samples takes two micro-batches where token steps fill each to 20;
    # sources of like length (most of a long-document set at its max_source_length) pad little either way
    source = rng.integers(900, 1024, 800)
    by_tokens, by_samples = _both_epochs(source, label, lambda s, lab: 20, 32)
    assert (len(by_tokens), len(by_samples)) == (40, 50)
    assert cheaper_step_count(by_tokens, by_samples, "seq2seq") == "tokens"
