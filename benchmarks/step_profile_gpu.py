"""Where a slow training step's seconds go (issue 4), and whether cuDNN's attention is what makes them slow.

    python benchmarks/step_profile_gpu.py --tokenizer .gpu/tok --out $OUT/step_profile.json     # 2 × H200 host

trial_throughput_gpu.py found steps several times slower than their neighbours, most where a micro-batch had a
padded shape not seen before. Here each run trains `--steps` steps under the budget's cap in a fresh process, as a
trial does, and every optimizer step is clocked with the device synchronised at its start and end:
- `step_s` (on_step_begin → on_step_end), with `forward_backward_s` (on_step_begin → on_pre_optimizer_step: every
  micro-batch's forward and backward, and the gradient clipping) apart from the rest (optimizer, scheduler);
  `between_s`, on_step_end → the next on_step_begin (the Trainer's log,
  the callbacks, loading the next batches);
- the step's real and padded tokens, micro-batches and new padded shapes (from memfit's collator), allocator
  retries, and `gc_s`, seconds in Python's garbage collector;
- in the `profile` variant only, each step under torch.profiler: the GPU's kernel seconds (`kernel_s`) and the
  host's most expensive operators (`host_top`). Its step times include the profiler's own cost.

Variants (`VARIANTS`): `cudnn`, torch's default, where scaled-dot-product attention takes cuDNN's kernel on an
H200; `efficient`, `memory.cudnn_attention=false`, torch's memory-efficient kernel instead; `profile`. (A
`keep_cache` variant, the preflight's probes leaving the allocator's cache full, patched a private function; it
was dropped in session 18, and its results in benchmarks/README.md stand.) The clock is a TrainerCallback handed
to `memfit.run.run(cfg, callbacks=...)`. Each GPU runs its
configurations (`PLAN`) in the order `--order` (ABBA by default), after a 3-step warm-up process: the first
process on a freshly started machine reads CUDA's libraries from disk, and its steps are slow for that alone.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from sweep_strategies_gpu import compose, config_overrides, data_overrides, make_data  # noqa: E402

# per GPU: (model, budget GiB, (batch, source, label)); each GPU runs its configurations one after another
PLAN = {
    "0": [("pegasus_large", 24, (16, 512, 256)), ("pegasus_large", 16, (4, 1024, 256))],
    "1": [("pegasus_large", 24, (8, 1024, 256)), ("qwen2_5_1_5b", 24, (2, 512, 256))],
}
VARIANTS = {
    "cudnn": ["memory.cudnn_attention=true"],  # torch's default on an H200: cuDNN's attention where it applies
    "efficient": ["memory.cudnn_attention=false"],  # torch's memory-efficient attention instead
    "profile": ["memory.cudnn_attention=true"],  # cudnn, each step under torch.profiler (its tokens/s is not real)
}
ORDER = ["cudnn", "efficient", "efficient", "cudnn"]  # ABBA: a drift over the runs does not favour either


class GcClock:
    """Seconds spent in Python's garbage collector, from gc.callbacks."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._began = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._began


class StepClock:
    """Per optimizer step: synchronised wall seconds and their split, allocator counters, GC seconds. A
    TrainerCallback's hooks (make_callback turns it into one); the collator is the training dataloader's."""

    def __init__(self, profile: bool) -> None:
        import torch

        self.torch, self.profile = torch, profile
        self.cuda = torch.cuda.is_available()  # a CPU smoke test of this script clocks without synchronising
        self.gc = GcClock()
        self.rows: list[dict] = []
        self.collator = None
        self._ended = None
        self._profiler = None

    def _counts(self) -> dict:
        c = self.collator
        return {
            "new_shapes": c.new_shapes,
            "tokens": c.tokens,
            "padded_tokens": c.padded_tokens,
            "micro_batches": c.micro_batches,
        }

    def _sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def _stats(self) -> dict:
        stats = self.torch.cuda.memory_stats() if self.cuda else {}
        return {"alloc_retries": stats.get("num_alloc_retries", 0), "gc_s": self.gc.seconds}

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs) -> None:
        self.collator = train_dataloader.collate_fn  # memfit's CountingCollator, as the Trainer was given it

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self._sync()
        self._began = time.perf_counter()
        self._before = self._stats()
        self._counts_before = self._counts()
        self.forward_backward_s = 0.0
        self.shapes: list = []  # each micro-batch's padded tensor shapes, as the collator made them
        if self.profile:
            from torch.profiler import ProfilerActivity, profile

            self._profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self._profiler.__enter__()

    def on_substep_end(self, args, state, control, **kwargs) -> None:
        self.shapes.append([list(v) for v in self.collator.last_shape.values()])

    def on_pre_optimizer_step(self, args, state, control, **kwargs) -> None:
        self.on_substep_end(args, state, control)  # the step's last micro-batch
        self._sync()
        self.forward_backward_s = time.perf_counter() - self._began

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self._sync()
        ended = time.perf_counter()
        after = self._stats()
        row = {
            "step": state.global_step,
            "step_s": ended - self._began,
            "forward_backward_s": self.forward_backward_s,
            "between_s": self._began - self._ended if self._ended is not None else None,
            **{key: value - self._counts_before[key] for key, value in self._counts().items()},
            "shapes": self.shapes,
            # the peak since memfit's meter last reset it, at the log before this step: this step's own peak
            "peak_allocated_gib": self.torch.cuda.max_memory_allocated() / 1024**3 if self.cuda else None,
            **{key: after[key] - self._before[key] for key in after},
        }
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            row.update(profile_summary(self._profiler))
            self._profiler = None
        self.rows.append(row)
        self._sync()
        self._ended = time.perf_counter()  # after the profile's own processing, which is not the Trainer's


def make_callback(clock: StepClock):
    """A transformers TrainerCallback whose hooks are the clock's."""
    from transformers import TrainerCallback

    hooks = ("on_train_begin", "on_step_begin", "on_substep_end", "on_pre_optimizer_step", "on_step_end")
    return type("StepClockCallback", (TrainerCallback,), {name: _forward(clock, name) for name in hooks})()


def _forward(clock: StepClock, name: str):
    return lambda self, *args, **kwargs: getattr(clock, name)(*args, **kwargs)


def profile_summary(profiler) -> dict:
    events = profiler.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
    return {
        "kernel_s": kernel_us / 1e6,
        "host_top": [[e.key, e.count, round(e.self_cpu_time_total / 1e6, 4)] for e in host],
    }


def one(args: argparse.Namespace) -> None:
    """One configuration, one variant, in this process (a fresh one per run, as a trial is)."""
    from memfit.run import run

    batch, source, label = args.config
    data, _ = make_data(Path(args.work))
    name = Path(args.json).stem
    cfg = compose(
        [
            f"model={args.model}",
            *data_overrides(data, args.tokenizer),
            *config_overrides(batch, source, label),
            *VARIANTS[args.variant],
            f"budget.gib={args.budget:g}",
            "budget.enforce=true",
            f"trainer.max_steps={args.steps}",
            f"output_dir={args.work}/outputs-{name}",
        ]
    )
    clock = StepClock(profile=args.variant == "profile")
    started = time.perf_counter()
    report = run(cfg, callbacks=[make_callback(clock)]).to_dict()
    keep = ("status", "reason", "tokens_per_s", "epoch_tokens_per_s", "worst_case_peak_gib")
    keep += ("peak_allocated_gib", "peak_reserved_gib", "predicted_peak_gib", "worst_case_shape")
    result = {
        "model": args.model,
        "budget": args.budget,
        "config": args.config,
        "variant": args.variant,
        **{key: report.get(key) for key in keep},
        "wall_s": time.perf_counter() - started,
        "steps": clock.rows,
    }
    Path(args.json).write_text(json.dumps(result))


def one_command(args: argparse.Namespace, device: str, index: int, run: tuple, variant: str, steps: int) -> str:
    model, budget, (batch, source, label) = run
    path = Path(args.work) / f"{index:02d}-{variant}-{model}-{batch}-{source}-{label}.json"
    command = [
        f"CUDA_VISIBLE_DEVICES={device} {sys.executable} {Path(__file__).name} one --config {batch} {source} {label}",
        f"--variant {variant} --steps {steps} --model {model} --budget {budget:g} --work {args.work} --json {path}",
        f"--tokenizer {args.tokenizer}" if args.tokenizer else "",
    ]
    return " ".join(command) + f" > {path.with_suffix('.log')} 2>&1"


def launch(args: argparse.Namespace) -> None:
    """Each GPU runs its configurations in turn, each in `args.order`'s variants, after one short warm-up run (the
    first process on a fresh machine reads CUDA's libraries from disk: its steps are slow for that alone)."""
    make_data(Path(args.work))
    started = time.perf_counter()
    processes = []
    for device, runs in PLAN.items():
        if device not in args.devices.split(","):
            continue
        lines = [one_command(args, device, 0, runs[0], "cudnn", 3)] if args.warmup else []
        for run in runs:
            for variant in args.order:
                lines.append(one_command(args, device, len(lines), run, variant, args.steps))
        processes.append(subprocess.Popen(["bash", "-c", " ; ".join(lines)], cwd=ROOT / "benchmarks"))
    for process in processes:
        process.wait()
    rows = [json.loads(path.read_text()) for path in sorted(Path(args.work).glob("[0-9][0-9]-*.json"))]
    rows = [row for row in rows if len(row["steps"]) > 3]  # not the warm-up runs
    out = {"steps": args.steps, "order": args.order, "wall_s": time.perf_counter() - started, "runs": rows}
    Path(args.out).write_text(json.dumps(out, indent=1))
    for row in rows:
        steady = row["steps"][1:]
        rate = sum(r["tokens"] for r in steady) / sum(r["step_s"] + (r["between_s"] or 0) for r in steady)
        print(
            row["model"],
            row["config"],
            row["variant"],
            row["status"],
            f"{rate:.0f} tokens/s after step 1,",
            f"worst case {row['worst_case_peak_gib'] or 0:.2f} GiB",
        )
        print("  step s:", " ".join(f"{r['step_s']:.2f}{'*' if r['new_shapes'] else ''}" for r in row["steps"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", choices=["launch", "one"], default="launch")
    parser.add_argument("--model", default="pegasus_large", help="one: the model")
    parser.add_argument("--budget", type=float, default=24, help="one: the budget, GiB")
    parser.add_argument("--steps", type=int, default=40, help="three of the length-grouped sampler's megabatches")
    parser.add_argument("--order", nargs="+", default=ORDER, choices=list(VARIANTS))
    parser.add_argument("--no-warmup", dest="warmup", action="store_false")
    parser.add_argument("--devices", default="0,1")
    parser.add_argument("--work", default="/tmp/memfit-step-profile")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--out", help="launch: the results file")
    parser.add_argument("--config", type=int, nargs=3, help="one: batch, source, label")
    parser.add_argument("--variant", choices=list(VARIANTS), default="cudnn")
    parser.add_argument("--json", help="one: where this run's result goes")
    args = parser.parse_args()
    if args.mode == "one":
        one(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
