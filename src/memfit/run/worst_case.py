"""The worst-case phase of a run: the memory model (cached or calibrated now), then the preflight's probes of the
worst batches the data can produce, judged against the limit; or, with estimate_only, the model's prediction alone."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memfit.config import GIB, limit_bytes, step_accumulates
from memfit.run.context import RunContext, TrainingSetup, WorstCase
from memfit.run.report import RunReport

log = logging.getLogger("memfit")


def probe_setup(ctx: RunContext, setup: TrainingSetup) -> Any:
    """How the preflight and the calibration probe: the run's model, and the Trainer's own optimizer, loss and
    mixed-precision forward, its collator."""
    import functools

    from memfit.memory.probe import ProbeSetup
    from memfit.training.trainer import forward_as_trained

    cfg, trainer, built = ctx.cfg, setup.trainer, setup.built

    def make_optimizer() -> Any:
        trainer.optimizer = None
        optimizer = trainer.create_optimizer()  # exactly the optimizer training will build
        trainer.optimizer = None  # so that training builds its own, with fresh state
        return optimizer

    model_vocab = getattr(built.model.config, "vocab_size", None) or len(built.tokenizer)
    return ProbeSetup(
        model=built.model,
        make_optimizer=make_optimizer,
        collator=setup.collator.pad,
        meter=ctx.meter,
        device=ctx.device,
        task=cfg.model.task,
        vocab_size=min(model_vocab, len(built.tokenizer)),
        steps=cfg.preflight.steps,
        accumulation=2 if step_accumulates(cfg) else 1,  # the probe runs a second micro-batch on held gradients
        generate=cfg.trainer.predict_with_generate,
        forward_as_trained=functools.partial(forward_as_trained, trainer),
        compute_loss=trainer.compute_loss,
    )


def budget_and_limit(ctx: RunContext) -> tuple[int, int]:
    """The budget in bytes and the limit a measured peak is judged against: budget minus margin, minus what a long
    run's allocator cache holds beyond a fresh probe (the meter's cache_growth), so that a whole run stays within
    budget minus margin."""
    cap, meter = ctx.cap, ctx.meter
    budget = cap.held_bytes
    if ctx.device != "cuda":  # nothing caps host allocations: never probe past the memory the host has free
        budget = min(budget, meter.reachable_bytes())
    return int(budget), limit_bytes(budget, ctx.cfg.budget.margin_gib) - meter.cache_growth


def calibrate(ctx: RunContext, setup: TrainingSetup, probes: Any) -> Any:
    """The memory model for this run (cached, or fitted now from a few probes), or None where it is not wanted."""
    from memfit.memory.calibration import cached, calibrate, wanted
    from memfit.memory.model import describe_architecture
    from memfit.memory.probe_shapes import calibration_shapes
    from memfit.memory.state import model_state_bytes
    from memfit.progress import progress_bar

    cfg = ctx.cfg
    if not wanted(cfg.calibration, ctx.device, cfg.trainer.batching):
        return None
    calibration = cached(cfg, ctx.device)
    if calibration is not None:
        log.info("memory model: calibration %s reused from %s", calibration.key, cfg.calibration.cache_dir)
    else:
        model = setup.built.model
        arch = describe_architecture(model, cfg.model.task)
        checkpointed = cfg.memory.gradient_checkpointing
        count = len(calibration_shapes(arch, cfg.calibration.probe_tokens, checkpointed=checkpointed))
        with progress_bar("memory model calibration", count) as show:
            calibration = calibrate(
                cfg,
                probes,
                arch,
                model_state_bytes(model, cfg.memory.optimizer),
                on_probe=lambda shape: show(advance=1, note=shape.describe(cfg.model.task)),
            )
    if calibration is not None:
        ctx.tracker.log_params({"memfit.calibration": calibration.key})
        ctx.tracker.log_facts({"calibration/seconds": 0.0 if calibration.from_cache else calibration.seconds})
    return calibration


def calibration_path(cache_dir: str, calibration: Any) -> str | None:
    """Where the calibration is cached: a sweeper reads it to predict its next trials."""
    if calibration is None:
        return None
    return str(Path(cache_dir).resolve() / f"{calibration.key}.json")


def _log_prediction(ctx: RunContext, calibration: Any, worst: Any) -> float | None:
    """The memory model's prediction for the worst probe beside what it measured: every run checks the model."""
    if calibration is None or worst.oom:
        return None
    predicted = calibration.estimate(worst.shape)
    error = predicted.reserved / worst.peak.reserved - 1
    ctx.tracker.log_facts(
        {
            "preflight/predicted_allocated_gib": predicted.allocated / GIB,
            "preflight/predicted_reserved_gib": predicted.reserved / GIB,
            "preflight/prediction_error_reserved": error,
        },
    )
    log.info(
        "memory model: predicted %.2f GiB reserved for the worst batch, measured %.2f GiB (%+.1f%%)",
        predicted.reserved / GIB,
        worst.peak.reserved / GIB,
        100 * error,
    )
    return predicted.reserved / GIB


def estimate(ctx: RunContext, setup: TrainingSetup) -> RunReport:
    """estimate_only=true: the memory model's prediction for this config, printed and recorded; no training."""
    from memfit.memory.estimate import estimate
    from memfit.memory.model import describe_architecture
    from memfit.memory.state import model_state_bytes

    cfg, model = ctx.cfg, setup.built.model
    budget, limit = budget_and_limit(ctx)
    calibration = calibrate(ctx, setup, probe_setup(ctx, setup))
    samples = len(ctx.prepared.datasets["train"])
    upper = min(cfg.preflight.max_batch_limit, samples)  # a larger batch would repeat samples
    result = estimate(
        cfg.model.task,
        ctx.prepared.audit.worst_train,
        model_state_bytes(model, cfg.memory.optimizer),
        describe_architecture(model, cfg.model.task),
        calibration,
        budget,
        limit,
        upper,
        _knob_savings(ctx, model),
    )
    result.largest_cap = _cap_note(result.largest_batch, upper, samples)  # as preflight_only says it
    result.budget_label, result.cache_growth = ctx.cap.judged_against, ctx.meter.cache_growth
    ctx.tracker.log_facts(result.metrics())
    ctx.tracker.log_text(result.summary(), "estimate.txt")
    print(result.summary())
    return RunReport(
        status="ok",
        steps=0,
        # as a trained run reports them: judged with the long run's cache growth, against budget minus margin
        predicted_peak_gib=(result.peak.reserved + ctx.meter.cache_growth) / GIB if result.peak else None,
        limit_gib=(limit + ctx.meter.cache_growth) / GIB,
        max_batch=result.largest_batch,
        max_batch_cap=upper,
        calibration=calibration_path(cfg.calibration.cache_dir, calibration),
    )


HOST_GUARD_ROWS = 16  # on CPU a batch of this many rows or more is scaled from one row before it is probed


def _past_the_host(ctx: RunContext, probes: Any, shape: Any) -> Any:
    """On CPU nothing stops an allocation but the kernel's OOM killer, which ends memfit with its MLflow run open: a
    batch of many rows is first scaled from one row of its lengths (activations grow with the rows), and where that
    expects more than the budget (at most the host's free memory) it is not probed; the Probe says so. None where it
    may be probed."""
    from memfit.data.audit import BatchShape
    from memfit.memory.probe import Probe, probe

    if ctx.device != "cpu" or shape.batch < HOST_GUARD_ROWS:
        return None
    one = probe(probes, BatchShape(1, shape.source, shape.label))[0]
    budget, _ = budget_and_limit(ctx)
    if one.oom:
        return None
    expected = one.static_bytes + max(one.peak.reserved - one.static_bytes, 0) * shape.batch
    if expected <= budget:
        return None
    reason = (
        f"one row of these lengths measured {one.peak.reserved / GIB:.2f} GiB, so {shape.batch} rows are expected to "
        f"need ~{expected / GIB:.2f} GiB, past the {budget / GIB:.2f} GiB this host's budget holds"
    )
    return Probe(
        shape,
        "train",
        None,
        static_bytes=one.static_bytes,
        attempted_bytes=expected,
        predicted_bytes=expected,
        not_run=reason,
    )


def probe_within_host(ctx: RunContext, probes: Any, shape: Any, eval_shape: Any = None) -> list[Any]:
    """The probe of `shape` (and `eval_shape` after it), or on CPU, where its rows scaled from one row are expected
    past the budget, the Probe that says so without running it."""
    from memfit.memory.probe import probe

    if (past := _past_the_host(ctx, probes, shape)) is not None:
        return [past]
    return probe(probes, shape, eval_shape)


def _probe_worst(ctx: RunContext, probes: Any) -> list[Any]:
    """Each of the audit's worst training shapes (the first with the worst eval batch after it), with progress."""
    from memfit.progress import progress_bar

    audit, task = ctx.prepared.audit, ctx.cfg.model.task
    eval_shape = audit.worst_eval if ctx.cfg.memory.eval_enabled else None
    measured = []
    with progress_bar("preflight", len(audit.worst_train)) as show:
        for index, shape in enumerate(audit.worst_train):
            show(note=f"train {shape.describe(task)}")
            measured += probe_within_host(ctx, probes, shape, eval_shape if index == 0 else None)
            show(advance=1)
    return measured


def _max_batch(ctx: RunContext, probes: Any, report: Any, calibration: Any) -> tuple[int | None, str | None]:
    """The largest batch whose worst case fits, searched up to preflight.max_batch_limit or the number of training
    samples (a larger batch would repeat samples), whether or not the configured batch fits, from the memory
    model's prediction where there is one; and, where the search reached that cap, what the cap was, or where not
    even batch 1 fits, what it needs."""
    from memfit.memory.batch_search import find_max_batch
    from memfit.memory.probe import probe
    from memfit.progress import progress_bar

    audit = ctx.prepared.audit
    worst_shape = audit.worst_at(2)  # what the memory model predicts for: any batch of two or more rows
    samples = len(ctx.prepared.datasets["train"])
    upper = min(ctx.cfg.preflight.max_batch_limit, samples)
    measured: dict[int, Any] = {}
    bound = ctx.cfg.preflight.max_search_seconds
    if ctx.device == "cpu" and ctx.cfg.trainer.batch_size >= HOST_GUARD_ROWS:  # the search's first probe scales from it
        measured[1] = probe(probes, audit.worst_at(1))[0]
    predicted = None
    if calibration is not None:
        predicted = max(1, calibration.largest_batch(worst_shape.source, worst_shape.label, report.limit_bytes, upper))
    with progress_bar("max batch search", None) as show:
        search = find_max_batch(
            probes,
            audit.worst_at,
            report.limit_bytes,
            upper,
            on_probe=lambda batch: show(advance=1, note=f"probing batch {batch}"),
            measured=measured,
            max_seconds=bound,
            predicted=predicted,
            first=ctx.cfg.trainer.batch_size,
        )
        show(note=f"largest fitting batch {search.largest}")
    start = f"the memory model's prediction, {predicted}" if predicted else "the configured batch, doubling"
    log.info("largest-batch search from %s: probed batches %s", start, ", ".join(map(str, search.probed)))
    largest = search.largest
    if largest is None and 1 in measured:
        needed, exact = report.needed_bytes(measured[1])
        what = measured[1].shape.describe(ctx.cfg.model.task)
        return None, f"no batch fits: {what} needs {'~' if exact else 'more than '}{needed / GIB:.2f} GiB"
    if search.untried is not None:
        return largest, (
            f"batch {search.untried} not tried: its probe would take ~{search.untried_seconds:.1f} s more, past "
            f"preflight.max_search_seconds={bound:g}; raise it to search further"
        )
    return largest, _cap_note(largest, upper, samples)


def _cap_note(largest: int | None, upper: int, samples: int) -> str | None:
    """Where a largest-batch search stopped at its own cap (so larger batches may fit too), else None."""
    if largest is None or largest < upper:
        return None
    if upper == samples:
        return f"all {samples} training samples in one batch; larger not tried"
    return "the cap preflight.max_batch_limit was reached; larger not tried"


def _knob_savings(ctx: RunContext, model: Any) -> Callable[[Any], dict[str, int]]:
    """What each memory knob the policy leaves off would hold less at a batch shape, for estimate_only's lines and
    the preflight's ways out alike (memory.savings)."""
    from memfit.memory.model import describe_architecture
    from memfit.memory.savings import dropped_copies, knob_savings

    arch, copies = describe_architecture(model, ctx.cfg.model.task), dropped_copies(model)
    return lambda shape: knob_savings(ctx.cfg.memory, arch, copies, shape)


def _ways_out(ctx: RunContext, setup: TrainingSetup, measured: list[Any], limit: int, calibration: Any) -> list[str]:
    from memfit.memory.preflight import suggest

    cfg, audit, prepared = ctx.cfg, ctx.prepared.audit, ctx.prepared
    return suggest(
        measured,
        limit,
        batch=cfg.trainer.batch_size,
        accumulation=2 if step_accumulates(cfg) else 1,  # the probe runs a second micro-batch on held gradients
        task=cfg.model.task,
        label_raw=prepared.label_raw,
        max_label=audit.max_label_length,
        memory=cfg.memory,
        source_raw=prepared.source_raw,
        max_source=audit.max_source_length,
        trainable_params=setup.built.trainable_params,
        lora_enabled=cfg.model.lora.enabled,
        # a shorter length is searched 8 tokens at a time; the rerun's preflight measures what the way out promises
        predict=(lambda shape: calibration.estimate(shape).reserved) if calibration else None,
        min_coverage=cfg.preflight.min_coverage,
        savings=_knob_savings(ctx, setup.built.model),
    )


def run_preflight(ctx: RunContext, setup: TrainingSetup, probes: Any, calibration: Any) -> WorstCase:
    """Probe the audit's worst batches under the budget with `probes` (probe_setup) and judge them, the memory model
    (calibrate; None where not wanted) predicting beside them; the report says whether they fit and, where they do
    not, the ways out. Logged and recorded either way."""
    from memfit.memory.preflight import PreflightReport, fits

    cfg = ctx.cfg
    budget, limit = budget_and_limit(ctx)
    start = time.perf_counter()
    measured = _probe_worst(ctx, probes)
    for each in measured:  # what an OOM's batch needs, where the memory model can say
        if each.oom and calibration is not None:
            each.predicted_bytes = calibration.estimate(each.shape).reserved
    passed = fits(measured, limit)
    report = PreflightReport(passed, measured, limit, budget, ctx.meter.label, cfg.model.task)
    report.budget_label, report.cache_growth = ctx.cap.judged_against, ctx.meter.cache_growth
    train_probes = [p for p in measured if p.phase == "train"]
    predicted = _log_prediction(ctx, calibration, max(train_probes, key=lambda p: (p.oom, p.judged_bytes)))
    if cfg.preflight.find_max_batch or cfg.preflight_only:  # "how large a batch can I afford?", fit or not
        report.max_batch, report.max_batch_cap = _max_batch(ctx, probes, report, calibration)
    if not passed:
        report.suggestions = _ways_out(ctx, setup, measured, limit, calibration)
    report.seconds = time.perf_counter() - start
    ctx.tracker.log_facts(report.metrics())
    ctx.tracker.log_text(report.summary(), "preflight.txt")
    if passed:
        log.info("\n%s", report.summary())
    else:
        log.error("preflight: the worst batch does not fit the budget; the run stops before step 1")
    return WorstCase(report, calibration, predicted)
