"""Training: HF Trainer wiring: the Trainer memfit builds, how it runs a step of micro-batches, and train()."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from memfit.data import CountingCollator
from memfit.data.collate import loss_positions
from memfit.data.packing import MicroBatches
from memfit.training.peaks import MicroBatchPeaks


@dataclass
class TrainingTotals:
    steps: int
    tokens: int
    wall_s: float
    final_loss: float | None
    eval_loss: float | None = None


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
        host cost of a LoRA step: benchmarks/results/lora_host_cost_cpu_mode_and_flops.json), though training changes
        no parameter count."""
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
    benchmarks/results/lora_host_cost_cpu_mode_and_flops.json). Only the top module is read, since modes change
    through it (Trainer's train and eval, memfit's probes), never a submodule alone."""
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
