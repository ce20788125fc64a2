"""Training: HF Trainer wiring and the callback that puts peak memory beside loss at every logged step."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from memfit.data import CountingCollator
from memfit.memory.meter import CudaMeter, HostMeter
from memfit.training.throughput import Window

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


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite: training stops at once instead of burning the rest of its budget."""


@dataclass
class TrainingTotals:
    steps: int
    tokens: int
    wall_s: float
    final_loss: float | None
    eval_loss: float | None = None


class MemoryLoggingCallback:
    """At each Trainer log: the window's peak allocated/reserved memory, tokens/s and the Trainer's own numbers.

    Cheap by design: reading the allocator's peak counters does not synchronise the GPU, token counts come
    from the collator on CPU, and the tracker buffers metrics and writes them in batches.
    """

    def __init__(
        self, meter: CudaMeter | HostMeter, tracker: Any, collator: CountingCollator, max_train_tokens: int | None
    ):
        self.meter, self.tracker, self.collator = meter, tracker, collator
        self.max_train_tokens = max_train_tokens
        self._last_time = 0.0
        self._last = (0, 0, 0, 0)  # the collator's tokens, padded tokens, micro-batches, new shapes at the last log
        self.windows: list[Window] = []  # between a train log and the log before it
        self._retries_before = 0

    @property
    def steady_tokens_per_s(self) -> float | None:
        """Tokens/s after the first logged window: the first step builds optimizer state and grows the allocator,
        which a short timed segment (a sweep trial's) would otherwise count as slowness. Later windows that met a
        new padded shape (`train/new_shapes`) stay in: leaving them out did not bring 5- or 10-step estimates
        closer to a long run's throughput on the H200 (benchmarks/README.md, trial_throughput_gpu.py)."""
        steady = self.windows[1:]
        seconds = sum(w.seconds for w in steady)
        return sum(w.tokens for w in steady) / seconds if steady and seconds > 0 else None

    @property
    def alloc_retries(self) -> int:
        """Allocator retries since training began (the preflight's probes near the cap are not counted)."""
        return self.meter.alloc_retries() - self._retries_before

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._retries_before = self.meter.alloc_retries()
        self.meter.reset_window()
        self._last_time, self._last = time.perf_counter(), self._counts()

    def _counts(self) -> tuple[int, int, int, int]:
        c = self.collator
        return c.tokens, c.padded_tokens, c.micro_batches, c.new_shapes

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.tracker.flush()  # a checkpoint's steps are in MLflow: a resumed run's history has no gap

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.max_train_tokens and self.collator.tokens >= self.max_train_tokens:
            control.should_training_stop = True  # the token budget is spent: the same data for every batch size

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
        metrics[prefix + "alloc_retries"] = self.alloc_retries  # cumulative since training began
        now, counts = time.perf_counter(), self._counts()
        if "loss" in logs and now > self._last_time:
            tokens, padded_tokens, micro_batches, new_shapes = (a - b for a, b in zip(counts, self._last, strict=True))
            window = Window(tokens, now - self._last_time, padded_tokens, micro_batches, new_shapes)
            metrics["train/tokens_per_s"] = window.tokens / window.seconds
            metrics["train/window_s"] = window.seconds  # wall seconds since the last log (one step at logging_steps=1)
            metrics["train/new_shapes"] = window.new_shapes  # > 0: paid a new shape's warm-up
            metrics["train/padding_share"] = 1 - window.tokens / window.padded_tokens if window.padded_tokens else 0.0
            self.windows.append(window)
        self._last_time, self._last = now, counts
        self.tracker.log_metrics(metrics, step=state.global_step)
        loss = metrics.get("train/loss", metrics.get("eval/loss"))
        if loss is not None and not math.isfinite(loss):
            self.tracker.flush()  # the non-finite step is in the store before the run ends
            raise NonFiniteLoss(f"nan_loss: loss is {loss} at step {state.global_step}")


def make_callback(
    meter: CudaMeter | HostMeter, tracker: Any, collator: CountingCollator, max_train_tokens: int | None = None
) -> Any:
    """The callback as a real TrainerCallback subclass (transformers is imported only here)."""
    cls = type("MemfitMemoryCallback", (MemoryLoggingCallback, _trainer_callback_base()), {})
    return cls(meter, tracker, collator, max_train_tokens)


def _counting_only_training(base: type) -> type:
    """The Trainer class, counting a batch's tokens when training takes it, and evaluation collating through
    the same collator without counting: tokens/s and a token budget are about trained tokens only."""

    def evaluate(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.data_collator.paused():
            return base.evaluate(self, *args, **kwargs)

    def training_step(self: Any, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        self.data_collator.consume()  # this micro-batch is now trained on: count it, remember its shape
        return base.training_step(self, model, inputs, *args, **kwargs)

    return type(base.__name__, (base,), {"evaluate": evaluate, "training_step": training_step})


def build_trainer(
    task: str, model: Any, tokenizer: Any, datasets: Any, args: Any, collator: Any, callbacks: list
) -> Any:
    """(Seq2Seq)Trainer for `task` over the datasets, evaluating where `args` does (memory.policy.training_arguments
    turns evaluation off without validation data or with memory.eval_enabled=false)."""
    from transformers import Seq2SeqTrainer, Trainer

    base = Seq2SeqTrainer if task == "seq2seq" else Trainer
    evaluate = "validation" in datasets and args.eval_strategy != "no"
    trainer = _counting_only_training(base)(
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


def _final_eval_loss(trainer: Any, last_step: int) -> float | None:
    """Eval loss at the last step: the Trainer's own when it evaluated there, else one evaluation now (training
    stopped early, e.g. on its token budget)."""
    if trainer.eval_dataset is None:
        return None
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    if evals and evals[-1].get("step") == last_step:
        return evals[-1]["eval_loss"]
    return trainer.evaluate().get("eval_loss")


def train(trainer: Any, collator: CountingCollator, resume_from: str | None = None) -> TrainingTotals:
    """Train (from `resume_from`, a checkpoint: step, optimizer, scheduler, RNG and data position restored)."""
    start = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=resume_from)
    wall = time.perf_counter() - start  # training only: the closing evaluation below is not in tokens/s
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return TrainingTotals(
        steps=result.global_step,
        tokens=collator.tokens,
        wall_s=wall,
        final_loss=losses[-1] if losses else None,
        eval_loss=_final_eval_loss(trainer, result.global_step),
    )
