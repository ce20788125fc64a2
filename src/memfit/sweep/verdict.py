"""Why a sweep found nothing feasible: which constraint binds (label coverage, memory, or both), by how much, and
the change that would let a configuration through. Pure: trials and the data's coverage in, one line out."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from memfit.sweep.outcome import constraint_dict
from memfit.sweep.screen import LABEL


class NothingFeasible(RuntimeError):
    """A sweep ended with no feasible configuration; the message says which constraint binds (exit code 3)."""


def _labels_that_meet(coverage_of: Callable[[int], float], floor: float, longest: int, cap: int) -> int | None:
    """The shortest doubling of `longest` (up to `cap`, then `cap` itself) whose labels keep at least `floor`."""
    length = longest
    while length < cap:
        length = min(length * 2, cap)
        if coverage_of(length) >= floor:
            return length
    return None


def coverage_line(labels: Sequence[int], coverage_of: Callable[[int], float], floor: float, cap: int) -> str | None:
    """The coverage half of the verdict, where every label length searched keeps less than the floor."""
    if not labels or floor <= 0 or any(coverage_of(int(label)) >= floor for label in labels):
        return None
    longest = max(int(label) for label in labels)
    kept = coverage_of(longest)
    ways = []
    if (enough := _labels_that_meet(coverage_of, floor, longest, cap)) is not None:
        ways.append(f"add {enough} (keeps {coverage_of(enough):.1%}) to {LABEL}'s choices")
    ways.append(f"set hydra.sweeper.coverage_floor={int(kept * 100) / 100:g}")
    return (
        f"coverage binds: the longest {LABEL} searched, {longest}, keeps {kept:.1%} of label tokens, under "
        f"hydra.sweeper.coverage_floor={floor:g}: {' or '.join(ways)}"
    )


def memory_line(trials: Sequence[Any], limit_gib: float | None) -> str | None:
    """The memory half: every configuration that kept enough labels needed more than the limit. Names the one
    least over it (measured, or predicted by the memory model) and by how much."""
    over = [
        t
        for t in trials
        if constraint_dict(t).get("memory_gib", 0.0) > 0 and constraint_dict(t).get("coverage", 0.0) <= 0
    ]
    if not over or limit_gib is None:
        return None
    least = min(over, key=lambda t: constraint_dict(t)["memory_gib"])
    excess = constraint_dict(least)["memory_gib"]
    how = "predicted" if least.user_attrs.get("predicted") else "measured"
    return (
        f"memory binds: every configuration that kept enough labels needs more than the {limit_gib:.2f} GiB limit; "
        f"the least over, trial {least.number} ({least.params}), {how} {limit_gib + excess:.2f} GiB, over by "
        f"{excess:.2f} GiB: raise budget.gib to at least {limit_gib + excess + 0.5:.1f}, search smaller "
        "trainer.batch_size or max lengths, or a policy that saves more (memory=tight)"
    )


def nothing_feasible(
    trials: Sequence[Any],
    labels: Sequence[int],
    coverage_of: Callable[[int], float] | None,
    floor: float,
    limit_gib: float | None,
    cap: int,
) -> str:
    """One line: which constraint binds and by how much, and what would let a configuration through."""
    parts = []
    if coverage_of is not None and (line := coverage_line(labels, coverage_of, floor, cap)) is not None:
        parts.append(line)
    if (line := memory_line(trials, limit_gib)) is not None:
        short = [] if coverage_of is None else [str(label) for label in labels if coverage_of(int(label)) < floor]
        if short:
            line += f" (and {LABEL} {', '.join(short)} keep less of the labels than coverage_floor={floor:g})"
        parts.append(line)
    if parts:
        return "; and ".join(parts) if len(parts) > 1 else parts[0]
    ran = [t for t in trials if t.user_attrs.get("reason")]
    reasons = sorted({str(t.user_attrs["reason"]).split(":")[0] for t in ran})
    return f"no trial ended feasible (reasons: {', '.join(reasons) or 'none recorded'}): see each trial's reason"


def label_choices(space: dict[str, Any], fixed_label: int | None, cap: int) -> list[int]:
    """The label lengths a sweep searched: the space's choices or range, else the fixed one (null: the model's)."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    distribution = space.get(LABEL)
    if isinstance(distribution, CategoricalDistribution):
        return [int(c) if c is not None else cap for c in distribution.choices]
    if isinstance(distribution, IntDistribution):
        return list(range(distribution.low, distribution.high + 1, distribution.step))
    return [] if distribution is not None else [int(fixed_label) if fixed_label is not None else cap]


def for_study(
    trials: Sequence[Any], space: dict[str, Any], screen: Any, floor: float, limit_gib: float | None, config: Any
) -> str:
    """nothing_feasible over a finished study, the labels and coverage read from its space and data screen."""
    cap = int(config.model.max_positions)
    labels = label_choices(space, config.memory.max_label_length, cap)
    coverage_of = None if screen is None else screen.coverage_of
    return nothing_feasible(trials, labels, coverage_of, floor, limit_gib, cap)
