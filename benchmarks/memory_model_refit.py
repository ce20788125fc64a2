"""Six probes against four, on the same measured rows: refit the memory model from a memory_model_gpu.py result's
recorded probes, once from all of them with the terms memfit fits now ("now"), and once from the first four alone
with the terms it fitted before run 16 (no T5 cross-attention term: "four"), and score both on the group's
held-apart rows.

    python benchmarks/memory_model_refit.py benchmarks/results/memory_model_run16_chunked.json

Results from before run 16 hold four probes; `--rows-as-probes` lends the "now" fit some of a group's measured rows
as probes (both fits are then scored on the other rows), which is how session 31 read run 15's misses:

    python benchmarks/memory_model_refit.py benchmarks/results/memory_model_run15_chunked.json \
        --rows-as-probes qwen2_5_0_5b:off:1x3072x3072 t5_base:off:2x2816x384,30x320x128

CPU, seconds: no model is built; the measured peaks are the result file's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _errors(fit, arch, rows: list[dict]) -> tuple[list[float], list[float]]:
    allocated, reserved = [], []
    for row in rows:
        if row.get("oom"):
            continue
        batch, source, label = row["shape"] if len(row["shape"]) == 3 else (*row["shape"], row["shape"][-1])
        allocated.append(100 * (fit.allocated(batch, source, label, arch) / row["allocated"] - 1))
        reserved.append(100 * (fit.reserved(batch, source, label, arch) / row["reserved"] - 1))
    return allocated, reserved


def _summary(errors: list[float]) -> str:
    size = [abs(e) for e in errors]
    return f"median {statistics.median(size):.2f}%, max {max(size):.2f}%" if size else "-"


def _describe(name: str, errors: dict[str, list[float]]) -> str:
    allocated = " ".join(f"{e:+.1f}" for e in errors["allocated"])
    return f"{name}: {allocated} / " + " ".join(f"{e:+.1f}" for e in errors["reserved"])


def _as_probe(row: dict) -> dict:
    """A measured row in a calibration probe's form: its forward + backward and optimizer-step peaks."""
    batch, source, label = row["shape"]
    allocated, reserved = row["backward"]
    step_allocated, step_reserved = row["step"]
    return {
        "batch": batch,
        "source": source,
        "label": label,
        "allocated": allocated,
        "reserved": reserved,
        "step_allocated": step_allocated,
        "step_reserved": step_reserved,
    }


def _lent(spec: list[str]) -> dict[tuple[str, bool], list[list[int]]]:
    """--rows-as-probes MODEL:on|off:BxSxL[,BxSxL] into {(model, checkpointing): [shapes]}."""
    lent = {}
    for item in spec:
        model, checkpointing, shapes = item.split(":")
        lent[(model, checkpointing == "on")] = [[int(n) for n in shape.split("x")] for shape in shapes.split(",")]
    return lent


def refit(paths: list[str], rows_as_probes: list[str] | None = None) -> dict:
    from memfit.memory.calibration import fit_peak
    from memfit.memory.model import Architecture

    lent = _lent(rows_as_probes or [])
    scored = {name: {"allocated": [], "reserved": []} for name in ("now", "four")}
    groups = []
    for path in paths:
        for group in json.loads(Path(path).read_text())["groups"]:
            calibration = group.get("calibration")
            if not calibration:
                continue
            arch = Architecture(**group["architecture"])
            branches = "backward" not in calibration["fit"]["windows"]
            borrowed = lent.get((group["model"], group["gradient_checkpointing"]), [])
            rows = [row for row in group["rows"] if not row.get("oom") and row["shape"] not in borrowed]
            probes = calibration["probes"] + [_as_probe(row) for row in group["rows"] if row["shape"] in borrowed]
            # before run 16: the first four probes, and T5 without its cross-attention term
            four_arch = arch if branches else replace(arch, relative_position_bias=False)
            fits = {"four": (fit_peak(four_arch, probes[:4], branches), four_arch)}
            with contextlib.suppress(ValueError):  # four probes cannot fit T5's five terms
                fits["now"] = (fit_peak(arch, probes, branches), arch)
            entry = {
                "model": group["model"],
                "checkpointing": group["gradient_checkpointing"],
                "loss": group["loss"],
                "probes": len(probes),
            }
            for name, (fit, fitted_arch) in fits.items():
                allocated, reserved = _errors(fit, fitted_arch, rows)
                scored[name]["allocated"] += allocated
                scored[name]["reserved"] += reserved
                entry[name] = {
                    "allocated": [round(e, 2) for e in allocated],
                    "reserved": [round(e, 2) for e in reserved],
                }
            groups.append(entry)
    totals = {name: {kind: _summary(errors) for kind, errors in kinds.items()} for name, kinds in scored.items()}
    return {"groups": groups, "totals": totals, "rows": {name: len(k["allocated"]) for name, k in scored.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="memory_model_gpu.py result files")
    parser.add_argument("--rows-as-probes", nargs="*", default=[], help="MODEL:on|off:BxSxL[,BxSxL] (checkpointing)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    result = refit(args.results, args.rows_as_probes)
    for group in result["groups"]:
        fits = [_describe(name, group[name]) for name in ("now", "four") if name in group]
        head = f"{group['model']:<14} ckpt={group['checkpointing']!s:<5} {group['loss']:<8} {group['probes']} probes"
        print(head, " | ".join(fits))
    print(json.dumps({"rows": result["rows"], **result["totals"]}, indent=1))


if __name__ == "__main__":
    main()
