"""Issue 26's reserved memory by replaying the CUDA caching allocator (CPU, from recorded traces).

    python benchmarks/allocator_replay_cpu.py benchmarks/results/allocator_traces/*.npz [--out results.json]

Each trace (`allocator_trace_gpu.py --sites 8`: one model and memory setting, the calibration's probe shapes and
run 18's held-apart shapes, every allocator event with its call site) is scored twice:

1. **Replay**: each shape's own events through `memfit.memory.allocator.ExpandableSegments` from the allocator's
   recorded starting state: does it place every allocation at the traced address and reach the measured peak
   reserved?
2. **Prediction**: for each held-apart shape, an `AllocationProgram` (a calibration probe's events, each
   allocation's size fitted as a law of the shape over the other probes) replayed at the held-apart shape, against
   its measured peak reserved. Every probe but the first (whose events hold the process's one-time allocations)
   serves as template, and the prediction is the largest of their figures (chosen on the first five traces, where
   the nearest template alone missed by up to 5.8%; benchmarks/README.md, "Run 19", says which rules came from
   which traces). Each template's figure is recorded too.

With `--fitted memory_model_run18_*.json` (memory_model_gpu.py's results for the same groups and shapes, measured
with the same release), the replay is set beside memfit's fitted model on the rows both measured alike: the fitted
model alone, the replay alone, and the replay for checkpointed groups with the fitted model elsewhere (where the
backward is one run of allocations without Python frames, which the alignment cannot follow across shapes).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from memfit.memory.allocation_program import AllocationProgram
from memfit.memory.allocator import Events, replay


def score(path: Path) -> dict:
    import numpy as np

    arrays = np.load(path)
    shapes = json.loads(str(arrays["shapes"]))
    sites = json.loads(str(arrays["meta"])).get("sites", [])
    frameless = sites.index("") if "" in sites else -2
    events = {s["key"]: Events.from_trace(arrays, s["key"]) for s in shapes}
    out = {"trace": path.name, "replay": [], "prediction": []}
    for shape in shapes:
        replayed = replay(events[shape["key"]])
        own = events[shape["key"]]
        traced = [a for a, action in zip(own.addr, own.action, strict=True) if action == 0]
        out["replay"].append(
            {
                "key": shape["key"],
                "shape": shape["shape"],
                "measured_reserved": shape["reserved"],
                "replayed_reserved": replayed.peak_reserved,
                "misplaced": sum(a != b for a, b in zip(traced, replayed.addresses, strict=True)),
            }
        )
    probes = [(s["key"], tuple(s["shape"])) for s in shapes if s["kind"] == "probe"]
    started = time.perf_counter()
    programs = {
        key: AllocationProgram.fit((shape, events[key]), [(s, events[k]) for k, s in probes if k != key], frameless)
        for key, shape in probes
    }
    fit_seconds = time.perf_counter() - started
    for shape in (s for s in shapes if s["kind"] == "held_apart"):
        target = tuple(shape["shape"])
        started = time.perf_counter()
        by_template = {key: program.predict(target) for key, program in programs.items()}
        chosen = max((key for key, _ in probes[1:]), key=lambda key: by_template[key][0])
        out["prediction"].append(
            {
                "key": shape["key"],
                "shape": shape["shape"],
                "measured_reserved": shape["reserved"],
                "measured_allocated": shape["allocated"],
                "template": chosen,
                "predicted_reserved": by_template[chosen][0],
                "predicted_allocated": by_template[chosen][1],
                "by_template": {k: {"reserved": r, "allocated": a} for k, (r, a) in by_template.items()},
                "unfitted": {k: p.unfitted for k, p in programs.items()},
                "seconds_per_prediction": (time.perf_counter() - started) / len(programs),
            }
        )
    out["fit_seconds"] = fit_seconds
    return out


def error(predicted: int, measured: int) -> float:
    return 100 * (predicted / measured - 1)


def _summary(label: str, errors: list[float]) -> None:
    absolute = sorted(abs(e) for e in errors)
    median, worst = absolute[len(absolute) // 2], absolute[-1]
    print(f"  {label}: {len(errors)} rows, median {median:.2f}%, max {worst:.2f}%, most under {min(errors):+.2f}%")


def beside_fitted(results: list[dict], fitted_paths: list[Path]) -> None:
    """The replay's and the fitted model's reserved on the rows both benchmarks measured at the same bytes."""
    replayed = {}
    for result in results:
        group = result["trace"].split("_", 1)[1].removesuffix(".npz")
        for row in result["prediction"]:
            replayed[(group, tuple(row["shape"]))] = row
    fitted, replay, combined = [], [], []
    for path in fitted_paths:
        for group in json.loads(path.read_text())["groups"]:
            checkpointed = group["gradient_checkpointing"]
            name = f"{group['model']}_{'ckpt' if checkpointed else 'off'}_{group['loss']}"
            for row in group["rows"]:
                match = replayed.get((name, tuple(row["shape"])))
                if match is None or match["measured_reserved"] != row.get("reserved"):
                    continue  # another shape, or measured by another release
                fitted.append(error(row["predicted_reserved"], row["reserved"]))
                replay.append(error(match["predicted_reserved"], row["reserved"]))
                combined.append(replay[-1] if checkpointed else fitted[-1])
    if fitted:
        print("reserved beside memory_model_gpu.py's fitted model, on the rows both measured alike:")
        _summary("fitted model", fitted)
        _summary("replay", replay)
        _summary("replay where checkpointed, fitted model elsewhere", combined)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--fitted", nargs="*", type=Path, default=[], help="memory_model_gpu.py results to compare")
    args = parser.parse_args()
    results = []
    for path in args.traces:
        result = score(path)
        results.append(result)
        exact = sum(r["replayed_reserved"] == r["measured_reserved"] and not r["misplaced"] for r in result["replay"])
        print(
            f"{path.name}: replay exact on {exact} of {len(result['replay'])} shapes; fit {result['fit_seconds']:.1f} s"
        )
        for row in result["prediction"]:
            spread = [error(t["reserved"], row["measured_reserved"]) for t in row["by_template"].values()]
            print(
                f"  {row['shape']}: reserved {error(row['predicted_reserved'], row['measured_reserved']):+.2f}% "
                f"(template {row['template']}; any template {min(spread):+.1f}..{max(spread):+.1f}%), "
                f"allocated {error(row['predicted_allocated'], row['measured_allocated']):+.2f}%"
            )
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))
    errors = sorted(
        abs(error(r["predicted_reserved"], r["measured_reserved"])) for x in results for r in x["prediction"]
    )
    if errors:
        median, worst = errors[len(errors) // 2], errors[-1]
        print(f"reserved over {len(errors)} held-apart rows: median {median:.2f}%, max {worst:.2f}%")
    beside_fitted(results, args.fitted)


if __name__ == "__main__":
    main()
