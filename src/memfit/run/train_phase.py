"""The training phase of a run: build model, collator and Trainer (shared with the preflight), train, and record
the summary, or the forensics of an OOM."""

from __future__ import annotations

import logging
import tempfile
from typing import Any

from memfit.run.context import RunContext, TrainingSetup
from memfit.run.identity import checkpoint_dir, run_name
from memfit.run.report import OutOfMemoryInTraining, RunReport
from memfit.training.peaks import MicroBatchPeaks

log = logging.getLogger("memfit")


def prepare_training(ctx: RunContext) -> TrainingSetup:
    """Model, collator, callback and Trainer: everything the preflight and training share."""
    from memfit.data import CountingCollator, model_columns
    from memfit.memory.policy import training_arguments
    from memfit.models import build_model
    from memfit.run.signals import stop_check_callback
    from memfit.training import faults
    from memfit.training.callback import make_callback
    from memfit.training.trainer import build_trainer

    cfg = ctx.cfg
    built = build_model(cfg, ctx.tokenizer, ctx.device)
    ctx.clock.lap("model")
    ctx.tracker.log_params(
        {
            "memfit.random_weights": built.random_weights,
            "memfit.total_params": built.total_params,
            "memfit.trainable_params": built.trainable_params,
        }
    )
    log.info(
        "model %s: %s params, %s trainable%s",
        cfg.model.name,
        _count(built.total_params),
        _count(built.trainable_params),
        " (random weights)" if built.random_weights else "",
    )
    memory = cfg.memory
    collator = CountingCollator(ctx.tokenizer, memory.pad_to_multiple_of, cfg.model.task, memory.causal_padding_mask)
    if collator.drops_padding_mask:
        log.info("memory.causal_padding_mask=false: right-padded batches attend through the causal mask alone")
    # on CPU nothing caps host memory at the budget: the callback stops a run whose RSS passes it
    host_budget = cfg.budget.gib if ctx.device == "cpu" and cfg.budget.enforce else None
    callback = make_callback(ctx.meter, ctx.tracker, collator, cfg.trainer.max_train_tokens, host_budget)
    callbacks = [callback, stop_check_callback(), *faults.callbacks_for(run_name(cfg)), *ctx.callbacks]
    ready = {split: model_columns(ds) for split, ds in ctx.prepared.datasets.items()}
    args = training_arguments(cfg, ctx.device, str(checkpoint_dir(cfg)), has_eval="validation" in ready)
    trainer = build_trainer(
        cfg.model.task, built.model, ctx.tokenizer, ready, args, collator, callbacks, cfg.memory.loss
    )
    trainer.peaks = MicroBatchPeaks(ctx.meter, keep_all=cfg.forensics.micro_batch_peaks)
    ctx.clock.lap("trainer")
    return TrainingSetup(built, collator, callback, trainer)


def _count(params: int) -> str:
    """1.5M, 2.1k or 37: a tiny model's adapters are not '0.00M'."""
    if params >= 100_000:
        return f"{params / 1e6:.1f}M"
    return f"{params / 1e3:.1f}k" if params >= 1000 else str(params)


def _record_oom(ctx: RunContext, setup: TrainingSetup, err: BaseException) -> str:
    """OOM forensics: the step, the batch that caused it, the allocator's summary and (opt-in) a snapshot."""
    import torch

    step = setup.trainer.state.global_step + 1
    shape = {k: list(v) for k, v in setup.collator.last_shape.items()}
    reason = f"oom: at step {step}, batch {shape}"
    report = [reason, "", str(err)]
    if (highest := setup.trainer.peaks.highest) is not None:  # the micro-batches that fitted before it
        report[1:1] = ["", f"the highest peak before it: {highest.describe()}"]
    if ctx.device == "cuda":
        report += ["", torch.cuda.memory_summary()]
        if ctx.cfg.forensics.memory_history:
            with tempfile.TemporaryDirectory() as tmp:
                snapshot = f"{tmp}/memory_snapshot.pickle"
                torch.cuda.memory._dump_snapshot(snapshot)  # no public API yet (torch 2.13)
                ctx.tracker.log_artifact(snapshot, "oom")
    ctx.tracker.log_text("\n".join(report), "oom/report.txt")
    return reason


def _record_peaks(ctx: RunContext, peaks: MicroBatchPeaks) -> str | None:
    """Which part of training its allocated peak was on (a tag), and with forensics.micro_batch_peaks every part's
    (an artifact)."""
    peaks.after_training()
    if peaks.highest is None:
        return None
    where = peaks.highest.describe()
    log.info("training's allocated peak: %s", where)
    ctx.tracker.set_tags({"memfit.peak_where": where})
    if peaks.keep_all:
        ctx.tracker.log_text(peaks.table(), "forensics/micro_batch_peaks.tsv")
    return where


def _epoch_tokens_per_s(ctx: RunContext, setup: TrainingSetup) -> float | None:
    """A whole epoch's tokens/s: the step-time model fitted to the segment's steps after the first (which builds the
    optimizer state) applied to the epoch's batch plan (memfit.training.throughput). None with too few steps."""
    from memfit.training.throughput import StepTimeModel, epoch_tokens_per_s, run_epoch_plan

    model = StepTimeModel.fit(setup.callback.windows[1:])
    if model is None:
        return None
    sampler = setup.trainer.step_sampler  # trainer.effective_batch=tokens: the steps it drew last
    steps = sampler.steps() if sampler is not None else None
    plan = run_epoch_plan(ctx.cfg, setup.trainer.train_dataset, setup.collator.capacity, steps)
    return epoch_tokens_per_s(model, plan)


def _optimizer_name(trainer: Any) -> str:
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps the one Trainer built
    fused = " (fused)" if getattr(optimizer, "defaults", {}).get("fused") else ""
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}{fused}"


def _finished_checkpoint(ctx: RunContext) -> int | None:
    """The step of the checkpoint this run resumes from where it already reached trainer.max_steps, else None."""
    checkpoint, max_steps = ctx.resume.checkpoint, ctx.cfg.trainer.max_steps
    step = int(checkpoint.rsplit("-", 1)[1]) if checkpoint else 0
    return step if checkpoint and 0 < max_steps <= step else None


def _load_finished(ctx: RunContext, setup: TrainingSetup, step: int) -> RunReport:
    """A run resumed at a checkpoint that reached max_steps trains nothing: Trainer.train would take one more step
    before its stop check (transformers 5.25), so the checkpoint's weights are loaded as train() loads them, and
    the run saves them (how a killed run's last checkpoint is exported)."""
    setup.trainer._load_from_checkpoint(ctx.resume.checkpoint)  # what Trainer.train(resume_from_checkpoint) calls
    log.info("%s reached trainer.max_steps=%d: nothing left to train", ctx.resume.checkpoint, ctx.cfg.trainer.max_steps)
    return RunReport(status="ok", steps=step)


def train(ctx: RunContext, setup: TrainingSetup) -> RunReport:
    """Train with the run's Trainer; record the summary metrics and return them as the report."""
    import torch

    from memfit.training.trainer import train

    if (finished := _finished_checkpoint(ctx)) is not None:
        return _load_finished(ctx, setup, finished)

    if ctx.device == "cuda" and ctx.cfg.forensics.memory_history:
        torch.cuda.memory._record_memory_history(max_entries=ctx.cfg.forensics.max_entries)  # no public API yet
    try:
        totals = train(setup.trainer, setup.collator, ctx.resume.checkpoint)
    except torch.OutOfMemoryError as err:
        raise OutOfMemoryInTraining(_record_oom(ctx, setup, err)) from err
    peak_where = _record_peaks(ctx, setup.trainer.peaks)
    ctx.tracker.set_tags({"memfit.optimizer": _optimizer_name(setup.trainer)})
    ctx.meter.window_peak()  # the span after the last logged step (a closing evaluation) counts too
    overall = ctx.meter.overall  # training's, since on_train_begin
    with_warmup = totals.tokens / totals.wall_s if totals.wall_s > 0 else 0.0
    tokens_per_s = setup.callback.steady_tokens_per_s or with_warmup
    retries = setup.callback.alloc_retries
    epoch_rate = _epoch_tokens_per_s(ctx, setup)
    if retries:
        log.warning(
            "the CUDA allocator freed its cache %d times during training to stay under the cap: every step fitted, "
            "but those steps waited for the device (tokens/s is lower than with headroom)",
            retries,
        )
    spread = setup.callback.tokens_per_s_spread
    # the numbers runs are compared by, as MLflow columns and charts; the rest of the summary among the run's facts
    headline = {
        "summary/peak_allocated_gib": overall.allocated_gib,
        "summary/peak_reserved_gib": overall.reserved_gib,
        "summary/tokens_per_s": tokens_per_s,  # after the first step's warm-up
        "summary/epoch_tokens_per_s": epoch_rate,
        "summary/final_loss": totals.final_loss,
        "summary/eval_loss": totals.eval_loss,
        "summary/alloc_retries": retries,
    }
    ctx.tracker.log_metrics({k: v for k, v in headline.items() if v is not None}, step=totals.steps)
    facts = {
        "summary/train_tokens": totals.tokens,
        "summary/wall_s": totals.wall_s,
        "summary/tokens_per_s_with_warmup": with_warmup,
        "summary/tokens_per_s_spread": spread,  # the steady steps' tokens/s: standard deviation over mean
    }
    ctx.tracker.log_facts({k: v for k, v in facts.items() if v is not None})
    return RunReport(
        status="ok",
        objective=tokens_per_s,
        peak_allocated_gib=overall.allocated_gib,
        peak_reserved_gib=overall.reserved_gib,
        tokens_per_s=tokens_per_s,
        tokens_per_s_spread=spread,
        epoch_tokens_per_s=epoch_rate,
        final_loss=totals.final_loss,
        eval_loss=totals.eval_loss,
        train_tokens=totals.tokens,
        steps=totals.steps,
        alloc_retries=retries,
        mean_micro_batch=setup.collator.rows / setup.collator.micro_batches if setup.collator.micro_batches else None,
        peak_where=peak_where,
    )
