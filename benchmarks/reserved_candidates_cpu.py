"""Candidate models of peak *reserved* memory, refitted from a memory_model_gpu.py result's recorded probes and
scored on its held-apart rows beside memfit's own (allocated × overhead + cached bytes per byte of logits):

    python benchmarks/reserved_candidates_cpu.py benchmarks/results/memory_model_run18_*_h100.json

- memfit: what memfit fits now (memfit.memory.calibration.fit_peak);
- constant: allocated plus the probes' mean excess (reserved - allocated);
- logits: allocated plus an excess linear in the float32 logits' bytes;
- ratio: allocated times the probes' mean reserved/allocated;
- terms: reserved linear in the shape's own terms (memfit.memory.model.shape_terms), where the probes outnumber them;
- windows: where the probes were measured window by window (checkpointed seq2seq), the largest of each window's
  fitted allocated plus its mean excess.

Every candidate predicts from memfit's fitted allocated peak, so only the reserved part differs. CPU, seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _candidates(arch, probes: list[dict], fit) -> dict:
    from memfit.memory.model import WINDOW_TERMS, fit_terms, logits_bytes, shape_terms, window_terms

    def logits(b: int, s: int, label: int) -> float:
        return float(logits_bytes(b, s, label, arch))

    excess = [p["reserved"] - p["allocated"] for p in probes]
    mean_excess = statistics.fmean(excess)
    ratio = statistics.fmean(p["reserved"] / p["allocated"] for p in probes)
    by_logits = fit_terms(
        [{"constant": 1.0, "logits": logits(p["batch"], p["source"], p["label"])} for p in probes], excess
    )
    out = {
        "memfit": lambda a, b, s, label: fit.reserved_from(a, logits(b, s, label)),
        "constant": lambda a, b, s, label: a + mean_excess,
        "logits": lambda a, b, s, label: a + by_logits.predict({"constant": 1.0, "logits": logits(b, s, label)}),
        "ratio": lambda a, b, s, label: a * ratio,
    }
    terms = [shape_terms(p["batch"], p["source"], p["label"], arch) for p in probes]
    if len(probes) > len(terms[0]):
        direct = fit_terms(terms, [p["reserved"] for p in probes])
        out["terms"] = lambda a, b, s, label: direct.predict(shape_terms(b, s, label, arch))
    windows = list(WINDOW_TERMS)
    if all(f"{w}_reserved" in p for p in probes for w in windows) and set(fit.windows) == set(windows):
        extra = {w: statistics.fmean(p[f"{w}_reserved"] - p[f"{w}_allocated"] for p in probes) for w in windows}
        out["windows"] = lambda a, b, s, label: max(
            fit.windows[w].predict(window_terms(w)(b, s, label, arch)) + extra[w] for w in windows
        )
    return out


def score(paths: list[str]) -> dict:
    from memfit.memory.calibration import fit_peak
    from memfit.memory.model import Architecture

    errors: dict[str, list[float]] = {}
    groups = []
    for path in paths:
        for group in json.loads(Path(path).read_text())["groups"]:
            calibration = group.get("calibration")
            if not calibration:
                continue
            arch, probes = Architecture(**group["architecture"]), calibration["probes"]
            fit = fit_peak(arch, probes, group["gradient_checkpointing"])
            entry = {"model": group["model"], "checkpointing": group["gradient_checkpointing"], "loss": group["loss"]}
            for name, predict in _candidates(arch, probes, fit).items():
                rows = []
                for row in group["rows"]:
                    if row.get("oom"):
                        continue
                    b, s, label = row["shape"] if len(row["shape"]) == 3 else [*row["shape"], row["shape"][-1]]
                    reserved = predict(fit.allocated(b, s, label, arch), b, s, label)
                    rows.append(round(100 * (reserved / row["reserved"] - 1), 2))
                entry[name] = rows
                errors.setdefault(name, []).extend(rows)
            groups.append(entry)
    totals = {}
    for name, values in errors.items():
        size = [abs(v) for v in values]
        totals[name] = {
            "rows": len(size),
            "median": statistics.median(size),
            "max": max(size),
            "over_5": sum(v > 5 for v in size),
        }
    return {"groups": groups, "totals": totals}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="memory_model_gpu.py result files")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    result = score(args.results)
    for group in result["groups"]:
        scored = "  ".join(f"{k}: {max(map(abs, v)):.1f}" for k, v in group.items() if isinstance(v, list) and v)
        print(f"{group['model']:<14} ckpt={group['checkpointing']!s:<5} {group['loss']:<8} max |error| %  {scored}")
    for name, total in result["totals"].items():
        size = f"median {total['median']:.2f}%, max {total['max']:.2f}%"
        print(f"{name:<9} {total['rows']} rows: {size}, {total['over_5']} past 5%")


if __name__ == "__main__":
    main()
