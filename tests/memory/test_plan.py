"""The batch plan of trainer.batching=budget (memfit.memory.plan): its grid, its sizes, and its proof.

The memory here is a formula (static bytes plus bytes per padded token), so each property can be checked exactly;
the real probes run in tests/run/test_budget_batching.py."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from memfit.config import GIB
from memfit.data.audit import BatchShape, padded
from memfit.data.packing import epoch_micro_batches, epoch_order
from memfit.memory.bisection import largest_fitting
from memfit.memory.edges import CELL_SAVING, fitted_edges, length_edges
from memfit.memory.meter import MemoryPeak
from memfit.memory.plan import BatchPlan, PlanError, grid, prove, replay
from memfit.memory.probe import Probe

STATIC = 1 * GIB
LIMIT = 3 * GIB


def _peak(shape: BatchShape, per_token: float) -> int:
    return int(STATIC + per_token * shape.batch * (shape.source + 3 * shape.label))


def _predict(shape: BatchShape) -> float:
    return _peak(shape, 128 * 1024)


def _measuring(per_token: float, log: list[BatchShape]):
    """A device whose peaks follow the formula at `per_token` bytes (over the limit: out of memory)."""

    def measure(shape: BatchShape) -> Probe:
        log.append(shape)
        peak = _peak(shape, per_token)
        if peak > 4 * GIB:
            return Probe(shape, "train", None, attempted_bytes=peak)
        return Probe(shape, "train", MemoryPeak(peak, peak), STATIC)

    return measure


def _long_tail(n: int = 400, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    source = rng.integers(50, 200, n)
    label = rng.integers(8, 64, n)
    label[rng.choice(n, n // 100, replace=False)] = rng.integers(600, 1200, n // 100)  # 1% long labels
    return source, label


def _plan(source, label, cap=32, fill=1.0):
    return grid(source, label, task="seq2seq", buckets=8, multiple=8, limit_bytes=LIMIT, fill=fill, cap=cap)


def _every_micro_batch_is_dominated_by_a_measured_fit(plan, source, label, seed=0):
    order = epoch_order(source, 32, group_by_length=False, seed=seed)
    micro = epoch_micro_batches(source, label, order, 32, plan.capacity, 8)
    assert sum(rows for rows, _, _ in micro) == len(source)  # each sample once
    fits = [s for s, p in plan.measured.items() if not p.oom and p.judged_bytes <= LIMIT]
    for rows, s, lab in micro:
        assert any(f.batch >= rows and f.source >= s and f.label >= lab for f in fits), (rows, s, lab)
    return micro


def test_the_grid_covers_every_sample_with_tail_edges():
    source, label = _long_tail()
    plan = _plan(source, label)
    assert plan.label_edges[-1] == padded(int(label.max()), 8) and plan.source_edges[-1] == padded(int(source.max()), 8)
    assert sum(plan.samples.values()) == len(source) and None not in plan.samples
    assert any(edge >= 600 for edge in plan.label_edges[:-1])  # the 1% tail has an edge of its own inside it


def test_short_cells_get_large_batches_long_ones_small_and_each_micro_batch_is_proven():
    source, label = _long_tail()
    measured: list[BatchShape] = []
    plan = prove(_plan(source, label), _predict, _measuring(128 * 1024, measured), budget_bytes=4 * GIB)
    batches = plan.batches
    short = max(b for (i, j), b in batches.items() if j == 0)
    longest = min(b for (i, j), b in batches.items() if j == len(plan.label_edges) - 1)
    assert short == 32 and 1 <= longest <= 4
    assert plan.rounds == 1 and set(measured) == set(plan.proof_shapes())  # an exact memory model: one round
    for cell, batch in batches.items():  # each cell the largest batch whose prediction fits
        assert _predict(plan.shape(cell, batch)) <= LIMIT
        assert batch == plan.cap or _predict(plan.shape(cell, batch + 1)) > LIMIT
    micro = _every_micro_batch_is_dominated_by_a_measured_fit(plan, source, label)
    assert np.mean([rows for rows, _, _ in micro]) > 12  # most steps at large micro-batches


def test_a_device_that_needs_more_than_predicted_tightens_the_plan_until_it_fits():
    source, label = _long_tail(seed=1)
    measured: list[BatchShape] = []
    plan = prove(_plan(source, label), _predict, _measuring(1.4 * 128 * 1024, measured), budget_bytes=4 * GIB)
    assert plan.rounds > 1 and plan.factor > 1.2  # measured over prediction: predictions scaled up
    assert plan.proven
    for shape in plan.proof_shapes():
        assert _peak(shape, 1.4 * 128 * 1024) <= LIMIT
    _every_micro_batch_is_dominated_by_a_measured_fit(plan, source, label, seed=2)
    stale = [p for s, p in plan.measured.items() if p.oom or p.judged_bytes > LIMIT]
    assert stale  # earlier rounds' probes past the limit are kept in the record
    for cell in plan.batches:  # the table's bound for a cell is a fit, never such a probe
        bound = plan.measured_for(cell)
        assert bound is not None and not bound.oom and bound.judged_bytes <= LIMIT


def test_a_lower_fill_leaves_headroom_and_a_cap_bounds_the_rows():
    source, label = _long_tail()
    full = prove(_plan(source, label), _predict, _measuring(128 * 1024, []), 4 * GIB)
    partial = prove(_plan(source, label, cap=8, fill=0.8), _predict, _measuring(128 * 1024, []), 4 * GIB)
    assert max(partial.batches.values()) == 8
    assert all(partial.batches[c] <= full.batches[c] for c in full.batches)
    assert all(_predict(partial.shape(c)) <= 0.8 * LIMIT for c in partial.batches)


def test_a_sample_that_does_not_fit_alone_fails_with_one_line_naming_it_and_a_way_out():
    source, label = _long_tail()
    label[5] = 8000  # 8000 label positions at 384 KiB each: over the limit even alone
    with pytest.raises(PlanError) as err:
        prove(_plan(source, label), _predict, _measuring(128 * 1024, []), 4 * GIB)
    message = str(err.value)
    assert "\n" not in message and "label 8000" in message and "memory.max_label_length=" in message


def _recorded(plan: BatchPlan) -> BatchPlan:
    """What a resumed run rebuilds from the plan beside its checkpoints: edges and batches, nothing measured."""
    return BatchPlan(
        plan.task, plan.source_edges, plan.label_edges, 8, LIMIT, 1.0, plan.cap, samples={}, batches=dict(plan.batches)
    )


def test_a_replayed_plan_keeps_its_batches_where_it_fits_and_packs_the_epoch_as_before():
    source, label = _long_tail(seed=1)
    first = prove(_plan(source, label), _predict, _measuring(1.4 * 128 * 1024, []), budget_bytes=4 * GIB)
    fresh = prove(_plan(source, label), _predict, _measuring(128 * 1024, []), budget_bytes=4 * GIB)
    assert fresh.batches != first.batches  # proven afresh on the device it resumes on, the plan would differ
    measured: list[BatchShape] = []
    again = _recorded(first)
    assert replay(again, source, label, _predict, _measuring(128 * 1024, measured))
    assert again.batches == first.batches and again.proven and set(measured) == set(first.proof_shapes())
    assert again.samples == first.samples and again.rounds == 1
    order = epoch_order(source, 32, group_by_length=False, seed=4)
    assert epoch_micro_batches(source, label, order, 32, again.capacity, 8) == epoch_micro_batches(
        source, label, order, 32, first.capacity, 8
    )


def test_a_replayed_plan_that_no_longer_fits_or_holds_the_data_is_refused():
    source, label = _long_tail(seed=1)
    first = prove(_plan(source, label), _predict, _measuring(128 * 1024, []), budget_bytes=4 * GIB)
    assert not replay(_recorded(first), source, label, _predict, _measuring(1.4 * 128 * 1024, []))  # a hungrier device
    longer = label.copy()
    longer[0] = first.label_edges[-1] + 8  # a label past the plan's last edge
    assert not replay(_recorded(first), source, longer, _predict, _measuring(128 * 1024, []))


def _causal_long_tail(n: int = 600, seed: int = 3) -> np.ndarray:
    """Prompt + response lengths: a broad bulk (the rows a cell allows change many times inside it) and a 1% tail."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(80, 640, n)
    lengths[rng.choice(n, n // 100, replace=False)] = rng.integers(1500, 2400, n // 100)
    return lengths


def _rows_at(length: int, cap: int = 32) -> int:
    return largest_fitting(lambda rows: _predict(BatchShape(rows, length, length)) <= LIMIT, cap)


def _expected_micro_batches(lengths: np.ndarray, edges: tuple[int, ...]) -> float:
    cells = np.searchsorted(edges, [padded(int(n), 8) for n in lengths])
    return sum((cells == i).sum() / _rows_at(edge) for i, edge in enumerate(edges))


def test_causal_edges_are_fitted_to_need_fewer_micro_batches_than_quantiles_and_every_sample_is_proven():
    lengths = _causal_long_tail()
    quantile = length_edges(lengths, 8, 8)
    fitted = fitted_edges(lengths, _rows_at, 8, 8)
    assert fitted is not None and len(fitted) <= 8 and fitted[-1] == padded(int(lengths.max()), 8)
    assert _expected_micro_batches(lengths, fitted) < 0.95 * _expected_micro_batches(lengths, quantile)

    def causal_plan(predict):
        return grid(
            lengths, lengths, task="causal", buckets=8, multiple=8, limit_bytes=LIMIT, fill=1.0, cap=32, predict=predict
        )

    plan = causal_plan(_predict)
    assert plan.source_edges == fitted and sum(plan.samples.values()) == len(lengths) and None not in plan.samples
    measured: list[BatchShape] = []
    prove(plan, _predict, _measuring(128 * 1024, measured), budget_bytes=4 * GIB)
    assert plan.rounds == 1 and set(measured) == set(plan.proof_shapes())
    _every_micro_batch_is_dominated_by_a_measured_fit(plan, lengths, lengths)
    assert causal_plan(None).source_edges == quantile  # without a memory model: the quantiles


def test_fitted_edges_are_the_least_micro_batches_any_choice_of_edges_gives():
    lengths = np.random.default_rng(5).integers(8, 200, 60)
    candidates = sorted({padded(int(n), 8) for n in lengths})
    longest = candidates[-1]
    for buckets in (1, 2, 3):
        fitted = fitted_edges(lengths, _rows_at, buckets, 8)
        every = [(*inner, longest) for k in range(buckets) for inner in itertools.combinations(candidates[:-1], k)]
        least = min(_expected_micro_batches(lengths, edges) for edges in every)
        assert len(fitted) <= buckets
        assert _expected_micro_batches(lengths, fitted) <= least * (1 + CELL_SAVING) + 1e-9


def test_a_causal_sample_too_long_for_the_budget_keeps_its_one_line_error():
    lengths = _causal_long_tail()
    lengths[7] = 30000
    assert fitted_edges(lengths, _rows_at, 8, 8) is None
    plan = grid(
        lengths, lengths, task="causal", buckets=8, multiple=8, limit_bytes=LIMIT, fill=1.0, cap=32, predict=_predict
    )
    with pytest.raises(PlanError) as err:
        prove(plan, _predict, _measuring(128 * 1024, []), 4 * GIB)
    assert "\n" not in str(err.value) and "30000 tokens" in str(err.value)
