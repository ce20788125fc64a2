"""Training: HF Trainer wiring and the callback that puts peak memory beside loss at every logged step."""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from memfit.config import GIB
from memfit.data import CountingCollator
from memfit.data.collate import loss_positions
from memfit.data.packing import MicroBatches
from memfit.memory.meter import CudaMeter, HostMeter
from memfit.training.peaks import MicroBatchPeaks
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
        self._last = (0, 0, 0, 0, 0)  # the collator's tokens, padded tokens, micro-batches, new shapes, rows: last log
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
    def tokens_per_s_spread(self) -> float | None:
        """How much the steady windows' tokens/s vary: their standard deviation over their mean (0.05: ±5%), with
        two windows or more after the first; how far a short segment's rate can be trusted."""
        import statistics

        rates = [w.tokens / w.seconds for w in self.windows[1:] if w.seconds > 0]
        if len(rates) < 2 or statistics.fmean(rates) <= 0:
            return None
        return statistics.stdev(rates) / statistics.fmean(rates)

    @property
    def alloc_retries(self) -> int:
        """Allocator retries since training began (the preflight's probes near the cap are not counted)."""
        return self.meter.alloc_retries() - self._retries_before

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._retries_before = self.meter.alloc_retries()
        # what training starts from (weights, and anything the preflight left): each micro-batch's peak builds on it
        start = self.meter.current_bytes() / GIB
        self.tracker.log_metrics({"mem/train_start_allocated_gib": start}, step=state.global_step)
        self.meter.reset_window()
        self.meter.reset_overall()  # the run's peaks are training's: the preflight's probes are reported apart
        self._last_time, self._last = time.perf_counter(), self._counts()

    def _counts(self) -> tuple[int, int, int, int, int]:
        c = self.collator
        return c.tokens, c.padded_tokens, c.micro_batches, c.new_shapes, c.rows

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
            tokens, padded_tokens, micro_batches, new_shapes, rows = (
                a - b for a, b in zip(counts, self._last, strict=True)
            )
            window = Window(tokens, now - self._last_time, padded_tokens, micro_batches, new_shapes)
            metrics["train/tokens_per_s"] = window.tokens / window.seconds
            metrics["train/window_s"] = window.seconds  # wall seconds since the last log (one step at logging_steps=1)
            metrics["train/new_shapes"] = window.new_shapes  # > 0: paid a new shape's warm-up
            metrics["train/padding_share"] = 1 - window.tokens / window.padded_tokens if window.padded_tokens else 0.0
            metrics["train/tokens"] = window.tokens  # real tokens of the window's steps
            metrics["train/micro_batches"] = micro_batches  # forward + backward passes in the window
            metrics["train/micro_batch_size"] = rows / micro_batches if micro_batches else 0.0  # mean rows of each
            metrics["train/samples"] = rows  # the window's samples (a step's vary with effective_batch=tokens)
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


class _MemfitTraining:
    """Mixed into the Trainer class (before it): counts a batch's tokens when training takes it, and evaluation
    collates through the same collator without counting, so tokens/s and a token budget are about trained tokens.

    A step of budget-shaped micro-batches (trainer.batching=budget: the collator hands over MicroBatches) runs them
    one after another, each micro-batch's mean loss weighted by its share of the step's label tokens, so the step's
    gradient is that of the mean loss per label token over all its samples, whatever the micro-batches' sizes.
    Trainer sees one batch per optimizer step (gradient accumulation 1): its schedule, checkpoints and the resumed
    position count steps of the same samples as they do with fixed batches.
    """

    task = "seq2seq"  # set on the class built by build_trainer
    memory_loss: str = "standard"  # memory.loss: chunked or fused compute head and loss without the full logits
    token_share: Any = None  # while a micro-batch of a budget-shaped step runs: its share of the step's label tokens
    eval_sums: tuple[Any, Any] = (0.0, 0)  # budget-shaped evaluation: summed loss over label tokens, and the tokens
    step_sampler: Any = None  # trainer.effective_batch=tokens: memfit.data.packing.TokenStepSampler draws the steps
    flos_parameters: int | None = None  # the parameters Trainer's FLOPs estimate counts, counted once
    peaks: MicroBatchPeaks | None = None  # marks the meter around every micro-batch: which one training peaked on
    # while a micro-batch trains: its label positions, counted by the collator on the host (memory.loss chunked or
    # fused then picks those rows without reading the labels back from the device)
    loss_positions: int | None = None

    def get_train_dataloader(self) -> Any:
        """Trainer's own, or one optimizer step per batch drawn by the step sampler (steps of unequal sample counts)."""
        if self.step_sampler is None:
            return super().get_train_dataloader()
        from torch.utils.data import DataLoader

        dataset = self.train_dataset
        if hasattr(dataset, "column_names"):  # a datasets.Dataset, as Trainer's own loader treats it
            dataset = self._remove_unused_columns(dataset, description="training")
        loader = DataLoader(
            dataset,
            batch_sampler=self.step_sampler,
            collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )
        return self.accelerator.prepare(loader)

    def _shares(self, inputs: MicroBatches) -> list[Any]:
        counts = [loss_positions(micro["labels"], self.task) for micro in inputs]
        total = sum(counts).clamp(min=1)  # a tensor: no device synchronisation
        return [count / total for count in counts]

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        with self.data_collator.paused():
            return super().evaluate(*args, **kwargs)

    def _train_micro_batch(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if self.peaks is not None:
            self.peaks.starting(self.state.global_step + 1)
        self.data_collator.consume()  # this micro-batch is now trained on: count it, remember its shape
        self.loss_positions = self._counted_positions(inputs)
        try:
            loss = super().training_step(model, inputs, *args, **kwargs)
        finally:
            self.loss_positions = None
        if self.peaks is not None:
            self.peaks.finished(self.data_collator.last_shape)
        return loss

    def _counted_positions(self, inputs: Any) -> int | None:
        """The label positions the collator counted for the batch training takes now, where its labels have the
        shape the collator gave them (read on the host); else None, and the loss counts them on the device."""
        collator = self.data_collator
        labels = inputs.get("labels") if hasattr(inputs, "get") else None
        if labels is None or tuple(labels.shape) != collator.last_shape.get("labels"):
            return None
        return collator.last_loss_positions

    def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(inputs, MicroBatches):
            return self._train_micro_batch(model, inputs, *args, **kwargs)
        loss = None
        for micro, share in zip(inputs, self._shares(inputs), strict=True):
            self.token_share = share  # compute_loss weights the micro-batch's mean loss by it
            part = self._train_micro_batch(model, micro, *args, **kwargs)
            loss = part if loss is None else loss + part
        self.token_share = None
        return loss

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
        if self.memory_loss != "standard":  # head and loss without the full logits (memfit.memory.loss)
            from memfit.memory.loss import model_loss

            smoothing = self.args.label_smoothing_factor
            positions = self.loss_positions
            chunked = model_loss(model, inputs, self.task, smoothing, kind=self.memory_loss, positions=positions)
            result = (chunked, {"loss": chunked}) if return_outputs else chunked
        else:
            result = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        if self.token_share is None:
            return result
        loss = result[0] if return_outputs else result
        # a micro-batch with no label tokens (all -100) has a NaN mean: it weighs nothing, and its zero passes no NaN
        # to the gradients; a NaN where there are tokens (divergence) still shows
        import torch

        share = self.token_share
        weighted = torch.where(share > 0, loss * share, torch.zeros_like(loss))
        return (weighted, result[1]) if return_outputs else weighted

    def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool, **kwargs: Any) -> Any:
        if not isinstance(inputs, MicroBatches):
            return super().prediction_step(model, inputs, prediction_loss_only, **kwargs)
        total = None
        for micro, share in zip(inputs, self._shares(inputs), strict=True):
            mean = super().prediction_step(model, micro, True, **kwargs)[0]
            total = mean * share if total is None else total + mean * share
            tokens = loss_positions(micro["labels"], self.task)
            self.eval_sums = (self.eval_sums[0] + mean * tokens, self.eval_sums[1] + tokens)
        return total, None, None

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """The eval loss per label token over the whole set, where budget-shaped eval batches differ in size."""
        self.eval_sums = (0.0, 0)
        output = super().evaluation_loop(*args, **kwargs)
        loss_sum, tokens = self.eval_sums
        prefix = kwargs.get("metric_key_prefix", args[3] if len(args) > 3 else "eval")
        if int(tokens) > 0 and f"{prefix}_loss" in output.metrics:
            output.metrics[f"{prefix}_loss"] = float(loss_sum / tokens)
        return output

    def floating_point_ops(self, inputs: Any) -> int:
        """Trainer's estimate, 6 × input tokens × parameters without embeddings, summed over a step's micro-batches,
        with the parameters counted once: Trainer counts them at every micro-batch, a walk over every module (a
        host cost of a LoRA step: benchmarks/README.md, session 35), though training changes no parameter count."""
        if isinstance(inputs, MicroBatches):
            return sum(self.floating_point_ops(micro) for micro in inputs)
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if main_input not in inputs or not hasattr(self.model, "num_parameters"):
            return 0
        if self.flos_parameters is None:
            self.flos_parameters = self.model.num_parameters(exclude_embeddings=True)
        return 6 * inputs[main_input].numel() * self.flos_parameters


def _set_mode(model: Any, mode: bool = True) -> Any:
    """nn.Module.train, returning at once where the model is already in that mode: Trainer sets train mode at every
    micro-batch, a walk over every module (qwen2_5_1_5b with LoRA: ~2,500; a host cost of a LoRA step,
    benchmarks/README.md, session 35). Only the top module is read, since modes change through it (Trainer's
    train and eval, memfit's probes), never a submodule alone."""
    if model.training == mode:
        return model
    return type(model).train(model, mode)


def build_trainer(
    task: str,
    model: Any,
    tokenizer: Any,
    datasets: Any,
    args: Any,
    collator: Any,
    callbacks: list,
    loss: str = "standard",
) -> Any:
    """(Seq2Seq)Trainer for `task` over the datasets, evaluating where `args` does (memory.policy.training_arguments
    turns evaluation off without validation data or with memory.eval_enabled=false); `loss`: memory.loss."""
    from transformers import Seq2SeqTrainer, Trainer

    base = Seq2SeqTrainer if task == "seq2seq" else Trainer
    evaluate = "validation" in datasets and args.eval_strategy != "no"
    model.train = functools.partial(_set_mode, model)  # model.eval() reaches it too (Module.eval calls self.train)
    trainer = type(base.__name__, (_MemfitTraining, base), {"task": task, "memory_loss": loss})(
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


@contextlib.contextmanager
def forward_as_trained(trainer: Any) -> Iterator[None]:
    """The model's forward as the Trainer will run it, for the length of the block: accelerate's prepare_model
    (called when training starts) wraps it in the accelerator's autocast and converts its outputs to float32 (a
    float32 copy of 16-bit logits, held beside them). The preflight's probe runs before training, so it wraps the
    forward the same way here and puts the model's own back after. Nothing changes where the accelerator runs no
    mixed precision."""
    accelerator, model = trainer.accelerator, trainer.model
    if not accelerator.native_amp:
        yield
        return
    from accelerate.utils import convert_outputs_to_fp32

    own, set_on_instance = model.forward, "forward" in vars(model)

    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with accelerator.autocast():
            return own(*args, **kwargs)

    model.forward = convert_outputs_to_fp32(autocast_forward)
    try:
        yield
    finally:
        if set_on_instance:  # a forward the instance already had (a wrapper of someone else's): put it back
            model.forward = own
        else:
            del model.forward  # the class's forward again
