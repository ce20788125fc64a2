"""memory.loss=chunked against the model's own loss: the peak host memory of forward + backward (CPU, ~30 s).

    python benchmarks/loss_memory_cpu.py --model tiny_seq2seq --batches 4 16

The worst batch of the README's preflight example (source 32 × labels 304; tiny_seq2seq's head has 30,522 entries),
built as the preflight builds it, through forward and backward three times per loss, each loss in a fresh process
(host RSS only grows within one), peak RSS per window from memfit's host meter. Prints one line per (loss, batch).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(model_name: str, loss: str, batch: int, source: int, label: int) -> list[int]:
    """Peak host RSS (bytes) of three forward + backward passes of one loss, in this process."""
    import gc

    from hydra import compose, initialize_config_dir

    from memfit.config import register_configs
    from memfit.data import CountingCollator
    from memfit.data.audit import BatchShape
    from memfit.memory.loss import model_loss
    from memfit.memory.meter import HostMeter
    from memfit.memory.probe import make_batch
    from memfit.models import build_model, build_tokenizer

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={model_name}", "trainer.device=cpu"])
    tokenizer = build_tokenizer(cfg.model)
    model = build_model(cfg, tokenizer, "cpu").model
    collator = CountingCollator(tokenizer, 8, cfg.model.task)
    shape = BatchShape(batch, source, label)
    inputs = make_batch(shape, collator.inner, cfg.model.task, len(tokenizer), "cpu")
    meter, peaks = HostMeter(), []
    for _ in range(3):
        gc.collect()
        meter.reset_window()
        value = model_loss(model, inputs, cfg.model.task) if loss == "chunked" else model(**inputs).loss
        value.backward()
        model.zero_grad(set_to_none=True)
        del value
        peaks.append(meter.window_peak().allocated)
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny_seq2seq")
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--source", type=int, default=32)
    parser.add_argument("--label", type=int, default=304)
    parser.add_argument("--child", nargs=2, metavar=("LOSS", "BATCH"))
    args = parser.parse_args()
    if args.child:
        loss, batch = args.child[0], int(args.child[1])
        print(json.dumps(measure(args.model, loss, batch, args.source, args.label)))
        return
    for batch in args.batches:
        for loss in ("standard", "chunked"):
            child = [sys.executable, __file__, "--model", args.model, "--source", str(args.source)]
            child += ["--label", str(args.label), "--child", loss, str(batch)]
            out = subprocess.run(child, cwd=ROOT, capture_output=True, text=True, check=True)
            peaks = json.loads(out.stdout.strip().splitlines()[-1])
            shown = ", ".join(f"{p / 2**20:.0f}" for p in peaks)
            print(
                f"{args.model} batch {batch} × source {args.source} × labels {args.label}, {loss}: "
                f"peak host RSS {shown} MiB (three passes)",
                flush=True,
            )


if __name__ == "__main__":
    main()
