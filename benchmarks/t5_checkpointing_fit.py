"""Why T5 with gradient checkpointing is not yet modelled, and what shape its peak has (issue 5). CPU, seconds.

    python benchmarks/t5_checkpointing_fit.py

Reads the 30 checkpointed t5_base peaks that memory_model_gpu.py measured on the H200 in runs 1-3 (probes and
held-apart rows: forward + backward peak allocated, model state included) and fits forms of

    peak = model state + max(E, D)

where E is the backward through the encoder (the last thing backward does) and D the backward through the decoder
and the logits. Each stack's peak is the kept checkpoints and position bias plus one recomputed layer; T5 computes
its relative position bias in its first layer as (q, k)-sized int64 positions and buckets and a (q, k, heads) float32
lookup, per sequence, not per batch row: a heads·n² term with no batch in it.

Printed: how well each form can fit all 30 points at once (its best case), and how far a fit from the four probes
memfit's calibration would run (checkpointed: batch × 4) is from the other 26 points.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

RESULTS = Path(__file__).resolve().parent / "results"
GIB = 2**30
HEADS = 12
STANDARD_PROBES = [(16, 512, 128), (16, 1024, 128), (16, 512, 512), (32, 256, 256)]


def checkpointed_t5_points() -> tuple[np.ndarray, float]:
    points, state = [], None
    for run in ("run1", "run2", "run3"):
        for group in json.loads((RESULTS / f"memory_model_{run}.json").read_text())["groups"]:
            if group["model"] != "t5_base" or not group["gradient_checkpointing"]:
                continue
            state = sum(group["state"].values())  # weights, gradients and AdamW state: all live at step 2's backward
            for probe in group["calibration"]["probes"]:
                points.append((probe["batch"], probe["source"], probe["label"], probe["allocated"]))
            for row in group["rows"]:
                if not row.get("oom"):
                    points.append((*row["shape"], row.get("backward", [row["allocated"]])[0]))
    return np.array(points, dtype=float), float(state)


def terms(points: np.ndarray) -> dict[str, np.ndarray]:
    b, s, l = points[:, 0], points[:, 1], points[:, 2]  # noqa: E741 - label length, as in the papers' notation
    return {
        "one": np.ones_like(b),
        "bs": b * s / 1e4,
        "bl": b * l / 1e4,
        "bhs2": b * HEADS * s * s / 1e8,
        "bhl2": b * HEADS * l * l / 1e8,
        "bhls": b * HEADS * l * s / 1e8,
        "hs2": HEADS * s * s / 1e8,
        "hl2": HEADS * l * l / 1e8,
    }


# a branch is [(coefficient, term)]; a coefficient named in both branches is shared
Branches = tuple[list[tuple[str, str]], list[tuple[str, str]]]
STATE = [("held", "state")]  # weights, gradients, AdamW state: a fixed coefficient of 1
PER_BATCH: Branches = (
    STATE + [("e0", "one"), ("e_bs", "bs"), ("bhs2", "bhs2")],
    STATE + [("d0", "one"), ("d_bs", "bs"), ("bl", "bl"), ("bhl2", "bhl2"), ("bhls", "bhls")],
)
WITH_BIAS: Branches = (PER_BATCH[0] + [("hs2", "hs2")], PER_BATCH[1] + [("hl2", "hl2")])
# four coefficients, as four probes can fit: shared constant and per-source-token bytes, the bias bytes fixed
FOUR: Branches = (
    STATE + [("c", "one"), ("bs", "bs"), ("bhs2", "bhs2"), ("bias", "hs2")],
    STATE + [("c", "one"), ("bs", "bs"), ("bl", "bl"), ("bias", "hl2")],
)


def predict(coef: dict[str, float], t: dict[str, np.ndarray], branches: Branches) -> np.ndarray:
    encoder, decoder = (sum(coef[c] * t[term] for c, term in branch) for branch in branches)
    return np.maximum(encoder, decoder)


def fit(t: dict, peaks: np.ndarray, branches: Branches, fixed: dict[str, float] | None = None) -> dict[str, float]:
    """Least squares of the relative error, non-negative coefficients, best of 30 starts (max() is not convex)."""
    fixed = {"held": 1.0, **(fixed or {})}
    free = sorted({c for branch in branches for c, _ in branch} - set(fixed))

    def residual(x: np.ndarray) -> np.ndarray:
        return predict({**fixed, **dict(zip(free, x, strict=True))}, t, branches) / peaks - 1

    starts = (np.random.default_rng(seed).uniform(0, 2, len(free)) for seed in range(30))
    best = min((least_squares(residual, x0, bounds=(0, np.inf)) for x0 in starts), key=lambda r: r.cost)
    return {**fixed, **dict(zip(free, best.x, strict=True))}


def errors(coef: dict, t: dict, peaks: np.ndarray, branches: Branches) -> str:
    e = np.abs(predict(coef, t, branches) / peaks - 1) * 100
    return f"median {np.median(e):.2f}%, max {e.max():.2f}%"


def subset(t: dict[str, np.ndarray], keep: np.ndarray) -> dict[str, np.ndarray]:
    return {k: v[keep] for k, v in t.items()}


def main() -> None:
    points, state = checkpointed_t5_points()
    peaks = points[:, 3] / GIB
    t = {**terms(points), "state": np.full(len(points), state / GIB)}
    print(f"{len(points)} checkpointed t5_base peaks (runs 1-3), relative errors of the whole peak\n")
    print("| form | fitted on | judged on | error |\n|---|---|---|---|")
    for name, branches in (("per-batch terms (8 free)", PER_BATCH), ("+ heads·n², no batch (10 free)", WITH_BIAS)):
        print(f"| {name} | all {len(points)} | the same | {errors(fit(t, peaks, branches), t, peaks, branches)} |")
    probes = np.array([(p[0], p[1], p[2]) in STANDARD_PROBES for p in points.tolist()])
    for bias_bytes in (0, 6, 8, 10, 12):
        coef = fit(subset(t, probes), peaks[probes], FOUR, {"bias": bias_bytes * 1e8 / GIB})  # GiB per term unit
        print(
            f"| 4 free (c, b·s, b·h·s², b·l), heads·n² at {bias_bytes} bytes each | the probes' 4 shapes "
            f"({probes.sum()} points) | the other {(~probes).sum()} | "
            f"{errors(coef, subset(t, ~probes), peaks[~probes], FOUR)} |"
        )


if __name__ == "__main__":
    main()
