"""What one micro-batch costs in padded tokens: the figure behind memfit.data.packing.MICRO_BATCH_COST (CPU, ~20 s).

    python benchmarks/packing_cost_fit.py

Replays the epochs of the fixed-batch arms that budget_batching_gpu.py trained on the H200 (pegasus_large at 24 and
40 GiB: batch, accumulation, label cut and the training phase's seconds, read from results/budget_batching_*.json)
over the same long-tail data's token lengths, as Trainer's sampler orders and the collator pads them, and fits
seconds = a · micro-batches + b · padded tokens by least squares. a / b is one micro-batch's cost in padded tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from long_tail_gpu import build_dataset  # noqa: E402

RUNS = {  # results file, arm, label cut
    "a24": ("budget_batching_pegasus_large_24_before_accumulation_probe.json", "a_fixed_full_labels", 1024),
    "b24": ("budget_batching_pegasus_large_24_before_accumulation_probe.json", "b_fixed_cut_labels", 64),
    "a40": ("budget_batching_pegasus_large_40.json", "a_fixed_full_labels", 1024),
    "b40": ("budget_batching_pegasus_large_40.json", "b_fixed_cut_labels", 64),
}


def token_lengths(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Source and label token lengths of the long-tail JSONL (the MiniLM WordPiece tokenizer the GPU runs used)."""
    from transformers import AutoTokenizer

    from memfit.models import bundled_model_dir

    tokenizer = AutoTokenizer.from_pretrained(bundled_model_dir())
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    source = [min(len(tokenizer(r["source"])["input_ids"]), 1024) for r in rows]
    label = [min(len(tokenizer(r["target"])["input_ids"]), 1024) for r in rows]
    return np.array(source), np.array(label)


def main() -> None:
    from memfit.data.packing import epoch_micro_batches, epoch_order

    data = Path("/tmp/memfit-packing-fit.jsonl")
    build_dataset(data, samples=800)
    source, label = token_lengths(data)
    columns, seconds = [], []
    for name, (file, arm, cut) in RUNS.items():
        run = json.loads((ROOT / "benchmarks/results" / file).read_text())["24GiB" if "24" in name else "40GiB"][arm]
        batch = int(run["overrides"][-2].split("=")[1])
        accumulation = int(run["overrides"][-1].split("=")[1])
        order = epoch_order(source, batch * accumulation, True, 42)
        micro = epoch_micro_batches(source, np.minimum(label, cut), order, batch, None, 8)
        padded_tokens = sum(rows * (s + lab) for rows, s, lab in micro)
        columns.append([len(micro), padded_tokens])
        seconds.append(run["phase_seconds"]["train"])
        print(
            f"{name}: batch {batch} × {accumulation}, {len(micro)} micro-batches, {padded_tokens} padded tokens, "
            f"{seconds[-1]:.2f} s"
        )
    (a, b), *_ = np.linalg.lstsq(np.array(columns, float), np.array(seconds), rcond=None)
    print(
        f"a = {a:.3f} s per micro-batch, b = {b * 1e6:.2f} µs per padded token: one micro-batch ≈ {a / b:,.0f} tokens"
    )


if __name__ == "__main__":
    main()
