"""Memory policy → concrete knobs: allocator environment, the budget cap, and Trainer arguments.

The allocator settings must be in place before CUDA initialises, so `apply_allocator_env` runs first
thing in a run, before torch touches the device.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from memfit.meter import GIB

OPTIMIZER_NAMES = {"adamw": "adamw_torch", "adamw_8bit": "adamw_bnb_8bit", "adafactor": "adafactor"}


def resolve_device(cfg: DictConfig) -> str:
    """'cuda' or 'cpu' for trainer.device=auto|cuda|cpu."""
    if cfg.trainer.device != "auto":
        return cfg.trainer.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def apply_allocator_env(memory: DictConfig) -> None:
    """expandable_segments lowers fragmentation in long runs; it has to be set before CUDA starts."""
    if not memory.expandable_segments:
        return
    current = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments" not in current:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [current, "expandable_segments:True"]))


@dataclass(frozen=True)
class BudgetCap:
    budget_bytes: int | None  # what the run must fit in; None = the whole device
    device_bytes: int
    fraction: float | None  # the allocator cap set on CUDA, None when not capped
    enforced: bool  # True when the device itself refuses allocations past the budget

    @property
    def label(self) -> str:
        if self.budget_bytes is None:
            return "no budget (whole device)"
        how = "enforced by the CUDA allocator cap" if self.enforced else "checked against measured peaks"
        return f"{self.budget_bytes / GIB:.2f} GiB ({how})"


def apply_budget(cfg: DictConfig, device: str, device_bytes: int) -> BudgetCap:
    """On CUDA, cap the allocator at min(budget, memory_fraction × device) so an over-budget step is a real OOM.

    On CPU the budget applies to host memory: it is compared with the measured peak RSS, not enforced.
    """
    budget = int(cfg.budget.gib * GIB) if cfg.budget.gib is not None else None
    fractions = [cfg.memory.memory_fraction] if cfg.memory.memory_fraction else []
    if cfg.budget.enforce and budget:
        fractions.append(budget / device_bytes)
    if device != "cuda":
        return BudgetCap(budget, device_bytes, None, enforced=False)
    import torch

    # Always set: the cap is process-wide and outlives a run, so an earlier run's small budget must not stay.
    fraction = min(1.0, *fractions) if fractions else 1.0
    torch.cuda.set_per_process_memory_fraction(fraction)
    if not fractions:
        return BudgetCap(budget, device_bytes, None, enforced=False)
    return BudgetCap(budget or int(fraction * device_bytes), device_bytes, fraction, enforced=True)


def _sampling_kwargs(args_cls: type, group_by_length: bool) -> dict[str, Any]:
    """transformers 5.x renamed group_by_length to train_sampling_strategy; support both spellings."""
    names = {f.name for f in dataclasses.fields(args_cls)}
    if "train_sampling_strategy" in names:
        return {"train_sampling_strategy": "group_by_length" if group_by_length else "random"}
    return {"group_by_length": group_by_length} if "group_by_length" in names else {}


def training_arguments(cfg: DictConfig, device: str, output_dir: str, has_eval: bool) -> Any:
    """HF (Seq2Seq)TrainingArguments from the trainer config and the memory policy's knobs."""
    from transformers import Seq2SeqTrainingArguments, TrainingArguments

    args_cls = Seq2SeqTrainingArguments if cfg.model.task == "seq2seq" else TrainingArguments
    t, mem = cfg.trainer, cfg.memory
    evaluate = has_eval and mem.eval_enabled
    # null eval_steps = once at the end: at max_steps, or per epoch when training by epochs
    eval_steps = t.eval_steps or (t.max_steps if t.max_steps > 0 else None)
    kwargs: dict[str, Any] = dict(
        output_dir=output_dir,
        per_device_train_batch_size=t.batch_size,
        per_device_eval_batch_size=mem.eval_batch_size or t.batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        learning_rate=t.learning_rate,
        weight_decay=t.weight_decay,
        warmup_steps=t.warmup_steps,
        max_steps=t.max_steps,
        num_train_epochs=t.num_train_epochs,
        logging_steps=t.logging_steps,
        eval_strategy=("steps" if eval_steps else "epoch") if evaluate else "no",
        eval_steps=eval_steps if evaluate else None,
        save_strategy="steps" if t.save_steps else "no",
        save_steps=t.save_steps or 500,
        seed=t.seed,
        bf16=mem.precision == "bf16",
        fp16=mem.precision == "fp16",
        optim=OPTIMIZER_NAMES[mem.optimizer],
        torch_empty_cache_steps=mem.empty_cache_steps,
        use_cpu=device == "cpu",
        dataloader_num_workers=t.dataloader_num_workers,
        report_to="none",  # memfit owns the MLflow run (tracking.py)
        remove_unused_columns=False,  # datasets hold only model inputs; peft wrappers hide forward's signature
        disable_tqdm=bool(os.environ.get("CI")),
    )
    kwargs.update(_sampling_kwargs(args_cls, mem.group_by_length))
    if args_cls is Seq2SeqTrainingArguments and t.predict_with_generate:
        from memfit.config import effective_lengths

        kwargs.update(predict_with_generate=True, generation_max_length=effective_lengths(cfg)[1])
    return args_cls(**kwargs)
