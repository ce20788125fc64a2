"""One training step's peak memory and time under variants of the memory knobs, at fixed shapes (issue 26).

    python benchmarks/step_variants_gpu.py --tokenizer .gpu/tok --out $OUT/step_variants.json

Each case builds the model as a run does (memfit's own config composition and `prepare_training`), then measures
the preflight's probe (two optimizer steps of forward + backward on a batch of exactly one shape, the run's real
optimizer) and reports peak allocated and reserved, the optimizer step's own peak and the steps' seconds:

- fused AdamW: pegasus_large, gradient checkpointing, batch 8 × 1024 × 64, the run's optimizer (Trainer's
  `adamw_torch_fused` on CUDA) against a foreach `torch.optim.AdamW` over the same parameters;
- frozen weights in bf16: qwen2_5_1_5b LoRA at batch 1 × 2048, `memory.frozen_dtype` fp32 against auto (bf16);
- the loss knob: qwen2_5_1_5b LoRA at batch 4 × 2048 without checkpointing and pegasus_large at batch 4 × 1024 ×
  1024, standard against chunked and fused (liger-kernel, where installed);
- the layer-kernels knob: qwen2_5_1_5b LoRA at 4 × 2048 with liger-kernel's RMSNorm and SwiGLU MLP
  (`memory.layer_kernels=liger`), with the standard and the fused loss.

Every number goes to --out as it is measured; `--cases` picks some;
`--device cpu --model tiny_causal --scale 0.0625` smoke-runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the qwen cases before memory.recompute_lora_dropout (session 26) kept LoRA's dropped copies, as `balanced` did then
KEPT = "memory.recompute_lora_dropout=false"
# name: (model, (batch, source, label), overrides, optimizer) — optimizer "run" is the run's own (Trainer's), "foreach"
# a foreach torch.optim.AdamW, as Trainer's adamw_torch builds it
CASES = {
    "pegasus_ckpt_fused_adamw": ("pegasus_large", (8, 1024, 64), ["memory.gradient_checkpointing=true"], "run"),
    "pegasus_ckpt_foreach_adamw": ("pegasus_large", (8, 1024, 64), ["memory.gradient_checkpointing=true"], "foreach"),
    "qwen_lora_frozen_fp32": ("qwen2_5_1_5b", (1, 2048, 2048), ["memory.frozen_dtype=fp32", KEPT], "run"),
    "qwen_lora_frozen_bf16": ("qwen2_5_1_5b", (1, 2048, 2048), ["memory.frozen_dtype=auto", KEPT], "run"),
    "qwen_lora_4x2048_standard": ("qwen2_5_1_5b", (4, 2048, 2048), ["memory.loss=standard", KEPT], "run"),
    "qwen_lora_4x2048_chunked": ("qwen2_5_1_5b", (4, 2048, 2048), ["memory.loss=chunked", KEPT], "run"),
    "qwen_lora_4x2048_fused": ("qwen2_5_1_5b", (4, 2048, 2048), ["memory.loss=fused", KEPT], "run"),
    "qwen_lora_4x2048_fused_dropout0": (
        "qwen2_5_1_5b",
        (4, 2048, 2048),
        ["memory.loss=fused", "model.lora.dropout=0.0", KEPT],
        "run",
    ),
    "qwen_lora_4x2048_fused_liger_layers": (
        "qwen2_5_1_5b",
        (4, 2048, 2048),
        ["memory.loss=fused", "memory.layer_kernels=liger", KEPT],
        "run",
    ),
    "qwen_lora_4x2048_fused_liger_layers_recomputed_dropout": (
        "qwen2_5_1_5b",
        (4, 2048, 2048),
        ["memory.loss=fused", "memory.layer_kernels=liger", "memory.recompute_lora_dropout=true"],
        "run",
    ),
    "qwen_lora_4x2048_chunked_liger_layers_recomputed_dropout": (
        "qwen2_5_1_5b",
        (4, 2048, 2048),
        ["memory.loss=chunked", "memory.layer_kernels=liger", "memory.recompute_lora_dropout=true"],
        "run",
    ),
    "qwen_lora_4x2048_standard_liger_layers": (
        "qwen2_5_1_5b",
        (4, 2048, 2048),
        ["memory.loss=standard", "memory.layer_kernels=liger", KEPT],
        "run",
    ),
    "pegasus_4x1024x1024_standard": ("pegasus_large", (4, 1024, 1024), ["memory.loss=standard"], "run"),
    "pegasus_4x1024x1024_chunked": ("pegasus_large", (4, 1024, 1024), ["memory.loss=chunked"], "run"),
    "pegasus_4x1024x1024_fused": ("pegasus_large", (4, 1024, 1024), ["memory.loss=fused"], "run"),
}
# every case above ran, and runs, with an attention mask kept per layer, as `balanced` did before session 27
PER_LAYER_MASKS = {name: "memory.shared_attention_mask=false" for name in CASES}
CASES |= {
    "qwen_lora_4x2048_fused_liger_layers_recomputed_dropout_shared_mask": (
        "qwen2_5_1_5b",
        (4, 2048, 2048),
        ["memory.loss=fused", "memory.layer_kernels=liger", "memory.recompute_lora_dropout=true"],
        "run",
    ),
    "pegasus_4x1024x1024_chunked_shared_mask": ("pegasus_large", (4, 1024, 1024), ["memory.loss=chunked"], "run"),
}
GIB = 2**30


def foreach_adamw(model, lr: float):
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    return lambda: torch.optim.AdamW(params, lr=lr, foreach=True)


def measure(name: str, args, out: dict, save) -> None:
    import torch
    from memory_model_gpu import compose, probe_context

    from memfit.data.audit import BatchShape
    from memfit.memory.probe import probe

    model, (batch, source, label), overrides, optimizer = CASES[name]
    model = args.model or model
    masks = [PER_LAYER_MASKS[name]] if name in PER_LAYER_MASKS else []
    cfg = compose(
        [
            f"model={model}",
            "memory=balanced",
            "memory.eval_enabled=false",
            "data.max_train_samples=32",
            "tracking=none",
            "budget.gib=null",
            f"output_dir={args.work}/outputs",
            f"trainer.device={args.device}",
            *([f"model.tokenizer={args.tokenizer}"] if args.tokenizer else []),
            *overrides,
            *masks,
        ]
    )
    row: dict = {"case": name, "model": model, "overrides": [*overrides, *masks], "optimizer": optimizer}
    try:
        started = time.perf_counter()
        built, setup = probe_context(cfg, args.device)
        row["build_s"] = time.perf_counter() - started
        if optimizer == "foreach":
            setup = replace(setup, make_optimizer=foreach_adamw(built.model, cfg.trainer.learning_rate))
        row["frozen_dtypes"] = sorted({str(p.dtype) for p in built.model.parameters() if not p.requires_grad})
        shape = BatchShape(batch, max(8, int(source * args.scale)), max(8, int(label * args.scale)))
        row["shape"] = [shape.batch, shape.source, shape.label]
        with _profiled(args.profile, row):
            measured = probe(replace(setup, steps=args.steps), shape)[0]
        row["oom"] = measured.oom
        if not measured.oom:
            row["allocated_gib"] = measured.peak.allocated / GIB
            row["reserved_gib"] = measured.peak.reserved / GIB
            row["backward_gib"] = [measured.backward_peak.allocated / GIB, measured.backward_peak.reserved / GIB]
            row["step_gib"] = [measured.step_peak.allocated / GIB, measured.step_peak.reserved / GIB]
            row["static_gib"] = measured.static_bytes / GIB
            row["step_seconds"] = list(measured.step_seconds)
            tokens = shape.batch * (shape.source if cfg.model.task == "causal" else shape.source + shape.label)
            row["tokens_per_s"] = tokens / min(measured.step_seconds[1:] or measured.step_seconds)
        del built, setup
    except Exception as err:  # noqa: BLE001 - a case that cannot run here (a missing kernel) is a result
        row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    out["rows"].append(row)
    save()
    print(json.dumps(row), flush=True)


@contextlib.contextmanager
def _profiled(enabled: bool, row: dict):
    """With --profile: the probe's steps under torch.profiler; the row gets the GPU's kernel seconds over all of
    them and the operators that took the most of it."""
    if not enabled:
        yield
        return
    import torch

    activity = torch.profiler.ProfilerActivity
    with torch.profiler.profile(activities=[activity.CUDA if torch.cuda.is_available() else activity.CPU]) as prof:
        yield
    events = prof.key_averages()
    row["kernel_s"] = sum(e.self_device_time_total for e in events) / 1e6
    top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:15]
    row["top_kernels_ms"] = [[e.key[:90], e.count, round(e.self_device_time_total / 1e3, 2)] for e in top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default=None, help="every case on this model instead (a CPU smoke run)")
    parser.add_argument("--scale", type=float, default=1.0, help="lengths times this (a CPU smoke run)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per probe (the first meets a new shape)")
    parser.add_argument("--profile", action="store_true", help="each case's probe under torch.profiler")
    parser.add_argument("--work", default="/tmp/memfit-step-variants")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    from memfit.memory.policy import apply_allocator_env

    apply_allocator_env(_balanced_memory())  # expandable segments, before CUDA starts
    out = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "rows": [],
    }
    path = Path(args.out)

    def save() -> None:
        path.write_text(json.dumps(out, indent=1))

    for name in args.cases:
        measure(name, args, out, save)


def _balanced_memory():
    from memory_model_gpu import compose

    return compose(["memory=balanced"]).memory


if __name__ == "__main__":
    main()
