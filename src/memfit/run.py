"""One run, straight through: config → data + length audit → model → worst-case preflight → training → tracking.

It returns a structured report (not a bare float), which is what a sweeper reads back from Hydra's job return.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from memfit.config import ConfigError, validate
from memfit.data import DataError
from memfit.policy import apply_allocator_env, fall_back_to_fp32_on_slow_cpu, pin_one_gpu, resolve_device

log = logging.getLogger("memfit")

EXIT_BAD_INPUT, EXIT_RUN_FAILED, EXIT_PREFLIGHT_FAILED = 2, 1, 3


@dataclass
class RunReport:
    status: str  # ok | oom | preflight_failed | nan_loss | failed | invalid
    reason: str | None = None
    objective: float | None = None  # tokens/s of training
    peak_allocated_gib: float | None = None
    peak_reserved_gib: float | None = None
    worst_case_peak_gib: float | None = None  # the preflight's measured peak (reserved) on the worst batch
    limit_gib: float | None = None  # what the preflight judged it against (budget minus margin)
    worst_case_shape: list[int] | None = None  # [batch, source, label]
    max_batch: int | None = None
    label_coverage: float | None = None
    tokens_per_s: float | None = None
    epoch_tokens_per_s: float | None = None  # a whole epoch's, from the segment's steps and the epoch's batch plan
    final_loss: float | None = None  # the last logged training loss
    eval_loss: float | None = None  # evaluation loss at the last step, when there is validation data
    train_tokens: int | None = None
    steps: int = 0
    run_id: str | None = None
    meter: str | None = None
    predicted_peak_gib: float | None = None  # the memory model's prediction (reserved) for the worst batch
    calibration: str | None = None  # the memory model's calibration file, for the sweeper's predictions
    alloc_retries: int | None = None  # times training's allocator freed its cache to stay under the cap (slow steps)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class OutOfMemoryInTraining(RuntimeError):
    """An OOM during training, after the forensics were recorded."""


def run_name(cfg: DictConfig) -> str:
    if cfg.tracking.run_name:
        return cfg.tracking.run_name
    budget = f"-{cfg.budget.gib:g}GiB" if cfg.budget.gib else ""
    return f"{cfg.model.name}-{cfg.memory.name}-b{cfg.trainer.batch_size}{budget}"


def run_tags(cfg: DictConfig, device: str, meter_label: str) -> dict[str, str]:
    return {
        "memfit.model": cfg.model.name,
        "memfit.data": cfg.data.name,
        "memfit.memory": cfg.memory.name,
        "memfit.budget_gib": "none" if cfg.budget.gib is None else f"{cfg.budget.gib:g}",
        "memfit.device": device,
        "memfit.meter": meter_label,
        "memfit.mode": "estimate_only" if cfg.estimate_only else "preflight_only" if cfg.preflight_only else "train",
        "memfit.cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "all"),
        "memfit.cpu_threads": os.environ.get("OMP_NUM_THREADS", "all"),
        "memfit.cpu_cores": core_ranges(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else "all",
    }


def core_ranges(cores: list[int]) -> str:
    """0-3,8-11 for [0, 1, 2, 3, 8, 9, 10, 11]: the cores this run may use, as taskset writes them."""
    runs: list[list[int]] = []
    for core in cores:
        if runs and core == runs[-1][-1] + 1:
            runs[-1].append(core)
        else:
            runs.append([core])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _is_oom(err: BaseException) -> bool:
    import torch

    return isinstance(err, torch.OutOfMemoryError | OutOfMemoryInTraining) or "out of memory" in str(err).lower()


class StartupClock:
    """Seconds of each phase before the preflight, one lap after another, so that every second of a run's start is
    counted in some phase (a phase includes the imports it triggers, none in a prestarted sweep trial): where a
    short sweep trial spends its time, and what two trials at once slow down."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> float:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now
        return self.seconds[phase]

    def summary(self) -> str:
        return ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in self.seconds.items())


def _log_audit(prepared: Any, tracker: Any) -> None:
    from memfit.audit import plot_histogram, render_table

    log.info("\n%s", render_table(prepared.audit).rstrip())
    tracker.log_metrics(prepared.audit.metrics(), step=0)
    with tempfile.TemporaryDirectory() as tmp:
        path = plot_histogram(prepared.audit, prepared.source_raw, prepared.label_raw, f"{tmp}/length_histogram.png")
        tracker.log_artifact(path, "audit")


def _probe_setup(cfg: DictConfig, ctx: dict[str, Any]) -> Any:
    """How the preflight and the calibration probe: the run's model, its real optimizer, its collator."""
    from memfit.preflight import ProbeSetup

    trainer, built = ctx["trainer"], ctx["built"]

    def make_optimizer() -> Any:
        trainer.optimizer = None
        optimizer = trainer.create_optimizer()  # exactly the optimizer training will build
        trainer.optimizer = None  # so that training builds its own, with fresh state
        return optimizer

    model_vocab = getattr(built.model.config, "vocab_size", None) or len(built.tokenizer)
    return ProbeSetup(
        built.model,
        make_optimizer,
        ctx["collator"].inner,
        ctx["meter"],
        ctx["device"],
        cfg.model.task,
        cfg.memory.precision,
        min(model_vocab, len(built.tokenizer)),
        cfg.preflight.steps,
        cfg.trainer.gradient_accumulation_steps,
        cfg.trainer.predict_with_generate,
    )


def _budget_and_limit(cfg: DictConfig, ctx: dict[str, Any]) -> tuple[int, int]:
    """The budget in bytes and the limit a peak is judged against (budget minus margin)."""
    cap, meter = ctx["cap"], ctx["meter"]
    budget = cap.budget_bytes or (cap.fraction or 1.0) * meter.total_bytes()
    if ctx["device"] != "cuda":  # nothing caps host allocations: never probe past the memory the host has free
        import psutil

        budget = min(budget, psutil.virtual_memory().available + meter.current_bytes())
    return int(budget), int(budget - cfg.budget.margin_gib * 1024**3)


def _calibrate(cfg: DictConfig, ctx: dict[str, Any], setup: Any) -> Any:
    """The memory model for this run (cached, or fitted now from a few probes), or None where it is not wanted."""
    from memfit.calibration import cached, calibrate, calibration_shapes, wanted
    from memfit.memory_model import describe_architecture, model_state_bytes
    from memfit.progress import progress_bar

    if not wanted(cfg, ctx["device"]):
        return None
    calibration = cached(cfg, ctx["device"])
    if calibration is not None:
        log.info("memory model: calibration %s reused from %s", calibration.key, cfg.calibration.cache_dir)
    else:
        model = ctx["built"].model
        arch = describe_architecture(model, cfg.model.task)
        probes = len(calibration_shapes(arch, cfg.calibration.probe_tokens))
        with progress_bar("memory model calibration", probes) as show:
            calibration = calibrate(
                cfg,
                setup,
                arch,
                model_state_bytes(model, cfg.memory.optimizer),
                on_probe=lambda shape: show(advance=1, note=shape.describe(cfg.model.task)),
            )
    if calibration is not None:
        ctx["tracker"].log_params({"memfit.calibration": calibration.key})
        ctx["tracker"].log_metrics({"calibration/seconds": 0.0 if calibration.from_cache else calibration.seconds})
    return calibration


def _log_prediction(ctx: dict[str, Any], calibration: Any, worst: Any) -> None:
    """The memory model's prediction for the worst probe beside what it measured: every run checks the model."""
    if calibration is None or worst.oom:
        return
    predicted = calibration.estimate(worst.shape)
    ctx["predicted_peak_gib"] = predicted.reserved / 1024**3
    ctx["tracker"].log_metrics(
        {
            "preflight/predicted_allocated_gib": predicted.allocated / 1024**3,
            "preflight/predicted_reserved_gib": predicted.reserved / 1024**3,
            "preflight/prediction_error_reserved": predicted.reserved / worst.peak.reserved - 1,
        },
        step=0,
    )
    log.info(
        "memory model: predicted %.2f GiB reserved for the worst batch, measured %.2f GiB (%+.1f%%)",
        predicted.reserved / 1024**3,
        worst.peak.reserved / 1024**3,
        100 * (predicted.reserved / worst.peak.reserved - 1),
    )


def _estimate(cfg: DictConfig, ctx: dict[str, Any]) -> RunReport:
    """estimate_only=true: the memory model's prediction for this config, printed and recorded; no training."""
    from memfit.estimate import estimate
    from memfit.memory_model import describe_architecture, model_state_bytes

    model = ctx["built"].model
    budget, limit = _budget_and_limit(cfg, ctx)
    calibration = _calibrate(cfg, ctx, _probe_setup(cfg, ctx))
    result = estimate(
        cfg.model.task,
        ctx["prepared"].audit.worst_train,
        model_state_bytes(model, cfg.memory.optimizer),
        describe_architecture(model, cfg.model.task),
        calibration,
        budget,
        limit,
        cfg.preflight.max_batch_limit,
    )
    ctx["tracker"].log_metrics(result.metrics(), step=0)
    ctx["tracker"].log_text(result.summary(), "estimate.txt")
    print(result.summary())
    return RunReport(
        status="ok",
        steps=0,
        predicted_peak_gib=result.peak.reserved / 1024**3 if result.peak else None,
        limit_gib=limit / 1024**3,
        max_batch=result.largest_batch,
        calibration=_calibration_path(cfg, calibration),
    )


def _calibration_path(cfg: DictConfig, calibration: Any) -> str | None:
    """Where the calibration is cached: a sweeper reads it to predict its next trials."""
    if calibration is None:
        return None
    return str(Path(cfg.calibration.cache_dir).resolve() / f"{calibration.key}.json")


def _run_preflight(cfg: DictConfig, ctx: dict[str, Any]) -> Any:
    """Probe the audit's worst batches under the budget; raise PreflightFailed when they do not fit."""
    from memfit.preflight import PreflightFailed, PreflightReport, find_max_batch, fits, probe, suggest
    from memfit.progress import progress_bar

    built, audit, meter = ctx["built"], ctx["prepared"].audit, ctx["meter"]
    setup = _probe_setup(cfg, ctx)
    budget, limit = _budget_and_limit(cfg, ctx)
    calibration = ctx["calibration"] = _calibrate(cfg, ctx, setup)
    start = time.perf_counter()
    probes = []
    eval_shape = audit.worst_eval if cfg.memory.eval_enabled else None
    with progress_bar("preflight", len(audit.worst_train)) as show:
        for index, shape in enumerate(audit.worst_train):
            show(note=f"train {shape.describe(cfg.model.task)}")
            probes += probe(setup, shape, eval_shape if index == 0 else None)
            show(advance=1)
    passed = fits(probes, limit)
    report = PreflightReport(passed, probes, limit, budget, meter.label, cfg.model.task)
    train_probes = [p for p in probes if p.phase == "train"]
    _log_prediction(ctx, calibration, max(train_probes, key=lambda p: (p.oom, p.judged_bytes)))
    if passed and (cfg.preflight.find_max_batch or cfg.preflight_only):
        worst_shape = max(audit.worst_train, key=lambda s: s.tokens)
        with progress_bar("max batch search", None) as show:
            report.max_batch = find_max_batch(
                setup,
                worst_shape,
                limit,
                cfg.preflight.max_batch_limit,
                on_probe=lambda batch: show(advance=1, note=f"probing batch {batch}"),
            )
            show(note=f"largest fitting batch {report.max_batch}")
    if not passed:
        report.suggestions = suggest(
            probes,
            limit,
            batch=cfg.trainer.batch_size,
            accumulation=cfg.trainer.gradient_accumulation_steps,
            task=cfg.model.task,
            label_raw=ctx["prepared"].label_raw,
            max_label=audit.max_label_length,
            memory=cfg.memory,
            source_raw=ctx["prepared"].source_raw,
            max_source=audit.max_source_length,
            trainable_params=built.trainable_params,
            lora_enabled=cfg.model.lora.enabled,
            predict=(lambda shape: calibration.estimate(shape).reserved) if calibration else None,
        )
    report.seconds = time.perf_counter() - start
    ctx["tracker"].log_metrics(report.metrics(), step=0)
    ctx["tracker"].log_text(report.summary(), "preflight.txt")
    if not passed:
        log.error("preflight: the worst batch does not fit the budget; the run stops before step 1")
        raise PreflightFailed(report)
    log.info("\n%s", report.summary())
    return report


def _record_oom(ctx: dict[str, Any], err: BaseException) -> str:
    """OOM forensics: the step, the batch that caused it, the allocator's summary and (opt-in) a snapshot."""
    import torch

    trainer, collator, tracker = ctx["trainer"], ctx["collator"], ctx["tracker"]
    step = trainer.state.global_step + 1
    shape = {k: list(v) for k, v in collator.last_shape.items()}
    reason = f"oom: at step {step}, batch {shape}"
    report = [reason, "", str(err)]
    if ctx["device"] == "cuda":
        report += ["", torch.cuda.memory_summary()]
        if ctx["cfg"].forensics.memory_history:
            with tempfile.TemporaryDirectory() as tmp:
                snapshot = f"{tmp}/memory_snapshot.pickle"
                torch.cuda.memory._dump_snapshot(snapshot)
                tracker.log_artifact(snapshot, "oom")
    tracker.log_text("\n".join(report), "oom/report.txt")
    return reason


def _train(cfg: DictConfig, ctx: dict[str, Any]) -> RunReport:
    import torch

    from memfit.training import train

    if ctx["device"] == "cuda" and cfg.forensics.memory_history:
        torch.cuda.memory._record_memory_history(max_entries=cfg.forensics.max_entries)
    try:
        totals = train(ctx["trainer"], ctx["collator"], ctx["resume"].checkpoint)
    except torch.OutOfMemoryError as err:
        reason = _record_oom(ctx, err)
        raise OutOfMemoryInTraining(reason) from err
    optimizer = ctx["trainer"].optimizer
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the one Trainer built
    ctx["tracker"].set_tags({"memfit.optimizer": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"})
    meter = ctx["meter"]
    overall = meter.overall
    with_warmup = totals.tokens / totals.wall_s if totals.wall_s > 0 else 0.0
    tokens_per_s = ctx["callback"].steady_tokens_per_s or with_warmup
    retries = ctx["callback"].alloc_retries
    epoch_rate = _epoch_tokens_per_s(cfg, ctx)
    summary = {
        "summary/peak_allocated_gib": overall.allocated_gib,
        "summary/peak_reserved_gib": overall.reserved_gib,
        "summary/train_tokens": totals.tokens,
        "summary/wall_s": totals.wall_s,
        "summary/tokens_per_s": tokens_per_s,  # after the first step's warm-up
        "summary/tokens_per_s_with_warmup": with_warmup,
        "summary/alloc_retries": retries,
    }
    if retries:
        log.warning(
            "the CUDA allocator freed its cache %d times during training to stay under the cap: every step fitted, "
            "but those steps waited for the device (tokens/s is lower than with headroom)",
            retries,
        )
    if epoch_rate is not None:
        summary["summary/epoch_tokens_per_s"] = epoch_rate
    if totals.final_loss is not None:
        summary["summary/final_loss"] = totals.final_loss
    if totals.eval_loss is not None:
        summary["summary/eval_loss"] = totals.eval_loss
    ctx["tracker"].log_metrics(summary, step=totals.steps)
    return RunReport(
        status="ok",
        objective=tokens_per_s,
        peak_allocated_gib=overall.allocated_gib,
        peak_reserved_gib=overall.reserved_gib,
        tokens_per_s=tokens_per_s,
        epoch_tokens_per_s=epoch_rate,
        final_loss=totals.final_loss,
        eval_loss=totals.eval_loss,
        train_tokens=totals.tokens,
        steps=totals.steps,
        alloc_retries=retries,
    )


def _epoch_tokens_per_s(cfg: DictConfig, ctx: dict[str, Any]) -> float | None:
    """A whole epoch's tokens/s: the step-time model fitted to the segment's steps after the first (which builds the
    optimizer state) applied to the epoch's batch plan (memfit.throughput). None with too few steps to fit."""
    from memfit.throughput import StepTimeModel, epoch_tokens_per_s, run_epoch_plan

    model = StepTimeModel.fit(ctx["callback"].windows[1:])
    if model is None:
        return None
    plan = run_epoch_plan(cfg, ctx["trainer"].train_dataset)
    return epoch_tokens_per_s(model, plan)


def _prepare_training(cfg: DictConfig, ctx: dict[str, Any]) -> None:
    """Model, collator, callback and Trainer: everything the preflight and training share."""
    from memfit import faults
    from memfit.data import CountingCollator, model_columns
    from memfit.models import build_model
    from memfit.policy import training_arguments
    from memfit.training import build_trainer, make_callback

    built = build_model(cfg, ctx["tokenizer"], ctx["device"])
    ctx["clock"].lap("model")
    ctx["tracker"].log_params(
        {
            "memfit.random_weights": built.random_weights,
            "memfit.total_params": built.total_params,
            "memfit.trainable_params": built.trainable_params,
        }
    )
    log.info(
        "model %s: %.1fM params, %.2fM trainable%s",
        cfg.model.name,
        built.total_params / 1e6,
        built.trainable_params / 1e6,
        " (random weights)" if built.random_weights else "",
    )
    collator = CountingCollator(ctx["tokenizer"], cfg.memory.pad_to_multiple_of, cfg.model.task)
    callback = make_callback(ctx["meter"], ctx["tracker"], collator, cfg.trainer.max_train_tokens)
    callbacks = [callback, *faults.callbacks_for(run_name(cfg))]
    ready = {split: model_columns(ds) for split, ds in ctx["prepared"].datasets.items()}
    output_dir = str(checkpoint_dir(cfg))
    args = training_arguments(cfg, ctx["device"], output_dir, has_eval="validation" in ready)
    ctx.update(
        callback=callback,
        built=built,
        collator=collator,
        trainer=build_trainer(cfg, built.model, ctx["tokenizer"], ready, args, collator, callbacks),
    )
    ctx["clock"].lap("trainer")


@dataclass
class ResumePoint:
    checkpoint: str | None = None  # the last checkpoint directory, for Trainer.train(resume_from_checkpoint=...)
    run_id: str | None = None  # the MLflow run that wrote it, continued instead of forking a new one


def checkpoint_dir(cfg: DictConfig) -> Path:
    return Path(cfg.output_dir) / "checkpoints" / run_name(cfg)


def find_resume_point(cfg: DictConfig) -> ResumePoint:
    """With trainer.resume=true: the last checkpoint of this run name and its MLflow run, if there is one."""
    import json

    if not cfg.trainer.resume or not checkpoint_dir(cfg).is_dir():
        return ResumePoint()
    from transformers.trainer_utils import get_last_checkpoint

    checkpoint = get_last_checkpoint(str(checkpoint_dir(cfg)))
    marker = checkpoint_dir(cfg) / "memfit_run.json"
    run_id = json.loads(marker.read_text()).get("run_id") if marker.exists() and checkpoint else None
    if checkpoint:
        log.info("resuming from %s (MLflow run %s)", checkpoint, run_id or "new")
    return ResumePoint(checkpoint, run_id)


def remember_run(cfg: DictConfig, tracker: Any, resume: ResumePoint) -> None:
    """Checkpointed runs note their MLflow run beside the checkpoints, so that a resume continues it."""
    import json

    if tracker.run_id is None or not cfg.trainer.save_steps:
        return
    checkpoint_dir(cfg).mkdir(parents=True, exist_ok=True)
    (checkpoint_dir(cfg) / "memfit_run.json").write_text(json.dumps({"run_id": tracker.run_id}))
    if resume.checkpoint:
        tracker.set_tags({"memfit.resumed_from": Path(resume.checkpoint).name})


def _fill_from_preflight(report: RunReport, preflight: Any, audit: Any, ctx: dict[str, Any]) -> None:
    report.label_coverage = audit.label_coverage
    if ctx.get("calibration") is not None:
        report.calibration = _calibration_path(ctx["cfg"], ctx["calibration"])
        report.predicted_peak_gib = ctx.get("predicted_peak_gib")
    if preflight is None:
        return
    worst = preflight.worst
    report.worst_case_peak_gib = worst.judged_bytes / 1024**3
    report.limit_gib = preflight.limit_bytes / 1024**3
    report.worst_case_shape = [worst.shape.batch, worst.shape.source, worst.shape.label]
    report.max_batch = preflight.max_batch


def run(cfg: DictConfig) -> RunReport:
    """Validate and load data (bad input raises before any model load or record), then audit, preflight, train."""
    clock = StartupClock()
    # before anything initialises CUDA, validation included (it may ask whether CUDA is available)
    apply_allocator_env(cfg.memory)
    kept_gpu = pin_one_gpu() if cfg.trainer.device != "cpu" else None
    validate(cfg)
    from memfit.preconditions import check_before_run, check_budget

    check_before_run(cfg)
    from transformers import set_seed

    from memfit.data import load_and_tokenize
    from memfit.meter import make_meter
    from memfit.models import build_tokenizer
    from memfit.policy import apply_attention_kernels, apply_budget
    from memfit.preflight import PreflightFailed
    from memfit.tracking import flatten, start_tracking

    device = resolve_device(cfg)
    if kept_gpu is not None and device == "cuda":  # said only where a GPU trains (on CPU the narrowing is moot)
        log.info("training on one GPU (CUDA_VISIBLE_DEVICES=%s): budget and preflight are per device", kept_gpu)
    if changed := fall_back_to_fp32_on_slow_cpu(cfg.memory, device):
        log.warning(
            "this CPU has no fast bf16 (no AVX-512): training in fp32, not bf16 (%s); memory measured is fp32's",
            ", ".join(f"memory.{knob}" for knob in changed),
        )
    set_seed(cfg.trainer.seed)
    clock.lap("checks")
    tokenizer = build_tokenizer(cfg.model)
    clock.lap("tokenizer")
    prepared = load_and_tokenize(cfg, tokenizer)
    audit_seconds = clock.lap("data")
    meter = make_meter(device)
    if problems := check_budget(cfg, device, meter.total_bytes()):
        raise ConfigError(problems)
    cap = apply_budget(cfg, device, meter.total_bytes())
    apply_attention_kernels(cfg.memory, device)
    clock.lap("device")  # on CUDA: the context's start
    log.info("device %s, memory meter: %s, budget: %s", device, meter.label, cap.label)
    resume = find_resume_point(cfg)
    tracker = start_tracking(cfg, run_name(cfg), run_tags(cfg, device, meter.label), run_id=resume.run_id)
    remember_run(cfg, tracker, resume)
    ctx: dict[str, Any] = dict(
        clock=clock,
        cfg=cfg,
        device=device,
        tokenizer=tokenizer,
        prepared=prepared,
        meter=meter,
        cap=cap,
        tracker=tracker,
        resume=resume,
    )
    preflight = None
    try:
        tracker.log_params(flatten(cfg))
        tracker.log_text(OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")
        clock.lap("tracking")
        _log_audit(prepared, tracker)
        tracker.log_metrics({"audit/seconds": audit_seconds}, step=0)
        clock.lap("audit")
        _prepare_training(cfg, ctx)
        log.info("start-up: %s", clock.summary())
        tracker.log_metrics({f"startup/{phase}_s": seconds for phase, seconds in clock.seconds.items()}, step=0)
        if cfg.estimate_only:
            report = _estimate(cfg, ctx)
        else:
            if cfg.preflight.enabled:
                preflight = _run_preflight(cfg, ctx)
            report = RunReport(status="ok", steps=0) if cfg.preflight_only else _train(cfg, ctx)
    except PreflightFailed as err:
        tracker.finish("FAILED", "preflight: the worst batch does not fit the budget")
        report = RunReport(status="preflight_failed", reason=str(err), run_id=tracker.run_id, meter=meter.label)
        _fill_from_preflight(report, err.report, prepared.audit, ctx)
        return report
    except (Exception, KeyboardInterrupt) as err:
        from memfit.training import NonFiniteLoss

        status = "oom" if _is_oom(err) else "nan_loss" if isinstance(err, NonFiniteLoss) else "failed"
        first_line = str(err).splitlines()[0] if str(err) else ""
        reason = (
            first_line
            if isinstance(err, OutOfMemoryInTraining | NonFiniteLoss)
            else f"{status}: {type(err).__name__}: {first_line}"
        )
        tracker.finish("KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED", reason)
        if status in ("oom", "nan_loss"):
            return RunReport(status=status, reason=reason, run_id=tracker.run_id, meter=meter.label)
        raise
    report.run_id, report.meter = tracker.run_id, meter.label
    _fill_from_preflight(report, preflight, prepared.audit, ctx)
    tracker.finish("FINISHED")
    if not (cfg.preflight_only or cfg.estimate_only):
        log.info(
            "done: %d steps, loss %s, peak allocated %.2f GiB, peak reserved %.2f GiB (%s), %.0f tokens/s",
            report.steps,
            f"{report.final_loss:.4f}" if report.final_loss is not None else "n/a",
            report.peak_allocated_gib,
            report.peak_reserved_gib,
            meter.label,
            report.tokens_per_s,
        )
    return report


def _write_report(report: RunReport) -> None:
    """report.json in the Hydra job's output directory, for scripts and for resuming sweeps."""
    import json

    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        path = Path(HydraConfig.get().runtime.output_dir) / "report.json"
        path.write_text(json.dumps(report.to_dict(), indent=1))


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def main(cfg: DictConfig) -> dict[str, Any]:
    """The Hydra task. Bad input: one line per problem, exit 2. Preflight does not fit: exit 3. A failed run: exit 1
    (in a single run; in a multirun the report goes back to the sweeper and the sweep goes on)."""
    try:
        report = run(cfg)
    except (ConfigError, DataError) as err:
        for line in str(err).splitlines():
            print(f"memfit: error: {line}", file=sys.stderr)
        invalid = RunReport(status="invalid", reason=str(err).splitlines()[0])
        _write_report(invalid)
        if _in_multirun():  # one bad trial must not end the sweep: report it instead
            return invalid.to_dict()
        sys.exit(EXIT_BAD_INPUT)
    except Exception as err:  # recorded FAILED in MLflow by run(); report.json says so too, for a sweeper
        first_line = str(err).splitlines()[0] if str(err) else ""
        _write_report(RunReport(status="failed", reason=f"failed: {type(err).__name__}: {first_line}"))
        raise
    _write_report(report)
    if report.status != "ok" and not _in_multirun():
        print(f"memfit: {report.status}: {report.reason}", file=sys.stderr)
        sys.exit(EXIT_PREFLIGHT_FAILED if report.status == "preflight_failed" else EXIT_RUN_FAILED)
    return report.to_dict()
