"""What each memory knob that is off would hold less at a batch shape: one table, read by estimate_only's lines
(memory.estimate) and by a failing preflight's ways out (memory.preflight), so that both say the same thing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memfit.data.audit import BatchShape
from memfit.memory.model import Architecture, logits_bytes

# What memory.recompute_lora_dropout would save (memfit.lora_dropout): peft's LoRA dropout keeps a dropped copy of
# its input per adapter, where the recomputing one keeps each input once for the adapters that read it.


def _product_element(precision: str) -> int:
    """Bytes of one element a product makes: 2 under bf16 or fp16 autocast, else 4."""
    return 2 if precision in ("bf16", "fp16") else 4


@dataclass(frozen=True)
class DroppedCopies:
    """Input features, summed, of the dropped copies a LoRA model with peft's own dropout keeps beyond one per input.
    Adapters under one parent module with one input width are taken to read one input (q, k and v; gate and up);
    a few do not (an attention's o, a seq2seq cross-attention's q), so this is an estimate: qwen2_5_1_5b LoRA at
    4 × 2048 in bf16, 2.63 GiB against the 2.94 GiB measured
    (benchmarks/results/step_variants_h200_session26_recompute.json)."""

    source_width: int  # a seq2seq encoder's adapters: their inputs are source-long
    target_width: int  # the rest: a decoder's (a causal model's every adapter, over its whole sequence)

    def bytes(self, batch: int, source: int, label: int, task: str, precision: str) -> int:
        """At a batch shape: each copy is in the product's dtype (bf16 or fp16 under autocast, else fp32)."""
        target = source if task == "causal" else label
        return batch * (self.source_width * source + self.target_width * target) * _product_element(precision)


def dropped_copies(model: Any) -> DroppedCopies:
    """The DroppedCopies of a built model's LoRA adapters that run peft's dropout (p > 0); zero for any other."""
    groups: dict[tuple[str, int], int] = {}
    for name, module in model.named_modules():
        dropouts = getattr(module, "lora_dropout", None)
        if dropouts is None or not hasattr(module, "in_features"):
            continue
        if any(getattr(dropout, "p", 0) > 0 for dropout in dropouts.values()):
            key = (name.rsplit(".", 1)[0], module.in_features)
            groups[key] = groups.get(key, 0) + 1
    source = sum((n - 1) * width for (parent, width), n in groups.items() if ".encoder." in f".{parent}.")
    target = sum((n - 1) * width for (parent, width), n in groups.items() if ".encoder." not in f".{parent}.")
    return DroppedCopies(source, target)


def mask_copies(batch: int, source: int, label: int, arch: Architecture, precision: str) -> int:
    """Bytes of the attention-mask copies kept beyond one where every layer converts a padded batch's boolean mask
    (memory.shared_attention_mask=false): each layer's batch × queries × keys copy in the queries' dtype (bf16 or
    fp16 under autocast, else fp32), but one; a causal model's self-attention, a seq2seq encoder's self-attention and
    its decoder's cross-attention (the decoder's own is causal and unpadded: no mask). Zero where attention is not
    SDPA's (eager keeps its scores; T5's position biases carry the mask)."""
    if arch.quadratic_attention:
        return 0
    element = _product_element(precision)

    def copies(layers: int, queries: int, keys: int) -> int:
        return max(layers - 1, 0) * batch * queries * keys * element

    if arch.task == "causal":
        return copies(arch.decoder_layers, source, source)
    return copies(arch.encoder_layers, source, source) + copies(arch.decoder_layers, label, source)


@dataclass(frozen=True)
class KnobWay:
    setting: str  # what to set: "memory.loss=chunked"
    why: str  # what it keeps instead, and its cost
    metric: str  # estimate_only's metric of the saving


KNOB_WAYS = {
    "recompute_lora_dropout": KnobWay(
        "memory.recompute_lora_dropout=true",
        "LoRA adapters keep their shared input and a mask, not a dropped copy each; one more elementwise product per "
        "adapter",
        "estimate/recompute_lora_dropout_saving_gib",
    ),
    "shared_attention_mask": KnobWay(
        "memory.shared_attention_mask=true",
        "one attention mask kept for the backward pass, not one per layer; the same attention",
        "estimate/shared_attention_mask_saving_gib",
    ),
    "loss": KnobWay(
        "memory.loss=chunked",
        "no full float32 logits and gradient; the head's gradients made chunk by chunk; on CUDA, memory.loss=fused "
        "saves as much",
        "estimate/chunked_loss_saving_gib",
    ),
}


def knob_savings(memory: Any, arch: Architecture, copies: DroppedCopies, shape: BatchShape) -> dict[str, int]:
    """Bytes each knob of KNOB_WAYS that `memory` leaves off would hold less at `shape` (only those that save)."""
    savings = {}
    if not memory.recompute_lora_dropout:
        savings["recompute_lora_dropout"] = copies.bytes(
            shape.batch, shape.source, shape.label, arch.task, memory.precision
        )
    # a causal model's right-padded batches without their padding mask (memory.causal_padding_mask=false) make no
    # mask to share; a left-padding tokenizer keeps it, and the way out is then left unsaid, never promised
    maskless = arch.task == "causal" and not memory.causal_padding_mask
    if not memory.shared_attention_mask and not maskless:
        savings["shared_attention_mask"] = mask_copies(shape.batch, shape.source, shape.label, arch, memory.precision)
    if memory.loss == "standard":
        from memfit.memory.loss import chunked_saving

        logits = logits_bytes(shape.batch, shape.source, shape.label, arch)
        savings["loss"] = chunked_saving(logits, arch.vocab_size)
    return {knob: saving for knob, saving in savings.items() if saving > 0}
