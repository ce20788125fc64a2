"""One run, straight through: config → data → model → training → tracking, returning a structured report.

The report (not a bare float) is what a sweeper reads back from Hydra's job return value.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from memfit.config import ConfigError, validate
from memfit.data import DataError
from memfit.policy import apply_allocator_env, resolve_device

log = logging.getLogger("memfit")


@dataclass
class RunReport:
    status: str  # ok | oom | failed
    reason: str | None = None
    objective: float | None = None  # tokens/s of training
    peak_allocated_gib: float | None = None
    peak_reserved_gib: float | None = None
    tokens_per_s: float | None = None
    final_loss: float | None = None
    steps: int = 0
    run_id: str | None = None
    meter: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
    }


def _is_oom(err: BaseException) -> bool:
    import torch

    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def _train(cfg: DictConfig, device: str, tokenizer: Any, datasets: Any, tracker: Any, meter: Any) -> RunReport:
    """Model → Trainer → train; the tracker already holds the run."""
    from memfit.data import CountingCollator, model_columns
    from memfit.models import build_model
    from memfit.policy import training_arguments
    from memfit.training import build_trainer, make_callback, train

    built = build_model(cfg, tokenizer, device)
    tracker.log_params(
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
    collator = CountingCollator(tokenizer, cfg.memory.pad_to_multiple_of, cfg.model.task)
    callback = make_callback(meter, tracker, collator)
    ready = {split: model_columns(ds) for split, ds in datasets.items()}
    output_dir = str(Path(cfg.output_dir) / "checkpoints" / run_name(cfg))
    args = training_arguments(cfg, device, output_dir, has_eval="validation" in ready)
    trainer = build_trainer(cfg, built.model, tokenizer, ready, args, collator, [callback])
    totals = train(trainer, collator)
    overall = meter.overall
    tokens_per_s = totals.tokens / totals.wall_s if totals.wall_s > 0 else 0.0
    tracker.log_metrics(
        {
            "summary/peak_allocated_gib": overall.allocated_gib,
            "summary/peak_reserved_gib": overall.reserved_gib,
            "summary/train_tokens": totals.tokens,
            "summary/wall_s": totals.wall_s,
            "summary/tokens_per_s": tokens_per_s,
            **({"summary/final_loss": totals.final_loss} if totals.final_loss is not None else {}),
        },
        step=totals.steps,
    )
    return RunReport(
        status="ok",
        objective=tokens_per_s,
        peak_allocated_gib=overall.allocated_gib,
        peak_reserved_gib=overall.reserved_gib,
        tokens_per_s=tokens_per_s,
        final_loss=totals.final_loss,
        steps=totals.steps,
        meter=meter.label,
    )


def run(cfg: DictConfig) -> RunReport:
    """Validate, load data, then train under tracking. Bad input raises before any model load or record."""
    validate(cfg)
    apply_allocator_env(cfg.memory)  # before anything initialises CUDA
    import torch
    from transformers import set_seed

    from memfit.data import load_and_tokenize
    from memfit.meter import make_meter
    from memfit.models import build_tokenizer
    from memfit.policy import apply_budget
    from memfit.tracking import flatten, start_tracking

    device = resolve_device(cfg)
    set_seed(cfg.trainer.seed)
    tokenizer = build_tokenizer(cfg.model)
    datasets = load_and_tokenize(cfg, tokenizer)
    meter = make_meter(device)
    cap = apply_budget(cfg, device, meter.total_bytes())
    log.info("device %s, memory meter: %s, budget: %s", device, meter.label, cap.label)
    tracker = start_tracking(cfg, run_name(cfg), run_tags(cfg, device, meter.label))
    try:
        tracker.log_params(flatten(cfg))
        tracker.log_text(OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")
        report = _train(cfg, device, tokenizer, datasets, tracker, meter)
    except (Exception, KeyboardInterrupt) as err:
        status = "oom" if _is_oom(err) else "failed"
        reason = f"{status}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        tracker.finish("FAILED" if not isinstance(err, KeyboardInterrupt) else "KILLED", reason)
        if status == "oom":
            torch.cuda.empty_cache() if device == "cuda" else None
            return RunReport(status="oom", reason=reason, run_id=tracker.run_id, meter=meter.label)
        raise
    report.run_id = tracker.run_id
    tracker.finish("FINISHED")
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


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def main(cfg: DictConfig) -> dict[str, Any]:
    """The Hydra task: bad input → one line per problem and exit 2; a failed run → exit 1 (in a single run)."""
    try:
        report = run(cfg)
    except (ConfigError, DataError) as err:
        for line in str(err).splitlines():
            print(f"memfit: error: {line}", file=sys.stderr)
        sys.exit(2)
    if report.status != "ok" and not _in_multirun():
        print(f"memfit: run failed: {report.reason}", file=sys.stderr)
        sys.exit(1)
    return report.to_dict()
