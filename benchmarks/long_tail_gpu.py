"""The OOM memfit exists to end, measured: a long-tail dataset under an emulated 24 GiB budget on one GPU.

    python benchmarks/long_tail_gpu.py --out benchmarks/results/long_tail_gpu.json [--tokenizer DIR]

Data: ACLSum paper introductions → summaries (typical label ~31 tokens), replicated to 400 pairs, of which 1% get
an untruncated long label of 500-1000 tokens (16-30× typical). Model: pegasus_large (random weights, true shapes),
bf16 autocast, AdamW, lengths up to 1024/1024, one epoch, effective batch 32, eval off.

(1) HF Trainer's `auto_find_batch_size` (start 64) on the same data and cap: its restarts and wall time.
(2) A typical-batch finder: the largest batch whose (source 512, labels 64) batch fits, found by memfit's own probe
    on truncated data; then training at that batch with no preflight: whether and when it OOMs.
(3) memfit: preflight_only + worst-case batch finder, then training at the batch it accepts, preflight on.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET_GIB = 24
EFFECTIVE_BATCH = 32


def build_dataset(
    path: Path, samples: int = 400, long_share: float = 0.01, seed: int = 0, long_words: tuple[int, int] = (380, 760)
) -> dict:
    from aclsum import ACLSum

    rng = random.Random(seed)
    docs = ACLSum("train").documents
    pairs = []
    for doc in docs:
        intro = " ".join(doc.sentences["introduction"])
        for aspect in ("challenge", "approach", "outcome"):
            pairs.append({"source": intro, "target": doc.summaries[aspect], "intro": intro})
    rows = [dict(pairs[i % len(pairs)]) for i in range(samples)]
    rng.shuffle(rows)
    long_rows = rng.sample(range(samples), max(1, int(samples * long_share)))
    for index in long_rows:
        words = (rows[index]["intro"] + " " + rows[(index + 1) % samples]["intro"]).split()
        # (380, 760) words: ~500-1000 WordPiece tokens
        rows[index]["target"] = " ".join(words[: rng.randint(*long_words)])
    path.write_text("".join(json.dumps({"source": r["source"], "target": r["target"]}) + "\n" for r in rows))
    return {"samples": samples, "long_label_rows": sorted(long_rows)}


def epoch_overrides(model: str, data: Path, device: str) -> list[str]:
    """One epoch of `model` on the long-tail JSONL: memory=balanced, lengths up to 1024/1024, eval off."""
    return [
        f"model={model}",
        "memory=balanced",
        "data=jsonl",
        f"data.path={data}",
        "data.validation_fraction=0",
        "memory.max_source_length=1024",
        "memory.max_label_length=1024",
        "memory.eval_enabled=false",
        "trainer.max_steps=-1",
        "trainer.num_train_epochs=1",
        f"trainer.device={device}",
        "trainer.batching=fixed",  # fixed batches unless an arm says budget (auto trains budget-shaped on CUDA)
    ]


def train_py(overrides: list[str], run_dir: Path, timeout: int = 900) -> dict:
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "train.py", *overrides, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=os.environ,
    )
    report_path = run_dir / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {"stderr": out.stderr[-1500:]}
    report.update(exit_code=out.returncode, wall_s=time.perf_counter() - start)
    return report


def auto_find_batch_size(common: list[str], start_batch: int, max_seconds: float) -> dict:
    """Plain HF Trainer with auto_find_batch_size under the same cap, on the same tokenized data and model."""
    import torch
    from hydra import compose, initialize_config_dir
    from transformers import Seq2SeqTrainer, TrainerCallback

    from memfit.config import register_configs
    from memfit.data import CountingCollator, load_and_tokenize, model_columns
    from memfit.memory.policy import apply_allocator_env, apply_budget, training_arguments
    from memfit.models import build_model, build_tokenizer

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "train", overrides=[*common, f"trainer.batch_size={start_batch}", "trainer.gradient_accumulation_steps=1"]
        )
    apply_allocator_env(cfg.memory)
    apply_budget(cfg, "cuda", torch.cuda.get_device_properties(0).total_memory)
    tokenizer = build_tokenizer(cfg.model)
    data = {k: model_columns(v) for k, v in load_and_tokenize(cfg, tokenizer).datasets.items()}
    model = build_model(cfg, tokenizer, "cuda").model
    attempts: list[dict] = []
    started = time.perf_counter()

    class Watch(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            attempts.append({"batch": state.train_batch_size, "steps_done": 0, "t": time.perf_counter() - started})

        def on_step_end(self, args, state, control, **kw):
            attempts[-1]["steps_done"] = state.global_step
            if time.perf_counter() - started > max_seconds:
                control.should_training_stop = True

    args = training_arguments(cfg, "cuda", "/tmp/auto_find", has_eval=False)
    args.auto_find_batch_size = True
    trainer = Seq2SeqTrainer(
        model=model,
        args=args,
        train_dataset=data["train"],
        data_collator=CountingCollator(tokenizer, 8, "seq2seq"),
        callbacks=[Watch()],
    )
    trainer.model_accepts_loss_kwargs = False
    outcome = "finished"
    try:
        trainer.train()
    except Exception as err:  # noqa: BLE001 - recorded as the outcome
        outcome = f"{type(err).__name__}: {str(err)[:200]}"
    wall = time.perf_counter() - started
    final = attempts[-1] if attempts else {}
    lost_time = attempts[-1]["t"] if attempts else 0.0  # everything before the last restart is thrown away
    return {
        "attempts": attempts,
        "restarts": max(0, len(attempts) - 1),
        "final_batch": final.get("batch"),
        "outcome": outcome,
        "wall_s": wall,
        "time_before_final_attempt_s": lost_time,
        "wasted_share": lost_time / wall if wall else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 1024**3,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/long_tail_gpu.json")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--work", default="/tmp/memfit-longtail")
    parser.add_argument("--model", default="pegasus_large")
    parser.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    parser.add_argument("--auto-find-child", action="store_true")
    parser.add_argument("--auto-find-seconds", type=float, default=150)
    args = parser.parse_args()
    work = Path(args.work)
    data = work / "long_tail.jsonl"
    common = [
        *epoch_overrides(args.model, data, args.device),
        f"budget.gib={BUDGET_GIB}",
        f"tracking.uri=sqlite:///{work}/mlflow.db",
        "trainer.logging_steps=1",
    ]
    if args.tokenizer:
        common.append(f"model.tokenizer={args.tokenizer}")
    if args.auto_find_child:
        print("RESULT " + json.dumps(auto_find_batch_size(common, 64, args.auto_find_seconds)), flush=True)
        return
    work.mkdir(parents=True, exist_ok=True)
    results: dict = {"command": " ".join(sys.argv), "budget_gib": BUDGET_GIB, "dataset": build_dataset(data)}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out_path.write_text(json.dumps(results, indent=1))
        print(json.dumps(results, indent=1)[-3000:], flush=True)

    def batch_args(batch: int) -> list[str]:
        return [
            f"trainer.batch_size={batch}",
            f"trainer.gradient_accumulation_steps={math.ceil(EFFECTIVE_BATCH / batch)}",
        ]

    # (3) memfit: will it fit, and the largest batch whose worst case fits
    memfit_pf = train_py([*common, "preflight_only=true", "trainer.batch_size=2"], work / "memfit_preflight")
    results["memfit_preflight"] = memfit_pf
    save()
    # (2) a typical-batch finder: the same finder, but on typical (512, 64) batches
    typical = train_py(
        [
            *common,
            "preflight_only=true",
            "trainer.batch_size=2",
            "memory.max_source_length=512",
            "memory.max_label_length=64",
        ],
        work / "typical_finder",
    )
    results["typical_finder"] = typical
    save()
    if typical.get("max_batch"):
        results["typical_batch_training"] = train_py(
            [*common, *batch_args(typical["max_batch"]), "preflight.enabled=false"], work / "typical_train"
        )
        save()
    if memfit_pf.get("max_batch"):
        results["memfit_training"] = train_py([*common, *batch_args(memfit_pf["max_batch"])], work / "memfit_train")
        save()
    if args.device != "cuda":
        return
    # (1) HF Trainer's auto_find_batch_size
    child = subprocess.run(
        [
            sys.executable,
            __file__,
            "--auto-find-child",
            "--work",
            str(work),
            "--model",
            args.model,
            "--auto-find-seconds",
            str(args.auto_find_seconds),
            *(["--tokenizer", args.tokenizer] if args.tokenizer else []),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=os.environ,
        timeout=900,
    )
    lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
    results["hf_auto_find_batch_size"] = json.loads(lines[-1][7:]) if lines else {"stderr": child.stderr[-2000:]}
    save()


if __name__ == "__main__":
    main()
