"""Where a LoRA step's time goes on the GPU: kernel seconds by kind against the step's wall seconds (issue 23).

    python benchmarks/lora_step_profile_gpu.py --tokenizer .gpu/tok --out $OUT/lora_step_profile.json

Issue 23's arms on qwen2_5_1_5b LoRA at 24 GiB (the long-tail set of budget_batching_gpu.py, memory=balanced,
lengths up to 1024/1024): (a) fixed batch 3 × 11 micro-batches a step, (b) labels cut to 64, batch 5 × 7, (c)
budget-shaped. Each arm trains `--steps` optimizer steps in a fresh process; steps in `--profile-steps` run under
torch.profiler (their wall time includes the profiler's cost), the others are clocked with the device synchronised
(step_profile_gpu.StepClock). A profiled step reports the GPU's kernel seconds, split by kind (GEMM, attention,
elementwise and the rest) and by the kernels that took most, so the step's wall seconds against its kernel seconds
say whether the host (launching kernels) or the GPU bounds it, and the split says where the GPU's time goes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from long_tail_gpu import build_dataset, epoch_overrides  # noqa: E402
from step_profile_gpu import StepClock, make_callback  # noqa: E402
from sweep_strategies_gpu import compose  # noqa: E402

ARMS = {
    "a": ["trainer.batching=fixed", "trainer.batch_size=3", "trainer.gradient_accumulation_steps=11"],
    "b": [
        "trainer.batching=fixed",
        "memory.max_label_length=64",
        "trainer.batch_size=5",
        "trainer.gradient_accumulation_steps=7",
    ],
    "c": ["trainer.batching=budget", "trainer.batch_size=32", "trainer.gradient_accumulation_steps=1"],
}
# a kernel's kind, by the first of these its name contains (lower case); session 44's result files were written
# by a first version that sorted every name holding "copy" or "cast" (gpu_kernel_impl_nocast too) as copy/cast
KINDS = [
    ("attention", ("fmha", "attention", "flash", "attn")),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "splitk")),
    ("reduce", ("reduce", "norm", "softmax", "sum_kernel")),
    ("copy/cast", ("direct_copy", "bfloat16_copy", "memcpy", "memset", "fill_kernel", "catarray", "index")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
]


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, marks in KINDS if any(mark in lowered for mark in marks)), "other")


def kernel_split(profiler) -> dict:
    """The profiled step's kernel seconds: in all, by kind, the top kernels, and how many kernels ran."""
    events = [e for e in profiler.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    by_kind: dict[str, float] = {}
    launches: dict[str, int] = {}
    for event in events:
        kind = kind_of(event.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + event.self_device_time_total / 1e6
        launches[kind] = launches.get(kind, 0) + event.count
    top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:15]
    return {
        "kernel_s": sum(by_kind.values()),
        "kernel_s_by_kind": {k: round(v, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "kernels_by_kind": launches,
        "kernels": sum(launches.values()),
        "kernel_top": [[e.key[:90], e.count, round(e.self_device_time_total / 1e6, 4)] for e in top],
    }


class SomeStepsProfiled(StepClock):
    """StepClock whose steps in `profiled` run under torch.profiler, reported by kernel_split."""

    def __init__(self, profiled: set[int]) -> None:
        super().__init__(profile=False)
        self.profiled = profiled

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self.profile = state.global_step + 1 in self.profiled  # global_step counts steps already done
        super().on_step_begin(args, state, control, **kwargs)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        profiler, wall = self._profiler, None
        if profiler is not None:  # the step's wall seconds end before the profiler processes its trace
            self._sync()
            wall = time.perf_counter() - self._began
            profiler.__exit__(None, None, None)
            self._profiler = None
        super().on_step_end(args, state, control, **kwargs)
        if profiler is not None:
            self.rows[-1].update(kernel_split(profiler), profiled=True, step_s=wall)


def one(args: argparse.Namespace) -> None:
    """One arm in this process."""
    from memfit.run import run

    data = Path(args.work) / "long_tail.jsonl"
    cfg = compose(
        [
            *epoch_overrides(args.model, data, args.device),
            f"model.tokenizer={args.tokenizer}",
            "tracking=none",
            f"budget.gib={args.budget:g}",
            f"calibration.cache_dir={args.work}/calibration",
            *ARMS[args.arm],
            f"trainer.max_steps={args.steps}",
            f"output_dir={args.work}/outputs-{args.arm}",
            *args.set,
        ]
    )
    clock = SomeStepsProfiled(set(args.profile_steps))
    started = time.perf_counter()
    report = run(cfg, callbacks=[make_callback(clock)]).to_dict()
    keep = ("status", "reason", "tokens_per_s", "peak_allocated_gib", "peak_reserved_gib", "mean_micro_batch")
    result = {"arm": args.arm, "overrides": ARMS[args.arm] + args.set, **{k: report.get(k) for k in keep}}
    result.update(wall_s=time.perf_counter() - started, steps=clock.rows)
    Path(args.json).write_text(json.dumps(result))


def summary(row: dict) -> list[str]:
    clocked = [s for s in row["steps"][1:] if not s.get("profiled")]
    lines = [f"arm {row['arm']} {row['status']} mean micro-batch {row.get('mean_micro_batch')}"]
    if clocked:
        seconds = sum(s["step_s"] for s in clocked)
        micro = sum(s["micro_batches"] for s in clocked)
        lines.append(
            f"  clocked: {sum(s['tokens'] for s in clocked) / seconds:.0f} tokens/s, "
            f"{seconds / micro * 1e3:.0f} ms a micro-batch, {sum(s['tokens'] for s in clocked) / micro:.0f} tokens "
            f"({sum(s['padded_tokens'] for s in clocked) / micro:.0f} padded) a micro-batch"
        )
    for s in row["steps"]:
        if s.get("profiled"):
            lines.append(
                f"  profiled step {s['step']}: wall {s['step_s']:.3f} s, kernels {s['kernel_s']:.3f} s "
                f"({s['kernels']} launches, {s['micro_batches']} micro-batches) {s['kernel_s_by_kind']}"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", choices=["launch", "one"], default="launch")
    parser.add_argument("--model", default="qwen2_5_1_5b")
    parser.add_argument("--budget", type=float, default=24)
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--data-seed", type=int, default=2)
    parser.add_argument("--arms", nargs="+", default=["a", "c"], choices=list(ARMS))
    parser.add_argument("--arm", choices=list(ARMS), help="one: the arm")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--profile-steps", type=int, nargs="*", default=[5, 6], help="1-based optimizer steps")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (no kernels)")
    parser.add_argument("--set", nargs="*", default=[], help="more overrides for every arm")
    parser.add_argument("--work", default="/tmp/memfit-lora-profile")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--json", help="one: where this arm's result goes")
    parser.add_argument("--out", help="launch: the results file")
    args = parser.parse_args()
    if args.mode == "one":
        one(args)
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    build_dataset(work / "long_tail.jsonl", samples=args.samples, seed=args.data_seed)
    rows = []
    for arm in args.arms:  # a fresh process per arm: nothing of one arm's allocator cache reaches the next
        path = work / f"{arm}.json"
        command = [sys.executable, __file__, "one", "--arm", arm, "--model", args.model, "--budget", str(args.budget)]
        command += ["--steps", str(args.steps), "--work", args.work, "--tokenizer", args.tokenizer, "--json", str(path)]
        command += ["--device", args.device, "--profile-steps", *map(str, args.profile_steps), "--set", *args.set]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        row = json.loads(path.read_text()) if path.exists() else {"arm": arm, "stderr": done.stderr[-2000:]}
        rows.append(row)
        print("\n".join(summary(row)) if "steps" in row else row, flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"model": args.model, "budget": args.budget, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
