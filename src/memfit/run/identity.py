"""A run's name, its tags, and where its checkpoints live: what a resumed run uses to find itself again."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("memfit")


def model_label(model: DictConfig) -> str:
    """The model's config name, with the checkpoint's own name where it loads one (a directory or a hub id): two
    checkpoints under model=local are two names."""
    if not model.name_or_path:
        return model.name
    checkpoint = Path(str(model.name_or_path).rstrip("/")).name
    return model.name if checkpoint == model.name else f"{model.name}-{checkpoint}"


def run_name(cfg: DictConfig) -> str:
    if cfg.tracking.run_name:
        return cfg.tracking.run_name
    budget = f"-{cfg.budget.gib:g}GiB" if cfg.budget.gib else ""
    return f"{model_label(cfg.model)}-{cfg.memory.name}-b{cfg.trainer.batch_size}{budget}"


def run_tags(cfg: DictConfig, device: str, meter_label: str) -> dict[str, str]:
    return {
        "memfit.model": cfg.model.name,
        "memfit.data": cfg.data.name,
        "memfit.memory": cfg.memory.name,
        "memfit.budget_gib": "none" if cfg.budget.gib is None else f"{cfg.budget.gib:g}",
        "memfit.device": device,
        "memfit.meter": meter_label,
        "memfit.mode": "estimate_only" if cfg.estimate_only else "preflight_only" if cfg.preflight_only else "train",
        "memfit.cuda_visible_devices": _visible_devices(device),
        "memfit.cpu_threads": os.environ.get("OMP_NUM_THREADS", "all"),
        "memfit.cpu_cores": core_ranges(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else "all",
    }


def _visible_devices(device: str) -> str:
    """CUDA_VISIBLE_DEVICES as the run saw it; on CPU it says that no GPU was used, whatever the variable held."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "all")
    return visible if device == "cuda" else f"{visible} (unused: the run trained on CPU)"


def core_ranges(cores: list[int]) -> str:
    """0-3,8-11 for [0, 1, 2, 3, 8, 9, 10, 11]: the cores this run may use, as taskset writes them."""
    runs: list[list[int]] = []
    for core in cores:
        if runs and core == runs[-1][-1] + 1:
            runs[-1].append(core)
        else:
            runs.append([core])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


@dataclass(frozen=True)
class ResumePoint:
    checkpoint: str | None = None  # the last checkpoint directory, for Trainer.train(resume_from_checkpoint=...)
    run_id: str | None = None  # the MLflow run that wrote it, continued instead of forking a new one


def checkpoint_dir(cfg: DictConfig) -> Path:
    return Path(cfg.output_dir) / "checkpoints" / run_name(cfg)


def model_dir(cfg: DictConfig) -> Path:
    """Where the run saves what it trained (trainer.save_model)."""
    return Path(cfg.output_dir) / "models" / run_name(cfg)


# what makes a run the one its checkpoints continue: the model, the data, the policy and what shapes its batches
IDENTITY_KEYS = (
    "model.name", "model.name_or_path", "model.revision", "model.lora.enabled", "model.lora.r",
    "model.lora.target_modules", "data.name", "data.format", "data.path", "data.validation_path", "data.hub_id",
    "data.hub_config", "data.source_column", "data.target_column", "data.text_column", "data.style",
    "data.source_sections", "data.targets", "data.max_train_samples", "memory.name", "memory.max_source_length",
    "memory.max_label_length", "trainer.batch_size", "trainer.gradient_accumulation_steps", "trainer.batching",
    "trainer.effective_batch",
)  # fmt: skip
FINGERPRINT_BYTES = 1 << 20  # a data file's fingerprint reads its size and its first and last MiB


def file_fingerprint(path: str) -> str:
    """A data file's contents in 16 hex digits: its size, first and last MiB (whole files read in milliseconds)."""
    file = Path(path)
    digest = hashlib.sha256(str(file.stat().st_size).encode())
    with file.open("rb") as fh:
        digest.update(fh.read(FINGERPRINT_BYTES))
        fh.seek(max(0, file.stat().st_size - FINGERPRINT_BYTES))
        digest.update(fh.read(FINGERPRINT_BYTES))
    return digest.hexdigest()[:16]


def run_identity(cfg: DictConfig) -> dict[str, str]:
    """The settings a resumed run must share with its checkpoints, as text, and the data files' fingerprints."""
    identity = {key: str(OmegaConf.select(cfg, key)) for key in IDENTITY_KEYS}
    for key in ("data.path", "data.validation_path"):
        path = OmegaConf.select(cfg, key)
        if path and Path(path).is_file():
            identity[f"{key} contents"] = file_fingerprint(path)
    return identity


def _identity_problem(cfg: DictConfig, recorded: dict[str, str] | None) -> str | None:
    """Why this run is not the one its checkpoints trained (one line), or None."""
    if recorded is None or cfg.trainer.resume == "force":
        return None
    now = run_identity(cfg)
    changed = [f"{key} {recorded[key]} -> {now.get(key)}" for key in recorded if recorded[key] != now.get(key)]
    if not changed:
        return None
    return (
        f"trainer.resume=true: the checkpoints under {checkpoint_dir(cfg)} belong to another run ({'; '.join(changed)}"
        "): give this run a name of its own (tracking.run_name=...) or continue them anyway with trainer.resume=force"
    )


COMPLETE_MARK = "trainer_state.json"  # the file Trainer writes last into a checkpoint


def last_complete_checkpoint(directory: Path) -> str | None:
    """The checkpoint-N of highest N that Trainer finished writing; later ones it did not finish (a full disk, a
    kill mid-save) are passed over, each said."""
    if not directory.is_dir():
        return None
    found = [p for p in directory.glob("checkpoint-*") if p.is_dir() and p.name.split("-", 1)[1].isdigit()]
    for checkpoint in sorted(found, key=lambda p: int(p.name.split("-", 1)[1]), reverse=True):
        if (checkpoint / COMPLETE_MARK).is_file():
            return str(checkpoint)
        log.warning("%s was not written to the end (no %s): resuming from an earlier one", checkpoint, COMPLETE_MARK)
    return None


def find_resume_point(cfg: DictConfig) -> ResumePoint:
    """With trainer.resume=true: the last checkpoint of this run name and its MLflow run, if there is one. Raises
    ConfigError where those checkpoints were trained by another run (other data, model or batches), unless
    trainer.resume=force."""
    if not cfg.trainer.resume:
        return ResumePoint()
    from memfit.config import ConfigError

    checkpoint = last_complete_checkpoint(checkpoint_dir(cfg))
    if not checkpoint:
        log.info("trainer.resume=true: no checkpoint under %s yet, so training starts at step 0", checkpoint_dir(cfg))
    if not cfg.trainer.save_steps:
        log.warning("trainer.resume=true, but trainer.save_steps=null writes no checkpoint: set e.g. save_steps=200")
    marker = checkpoint_dir(cfg) / "memfit_run.json"
    recorded = json.loads(marker.read_text()) if marker.exists() and checkpoint else {}
    if problem := _identity_problem(cfg, recorded.get("identity")):
        raise ConfigError([problem])
    if checkpoint and recorded and "identity" not in recorded:
        log.warning("%s records no run identity (an older memfit): resuming without checking it", marker)
    run_id = recorded.get("run_id")
    if checkpoint:
        log.info("resuming from %s (MLflow run %s)", checkpoint, run_id or "new")
    return ResumePoint(checkpoint, run_id)


def remember_run(cfg: DictConfig, tracker: Any, resume: ResumePoint) -> None:
    """Checkpointed runs note their MLflow run and identity beside the checkpoints, so that a resume continues the
    run, and only the run, that wrote them (after trainer.resume=force, this one's)."""
    if tracker.run_id is None or not cfg.trainer.save_steps:
        return
    checkpoint_dir(cfg).mkdir(parents=True, exist_ok=True)
    marker = {"run_id": tracker.run_id, "identity": run_identity(cfg)}
    (checkpoint_dir(cfg) / "memfit_run.json").write_text(json.dumps(marker, indent=1))
    if resume.checkpoint:
        tracker.set_tags({"memfit.resumed_from": Path(resume.checkpoint).name})
