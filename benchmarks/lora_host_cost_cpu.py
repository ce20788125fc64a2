"""What a LoRA micro-batch costs the host, apart from its arithmetic: qwen2_5_1_5b's 28 layers and seven LoRA targets
at a width of 64, one row of 32 tokens a step, on CPU (about 3 min on 2 cores).

    python benchmarks/lora_host_cost_cpu.py --tokenizer .gpu/tok --out benchmarks/results/lora_host_cost_cpu.json

On a GPU a qwen2_5_1_5b LoRA micro-batch costs a fixed 0.15-0.25 s besides its tokens (benchmarks/README.md, the
budget_batching replays): the host dispatching each layer's and each adapter's small operations. At this width the
arithmetic is negligible, so a step's wall time here is that dispatch, and the variants show which of memfit's knobs
and which LoRA settings add to it. Host speeds differ, so compare variants, not these seconds with a GPU host's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from token_steps_convergence_cpu import compose  # noqa: E402

VARIANTS = {
    "balanced": [],
    "lora dropout 0": ["model.lora.dropout=0"],
    "memory.recompute_lora_dropout=false": ["memory.recompute_lora_dropout=false"],
    "memory.shared_attention_mask=false": ["memory.shared_attention_mask=false"],
    "memory.loss=standard": ["memory.loss=standard"],
}


def narrow_qwen(tokenizer: str) -> list[str]:
    """qwen2_5_1_5b's 28 layers and LoRA targets at a width of 64: its operations, with little arithmetic in them."""
    return [
        "model=qwen2_5_1_5b",
        "model.architecture.hidden_size=64",
        "model.architecture.intermediate_size=128",
        "model.architecture.num_attention_heads=4",
        "model.architecture.num_key_value_heads=2",
        "model.architecture.vocab_size=30522",
        f"model.tokenizer={tokenizer}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", required=True, help="a local tokenizer of 30,522 entries (.gpu/tok)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--work", default="/tmp/memfit-lora-host-cost")
    parser.add_argument("--out", default="benchmarks/results/lora_host_cost_cpu.json")
    args = parser.parse_args()
    from memfit.run import run

    narrow = narrow_qwen(args.tokenizer)
    common = [
        "memory=balanced",
        "memory.precision=fp32",
        "memory.max_source_length=32",
        "memory.max_label_length=32",
        "memory.eval_enabled=false",
        "trainer.device=cpu",
        "trainer.batching=fixed",
        "trainer.batch_size=1",
        "trainer.gradient_accumulation_steps=1",
        f"trainer.max_steps={args.steps}",
        "preflight.enabled=false",
        "calibration.enabled=false",
        "tracking=none",
        f"output_dir={args.work}/outputs",
    ]
    results: dict = {"command": " ".join(sys.argv), "seconds_per_step": {}}
    for _ in range(args.repeats):  # variants interleaved: a drift in the host's speed touches each alike
        for name, extra in VARIANTS.items():
            report = run(compose([*narrow, *common, *extra]))
            seconds = report.phase_seconds["train"] / max(report.steps, 1)
            results["seconds_per_step"].setdefault(name, []).append(seconds)
            print(f"{name}: {report.status}, {seconds:.4f} s a step", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
