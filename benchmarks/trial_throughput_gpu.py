"""Why a sweep trial's tokens/s fell short of the warm table's (issue 4): warm-up, or the budget's allocator cap?

    python benchmarks/trial_throughput_gpu.py cap --tokenizer .gpu/tok --out $OUT/trial_throughput_cap.json
    python benchmarks/trial_throughput_gpu.py segment --tokenizer .gpu/tok --out $OUT/trial_throughput_segment.json

The live pegasus_large sweep at 24 GiB measured (16, 512, 256) at 35.3k tokens/s in its fresh trial process against
73.6k in sweep_strategies_gpu.py's warm, uncapped table. Each configuration here trains 20 steps in a fresh
`python train.py` process, as a trial does, twice at once on two GPUs: under the 24 GiB allocator cap
(`budget.enforce=true`, what a trial runs under) and judged against 24 GiB without the cap (`budget.enforce=false`).
Recorded per step from the run's MLflow store: tokens/s, the step's real tokens, and the caching allocator's
cumulative `num_alloc_retries` (each retry frees the cache and synchronises the device to fit under the cap).
Warm-up shows as slow first steps in both arms; cap pressure as retries and slow steps in the capped arm only.

segment: four configurations trained 80 steps each under the cap; for 5- and 10-step segments of each run, what a
trial would report under each rule, and memfit's epoch estimate (memfit.training.throughput: the segment's step times
applied to the epoch's batch plan, `epoch_plan`) against the same run's first-epoch rate (`epoch_reference`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from sweep_strategies_gpu import EFFECTIVE_BATCH, config_overrides, data_overrides, make_data  # noqa: E402

CONFIGS = [(16, 512, 256), (8, 1024, 512), (8, 512, 256)]
STEPS = 20
SEGMENT_CONFIGS = [(16, 512, 256), (4, 512, 512), (8, 512, 256), (8, 1024, 256)]
LONG_STEPS = 80


def arm(
    name: str, device: str, enforce: bool, data: Path, args: argparse.Namespace, configs: list, steps: int
) -> subprocess.Popen:
    """One process per arm, running the configurations in turn (each a fresh train.py, as a trial is)."""
    work = Path(args.work) / name
    script = []
    for batch, source, label in configs:
        tag = f"{batch}-{source}-{label}"
        command = [
            sys.executable,
            "train.py",
            f"model={args.model}",
            *data_overrides(data, args.tokenizer),
            "tracking=mlflow",
            *config_overrides(batch, source, label),
            f"budget.gib={args.budget:g}",
            f"budget.enforce={str(enforce).lower()}",
            f"trainer.max_steps={steps}",
            *args.set,
            f"output_dir={work / 'outputs'}",
            f"hydra.run.dir={work / tag}",
        ]
        script.append(" ".join(command) + f" > {work / tag}.log 2>&1")
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": device}  # torch's default threads, as the sweeper's trials now
    return subprocess.Popen(["bash", "-c", " ; ".join(script)], cwd=ROOT, env=env)


def read_arm(name: str, args: argparse.Namespace, configs: list) -> list[dict]:
    from mlflow.tracking import MlflowClient

    from memfit.tracking import default_tracking_uri, run_facts

    work = Path(args.work) / name
    client = MlflowClient(default_tracking_uri(str(work / "outputs")))
    rows = []
    for batch, source, label in configs:
        tag = f"{batch}-{source}-{label}"
        report_path = work / tag / "report.json"
        report = json.loads(report_path.read_text()) if report_path.exists() else {}

        def history(key: str, run_id: str) -> list[float]:
            return [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]

        run_id = report.get("run_id")
        metrics = run_facts(client, run_id) if run_id else {}
        rows.append(
            {
                "config": [batch, source, label],
                "status": report.get("status"),
                "reason": report.get("reason"),
                "tokens_per_s": report.get("tokens_per_s"),
                "worst_case_peak_gib": report.get("worst_case_peak_gib"),
                "step_tokens_per_s": history("train/tokens_per_s", run_id) if run_id else [],
                "alloc_retries": history("mem/alloc_retries", run_id) if run_id else [],
                "peak_reserved_gib": history("mem/peak_reserved_gib", run_id) if run_id else [],
                "window_s": history("train/window_s", run_id) if run_id else [],
                "new_shapes": history("train/new_shapes", run_id) if run_id else [],
                "padding_share": history("train/padding_share", run_id) if run_id else [],
                # the preflight's worst training shape: its first step (a new shape) and its repeats
                "preflight_first_step_s": metrics.get("preflight/first_step_s"),
                "preflight_repeat_step_s": metrics.get("preflight/repeat_step_s"),
            }
        )
    return rows


def epoch_plan_for(args: argparse.Namespace, data: Path, config: list[int]) -> object:
    """The epoch's batch plan of one configuration over this benchmark's data (memfit.training.throughput)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from memfit.config import register_configs
    from memfit.data import load_and_tokenize, model_columns
    from memfit.models import build_tokenizer
    from memfit.training.throughput import run_epoch_plan

    register_configs()
    GlobalHydra.instance().clear()
    overrides = [f"model={args.model}", *data_overrides(data, args.tokenizer), *config_overrides(*config), *args.set]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    return run_epoch_plan(cfg, model_columns(load_and_tokenize(cfg, build_tokenizer(cfg.model)).datasets["train"]))


def plan_estimate(row: dict, segment: int, plan: object) -> float | None:
    """What memfit's epoch estimate (memfit.training.throughput) makes of the first `segment` steps of this run."""
    from memfit.training.throughput import StepTimeModel, Window, epoch_tokens_per_s

    accumulation = -(-EFFECTIVE_BATCH // row["config"][0])
    windows = []
    for rate, seconds, new, share in list(
        zip(row["step_tokens_per_s"], row["window_s"], row["new_shapes"], row["padding_share"], strict=True)
    )[1:segment]:
        tokens = rate * seconds
        windows.append(Window(round(tokens), seconds, round(tokens / (1 - share)), accumulation, int(new)))
    model = StepTimeModel.fit(windows)
    return epoch_tokens_per_s(model, plan) if model else None


def segment_estimates(row: dict, segment: int, plan: object | None = None) -> dict:
    """What a `segment`-step trial would report under each rule, against the same run's later steps and against
    its first epoch (after the first step)."""
    windows = list(zip(row["step_tokens_per_s"], row["window_s"], row["new_shapes"], strict=True))

    def rate(ws: list) -> float | None:
        seconds = sum(w[1] for w in ws)
        return sum(w[0] * w[1] for w in ws) / seconds if ws and seconds > 0 else None

    first, later = windows[:segment], windows[segment:]
    seen = [w for w in first[1:] if w[2] == 0]
    return {
        "all_but_first": rate(first[1:]),  # the rule before: leave out only the first window
        "seen_shapes_only": rate(seen or first[1:]),  # memfit now: leave out windows that met a new shape
        "windows_with_new_shapes": sum(w[2] > 0 for w in first),
        "long_run_reference": rate(later[len(later) // 2 :]),  # the second half of the rest: shapes mostly seen
        # memfit's epoch estimate from the same steps and the epoch's batch plan, against the first epoch's rate
        "epoch_plan": plan_estimate(row, segment, plan) if plan is not None and row.get("padding_share") else None,
        "epoch_reference": rate(windows[1 : plan.micro_batches // -(-EFFECTIVE_BATCH // row["config"][0])])
        if plan is not None
        else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["cap", "segment"])
    parser.add_argument("--model", default="pegasus_large")
    parser.add_argument("--budget", type=float, default=24)
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", default="/tmp/memfit-trial-throughput")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--set", nargs="*", default=[], help="more overrides, e.g. memory.pad_to_multiple_of=64")
    parser.add_argument("--one-gpu", action="store_true", help="run the arms one after another on GPU 0")
    parser.add_argument(
        "--long-steps", type=int, default=LONG_STEPS, help="segment: steps per run (≥ 51 covers one epoch)"
    )
    args = parser.parse_args()
    data, _ = make_data(Path(args.work))
    started = time.perf_counter()
    if args.mode == "cap":  # the same configurations capped (GPU 0) and uncapped (GPU 1)
        plan = {"capped": ("0", True, CONFIGS, STEPS), "uncapped": ("1", False, CONFIGS, STEPS)}
    else:  # long runs, half the configurations per GPU, under the cap as trials run
        half = len(SEGMENT_CONFIGS) // 2
        plan = {
            "gpu0": ("0", True, SEGMENT_CONFIGS[:half], args.long_steps),
            "gpu1": ("1", True, SEGMENT_CONFIGS[half:], args.long_steps),
        }
    if args.one_gpu:  # every arm on GPU 0, one after another: the same runs, none beside another
        arms = {}
        for name, (_, enforce, configs, steps) in plan.items():
            arms[name] = arm(name, "0", enforce, data, args, configs, steps)
            arms[name].wait()
    else:
        arms = {
            name: arm(name, device, enforce, data, args, configs, steps)
            for name, (device, enforce, configs, steps) in plan.items()
        }
    for process in arms.values():
        process.wait()
    out = {
        "mode": args.mode,
        "model": args.model,
        "budget": args.budget,
        "overrides": args.set,
        "one_gpu": args.one_gpu,
        "wall_s": time.perf_counter() - started,
        **{name: read_arm(name, args, plan[name][2]) for name in arms},
    }
    if args.mode == "segment":
        for name in arms:
            for row in out[name]:
                if len(row["window_s"]) == args.long_steps:
                    plan = epoch_plan_for(args, data, row["config"])
                    row["epoch_plan"] = vars(plan)
                    row["estimates"] = {n: segment_estimates(row, n, plan) for n in (5, 10)}
    Path(args.out).write_text(json.dumps(out, indent=1))
    for name in arms:
        for row in out[name]:
            print(name, row["config"], row["status"], f"{row['tokens_per_s'] or 0:.0f}", flush=True)
            print("  tokens/s:", " ".join(f"{v / 1000:.1f}k" for v in row["step_tokens_per_s"]))
            shapes = " ".join(f"{v:.0f}" for v in row["new_shapes"])
            print("  new shapes:", shapes, "retries:", row["alloc_retries"][-1:])
            if "estimates" in row:
                print("  ", json.dumps(row["estimates"]))


if __name__ == "__main__":
    main()
