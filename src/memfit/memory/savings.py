"""What each memory knob that is off would hold less at a batch shape: one table, read by estimate_only's lines
(memory.estimate) and by a failing preflight's ways out (memory.preflight), so that both say the same thing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memfit.data.audit import BatchShape
from memfit.memory.model import Architecture, DroppedCopies, logits_bytes, mask_copies


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
    if not memory.shared_attention_mask:
        savings["shared_attention_mask"] = mask_copies(shape.batch, shape.source, shape.label, arch, memory.precision)
    if memory.loss == "standard":
        from memfit.memory.loss import chunked_saving

        logits = logits_bytes(shape.batch, shape.source, shape.label, arch)
        savings["loss"] = chunked_saving(logits, arch.vocab_size)
    return {knob: saving for knob, saving in savings.items() if saving > 0}
