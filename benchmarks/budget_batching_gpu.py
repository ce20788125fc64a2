"""Budget-shaped batches against the two fixed-batch choices, one full epoch each, on a long-tail set (issue 23).

    python benchmarks/budget_batching_gpu.py --model pegasus_large --budgets 24 --tokenizer .gpu/tok \
        --out $OUT/budget_batching_pegasus_large.json

Data: benchmarks/long_tail_gpu.build_dataset (ACLSum introductions → summaries, 1% of targets 500-1,000 tokens),
`--samples` pairs. Every arm trains one epoch at the same effective batch (`--effective`, samples per optimizer step),
memory=balanced, lengths up to 1024/1024, eval off, under the budget enforced by the allocator cap:
  (a) fixed: the largest batch whose worst case fits at full label length (memfit's preflight_only search);
  (b) fixed, labels cut to `--cut` tokens: the largest batch whose worst case fits at that cut (less label coverage);
  (c) trainer.batching=budget at full label length (steps of equal label tokens, trainer.effective_batch=tokens);
  (c, samples) the same with steps of exactly 32 samples (`--c-samples`: trainer.effective_batch=samples);
  (c at b's step) the same, at the samples per optimizer step that (b)'s whole batches round up to (`--c-at-b-step`):
      (b) at batch 15 takes ceil(32 / 15) = 3 micro-batches, 45 samples a step, so fewer optimizer updates an epoch.
Each arm is a fresh `python train.py` (tracking off); its report.json gives tokens/s, peaks, coverage and retries.
`--rounds N` trains (a), (b) and (c) N times, each round starting one arm later (abc, bca, cab, ...), so a drift in
the machine's speed within a call reaches every arm; the JSON keeps round 1 under the arm's name and the others as
`<arm>_round<k>`, and the summary prints each round's ratios and the ratio of the medians.
The searches of (a) and (b) measure memory only (no timing), so they run side by side, each under its own cap.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from long_tail_gpu import build_dataset, epoch_overrides  # noqa: E402
from long_tail_gpu import train_py as run_train_py  # noqa: E402


def train_py(overrides: list[str], run_dir: Path, timeout: int = 600) -> dict:
    """One `python train.py` (long_tail_gpu.train_py) with its plan table, read from the job's log."""
    report = run_train_py(overrides, run_dir, timeout)
    report["overrides"] = overrides
    log = run_dir / "train.log"
    lines = log.read_text().splitlines() if log.exists() else []
    plan = [line for line in lines if line.startswith(("│", "┃", "batch plan", "shapes measured"))]
    if plan:
        report["plan_table"] = plan[-40:]
    train_s = report.get("phase_seconds", {}).get("train")
    if train_s and report.get("train_tokens"):
        report["epoch_tokens_per_s_measured"] = report["train_tokens"] / train_s  # the whole epoch, warm-up included
    return report


def fixed(batch: int, effective: int) -> list[str]:
    return [f"trainer.batch_size={batch}", f"trainer.gradient_accumulation_steps={math.ceil(effective / batch)}"]


def run_budget(common: list[str], work: Path, budget: float, args: argparse.Namespace, out: dict) -> dict:
    """The three arms at one budget, each recorded into `out` as soon as it ends."""
    here = [*common, f"budget.gib={budget}"]
    shaped = ["trainer.batching=budget", *fixed(args.effective, args.effective)]
    worst: dict = {}
    typical: dict = {}
    cut = [f"memory.max_label_length={args.cut}"]
    if args.arms == "abc":
        search = ["preflight_only=true", "trainer.batch_size=1", f"preflight.max_batch_limit={args.effective}"]
        # the two searches measure memory only, each in its own process under its own cap: side by side where two
        # budgets fit the card; past that one search's probes ran out of memory beside the other's (70 GiB on an
        # H100: (b) searched batch 1 where 32 fits alone, "Session 50")
        side_by_side = 2 if 2 * budget <= card_gib(args.device) else 1
        with ThreadPoolExecutor(side_by_side) as pool:
            full = pool.submit(train_py, [*here, *search], work / f"{budget}_a_search")
            short = pool.submit(train_py, [*here, *cut, *search], work / f"{budget}_b_search")
            out["a_search"], out["b_search"] = worst, typical = full.result(), short.result()
    arms = {}
    if args.arms == "abc" and worst.get("max_batch"):
        arms["a_fixed_full_labels"] = [*here, *fixed(worst["max_batch"], args.effective)]
    if args.arms == "abc" and typical.get("max_batch"):
        arms["b_fixed_cut_labels"] = [*here, *cut, *fixed(typical["max_batch"], args.effective)]
    arms["c_budget"] = [*here, *shaped]
    names = list(arms)
    for round_ in range(args.rounds):  # each round starts one arm later: a drift in the machine's speed meets each
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            key = name if round_ == 0 else f"{name}_round{round_ + 1}"
            out[key] = train_py(arms[name], work / (f"{budget}_{name[0]}" + (f"_{round_ + 1}" if round_ else "")))
    if args.c_samples:
        by_samples = [*shaped, "trainer.effective_batch=samples"]
        out["c_budget_samples"] = train_py([*here, *by_samples], work / f"{budget}_c_samples")
    typical_batch = out.get("b_search", {}).get("max_batch")
    if args.c_at_b_step and typical_batch:
        b_step = typical_batch * math.ceil(args.effective / typical_batch)
        b_shaped = ["trainer.batching=budget", *fixed(b_step, b_step)]
        out["c_budget_at_b_step"] = train_py([*here, *b_shaped], work / f"{budget}_c_b_step")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="pegasus_large")
    parser.add_argument("--budgets", type=float, nargs="+", default=[24])
    parser.add_argument("--samples", type=int, default=800)
    parser.add_argument("--effective", type=int, default=32)
    parser.add_argument("--cut", type=int, default=64)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--work", default="/tmp/memfit-budget-batching")
    parser.add_argument("--out", default="benchmarks/results/budget_batching.json")
    parser.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    parser.add_argument("--arms", default="abc", choices=["abc", "c"], help="c: the budget-shaped arm alone")
    parser.add_argument("--data-seed", type=int, default=0, help="which pairs get the long labels (held-apart data)")
    parser.add_argument("--c-at-b-step", action="store_true", help="(c) again at (b)'s samples per optimizer step")
    parser.add_argument("--c-samples", action="store_true", help="(c) again with steps of exactly --effective samples")
    parser.add_argument("--set", nargs="*", default=[], help="more overrides for every arm")
    parser.add_argument("--rounds", type=int, default=1, help="train the arms this many times, each round rotated")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = work / "long_tail.jsonl"
    dataset = build_dataset(data, samples=args.samples, seed=args.data_seed)
    results: dict = {"command": " ".join(sys.argv), "dataset": dataset, "host": host_cpu()}
    common = [
        *epoch_overrides(args.model, data, args.device),
        "tracking=none",
        f"calibration.cache_dir={work}/calibration",
        *args.set,
    ]
    if args.tokenizer:
        common.append(f"model.tokenizer={args.tokenizer}")
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    class Saving(dict):
        def __setitem__(self, key: str, value: dict) -> None:
            super().__setitem__(key, value)
            out_path.write_text(json.dumps(results, indent=1))

    for budget in args.budgets:
        results[f"{budget:g}GiB"] = arms = Saving()
        run_budget(common, work, budget, args, arms)
    print(summary(results), flush=True)


def card_gib(device: str) -> float:
    """The card's memory in GiB, from nvidia-smi: no CUDA context in this process, which would hold memory beside
    the arms' (CPU: unbounded here, the searches then run side by side)."""
    import subprocess

    if device != "cuda":
        return math.inf
    query = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "--id=0"]
    return int(subprocess.run(query, capture_output=True, text=True, check=True).stdout.strip()) / 1024  # MiB


def host_cpu() -> dict:
    """The CPU beside the GPU: a LoRA model's small fixed batches are bound by the host launching kernels, so the
    same arms ran 1.4-1.7× apart on two H100 hosts (benchmarks/README.md, "Session 39")."""
    import os

    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return {"cpu": names[0] if names else None, "cpus": os.cpu_count()}


def summary(results: dict) -> str:
    lines = []
    for key, arms in results.items():
        if not key.endswith("GiB"):
            continue
        for arm in ("a_fixed_full_labels", "b_fixed_cut_labels", "c_budget", "c_budget_samples", "c_budget_at_b_step"):
            r = arms.get(arm, {})
            lines.append(
                f"{key} {arm}: exit {r.get('exit_code')} status {r.get('status')} tokens/s {r.get('tokens_per_s')} "
                f"epoch {r.get('epoch_tokens_per_s_measured')} coverage {r.get('label_coverage')} "
                f"peak alloc {r.get('peak_allocated_gib')} reserved {r.get('peak_reserved_gib')} "
                f"retries {r.get('alloc_retries')} micro {r.get('mean_micro_batch')} steps {r.get('steps')}"
            )
        lines += round_ratios(arms)
    return "\n".join(lines)


def round_ratios(arms: dict) -> list[str]:
    """With --rounds: each round's (c) over (a) and over (b), and the ratio of the arms' medians, from the whole
    epoch's measured tokens/s (what the issue's goal reads) and from the steady steps' rates."""
    import statistics

    def speeds(arm: str, rate: str) -> list[float]:
        keys = [arm, *sorted(k for k in arms if k.startswith(f"{arm}_round"))]
        return [arms[k][rate] for k in keys if arms.get(k, {}).get(rate)]

    lines = []
    for rate, what in (("epoch_tokens_per_s_measured", "epoch"), ("tokens_per_s", "steady")):
        a, b, c = (speeds(arm, rate) for arm in ("a_fixed_full_labels", "b_fixed_cut_labels", "c_budget"))
        if len(c) < 2 or not (a and b):
            continue
        pairs = [f"{x / y:.2f}×/{x / z:.2f}×" for x, y, z in zip(c, a, b, strict=False)]
        medians = statistics.median(c) / statistics.median(a), statistics.median(c) / statistics.median(b)
        lines.append(
            f"  rounds, {what} tokens/s, (c) over (a)/(b): {', '.join(pairs)}; "
            f"medians {medians[0]:.2f}×/{medians[1]:.2f}×"
        )
    return lines


if __name__ == "__main__":
    main()
