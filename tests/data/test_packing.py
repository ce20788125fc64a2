"""Packing one optimizer step's samples into budget-shaped micro-batches (memfit.data.packing)."""

from __future__ import annotations

import numpy as np

from memfit.data.audit import padded
from memfit.data.packing import epoch_micro_batches, epoch_order, pack


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
