"""Which feasible trial a throughput sweep picks: the fastest measured, unless trials within its measurement's noise
keep more of the data.

A timed segment of a few steps measures tokens/s only to within its steps' spread (standard deviation over mean:
9-35%, benchmarks/results/sweep_ties_pegasus_large_24_seed2_steps10.json), and between runs of one sweep one
configuration's rate moved by up to 20%, while the top configurations of a space are often closer than that: "the
fastest" alone flipped from run to run.
Trials within the band of the fastest are ties, and of those the one keeping the most label tokens, then source
tokens, is picked (the fastest of them where they keep the same): one pick whichever of them the noise put first,
and more of the data trained on where speed cannot tell them apart. Like the one-standard-error rule of model
selection, it trades an unprovable few percent of speed for a pick that reruns agree on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memfit.sweep.outcome import directions

THROUGHPUT_OBJECTIVES = ("throughput", "epoch_throughput")  # measured over steps whose spread the trial records


@dataclass(frozen=True)
class Pick:
    best: Any  # the trial picked (an Optuna FrozenTrial)
    fastest: Any  # the trial with the best objective value
    band: float  # the share of the fastest trial's value within which trials are ties; 0: the best value wins

    def describe(self) -> str:
        """Why `best` is not the fastest trial; empty where it is."""
        if self.best is self.fastest:
            return ""
        behind = 1 - self.best.values[0] / self.fastest.values[0]  # the share of the fastest's value the band takes
        return (
            f"; picked over trial {self.fastest.number} ({self.fastest.values[0]:.4g}: this one is {behind:.0%} "
            f"behind it, within the ±{self.band:.0%} tie band), as it keeps more of the data "
            "(hydra.sweeper.tie_band=0: the fastest)"
        )


def _kept(trial: Any) -> tuple[float, float]:
    attrs = trial.user_attrs
    return (attrs.get("label_coverage") or 0.0, attrs.get("source_coverage") or 0.0)


def pick(feasible: list[Any], names: list[str], tie_band: float | None) -> Pick:
    """The trial a study of objectives `names` picks among its feasible trials (single-objective; pareto mode
    takes its front). `tie_band`: the share of the fastest trial's value within which trials are ties; None: the
    fastest trial's own measured spread (`tokens_per_s_spread`). Other objectives than throughput have no ties."""
    best_of = max if directions(names)[0] == "maximize" else min
    fastest = best_of(feasible, key=lambda t: t.values[0])
    if len(names) != 1 or names[0] not in THROUGHPUT_OBJECTIVES:
        return Pick(fastest, fastest, 0.0)
    band = tie_band if tie_band is not None else float(fastest.user_attrs.get("tokens_per_s_spread") or 0.0)
    ties = [t for t in feasible if t.values[0] >= fastest.values[0] * (1 - band)]
    best = max(ties, key=lambda t: (*_kept(t), t.values[0]))
    return Pick(best, fastest if best.values[0] < fastest.values[0] else best, band)
