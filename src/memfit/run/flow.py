"""One run, straight through: config → data + length audit → model → worst-case preflight → training → tracking."""

from __future__ import annotations

import errno
import logging
import tempfile
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from memfit.config import GIB, ConfigError, limit_bytes, validate
from memfit.config.local_model import check_vocabulary, tokenizer_problem
from memfit.memory.policy import (
    apply_allocator_env,
    fall_back_to_fp32_on_slow_cpu,
    pin_one_gpu,
    resolve_device,
    resolve_loss,
)
from memfit.run.auto_lengths import fit_auto_lengths
from memfit.run.batch_plan import plan_batches
from memfit.run.context import RunContext, StartupClock, TrainingSetup, WorstCase
from memfit.run.identity import find_resume_point, remember_run, run_name, run_tags
from memfit.run.report import OutOfMemoryInTraining, RunReport, is_oom
from memfit.run.save_phase import save_model
from memfit.run.signals import Stopped, raise_if_stopped
from memfit.run.state_bound import state_over_room
from memfit.run.train_phase import prepare_training, train
from memfit.run.worst_case import calibrate, calibration_path, estimate, probe_setup, run_preflight

log = logging.getLogger("memfit")

DISK_FULL_BYTES = 16 * 1024**2  # below this much free, a failed write is taken for a full disk


def _log_audit(ctx: RunContext, audit_seconds: float) -> None:
    from memfit.data.audit import plot_histogram, render_table

    prepared, tracker = ctx.prepared, ctx.tracker
    log.info("\n%s", render_table(prepared.audit).rstrip())
    tracker.log_facts({**prepared.audit.metrics(), "audit/seconds": audit_seconds})
    tracker.log_metrics({"summary/label_coverage": prepared.audit.label_coverage}, step=0)
    with tempfile.TemporaryDirectory() as tmp:
        path = plot_histogram(prepared.audit, prepared.source_raw, prepared.label_raw, f"{tmp}/length_histogram.png")
        tracker.log_artifact(path, "audit")


def _resolve_kernels(cfg: DictConfig, device: str) -> None:
    """memory.loss and memory.layer_kernels: `auto` becomes what the measurements favour for this model on this device
    (logged); liger's layer kernels on a family liger has none for stop the run before anything is recorded."""
    from memfit.models import check_layer_kernels, model_type, resolve_layer_kernels

    if loss := resolve_loss(cfg.memory, cfg.model.task):
        log.info("memory.loss=auto: %s for a %s model", loss, cfg.model.task)
    family = model_type(cfg.model)
    if kernels := resolve_layer_kernels(cfg.memory, family, device):
        log.info("memory.layer_kernels=auto: %s for model_type %s on %s", kernels, family, device)
    if problems := check_layer_kernels(cfg.memory.layer_kernels, cfg.model.name, family):
        raise ConfigError(problems)


def _start(cfg: DictConfig, clock: StartupClock, callbacks: tuple[Any, ...] = ()) -> RunContext:
    """Checks, device, tokenizer, data and its audit, the budget cap and the MLflow run: bad input raises before any
    model load or record."""
    # before anything initialises CUDA, validation included (it may ask whether CUDA is available)
    apply_allocator_env(cfg.memory)
    kept_gpu = pin_one_gpu() if cfg.trainer.device != "cpu" else None
    validate(cfg)
    from memfit.preconditions import check_before_run, check_budget

    check_before_run(cfg)
    from transformers import set_seed

    from memfit.data import load_and_tokenize
    from memfit.memory.meter import make_meter
    from memfit.memory.policy import (
        apply_attention_kernels,
        apply_budget,
        fragmentation_warning,
        resolve_batching,
        shared_device_warning,
    )
    from memfit.models import build_tokenizer
    from memfit.tracking import start_tracking

    device = resolve_device(cfg)
    if kept_gpu is not None and device == "cuda":  # said only where a GPU trains (on CPU the narrowing is moot)
        log.info("training on one GPU (CUDA_VISIBLE_DEVICES=%s): budget and preflight are per device", kept_gpu)
    if changed := fall_back_to_fp32_on_slow_cpu(cfg.memory, device):
        log.warning(
            "this CPU has no fast bf16 (no AVX-512): training in fp32, not bf16 (%s); memory measured is fp32's",
            ", ".join(f"memory.{knob}" for knob in changed),
        )
    _resolve_kernels(cfg, device)
    if batching := resolve_batching(cfg, device):
        log.info("trainer.batching=auto: %s on %s", batching, device)
    if warning := fragmentation_warning(cfg, device):
        log.warning(warning)
    set_seed(cfg.trainer.seed)
    clock.lap("checks")
    try:
        tokenizer = build_tokenizer(cfg.model)
    except (OSError, ValueError) as err:  # a tokenizer file that is not what it should be: unreadable, not JSON
        raise ConfigError([tokenizer_problem(cfg.model, err)]) from None
    if problems := check_vocabulary(cfg.model, tokenizer):
        raise ConfigError(problems)
    clock.lap("tokenizer")
    prepared = load_and_tokenize(cfg, tokenizer)
    clock.lap("data")
    meter = make_meter(device)
    if problems := check_budget(cfg, device, meter.total_bytes()):
        raise ConfigError(problems)
    cap = apply_budget(cfg, device, meter.total_bytes())
    limit = limit_bytes(cap.held_bytes, cfg.budget.margin_gib)
    if warning := shared_device_warning(meter.reachable_bytes(), limit, device):
        log.warning(warning)
    apply_attention_kernels(cfg.memory, device)
    clock.lap("device")  # on CUDA: the context's start
    log.info("device %s, memory meter: %s, budget: %s", device, meter.label, cap.label)
    resume = find_resume_point(cfg)
    tracker = start_tracking(cfg, run_name(cfg), run_tags(cfg, device, meter.label), run_id=resume.run_id)
    remember_run(cfg, tracker, resume)
    return RunContext(cfg, device, tokenizer, prepared, meter, cap, tracker, resume, clock, callbacks=callbacks)


def _record_start(ctx: RunContext) -> None:
    from memfit.tracking import flatten

    ctx.tracker.log_params(flatten(ctx.cfg))
    ctx.tracker.log_text(OmegaConf.to_yaml(ctx.cfg, resolve=True), "config.yaml")
    ctx.clock.lap("tracking")
    _log_audit(ctx, ctx.clock.seconds["data"])
    ctx.clock.lap("audit")


def _with_worst_case(report: RunReport, ctx: RunContext, worst: WorstCase) -> RunReport:
    """The preflight's and the memory model's findings, copied into the run's report."""
    report.run_id, report.meter = ctx.tracker.run_id, ctx.meter.label
    report.label_coverage = ctx.prepared.audit.label_coverage
    report.source_coverage = ctx.prepared.audit.source_coverage
    kept = ctx.meter.cache_growth  # what the preflight kept below its limit for a long run's cache (run.worst_case)
    if worst.calibration is not None:
        report.calibration = calibration_path(ctx.cfg.calibration.cache_dir, worst.calibration)
        if worst.predicted_peak_gib is not None:
            report.predicted_peak_gib = worst.predicted_peak_gib + kept / GIB  # beside the judged worst case
    if worst.report is not None and worst.report.probes:
        judged = worst.report.worst
        report.worst_case_peak_gib = (judged.judged_bytes + kept) / GIB  # judged as the preflight judged it
        ctx.tracker.log_metrics({"summary/worst_case_peak_gib": report.worst_case_peak_gib}, step=0)
        report.limit_gib = (worst.report.limit_bytes + kept) / GIB  # budget minus margin
        report.worst_case_shape = [judged.shape.batch, judged.shape.source, judged.shape.label]
        report.max_batch = worst.report.max_batch
    report.phase_seconds = dict(ctx.clock.seconds)
    return report


def _growth_past_preflight(report: RunReport, ctx: RunContext) -> None:
    """How far training's peak reserved memory went past the preflight's judged worst case (the worst batch's
    measured reserved plus what the preflight kept for a long run's allocator cache, which a fresh probe does not
    hold). Logged on every run that trained after a preflight; growth that took it past budget minus margin is
    also said, with what held it on CUDA (the cap), and on CPU that nothing does."""
    if not report.steps or report.worst_case_peak_gib is None or report.peak_reserved_gib is None:
        return
    growth = report.peak_reserved_gib - report.worst_case_peak_gib
    report.reserved_over_preflight_gib = growth
    ctx.tracker.log_facts({"summary/reserved_over_preflight_gib": growth})
    if ctx.device == "cuda" and report.limit_gib is not None and (report.peak_allocated_gib or 0) > report.limit_gib:
        log.warning(
            "training's allocated memory reached %.2f GiB, past the %.2f GiB limit the preflight proved every batch "
            "within: %s. The preflight did not measure this part of training; forensics.micro_batch_peaks=true "
            "records every micro-batch's shape and peak (docs/preflight.md)",
            report.peak_allocated_gib,
            report.limit_gib,
            report.peak_where or "where is not known",
        )
    if ctx.device == "cpu" and report.limit_gib is not None and report.peak_reserved_gib > report.limit_gib:
        log.warning(
            "training's host memory (RSS) reached %.2f GiB, %.2f GiB past the preflight's judged %.2f GiB for the "
            "worst batch and over the budget minus margin, %.2f GiB: on CPU the process grows over a run (the "
            "allocator, evaluation, what Python keeps) and nothing caps it; past budget.gib the run stops "
            "(docs/preflight.md)",
            report.peak_reserved_gib,
            growth,
            report.worst_case_peak_gib,
            report.limit_gib,
        )
    if ctx.device == "cuda" and report.limit_gib is not None and report.peak_reserved_gib > report.limit_gib:
        log.warning(
            "training's reserved memory reached %.2f GiB, %.2f GiB past the preflight's judged %.2f GiB for the "
            "worst batch and over the budget minus margin, %.2f GiB: allocator cache grown over the run, which the "
            "budget's cap bounds (%d allocator retries; docs/batching.md)",
            report.peak_reserved_gib,
            growth,
            report.worst_case_peak_gib,
            report.limit_gib,
            report.alloc_retries or 0,
        )


def _worst_case(ctx: RunContext, setup: TrainingSetup) -> WorstCase:
    """The memory model, `auto` max lengths settled by it (the data cut anew where the budget needs it), then the
    preflight: the batch plan proven, or the fixed batch's worst case."""
    probes = probe_setup(ctx, setup)
    calibration = calibrate(ctx, setup, probes)
    if fit_auto_lengths(ctx, setup, probes, calibration):
        _log_audit(ctx, ctx.clock.seconds.get("data", 0.0))
    prove = plan_batches if ctx.cfg.trainer.batching == "budget" else run_preflight
    return prove(ctx, setup, probes, calibration)


def _phases(ctx: RunContext) -> tuple[RunReport, WorstCase, TrainingSetup | None]:
    """Model and Trainer, then estimate, preflight and training, as the config asks."""
    cfg, worst = ctx.cfg, WorstCase()
    if too_large := state_over_room(ctx):  # before any weight loads
        log.error("%s", too_large.reason)
        return too_large, worst, None
    setup: TrainingSetup = prepare_training(ctx)
    raise_if_stopped()  # a stop signal dropped while the model was built (signals._received)
    log.info("start-up: %s", ctx.clock.summary())
    ctx.tracker.log_facts({f"startup/{phase}_s": seconds for phase, seconds in ctx.clock.seconds.items()})
    if cfg.estimate_only:
        return estimate(ctx, setup), worst, setup
    if cfg.preflight.enabled:
        worst = _worst_case(ctx, setup)
        ctx.clock.lap("preflight")
        if not worst.report.passed:
            return RunReport(status="preflight_failed", reason=worst.report.summary()), worst, setup
        raise_if_stopped()
    if cfg.preflight_only:
        return RunReport(status="ok", steps=0), worst, setup
    report = train(ctx, setup)
    ctx.clock.lap("train")
    return report, worst, setup


def _disk_full(err: BaseException | None, output_dir: str) -> bool:
    """Whether a full disk is what raised `err`: an ENOSPC in its chain, or, since torch.save's failure on a full
    disk names only its stream ("iostream error"), an OS or runtime error while output_dir's disk is full."""
    import shutil

    first, seen = err, set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    try:
        return isinstance(first, OSError | RuntimeError) and shutil.disk_usage(output_dir).free < DISK_FULL_BYTES
    except OSError:
        return False


def _ended_by(err: BaseException, output_dir: str) -> tuple[str, str]:
    """(status, reason) of a run that an exception ended."""
    from memfit.training.callback import NonFiniteLoss, OverBudget

    if isinstance(err, KeyboardInterrupt):
        how = err.name if isinstance(err, Stopped) else "SIGINT"
        return "interrupted", f"killed: stopped by {how}; a checkpointed run continues with trainer.resume=true"
    if _disk_full(err, output_dir):
        return "disk_full", (
            f"no space left on device while the run wrote (output_dir={output_dir}): free some disk, then "
            "trainer.resume=true continues from the last checkpoint written whole"
        )
    kinds = {NonFiniteLoss: "nan_loss", OverBudget: "over_budget"}
    status = "oom" if is_oom(err) else next((s for kind, s in kinds.items() if isinstance(err, kind)), "failed")
    first_line = str(err).splitlines()[0] if str(err) else ""
    if isinstance(err, OutOfMemoryInTraining | NonFiniteLoss | OverBudget):
        return status, first_line
    return status, f"{status}: {type(err).__name__}: {first_line}"


def run(cfg: DictConfig, callbacks: Sequence[Any] = ()) -> RunReport:
    """Validate and load data (bad input raises before any model load or record), then audit, preflight, train.
    `callbacks`: more transformers TrainerCallbacks for the run's Trainer, after memfit's own (a benchmark's clock)."""
    ctx = _start(cfg, StartupClock(), tuple(callbacks))
    saved = None
    try:
        _record_start(ctx)
        report, worst, setup = _phases(ctx)
        _with_worst_case(report, ctx, worst)
        _growth_past_preflight(report, ctx)
        if report.status == "ok" and setup is not None:
            saved = save_model(ctx, setup, report)
    except (Exception, KeyboardInterrupt) as err:
        status, reason = _ended_by(err, cfg.output_dir)
        ctx.tracker.finish("KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED", reason)
        if status in ("oom", "nan_loss", "over_budget", "disk_full"):
            return RunReport(status=status, reason=reason, run_id=ctx.tracker.run_id, meter=ctx.meter.label)
        raise
    if report.status == "preflight_failed":
        ctx.tracker.finish("FAILED", "preflight: the worst batch does not fit the budget")
        return report
    ctx.tracker.finish("FINISHED")
    if not (cfg.preflight_only or cfg.estimate_only) and report.peak_allocated_gib is not None:  # it trained
        log.info(
            "done: %d steps, loss %s, peak allocated %.2f GiB, peak reserved %.2f GiB (%s), %.0f tokens/s",
            report.steps,
            f"{report.final_loss:.4f}" if report.final_loss is not None else "n/a",
            report.peak_allocated_gib,
            report.peak_reserved_gib,
            ctx.meter.label,
            report.tokens_per_s,
        )
    if saved:
        log.info(saved)
    return report
