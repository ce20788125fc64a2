"""Six probes against four, on the same measured rows: refit the memory model from a memory_model_gpu.py result's
recorded probes, once from all of them with the terms memfit fits now ("now"), and once from the first four alone
with the terms it fitted before run 16 (no T5 cross-attention term: "four"), and score both on the group's
held-apart rows.

    python benchmarks/memory_model_refit.py benchmarks/results/memory_model_run16_chunked.json

Where a checkpointed seq2seq model's probes were measured window by window (Pegasus and BART since session 35),
"whole" also fits them as one sum over the step, as before, and scores it on the same rows.

Results from before run 16 hold four probes; `--rows-as-probes` lends the "now" fit some of a group's measured rows
as probes (both fits are then scored on the other rows), which is how session 31 read run 15's misses:

    python benchmarks/memory_model_refit.py benchmarks/results/memory_model_run15_chunked.json \
        --rows-as-probes qwen2_5_0_5b:off:1x3072x3072 t5_base:off:2x2816x384,30x320x128

"reserved_excess" scores a candidate reserved model beside memfit's (allocated plus a constant excess and bytes per
byte of logits, fitted over the probes; T5's windows keep memfit's): a lead, to be scored on rows it was not fitted
on before anything adopts it.

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


def _errors(fit, arch, rows: list[dict], candidate: bool, excess=None) -> dict[str, list[float]]:
    """Each row's error, predicted/measured - 1 in %: allocated, reserved as memfit predicts it, and for the
    `candidate` reserved model, allocated plus the excess that _excess_model fitted (memfit's reserved where no
    `excess` is given: T5's windows keep theirs)."""
    from memfit.memory.model import logits_bytes

    errors = {"allocated": [], "reserved": [], "reserved_excess": []}
    for row in rows:
        if row.get("oom"):
            continue
        batch, source, label = row["shape"]
        allocated = fit.allocated(batch, source, label, arch)
        errors["allocated"].append(100 * (allocated / row["allocated"] - 1))
        errors["reserved"].append(100 * (fit.reserved(batch, source, label, arch) / row["reserved"] - 1))
        if candidate:
            reserved = (
                allocated + excess(logits_bytes(batch, source, label, arch)) if excess else errors["reserved"][-1]
            )
            errors["reserved_excess"].append(100 * (reserved / row["reserved"] - 1) if excess else reserved)
    return errors


def _excess_model(arch, probes: list[dict]):
    """A candidate reserved model, for comparison (not memfit's): the allocator's excess over allocated as a constant
    plus bytes per byte of logits, fitted over the probes, raised by the largest probe it under-reads."""
    from memfit.memory.model import fit_terms, logits_bytes

    rows = [{"constant": 1.0, "logits": float(logits_bytes(p["batch"], p["source"], p["label"], arch))} for p in probes]
    excess = [p["reserved"] - p["allocated"] for p in probes]
    try:
        coefficients = fit_terms(rows, excess).coefficients
    except ValueError:  # every probe's logits alike
        coefficients = {"constant": statistics.fmean(excess), "logits": 0.0}
    if coefficients["logits"] < 0:
        coefficients = {"constant": statistics.fmean(excess), "logits": 0.0}

    def read(logits: float) -> float:
        return coefficients["constant"] + coefficients["logits"] * logits

    top = max(e - read(row["logits"]) for e, row in zip(excess, rows, strict=True))
    return lambda logits: read(logits) + top


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


WHOLE_STEP = ("batch", "source", "label", "allocated", "reserved", "step_allocated", "step_reserved")


def _whole_step(probe: dict) -> dict:
    """A probe without its windows' peaks, so it fits as one sum over the step (as before windows, session 35)."""
    return {key: probe[key] for key in WHOLE_STEP}


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
    scored = {name: {"allocated": [], "reserved": [], "reserved_excess": []} for name in ("now", "four", "whole")}
    groups = []
    for path in paths:
        for group in json.loads(Path(path).read_text())["groups"]:
            calibration = group.get("calibration")
            if not calibration or "windows" not in calibration["fit"]:  # none, or a format before run 10's
                continue
            arch = Architecture(**group["architecture"])
            branches = "backward" not in calibration["fit"]["windows"]
            borrowed = lent.get((group["model"], group["gradient_checkpointing"]), [])
            rows = [row for row in group["rows"] if not row.get("oom") and row["shape"] not in borrowed]
            for row in rows:  # causal rows may be recorded as (batch, length)
                row["shape"] = list(row["shape"]) if len(row["shape"]) == 3 else [*row["shape"], row["shape"][-1]]
            probes = calibration["probes"] + [_as_probe(row) for row in group["rows"] if row["shape"] in borrowed]
            # before run 16: the first four probes, and T5 without its cross-attention term
            four_arch = arch if branches else replace(arch, relative_position_bias=False)
            checkpointed = group["gradient_checkpointing"]
            fits = {"four": (fit_peak(four_arch, probes[:4], checkpointed), four_arch)}
            with contextlib.suppress(ValueError):  # four probes cannot fit T5's five terms
                fits["now"] = (fit_peak(arch, probes, checkpointed), arch)
            if branches and not arch.relative_position_bias:  # windows against one fit of the same probes' whole step
                fits["whole"] = (fit_peak(arch, [_whole_step(p) for p in probes], checkpointed), arch)
            entry = {
                "model": group["model"],
                "checkpointing": group["gradient_checkpointing"],
                "loss": group.get("loss", "standard"),  # runs before 14 had no loss knob
                "probes": len(probes),
            }
            for name, (fit, fitted_arch) in fits.items():
                excess = _excess_model(fitted_arch, probes) if name == "now" and not branches else None
                errors = _errors(fit, fitted_arch, rows, name == "now", excess)
                for kind, values in errors.items():
                    scored[name][kind] += values
                entry[name] = {kind: [round(e, 2) for e in values] for kind, values in errors.items()}
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
        fits = [_describe(name, group[name]) for name in ("now", "four", "whole") if name in group]
        head = f"{group['model']:<14} ckpt={group['checkpointing']!s:<5} {group['loss']:<8} {group['probes']} probes"
        print(head, " | ".join(fits))
    print(json.dumps({"rows": result["rows"], **result["totals"]}, indent=1))


if __name__ == "__main__":
    main()
