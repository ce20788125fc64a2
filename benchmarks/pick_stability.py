"""Which configuration recorded H200 budget sweeps pick, with and without the tie band (memfit.sweep.ties): the
fastest measured trial against the trial `ties.pick` takes among those within the fastest trial's spread.

Replays the trials recorded by `sweep_strategies_gpu.py live` (results/sweep_*.json) through the public
`memfit.sweep.ties.pick`. Sweeps recorded before trials carried their coverage are given it by rank: on one data
set a longer max length keeps at least as many tokens, so (label length, source length) orders the trials as their
coverage would. CPU only, seconds:

    python benchmarks/pick_stability.py results/sweep_fork_pegasus_large_24_*.json ... [--out results/x.md]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import optuna

from memfit.sweep.ties import pick

LABEL, SOURCE = "memory.max_label_length", "memory.max_source_length"


def _frozen(trial: dict, labels: list[int], sources: list[int]) -> optuna.trial.FrozenTrial:
    params = trial["params"]
    made = optuna.trial.create_trial(
        params={},
        distributions={},
        values=[trial["epoch_tokens_per_s"]],
        user_attrs={
            "tokens_per_s_spread": trial.get("tokens_per_s_spread"),
            "label_coverage": labels.index(params[LABEL]) if LABEL in params else 0,  # rank: see the docstring
            "source_coverage": sources.index(params[SOURCE]) if SOURCE in params else 0,
            "params": params,
        },
    )
    made.number = trial["number"]
    return made


def picks(path: Path) -> dict:
    """The fastest measured trial and the tie band's pick of one recorded sweep."""
    recorded = json.loads(path.read_text())
    ran = [t for t in recorded["trials"] if t.get("status") == "ok" and not t.get("not_run")]
    measured = [t for t in ran if t.get("epoch_tokens_per_s")]
    labels = sorted({t["params"].get(LABEL, 0) for t in measured})
    sources = sorted({t["params"].get(SOURCE, 0) for t in measured})
    chosen = pick([_frozen(t, labels, sources) for t in measured], ["epoch_throughput"], None)
    micro = recorded.get("segment_micro_batches")
    segment = f"{micro} micro-batches" if micro else "10 steps"
    return {
        "sweep": path.stem,
        "segment": segment if "segment_micro_batches" in recorded else "not recorded",
        "wall_s": recorded.get("wall_s"),
        "fastest": _describe(chosen.fastest),
        "picked": _describe(chosen.best),
        "band": chosen.band,
    }


def _describe(trial: optuna.trial.FrozenTrial) -> str:
    params = trial.user_attrs["params"]
    fixed = f"fixed {params.get('trainer.batch_size')}"
    batch = "budget-shaped" if params.get("trainer.batching") == "budget" else fixed
    return f"{batch} {params.get(SOURCE)}/{params.get(LABEL)} ({trial.values[0] / 1e3:.1f}k)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="write the table here too")
    args = parser.parse_args()
    lines = [
        "| sweep | segment | wall s | fastest measured | picked (tie band) | band |",
        "|---|---|---|---|---|---|",
    ]
    for path in args.sweeps:
        row = picks(path)
        lines.append(
            f"| {row['sweep']} | {row['segment']} | {row['wall_s'] or 0:.0f} | {row['fastest']} | {row['picked']} "
            f"| ±{100 * row['band']:.0f}% |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
