"""The batch plan of trainer.batching=budget: every length range of the data trains at the largest micro-batch
whose padded worst case fits the limit, and the plan is proven before step 1.

The grid. Source and label lengths (padded as the collator pads) are cut at edges: the data's own quantiles (p25, p50,
p75, then towards the tail: p90, p97, p99, p99.7, ... and the longest), so that most samples lie near the top of their
cell and the rare long ones get cells of their own. A causal LM has one length (prompt + response), and where the
memory model is known before the grid its edges are chosen instead to need the fewest micro-batches an epoch
(`fitted_edges`). A cell holds the micro-batches padded to at most its edges. Only cells that hold a sample are sized.

The sizes. The memory model (a calibrated `predict(shape)`: peak reserved bytes) proposes each cell's batch: the
most rows, up to the cap, whose predicted peak at the cell's edges stays within fill × limit. A micro-batch padded to
(s, l) may hold as many rows as the largest batch among the cells at or beyond (s, l) in both lengths
(`BatchPlan.capacity`), which is what memfit.data.packing packs to.

What is proven, and how. Peak memory grows with rows, source length and label length. So a measured shape
(b, s, l) within the limit bounds every micro-batch of at most b rows padded to at most (s, l). For each batch size
in the plan, the preflight measures the cells that are maximal among the cells of that size (no other cell of the
same size is as long in both lengths); every micro-batch the packing can produce has at most the rows of some cell
at or beyond its padded lengths, and that cell is dominated by a measured shape of its own size. When a measured
shape measures more than predicted, later predictions are scaled up by measured / predicted; when one does not fit,
the cells at or beyond it may hold at most one row fewer, and the plan is sized and measured again, until every
proof shape fits. The guarantee: no micro-batch of the plan holds more than a shape the preflight ran within
the limit on this device (measured fresh, as the preflight measures: allocator cache grown by a long run is not).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from memfit.config import GIB
from memfit.data.audit import BatchShape, padded
from memfit.memory.bisection import largest_fitting
from memfit.memory.edges import fitted_edges, length_edges
from memfit.memory.probe import Probe

Cell = tuple[int, int]  # (source edge index, label edge index)


class PlanError(ValueError):
    """The budget cannot hold some sample of the data even alone, or the plan cannot be made to fit."""


@dataclass
class BatchPlan:
    """Cells of the length grid, each with its batch size, its predicted peak and (where measured) its probe."""

    task: str
    source_edges: tuple[int, ...]
    label_edges: tuple[int, ...]
    multiple: int | None
    limit_bytes: int
    fill: float
    cap: int  # the most rows a micro-batch may hold (trainer.max_micro_batch, else the step's samples)
    samples: dict[Cell, int]  # samples whose own padded lengths fall in each cell (the cells that are sized)
    batches: dict[Cell, int] = field(default_factory=dict)
    predicted: dict[Cell, int] = field(default_factory=dict)  # bytes at the cell's batch and edges
    ceilings: dict[Cell, int] = field(default_factory=dict)  # at most this many rows, after a measurement failed
    factor: float = 1.0  # predictions scaled by the worst measured / predicted seen
    measured: dict[BatchShape, Probe] = field(default_factory=dict)
    rounds: int = 0

    def cell_of(self, source: int, label: int) -> Cell | None:
        """The cell whose edges hold these padded lengths; None beyond the last edge."""
        i = bisect.bisect_left(self.source_edges, source)
        j = i if self.task == "causal" else bisect.bisect_left(self.label_edges, label)
        if i >= len(self.source_edges) or j >= len(self.label_edges):
            return None
        return i, j

    def shape(self, cell: Cell, batch: int | None = None) -> BatchShape:
        i, j = cell
        return BatchShape(self.batches[cell] if batch is None else batch, self.source_edges[i], self.label_edges[j])

    def capacity(self, source: int, label: int) -> int:
        """The most rows a micro-batch padded to (source, label) may hold: the largest batch among the sized cells
        at or beyond it in both lengths (0 where none is)."""
        cell = self.cell_of(source, label)
        if cell is None:
            return 0
        return max((b for c, b in self.batches.items() if c[0] >= cell[0] and c[1] >= cell[1]), default=0)

    def proof_shapes(self) -> list[BatchShape]:
        """For each batch size of the plan, the shapes of its cells that no other cell of that size dominates."""
        shapes = []
        for cell, batch in self.batches.items():
            if batch < 1:
                continue
            same = [c for c, b in self.batches.items() if b == batch and c != cell]
            if not any(c[0] >= cell[0] and c[1] >= cell[1] for c in same):
                shapes.append(self.shape(cell))
        return sorted(shapes, key=lambda s: (-s.tokens, -s.batch))

    @property
    def proven(self) -> bool:
        return all(self._fits(s) for s in self.proof_shapes())

    def _fits(self, shape: BatchShape) -> bool:
        probe = self.measured.get(shape)
        return probe is not None and not probe.oom and probe.judged_bytes <= self.limit_bytes

    def measured_for(self, cell: Cell) -> Probe | None:
        """The probe that bounds a cell: its own shape's, or the tightest shape of its size that dominates it and fit
        (an earlier round's probe past the limit bounds nothing; it is shown only where no fitting one dominates)."""
        batch = self.batches.get(cell, 0)
        dominating = [
            (shape, probe)
            for shape, probe in self.measured.items()
            if shape.batch == batch
            and bisect.bisect_left(self.source_edges, shape.source) >= cell[0]
            and bisect.bisect_left(self.label_edges, shape.label) >= cell[1]
        ]
        if not dominating:
            return None
        _, probe = min(dominating, key=lambda item: (not self._fits(item[0]), item[1].judged_bytes))
        return probe


def grid(
    source: np.ndarray,
    label: np.ndarray,
    *,
    task: str,
    buckets: int,
    multiple: int | None,
    limit_bytes: int,
    fill: float,
    cap: int,
    predict: Callable[[BatchShape], float] | None = None,
) -> BatchPlan:
    """The length grid over the samples' lengths (training and evaluation), with each cell's sample count. A causal
    LM's edges are fitted to the memory model where `predict` is given: the rows each padded length allows, as
    `size` sizes a cell."""
    fitted = None
    if task == "causal" and predict is not None:

        def rows_at(length: int) -> int:
            return largest_fitting(lambda rows: predict(BatchShape(rows, length, length)) <= fill * limit_bytes, cap)

        fitted = fitted_edges(source, rows_at, buckets, multiple)
    source_edges = fitted or length_edges(source, buckets, multiple)
    label_edges = source_edges if task == "causal" else length_edges(label, buckets, multiple)
    return _counted(
        BatchPlan(task, source_edges, label_edges, multiple, limit_bytes, fill, cap, samples={}), source, label
    )


def _counted(plan: BatchPlan, source: np.ndarray, label: np.ndarray) -> BatchPlan:
    """The plan with each cell's count of the samples whose padded lengths fall in it."""
    for s, lab in zip(source, label, strict=True):
        cell = plan.cell_of(padded(int(s), plan.multiple), padded(int(lab), plan.multiple))
        plan.samples[cell] = plan.samples.get(cell, 0) + 1
    return plan


def size(plan: BatchPlan, predict: Callable[[BatchShape], float]) -> None:
    """Each sized cell's batch: the most rows (up to the cap and its ceiling) whose scaled prediction at the cell's
    edges is within fill × limit; 0 where one row is not."""
    target = plan.fill * plan.limit_bytes
    for cell in plan.samples:
        upper = min(plan.cap, plan.ceilings.get(cell, plan.cap))
        low = largest_fitting(lambda batch, cell=cell: plan.factor * predict(plan.shape(cell, batch)) <= target, upper)
        plan.batches[cell] = low
        plan.predicted[cell] = int(plan.factor * predict(plan.shape(cell, max(low, 1))))


def _too_long(plan: BatchPlan, predict: Callable[[BatchShape], float]) -> str | None:
    """The one-line error for a sample that does not fit even alone, naming its lengths and the nearest way out."""
    unfit = [c for c, b in plan.batches.items() if b < 1]
    if not unfit:
        return None
    cell = max(unfit, key=lambda c: (c[1], c[0]))  # the longest label that does not fit: name its sample
    shape = plan.shape(cell, 1)
    needed = plan.predicted[cell] / GIB
    what = f"{shape.source} tokens" if plan.task == "causal" else f"source {shape.source} × label {shape.label}"
    knob = "memory.max_source_length" if plan.task == "causal" else "memory.max_label_length"
    shorter = next(
        (
            n
            for n in range(shape.label - 8, 7, -8)
            if plan.factor * predict(BatchShape(1, n if plan.task == "causal" else shape.source, n))
            <= plan.fill * plan.limit_bytes
        ),
        None,
    )
    least = min(plan.predicted.values()) / GIB  # what the shortest sample needs alone
    way_out = (
        f"set {knob}={shorter}, or memory.gradient_checkpointing=true, or raise budget.gib"
        if shorter
        else f"even the shortest sample needs ~{least:.2f} GiB: raise budget.gib, or memory.gradient_checkpointing=true"
    )
    return (
        f"trainer.batching=budget: a sample of {what} needs ~{needed:.2f} GiB alone (memory model), over the limit "
        f"{plan.limit_bytes / GIB:.2f} GiB: {way_out}"
    )


def scaled_predictor(one: Probe, two: Probe, budget_bytes: int) -> Callable[[BatchShape], float]:
    """Without a memory model (none calibrated): a peak linear in the batch's padded tokens, through two probes of
    one shape at 1 and 2 rows; where the second ran out of memory, through the budget (an underestimate that the
    proof's measurements correct)."""
    base = one.judged_bytes if not one.oom else budget_bytes
    second = two.judged_bytes if not two.oom else max(budget_bytes, two.attempted_bytes or 0)
    per_token = max(second - base, 1) / one.shape.tokens
    static = max(base - per_token * one.shape.tokens, 0)

    def predict(shape: BatchShape) -> float:
        return static + per_token * shape.tokens

    return predict


def prove(
    plan: BatchPlan,
    predict: Callable[[BatchShape], float],
    measure: Callable[[BatchShape], Probe],
    budget_bytes: int,
    max_rounds: int = 12,
    on_round: Callable[[BatchPlan], None] | None = None,
) -> BatchPlan:
    """Size the plan, then measure its proof shapes and tighten it until every one fits (module docstring)."""
    for plan.rounds in range(1, max_rounds + 1):
        size(plan, predict)
        if (problem := _too_long(plan, predict)) is not None:
            raise PlanError(problem)
        if on_round is not None:
            on_round(plan)
        if (failed := _first_unfit(plan, predict, measure, budget_bytes)) is None:
            return plan
        _lower_ceilings(plan, failed)
    raise PlanError(
        f"trainer.batching=budget: the plan still measured over the limit after {max_rounds} rounds: "
        "lower trainer.micro_batch_fill (e.g. 0.9)"
    )


def _first_unfit(
    plan: BatchPlan, predict: Callable[[BatchShape], float], measure: Callable[[BatchShape], Probe], budget_bytes: int
) -> BatchShape | None:
    """Measure the plan's proof shapes, nearest the limit first (each shape once), scaling later predictions by what
    was measured; the first that does not fit, or None where all do."""
    for shape in sorted(plan.proof_shapes(), key=predict, reverse=True):
        if shape not in plan.measured:
            plan.measured[shape] = measure(shape)
        probe = plan.measured[shape]
        needed = max(budget_bytes, probe.attempted_bytes or 0) if probe.oom else probe.judged_bytes
        plan.factor = max(plan.factor, needed / predict(shape))  # later rounds predict with what was measured
        if not plan._fits(shape):
            return shape
    return None


def replay(
    plan: BatchPlan,
    source: np.ndarray,
    label: np.ndarray,
    predict: Callable[[BatchShape], float],
    measure: Callable[[BatchShape], Probe],
) -> bool:
    """A plan sized before (its edges and `batches`; a resumed run's) proven on this device as `prove` proves one:
    its proof shapes measured. True where every sample falls in one of its sized cells and every proof shape fits;
    the plan then holds exactly the batches it was given, so a packing of it repeats the one made before."""
    _counted(plan, source, label)
    if None in plan.samples or any(plan.batches.get(cell, 0) < 1 for cell in plan.samples):
        return False  # the data now holds lengths the plan did not size
    plan.rounds = 1
    if _first_unfit(plan, predict, measure, plan.limit_bytes) is not None:
        return False
    plan.predicted = {cell: int(plan.factor * predict(plan.shape(cell))) for cell in plan.batches}
    return True


def _lower_ceilings(plan: BatchPlan, failed: BatchShape) -> None:
    """Cells at or beyond a failing shape's lengths hold at most one row fewer than it did."""
    i = bisect.bisect_left(plan.source_edges, failed.source)
    j = bisect.bisect_left(plan.label_edges, failed.label)
    for cell in plan.samples:
        if cell[0] >= i and cell[1] >= j:
            plan.ceilings[cell] = min(plan.ceilings.get(cell, plan.cap), failed.batch - 1)


def describe_range(edges: Sequence[int], index: int) -> str:
    """'65-128': the lengths a cell holds along one dimension."""
    low = edges[index - 1] + 1 if index else 1
    return f"{low}-{edges[index]}"


def micro_batch_cells(plan: BatchPlan, micro_batches: list[tuple[int, int, int]]) -> dict[Cell, list[int]]:
    """An epoch's micro-batches (rows, padded source, padded label) by the cell of their padded lengths: rows each."""
    cells: dict[Cell, list[int]] = {}
    for rows, source, label in micro_batches:
        cells.setdefault(plan.cell_of(source, label), []).append(rows)
    return cells


def plan_rows(plan: BatchPlan, micro_batches: list[tuple[int, int, int]]) -> list[dict]:
    """One row per cell that holds samples or an epoch's micro-batches: what batch_plan.json records."""
    by_cell = micro_batch_cells(plan, micro_batches)
    total_samples, total_micro = sum(plan.samples.values()), max(len(micro_batches), 1)
    rows = []
    for cell in sorted(set(plan.samples) | set(by_cell)):
        probe = plan.measured.get(plan.shape(cell)) if cell in plan.batches else None
        bound = plan.measured_for(cell) if cell in plan.batches else None
        rows.append(
            {
                "source": describe_range(plan.source_edges, cell[0]),
                "label": describe_range(plan.label_edges, cell[1]),
                "batch": plan.batches.get(cell, plan.capacity(plan.source_edges[cell[0]], plan.label_edges[cell[1]])),
                "predicted_gib": plan.predicted[cell] / GIB if cell in plan.predicted else None,
                "measured_gib": probe.peak.reserved_gib if probe is not None and probe.peak else None,
                "bounded_by_gib": bound.peak.reserved_gib if bound is not None and bound.peak else None,
                "samples": plan.samples.get(cell, 0) / total_samples,
                "micro_batches": len(by_cell.get(cell, [])) / total_micro,
            }
        )
    return rows


def render_plan(plan: BatchPlan, micro_batches: list[tuple[int, int, int]], meter: str) -> str:
    """The plan as a table: length ranges, batch, predicted and measured peak, share of samples and of micro-batches."""
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    def gib(value: float | None) -> str:
        return "" if value is None else f"{value:.2f}"

    causal = plan.task == "causal"
    title = f"batch plan (trainer.batching=budget): limit {plan.limit_bytes / GIB:.2f} GiB ({meter})"
    table = Table(title=title, title_justify="left")
    heads = ["tokens"] if causal else ["source", "label"]
    for head in (*heads, "batch", "predicted GiB", "measured GiB", "samples", "micro-batches"):
        table.add_column(head, justify="right")
    for row in plan_rows(plan, micro_batches):
        measured = gib(row["measured_gib"]) or (f"≤ {gib(row['bounded_by_gib'])}" if row["bounded_by_gib"] else "")
        lengths = [row["source"]] if causal else [row["source"], row["label"]]
        table.add_row(
            *lengths,
            str(row["batch"]),
            gib(row["predicted_gib"]),
            measured,
            f"{row['samples']:.1%}",
            f"{row['micro_batches']:.1%}",
        )
    buffer = StringIO()
    console = Console(file=buffer, width=120, force_terminal=False)
    console.print(table)
    rows = [r for r, _, _ in micro_batches]
    console.print(
        f"{len(plan.measured)} shapes measured in {plan.rounds} round(s), prediction scale {plan.factor:.3f}; "
        f"an epoch: {len(rows)} micro-batches, {np.mean(rows) if rows else 0:.1f} rows each on average "
        f"(measured: each shape's peak reserved; ≤: bounded by the measured shape of that batch that dominates it)"
    )
    return buffer.getvalue()


def plan_metrics(plan: BatchPlan, micro_batches: list[tuple[int, int, int]]) -> dict[str, float]:
    """plan/... numbers for MLflow."""
    rows = [r for r, _, _ in micro_batches] or [0]
    fitting = [p for p in plan.measured.values() if not p.oom and p.judged_bytes <= plan.limit_bytes]
    sized = [b for b in plan.batches.values() if b > 0]
    return {
        "plan/cells": len(plan.batches),
        "plan/min_batch": min(sized, default=0),
        "plan/max_batch": max(sized, default=0),
        "plan/mean_micro_batch": float(np.mean(rows)),
        "plan/epoch_micro_batches": len(micro_batches),
        "plan/shapes_measured": len(plan.measured),
        "plan/rounds": plan.rounds,
        "plan/prediction_scale": plan.factor,
        "plan/max_measured_gib": max((p.peak.reserved_gib for p in fitting), default=0.0),
        "plan/limit_gib": plan.limit_bytes / GIB,
    }
