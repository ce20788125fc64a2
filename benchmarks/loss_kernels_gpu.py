"""The loss alone, at real heads' shapes: the standard cross-entropy over full logits, memfit's chunked loss and
liger-kernel's fused one, forward + backward, timed with CUDA events and measured for peak memory (issue 26).

    python benchmarks/loss_kernels_gpu.py --out $OUT/loss_kernels.json

Heads: pegasus_large's (V 96,103, H 1024, a trained fp32 weight and final_logits_bias, 4 × 1024 label rows) and
qwen2_5_1_5b's under LoRA (V 151,936, H 1536, a frozen bf16 weight, 4 × 2047 rows). The hidden states come as a run
hands them to the loss: float32 for pegasus_large (its final LayerNorm runs in float32 under autocast), bf16 for
Qwen; the head's products run in bf16, as under autocast (the standard head inside it, memfit's losses told the
dtype as `model_loss` tells them). `--chunk-rows` times the chunked loss at other chunk sizes besides the default;
`--profile` adds the top kernels of each loss (torch.profiler).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADS = {
    "pegasus_large": {
        "vocab": 96103,
        "width": 1024,
        "rows": 4 * 1024,
        "weight": "float32",
        "trained": True,
        "hidden": "float32",
    },
    "qwen2_5_1_5b_lora": {
        "vocab": 151936,
        "width": 1536,
        "rows": 4 * 2047,
        "weight": "bfloat16",
        "trained": False,
        "hidden": "bfloat16",
    },
}
GIB = 2**30


def head_tensors(spec: dict):
    import torch

    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(
        spec["vocab"], spec["width"], device="cuda", dtype=getattr(torch, spec["weight"]), generator=generator
    ).mul_(0.02)
    weight.requires_grad_(spec["trained"])
    bias = torch.zeros(spec["vocab"], device="cuda", requires_grad=spec["trained"]) if spec["trained"] else None
    hidden = torch.randn(
        spec["rows"], spec["width"], device="cuda", dtype=getattr(torch, spec["hidden"]), generator=generator
    )
    hidden.requires_grad_(True)
    labels = torch.randint(0, spec["vocab"], (spec["rows"],), device="cuda", generator=generator)
    labels[-spec["rows"] // 8 :] = -100  # padding
    return hidden, weight, bias, labels


def losses(chunk_rows: list[int]):
    import torch
    import torch.nn.functional as F

    from memfit.memory.loss import chunked_cross_entropy, fused_cross_entropy, rows_per_chunk

    def standard(hidden, weight, bias, labels):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = F.linear(hidden, weight, bias)
        return F.cross_entropy(logits.float(), labels)

    def chunked(rows: int | None):
        def loss(hidden, weight, bias, labels):
            chunk = rows or rows_per_chunk(weight.shape[0])
            return chunked_cross_entropy(hidden, weight, labels, bias, chunk, dtype=torch.bfloat16)

        return loss

    def fused(hidden, weight, bias, labels):
        return fused_cross_entropy(hidden, weight, labels, bias, dtype=torch.bfloat16)

    return {
        "standard": standard,
        "chunked": chunked(None),
        **{f"chunked_{rows}_rows": chunked(rows) for rows in chunk_rows},
        "fused": fused,
    }


def measure(loss, tensors, repeats: int) -> dict:
    import torch

    def once() -> None:
        loss(*tensors).backward()
        for tensor in tensors[:3]:
            if tensor is not None:
                tensor.grad = None

    once()  # warm-up (Triton compiles here)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        once()
    end.record()
    torch.cuda.synchronize()
    return {
        "ms": start.elapsed_time(end) / repeats,
        "peak_over_inputs_gib": (torch.cuda.max_memory_allocated() - base) / GIB,
    }


def top_kernels(loss, tensors) -> list:
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        loss(*tensors).backward()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)[:8]
    return [[e.key[:80], e.count, round(e.self_device_time_total / 1e3, 3)] for e in events]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--chunk-rows", type=int, nargs="*", default=[], help="chunked loss at these chunk sizes too")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": []}
    for head, spec in HEADS.items():
        tensors = head_tensors(spec)
        for name, loss in losses(args.chunk_rows).items():
            row = {"head": head, "loss": name, **measure(loss, tensors, args.repeats)}
            if args.profile:
                row["top_kernels_ms"] = top_kernels(loss, tensors)
            out["rows"].append(row)
            Path(args.out).write_text(json.dumps(out, indent=1))
            print(json.dumps(row), flush=True)
        del tensors
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
