"""Training: HF Trainer wiring and the callback that puts peak memory beside loss at every logged step."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from memfit.data import CountingCollator
from memfit.meter import CudaMeter, HostMeter

# Trainer log keys → memfit metric names (`train/...`, `eval/...`), so the MLflow UI groups them.
_RENAMES = {"loss": "train/loss", "learning_rate": "train/learning_rate", "grad_norm": "train/grad_norm"}


def _metric_name(key: str) -> str | None:
    if key in _RENAMES:
        return _RENAMES[key]
    if key.startswith("eval_"):
        return "eval/" + key.removeprefix("eval_")
    return None


def _trainer_callback_base() -> type:
    from transformers import TrainerCallback

    return TrainerCallback


@dataclass
class TrainingTotals:
    steps: int
    tokens: int
    wall_s: float
    final_loss: float | None


class MemoryLoggingCallback:
    """At each Trainer log: the window's peak allocated/reserved memory, tokens/s and the Trainer's own numbers.

    Cheap by design: reading the allocator's peak counters does not synchronise the GPU, token counts come
    from the collator on CPU, and the tracker buffers metrics and writes them in batches.
    """

    def __init__(self, meter: CudaMeter | HostMeter, tracker: Any, collator: CountingCollator):
        self.meter, self.tracker, self.collator = meter, tracker, collator
        self._last_time = 0.0
        self._last_tokens = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.meter.reset_window()
        self._last_time, self._last_tokens = time.perf_counter(), self.collator.tokens

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        logs = logs or {}
        if "train_runtime" in logs:  # Trainer's end-of-training summary: memfit logs its own summary
            return
        metrics = {name: float(v) for k, v in logs.items() if (name := _metric_name(k)) and isinstance(v, int | float)}
        peak = self.meter.window_peak()
        self.meter.reset_window()
        prefix = "mem/eval_" if any(k.startswith("eval_") for k in logs) else "mem/"
        metrics[prefix + "peak_allocated_gib"] = peak.allocated_gib
        metrics[prefix + "peak_reserved_gib"] = peak.reserved_gib
        now, tokens = time.perf_counter(), self.collator.tokens
        if "loss" in logs and now > self._last_time:
            metrics["train/tokens_per_s"] = (tokens - self._last_tokens) / (now - self._last_time)
        self._last_time, self._last_tokens = now, tokens
        self.tracker.log_metrics(metrics, step=state.global_step)


def make_callback(meter: CudaMeter | HostMeter, tracker: Any, collator: CountingCollator) -> Any:
    """The callback as a real TrainerCallback subclass (transformers is imported only here)."""
    cls = type("MemfitMemoryCallback", (MemoryLoggingCallback, _trainer_callback_base()), {})
    return cls(meter, tracker, collator)


def build_trainer(
    cfg: DictConfig, model: Any, tokenizer: Any, datasets: Any, args: Any, collator: Any, callbacks: list
) -> Any:
    from transformers import Seq2SeqTrainer, Trainer

    trainer_cls = Seq2SeqTrainer if cfg.model.task == "seq2seq" else Trainer
    evaluate = "validation" in datasets and cfg.memory.eval_enabled
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=datasets["train"],
        eval_dataset=datasets["validation"] if evaluate else None,
        data_collator=collator,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    # Several seq2seq models take **kwargs but ignore num_items_in_batch, so Trainer skips its 1/accumulation
    # scaling and both the logged loss and the gradients grow with accumulation. Mean loss per micro-batch,
    # scaled by Trainer, is right for every model.
    trainer.model_accepts_loss_kwargs = False
    return trainer


def train(trainer: Any, collator: CountingCollator) -> TrainingTotals:
    start = time.perf_counter()
    result = trainer.train()
    wall = time.perf_counter() - start
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return TrainingTotals(
        steps=result.global_step, tokens=collator.tokens, wall_s=wall, final_loss=losses[-1] if losses else None
    )
