"""Does counting budget-shaped steps in label tokens change what training learns? (CPU, ~10 min on 2 cores)

    python benchmarks/token_steps_convergence_cpu.py --out benchmarks/results/token_steps_convergence_cpu.json

trainer.effective_batch=tokens packs micro-batches of like lengths and deals them into steps balanced in label
tokens, so a step's samples are no longer a random draw and its sample count varies (docs/batching.md). This trains
tiny_seq2seq (random weights) on a held-apart long-tail set (benchmarks/long_tail_gpu.build_dataset, data seed 3: 1%
of targets 500-1,000 tokens), three epochs at 16 samples a step, four arms per training seed: fixed batches of 16,
budget-shaped steps of 16 samples, budget-shaped steps counted in tokens, the same with trainer.pad_tolerance=0.1
(micro-batches drawn among samples of like length); and records each run's final training and
evaluation loss (per label token, on the same 10% validation split) and steps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from long_tail_gpu import build_dataset  # noqa: E402

ARMS = {
    "fixed": ["trainer.batching=fixed"],
    "budget_samples": ["trainer.batching=budget", "trainer.effective_batch=samples"],
    "budget_tokens": ["trainer.batching=budget", "trainer.effective_batch=tokens"],
    "budget_tokens_pad_tolerance": [
        "trainer.batching=budget",
        "trainer.effective_batch=tokens",
        "trainer.pad_tolerance=0.1",
    ],
}


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from memfit.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose("train", overrides=overrides)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--samples", type=int, default=800)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--work", default="/tmp/memfit-token-steps")
    parser.add_argument("--out", default="benchmarks/results/token_steps_convergence_cpu.json")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--token-window", type=int, default=None, help="steps' samples packed at once (tokens arm)")
    args = parser.parse_args()
    import memfit.data.packing as packing
    from memfit.run import run

    if args.token_window:
        packing.TOKEN_STEP_WINDOW = args.token_window

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = work / "long_tail.jsonl"
    results: dict = {"command": " ".join(sys.argv), "dataset": build_dataset(data, samples=args.samples, seed=3)}
    results["token_step_window"] = packing.TOKEN_STEP_WINDOW
    results["runs"] = []
    common = [
        "model=tiny_seq2seq",
        "data=jsonl",
        f"data.path={data}",
        "data.validation_fraction=0.1",
        "trainer.device=cpu",
        "memory.precision=fp32",
        "memory.max_source_length=256",
        "memory.max_label_length=1024",
        "trainer.batch_size=16",
        "trainer.gradient_accumulation_steps=1",
        "trainer.max_steps=-1",
        f"trainer.num_train_epochs={args.epochs}",
        "trainer.learning_rate=1e-3",
        "tracking=none",
        f"output_dir={work / 'outputs'}",
        f"calibration.cache_dir={work / 'calibration'}",
    ]
    for seed in args.seeds:
        for arm in args.arms:
            report = run(compose([*common, *ARMS[arm], f"trainer.seed={seed}"])).to_dict()
            row = {
                "arm": arm,
                "seed": seed,
                **{k: report.get(k) for k in ("status", "steps", "final_loss", "eval_loss")},
            }
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
            Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
