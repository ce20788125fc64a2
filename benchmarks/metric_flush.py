"""The periodic MLflow write that memfit's step hooks do not pay on every step: one batch of buffered metrics.

A step's hooks only append to a buffer; every `MlflowTracker.flush_every_s` seconds the buffer goes to the store in
one `log_batch`. This times that write for a 10 s window of steps (7 metrics per step, as the callback logs),
against a sqlite store, so its share of step time can be stated: write seconds / 10 s.

    python benchmarks/metric_flush.py --steps-per-window 40 --windows 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

METRICS = ("train/loss", "train/learning_rate", "train/grad_norm", "train/tokens_per_s")
MEM = ("mem/peak_allocated_gib", "mem/peak_reserved_gib", "train/epoch")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps-per-window", type=int, default=40, help="steps in 10 s (0.25 s/step)")
    parser.add_argument("--windows", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/metric_flush.json")
    args = parser.parse_args()

    from memfit.tracking import MlflowTracker

    with tempfile.TemporaryDirectory() as tmp:
        tracker = MlflowTracker(f"sqlite:///{tmp}/mlflow.db", "flush", "bench", {})
        tracker.flush_every_s = float("inf")  # this script decides when to write
        seconds = []
        step = 0
        for _ in range(args.windows):
            for _ in range(args.steps_per_window):
                step += 1
                tracker.log_metrics({name: 0.1 * step for name in METRICS + MEM}, step=step)
            start = time.perf_counter()
            tracker.flush()
            seconds.append(time.perf_counter() - start)
        tracker.finish()
    result = {
        "command": "python benchmarks/metric_flush.py " + f"--steps-per-window {args.steps_per_window} "
        f"--windows {args.windows}",
        "metrics_per_write": args.steps_per_window * len(METRICS + MEM),
        "median_write_s": statistics.median(seconds),
        "max_write_s": max(seconds),
        "share_of_wall_time_pct_at_one_write_per_10s": 100 * statistics.median(seconds) / 10.0,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
