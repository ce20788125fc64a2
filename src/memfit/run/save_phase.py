"""The end of a run that trained: what it trained saved under output_dir/models/<run name>/ and in its MLflow run,
with memfit.json (the config, the audit's coverage and the proven memory figures) and the line that loads it."""

from __future__ import annotations

import json
import logging
from typing import Any

from omegaconf import OmegaConf

from memfit.run.context import RunContext, TrainingSetup
from memfit.run.identity import model_dir
from memfit.run.report import RunReport

log = logging.getLogger("memfit")

# what memfit.json keeps of the run's report: how it fitted and how it trained
REPORT_FIELDS = (
    "steps", "final_loss", "eval_loss", "label_coverage", "source_coverage", "worst_case_peak_gib", "limit_gib",
    "worst_case_shape", "peak_allocated_gib", "peak_reserved_gib", "tokens_per_s", "run_id",
)  # fmt: skip


def _record(ctx: RunContext, setup: TrainingSetup, report: RunReport) -> dict[str, Any]:
    import memfit
    from memfit.tracking import mask_credentials

    cfg = ctx.cfg
    config = json.loads(mask_credentials(json.dumps(OmegaConf.to_container(cfg, resolve=True))))
    return {
        "memfit_version": memfit.__version__,
        "model": cfg.model.name,
        "name_or_path": cfg.model.name_or_path,
        "revision": cfg.model.revision,
        "task": cfg.model.task,
        "random_base_weights": setup.built.random_weights,
        "device": ctx.device,
        "budget_gib": cfg.budget.gib,
        **{name: getattr(report, name) for name in REPORT_FIELDS},
        "config": config,  # a password in a URL masked, as everywhere memfit writes
    }


def _base(ctx: RunContext, setup: TrainingSetup) -> str | None:
    """What an adapter loads onto, by name; None where the base weights are random (nothing can load them again)."""
    if setup.built.random_weights:
        return None
    return ctx.cfg.model.name_or_path


def save_model(ctx: RunContext, setup: TrainingSetup, report: RunReport) -> str | None:
    """trainer.save_model=final|best: the model (or adapter) as trained, or the best checkpoint's, which Trainer
    loaded at the end (load_best_model_at_end); logged as the run's `model/` artifacts. Returns the line that says
    where it is and how to load it (the run's last)."""
    from memfit.training.saving import load_hint, save_trained

    cfg = ctx.cfg
    if cfg.trainer.save_model == "none" or not report.steps:
        return None
    base = _base(ctx, setup)
    saved = save_trained(setup.trainer, model_dir(cfg), _record(ctx, setup, report), cfg.model.lora.merge_on_save)
    ctx.tracker.log_artifacts(str(saved.path), "model")
    ctx.tracker.set_tags({"memfit.saved_model": str(saved.path)})
    report.saved_model = str(saved.path)
    if saved.adapter and base is None and saved.merged is None:
        log.warning(
            "the LoRA adapter was trained on random base weights (no model.name_or_path): it is of use only on them; "
            "model.lora.merge_on_save=true saves the base with it"
        )
    what = "LoRA adapter" if saved.adapter and saved.merged is None else "model"
    return f"saved the trained {what} to {saved.path}: load it with {load_hint(saved, cfg.model.task, base)}"
