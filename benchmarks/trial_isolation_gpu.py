"""Do measured peaks depend on trial order? The same two configurations, big-first and small-first, in sweeps with
a fresh process per trial (isolation=process, memfit's default) and with trials in the sweeper's process
(isolation=none). With isolation, the small configuration's measured worst-case peak must not move with the order.

    python benchmarks/trial_isolation_gpu.py --tokenizer .gpu/tok --out $OUT/trial_isolation_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIG = {"trainer.batch_size": 16, "memory.max_source_length": 1024, "memory.max_label_length": 256}
SMALL = {"trainer.batch_size": 2, "memory.max_source_length": 512, "memory.max_label_length": 64}


def sweep(isolation: str, order: list[dict], model: str, tokenizer: str | None, workdir: Path) -> dict:
    import optuna

    storage = f"sqlite:///{workdir}/optuna.db"
    name = f"isolation-{isolation}-{'big-first' if order[0] is BIG else 'small-first'}"
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize", load_if_exists=True)
    for params in order:
        study.enqueue_trial(params)
    space = [f"{key}=choice({BIG[key]},{SMALL[key]})" for key in BIG]
    command = [
        sys.executable,
        str(ROOT / "train.py"),
        "-m",
        "sweep=budget",
        f"model={model}",
        "budget.gib=40",
        "trainer.max_steps=6",
        "memory.eval_enabled=false",
        "hydra.sweeper.coverage_floor=0",
        "hydra.sweeper.n_trials=2",
        f"hydra.sweeper.isolation={isolation}",
        f"hydra.sweeper.storage={storage}",
        f"hydra.sweeper.study_name={name}",
        f"hydra.sweeper.preset_dir={workdir}/preset",
        f"hydra.sweep.dir={workdir}/{name}",
        f"output_dir={workdir}",
        *space,
    ]
    if tokenizer:
        command.append(f"model.tokenizer={tokenizer}")
    start = time.perf_counter()
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=os.environ)
    trials = optuna.load_study(study_name=name, storage=storage).trials
    return {
        "study": name,
        "returncode": out.returncode,
        "seconds": time.perf_counter() - start,
        "trials": [
            {
                "number": t.number,
                "params": t.params,
                "status": t.user_attrs.get("status"),
                "worst_case_peak_gib": t.user_attrs.get("worst_case_peak_gib"),
                "tokens_per_s": t.user_attrs.get("tokens_per_s"),
            }
            for t in trials
        ],
        "stderr_tail": out.stderr[-1500:] if out.returncode else "",
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="pegasus_large")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--out", default="benchmarks/results/trial_isolation_gpu.json")
    parser.add_argument("--isolation", nargs="+", default=["process", "none"], choices=["process", "none"])
    args = parser.parse_args()
    import torch

    result = {
        "command": " ".join(["python", *sys.argv]),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "model": args.model,
        "fork_trials": True,  # the sweeper's default since session 22: each trial forked from the fork server
        "sweeps": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for isolation in args.isolation:
            for order in ([BIG, SMALL], [SMALL, BIG]):
                result["sweeps"].append(sweep(isolation, order, args.model, args.tokenizer, Path(tmp)))
                Path(args.out).write_text(json.dumps(result, indent=1) + "\n")  # partial results survive a cut
    small = {
        s["study"]: next(t["worst_case_peak_gib"] for t in s["trials"] if t["params"]["trainer.batch_size"] == 2)
        for s in result["sweeps"]
    }
    result["small_config_worst_case_peak_gib"] = small
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(small, indent=1))


if __name__ == "__main__":
    main()
