"""Where the batch plan (memfit.memory.plan) cuts lengths into cells: at the data's quantiles, or, for one length
(a causal LM's), where the cells need the fewest micro-batches an epoch under the memory model."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from memfit.data.audit import padded

# quantiles of the edges, then the longest: the quartiles where most samples lie (a cell trains at its top edge's
# batch, so a wide first cell sizes most samples by lengths they do not have), then towards the tail
TAIL_QUANTILES = (0.25, 0.5, 0.75, 0.9, 0.97, 0.99, 0.997, 0.999, 0.9997, 0.9999)


def length_edges(lengths: np.ndarray, buckets: int, multiple: int | None) -> tuple[int, ...]:
    """Up to `buckets` cell edges over these lengths, padded: the tail quantiles, the longest last."""
    quantiles = [*TAIL_QUANTILES[: max(buckets - 1, 0)], 1.0]
    values = np.quantile(lengths, quantiles, method="higher") if len(lengths) else [1]
    return tuple(sorted({padded(int(v), multiple) for v in values}))


# a cell more is kept only where it saves more than this share of the epoch's micro-batches: each cell can cost a
# proof probe before step 1
CELL_SAVING = 0.005


def fitted_edges(
    lengths: np.ndarray, rows_at: Callable[[int], int], buckets: int, multiple: int | None
) -> tuple[int, ...] | None:
    """Up to `buckets` edges over one length (a causal LM's) that minimise the micro-batches an epoch needs: the sum
    over cells of their samples / the rows allowed at the cell's upper edge (`rows_at`), by dynamic programming over
    the data's padded lengths; the fewest cells within CELL_SAVING of the least. Quantile edges leave the bulk of the
    data in wide cells sized at their top: replayed over the GPU benchmark's runs this packs 6-8% fewer micro-batches
    (benchmarks/plan_fill_replay.py). None where the longest sample does not fit alone (the quantile grid
    then names it)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    rounded = -(-lengths // multiple) * multiple if multiple else lengths  # padded(), over the array
    candidates, counts = np.unique(rounded, return_counts=True)
    if not len(candidates):
        return None
    rows = np.array([rows_at(int(c)) for c in candidates], dtype=float)
    if rows.min() < 1:
        return None
    layers = _least_micro_batches(counts, rows, max(buckets, 1))
    least = min(total for total, _ in layers)
    cells = next(k for k, (total, _) in enumerate(layers, 1) if total <= least * (1 + CELL_SAVING))
    edges, j = [], len(candidates)
    for k in range(cells, 0, -1):  # back from the longest: each cell's upper edge, then where it starts
        edges.append(int(candidates[j - 1]))
        j = int(layers[k - 1][1][j])
    return tuple(sorted(edges))


def _least_micro_batches(counts: np.ndarray, rows: np.ndarray, buckets: int) -> list[tuple[float, np.ndarray]]:
    """For 1..buckets cells over lengths of these sample counts and allowed rows: the least micro-batches that cover
    them all, and for each prefix where its last cell starts (to walk the edges back)."""
    before = np.concatenate([[0], np.cumsum(counts)])  # samples shorter than each length
    m = len(counts)
    cost = np.full(m + 1, np.inf)
    cost[0] = 0.0  # the least micro-batches covering the first j lengths with the cells so far
    layers = []
    for _ in range(buckets):
        best, start = np.full(m + 1, np.inf), np.zeros(m + 1, dtype=int)
        for j in range(1, m + 1):
            total = cost[:j] + (before[j] - before[:j]) / rows[j - 1]  # the last cell: lengths start..j-1
            start[j] = int(np.argmin(total))
            best[j] = total[start[j]]
        layers.append((float(best[m]), start))
        cost = best
    return layers
