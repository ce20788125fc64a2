"""The worst-case phase of a run with budget-shaped batches (trainer.batching=budget): the batch plan sized by the
memory model (calibrated now or cached, on CPU from host-RSS probes) and proven by the preflight's probes, printed,
recorded, and handed to the collator that packs every step's samples by it (memfit.memory.plan says what is proven)."""

from __future__ import annotations

import json
import logging
import tempfile
import time
from typing import Any

import numpy as np

from memfit.config import GIB
from memfit.run.context import RunContext, TrainingSetup, WorstCase
from memfit.run.plan_record import PLAN_FILE, plan_settings, save_plan, stored_plan
from memfit.run.worst_case import budget_and_limit

log = logging.getLogger("memfit")


def step_samples(cfg: Any) -> int:
    """Samples per optimizer step: trainer.batch_size × gradient_accumulation_steps, in either batching mode."""
    return cfg.trainer.batch_size * cfg.trainer.gradient_accumulation_steps


def _lengths(ctx: RunContext) -> tuple[np.ndarray, np.ndarray]:
    """(source, label) lengths of every sample a micro-batch can hold: training's, and evaluation's where it runs."""
    from memfit.data.packing import dataset_lengths

    datasets, task = ctx.prepared.datasets, ctx.cfg.model.task
    splits = ["train"] + (["validation"] if ctx.cfg.memory.eval_enabled and "validation" in datasets else [])
    pairs = [dataset_lengths(datasets[split], task) for split in splits]
    return np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs])


def _epoch_micro_batches(cfg: Any, dataset: Any, plan: Any, sampler: Any) -> list[tuple[int, int, int]]:
    """One training epoch as the collator will pack it: the step sampler's steps, else the sampler's order under the
    run's seed cut every step's samples."""
    from memfit.data.packing import dataset_lengths, epoch_micro_batches, epoch_order, step_micro_batches

    multiple = cfg.memory.pad_to_multiple_of
    if sampler is not None:
        return step_micro_batches(sampler.source, sampler.label, sampler.steps(), plan.capacity, multiple)
    source, label = dataset_lengths(dataset, cfg.model.task)
    order = epoch_order(source, step_samples(cfg), cfg.memory.group_by_length, cfg.trainer.seed)
    return epoch_micro_batches(source, label, order, step_samples(cfg), plan.capacity, multiple)


def _token_sampler(cfg: Any, dataset: Any, plan: Any) -> Any:
    """The sampler that draws steps of equal label tokens, packed by the plan's capacities."""
    from memfit.data.packing import TokenStepSampler, dataset_lengths

    source, label = dataset_lengths(dataset, cfg.model.task)
    return TokenStepSampler(
        source,
        label,
        step_samples=step_samples(cfg),
        capacity=plan.capacity,
        multiple=cfg.memory.pad_to_multiple_of,
        seed=cfg.trainer.seed,
        tolerance=cfg.trainer.pad_tolerance,
    )


def _step_sampler(cfg: Any, dataset: Any, plan: Any) -> tuple[Any, list[tuple[int, int, int]]]:
    """trainer.effective_batch=tokens: the sampler that draws steps of equal label tokens; None for samples; auto:
    whichever of the two packs this epoch for less (memfit.data.packing.cheaper_step_count), set on the config.
    With the sampler, the epoch's micro-batches as the collator will pack them (the plan's record)."""
    from memfit.data.packing import cheaper_step_count

    if cfg.trainer.effective_batch == "samples":
        return None, _epoch_micro_batches(cfg, dataset, plan, None)
    sampler = _token_sampler(cfg, dataset, plan)
    by_tokens = _epoch_micro_batches(cfg, dataset, plan, sampler)
    if cfg.trainer.effective_batch == "auto":
        by_samples = _epoch_micro_batches(cfg, dataset, plan, None)
        cfg.trainer.effective_batch = cheaper_step_count(by_tokens, by_samples, cfg.model.task)
        log.info(
            "batch plan: trainer.effective_batch=auto -> %s (an epoch of %d micro-batches in token steps, %d in "
            "steps of %d samples)",
            cfg.trainer.effective_batch,
            len(by_tokens),
            len(by_samples),
            step_samples(cfg),
        )
        if cfg.trainer.effective_batch == "samples":
            return None, by_samples
    log.info(
        "batch plan: each optimizer step holds about the label tokens of %d average samples (%.0f), micro-batches "
        "packed full (trainer.effective_batch=tokens)",
        step_samples(cfg),
        step_samples(cfg) * float(np.mean(sampler.label)) if len(sampler.label) else 0.0,
    )
    return sampler, by_tokens


def _record(ctx: RunContext, plan: Any, micro: list[tuple[int, int, int]]) -> None:
    from memfit.memory.plan import plan_metrics, plan_rows, render_plan

    table = render_plan(plan, micro, ctx.meter.label)
    log.info("\n%s", table.rstrip())
    ctx.tracker.log_facts(plan_metrics(plan, micro))
    ctx.tracker.log_text(table, "batch_plan/batch_plan.txt")
    ctx.tracker.set_tags({"memfit.effective_batch": ctx.cfg.trainer.effective_batch})
    record = {
        "task": plan.task,
        "effective_batch": ctx.cfg.trainer.effective_batch,
        "pad_tolerance": ctx.cfg.trainer.pad_tolerance,
        "limit_gib": plan.limit_bytes / GIB,
        "fill": plan.fill,
        "cap": plan.cap,
        "source_edges": list(plan.source_edges),
        "label_edges": list(plan.label_edges),
        "prediction_scale": plan.factor,
        "rounds": plan.rounds,
        "cells": plan_rows(plan, micro),
        "measured": [
            {
                "shape": [s.batch, s.source, s.label],
                "oom": p.oom,
                "reserved_gib": p.judged_bytes / GIB,
                "allocated_gib": p.peak.allocated / GIB if p.peak is not None else None,
            }
            for s, p in plan.measured.items()
        ],
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/batch_plan.json"
        with open(path, "w") as out:
            json.dump(record, out, indent=1)
        ctx.tracker.log_artifact(path, "batch_plan")


def _predictor(calibration: Any, longest: Any, task: str, measure: Any, budget: int) -> Any:
    """The memory model's prediction of a shape's peak reserved bytes; without one (not calibrated: another process
    is calibrating, or the model is not one memfit can fit), peaks scaled from two probes of the longest sample's
    padded lengths."""
    from memfit.data.audit import BatchShape
    from memfit.memory.plan import scaled_predictor

    if calibration is not None:  # the fitted model: a plan asks for hundreds of shapes and measures its cells
        return lambda shape: calibration.estimate(shape).reserved
    log.info("batch plan: no memory model; sizes scaled from two probes of %s", longest.describe(task))
    return scaled_predictor(measure(longest), measure(BatchShape(2, longest.source, longest.label)), budget)


def _proven_plan(
    ctx: RunContext,
    lengths: tuple[np.ndarray, np.ndarray],
    bounds: tuple[int, int],
    settings: dict,
    predict: Any,
    measure: Any,
) -> Any:
    """A resumed run's recorded plan where it still holds the data and fits this device (memfit.run.plan_record),
    else a plan sized by `predict` and proven by `measure`; raises PlanError where none can hold some sample."""
    from memfit.memory.plan import BatchPlan, grid, prove, replay

    cfg, (budget, limit) = ctx.cfg, bounds
    common = {
        "task": cfg.model.task,
        "multiple": cfg.memory.pad_to_multiple_of,
        "limit_bytes": limit,
        "fill": cfg.trainer.micro_batch_fill,
        "cap": min(cfg.trainer.max_micro_batch or step_samples(cfg), step_samples(cfg)),
    }
    stored = stored_plan(cfg, ctx.resume.checkpoint, settings)
    if stored is not None:
        batches = {(i, j): rows for i, j, rows in stored.batches}
        plan = BatchPlan(
            source_edges=tuple(stored.source_edges),
            label_edges=tuple(stored.label_edges),
            samples={},
            batches=batches,
            **common,
        )
        if replay(plan, *lengths, predict, measure):
            cfg.trainer.effective_batch = stored.effective_batch
            ctx.tracker.set_tags({"memfit.batch_plan": f"replayed ({PLAN_FILE} beside the checkpoints)"})
            log.info(
                "batch plan: the resumed run replays the plan beside its checkpoints (%s, %s), measured again",
                PLAN_FILE,
                stored.effective_batch,
            )
            return plan
        log.warning(
            "trainer.resume: the batch plan beside the checkpoints does not hold this data or no longer fits "
            "this device: proving a new one; the rest of this epoch is packed anew"
        )
    plan = grid(*lengths, buckets=cfg.trainer.length_buckets, predict=predict, **common)
    return prove(plan, predict, measure, budget)


def plan_batches(ctx: RunContext, setup: TrainingSetup, probes: Any, calibration: Any) -> WorstCase:
    """Size and prove the batch plan with `probes` (worst_case.probe_setup) and the memory model (worst_case.calibrate;
    budget batching calibrates on every device); a passing plan is set on the collator. A plan that cannot hold some
    sample fails the preflight with one line (the sample's lengths and the nearest way out)."""
    from memfit.data.audit import BatchShape, padded
    from memfit.memory.plan import PlanError
    from memfit.memory.preflight import PreflightReport
    from memfit.memory.probe import probe
    from memfit.progress import progress_bar

    cfg = ctx.cfg
    budget, limit = budget_and_limit(ctx)
    start = time.perf_counter()
    settings = plan_settings(cfg)  # before auto resolves
    source, label = _lengths(ctx)
    multiple = cfg.memory.pad_to_multiple_of
    longest = BatchShape(1, padded(int(source.max(initial=1)), multiple), padded(int(label.max(initial=1)), multiple))

    report = PreflightReport(False, [], limit, budget, ctx.meter.label, cfg.model.task)
    report.budget_label, report.cache_growth = ctx.cap.judged_against, ctx.meter.cache_growth
    with progress_bar("batch plan", None) as show:

        def measure(shape: Any) -> Any:
            show(advance=1, note=f"probing {shape.describe(cfg.model.task)}")
            return probe(probes, shape)[0]

        predict = _predictor(calibration, longest, cfg.model.task, measure, budget)
        try:
            plan = _proven_plan(ctx, (source, label), (budget, limit), settings, predict, measure)
        except PlanError as err:
            report.failure = str(err)
            log.error("preflight: %s", err)
    report.seconds = time.perf_counter() - start
    if report.failure is None:
        report.passed = True
        report.probes = [plan.measured[shape] for shape in plan.proof_shapes()]
        sampler, micro = _step_sampler(cfg, setup.trainer.train_dataset, plan)
        _record(ctx, plan, micro)
        save_plan(cfg, plan, settings)
        setup.collator.capacity = plan.capacity
        setup.trainer.step_sampler = sampler
    ctx.tracker.log_facts(report.metrics())
    ctx.tracker.log_text(report.summary(), "preflight.txt")
    worst = max(report.probes, key=lambda p: p.judged_bytes, default=None)
    predicted = predict(worst.shape) / GIB if worst is not None else None
    return WorstCase(report, calibration, predicted, plan if report.passed else None)
