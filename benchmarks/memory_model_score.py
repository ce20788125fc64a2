"""Score memory_model_gpu.py result files together: each group's per-row errors (predicted/measured - 1, in %) and
the totals over every row, for allocated, reserved as memfit predicted it, and where the rows hold them the
alternatives recorded beside it (`predicted_reserved_fitted_ratio`; the largest of `predicted_reserved_templates`,
the replay's rule up to session 42).

    python benchmarks/memory_model_score.py benchmarks/results/memory_model_run20_*_h100.json

CPU, instant: the measured peaks are the result files'.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _error(predicted: float, measured: float) -> float:
    return 100 * (predicted / measured - 1)


def _largest_template(row: dict) -> int | None:
    templates = row.get("predicted_reserved_templates")
    return max(max(templates), row["predicted_allocated"]) if templates else None


COLUMNS = {
    "allocated": lambda row: (row["predicted_allocated"], row["allocated"]),
    "reserved": lambda row: (row["predicted_reserved"], row["reserved"]),
    "reserved, largest template": lambda row: (_largest_template(row), row["reserved"]),
    "reserved, fitted ratio": lambda row: (row.get("predicted_reserved_fitted_ratio"), row["reserved"]),
}


def score(paths: list[Path]) -> tuple[list[dict], dict[str, list[float]]]:
    groups, totals = [], {name: [] for name in COLUMNS}
    for path in paths:
        for group in json.loads(path.read_text())["groups"]:
            rows = [row for row in group["rows"] if not row.get("oom")]
            entry = {
                "group": f"{group['model']} {'ckpt' if group['gradient_checkpointing'] else 'off'} {group['loss']}",
                "reserved_by": group.get("calibration", {}).get("reserved_by", "fitted ratio"),
            }
            for name, read in COLUMNS.items():
                pairs = [read(row) for row in rows]
                if all(predicted is not None for predicted, _ in pairs):
                    entry[name] = [_error(predicted, measured) for predicted, measured in pairs]
                    totals[name] += entry[name]
            groups.append(entry)
    return groups, totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path, help="memory_model_gpu.py result files")
    groups, totals = score(parser.parse_args().results)
    for entry in groups:
        print(f"{entry['group']} (reserved by {entry['reserved_by']})")
        for name in COLUMNS:
            if name in entry:
                print(f"  {name:<27} " + " ".join(f"{e:+.2f}" for e in entry[name]))
    for name, errors in totals.items():
        if errors:
            size = [abs(e) for e in errors]
            print(
                f"{name:<27} {len(errors)} rows: median {statistics.median(size):.2f}%, max {max(size):.2f}%, "
                f"from {min(errors):+.2f}% to {max(errors):+.2f}%"
            )


if __name__ == "__main__":
    main()
