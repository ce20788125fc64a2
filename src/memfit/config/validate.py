"""One-pass validation of a composed config: every problem collected, each a line naming the field and the fix,
before anything heavy is imported."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from memfit.config.data_source import check_data_source
from memfit.config.local_model import (
    check_local_model,
    checkpoint_problem,
    resolve_local_model,
    unresolved_problems,
)
from memfit.config.schema import (
    AUTO,
    BATCHING,
    CALIBRATION_SETTINGS,
    DEVICES,
    EFFECTIVE_BATCH,
    FROZEN_DTYPES,
    LAYER_KERNELS,
    LOSSES,
    MODEL_SOURCES,
    OPTIMIZERS,
    OVERLENGTH_POLICIES,
    PRECISIONS,
    SAVE_MODEL,
    TASKS,
    TRACKING_BACKENDS,
    WEIGHT_DTYPES,
    effective_lengths,
    memory_knobs,
)


class ConfigError(ValueError):
    """Every problem found in one pass; each line names a field and the fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def _choice(problems: list[str], field_name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        problems.append(f"{field_name}={value!r} is not one of {', '.join(choices)}: set {field_name}=<one of them>")


def _positive(problems: list[str], field_name: str, value: Any, fix: str) -> None:
    if value is not None and value <= 0:
        problems.append(f"{field_name}={value:g} must be > 0: {fix}")


def _validate_model(cfg: DictConfig, problems: list[str]) -> None:
    m = cfg.model
    _choice(problems, "model.task", m.task, TASKS)
    _choice(problems, "model.source", m.source, MODEL_SOURCES)
    if m.source == "pretrained" and not m.name_or_path:
        problems.append(
            "model.name_or_path is empty but model.source=pretrained: give a checkpoint directory or a hub id"
        )
    if problem := checkpoint_problem(m):
        problems.append(problem)
    if m.source == "random" and "model_type" not in m.architecture:
        problems.append("model.architecture.model_type is missing: random weights need an HF model_type and its config")
    problems += check_local_model(m)
    if m.lora.enabled:
        _positive(problems, "model.lora.r", m.lora.r, "use a rank such as 8 or 16")


def _is_length(value: Any) -> bool:
    """A max length is a whole number of tokens, auto or null."""
    return value is None or value == AUTO or (isinstance(value, int) and not isinstance(value, bool))


def _length_type_problems(memory: DictConfig) -> list[str]:
    return [
        f"memory.{key}={value!r} is not a length: set memory.{key}=auto (the model's limit, cut only where the "
        f"budget needs it), a number of tokens such as 512, or null (the model's limit)"
        for key in ("max_source_length", "max_label_length")
        if not _is_length(value := memory[key])
    ]


def _validate_lengths(cfg: DictConfig, problems: list[str]) -> None:
    if types := _length_type_problems(cfg.memory):
        problems += types
        return
    limit = cfg.model.max_positions
    lengths = dict(zip(("max_source_length", "max_label_length"), effective_lengths(cfg), strict=True))
    for key, value in lengths.items():
        _positive(problems, f"memory.{key}", value, f"set memory.{key}=128 or another positive length")
        if value > limit and cfg.model.task == "seq2seq":
            problems.append(
                f"memory.{key}={value} exceeds {cfg.model.name}'s {limit} positions: set memory.{key}<={limit}"
            )
    total = sum(lengths.values())
    if cfg.model.task == "causal" and min(lengths.values()) > 0 and total > limit:
        problems.append(
            f"memory.max_source_length+memory.max_label_length={total} exceeds {cfg.model.name}'s {limit} positions:"
            " shorten one of them"
        )


def _validate_memory(cfg: DictConfig, problems: list[str]) -> None:
    mem = cfg.memory
    _choice(problems, "memory.overlength", mem.overlength, OVERLENGTH_POLICIES)
    _choice(problems, "memory.precision", mem.precision, PRECISIONS)
    _choice(problems, "memory.weights_dtype", mem.weights_dtype, WEIGHT_DTYPES)
    _choice(problems, "memory.frozen_dtype", mem.frozen_dtype, FROZEN_DTYPES)
    _choice(problems, "memory.optimizer", mem.optimizer, OPTIMIZERS)
    _choice(problems, "memory.loss", mem.loss, LOSSES)
    _choice(problems, "memory.layer_kernels", mem.layer_kernels, LAYER_KERNELS)
    _positive(problems, "memory.pad_to_multiple_of", mem.pad_to_multiple_of, "use 8 (tensor cores) or null")
    _positive(problems, "memory.eval_batch_size", mem.eval_batch_size, "use a positive batch or null")
    _positive(problems, "memory.empty_cache_steps", mem.empty_cache_steps, "use a positive step count or null")
    if mem.memory_fraction is not None and not 0 < mem.memory_fraction <= 1:
        problems.append(f"memory.memory_fraction={mem.memory_fraction} must be in (0, 1]: use 0.9 or null")
    if mem.load_in_4bit and not cfg.model.lora.enabled:
        problems.append(
            "memory.load_in_4bit=true needs LoRA (4-bit weights cannot be trained): set model.lora.enabled=true"
        )


def _validate_trainer(cfg: DictConfig, problems: list[str]) -> None:
    t = cfg.trainer
    _positive(problems, "trainer.batch_size", t.batch_size, "set trainer.batch_size=1 or more")
    _positive(problems, "trainer.gradient_accumulation_steps", t.gradient_accumulation_steps, "set it to 1 or more")
    _positive(problems, "trainer.learning_rate", t.learning_rate, "use e.g. 5e-5")
    _positive(problems, "trainer.logging_steps", t.logging_steps, "use 1 to log every step")
    _positive(problems, "trainer.eval_steps", t.eval_steps, "use a positive step count or null")
    _positive(problems, "trainer.save_steps", t.save_steps, "use a positive step count or null")
    _positive(problems, "trainer.max_train_tokens", t.max_train_tokens, "use a positive token count or null")
    for key, fix in (
        ("warmup_steps", "use 0 for none"),
        ("weight_decay", "use 0.0 for none, or e.g. 0.01"),
        ("dataloader_num_workers", "use 0 to load batches in the training process"),
    ):
        if t[key] < 0:
            problems.append(f"trainer.{key}={t[key]:g} must be >= 0: {fix}")
    _choice(problems, "trainer.device", t.device, DEVICES)
    if t.predict_with_generate and cfg.model.task != "seq2seq":
        problems.append("trainer.predict_with_generate=true is for seq2seq models: set it to false for a causal LM")
    if t.max_steps == 0 or (t.max_steps < 0 and t.num_train_epochs <= 0):
        problems.append("trainer.max_steps/num_train_epochs give no training: set trainer.max_steps>0 or epochs>0")
    if t.resume not in (True, False, "force"):
        problems.append(f"trainer.resume={t.resume} is not one of true, false, force: set trainer.resume=true")
    _validate_saving(cfg, problems)
    _validate_batching(cfg, problems)


def _validate_saving(cfg: DictConfig, problems: list[str]) -> None:
    t = cfg.trainer
    _choice(problems, "trainer.save_model", t.save_model, SAVE_MODEL)
    if cfg.model.lora.merge_on_save and not cfg.model.lora.enabled:
        problems.append("model.lora.merge_on_save=true merges a LoRA adapter: set model.lora.enabled=true or drop it")
    if cfg.model.lora.merge_on_save and cfg.memory.load_in_4bit:
        problems.append(
            "model.lora.merge_on_save=true cannot merge into 4-bit base weights: load the base in bf16 and merge the "
            "saved adapter there, or drop it"
        )
    if t.save_model != "best":
        return
    if not t.eval_steps or not t.save_steps or t.save_steps % t.eval_steps:
        problems.append(
            "trainer.save_model=best keeps the checkpoint with the lowest eval loss: set trainer.eval_steps and "
            "trainer.save_steps (a multiple of eval_steps), e.g. eval_steps=50 save_steps=50"
        )
    if not cfg.memory.eval_enabled:
        problems.append("trainer.save_model=best needs evaluation: set memory.eval_enabled=true or save_model=final")


def _validate_batching(cfg: DictConfig, problems: list[str]) -> None:
    t = cfg.trainer
    _choice(problems, "trainer.batching", t.batching, BATCHING)
    _choice(problems, "trainer.effective_batch", t.effective_batch, EFFECTIVE_BATCH)
    if not 0 < t.micro_batch_fill <= 1:
        problems.append(f"trainer.micro_batch_fill={t.micro_batch_fill} must be in (0, 1]: use 1.0 or e.g. 0.9")
    _positive(problems, "trainer.max_micro_batch", t.max_micro_batch, "use a positive row count or null")
    if t.pad_tolerance is not None and not t.pad_tolerance > 0:
        problems.append(f"trainer.pad_tolerance={t.pad_tolerance} must be > 0: use e.g. 0.1, or null for none")
    if t.length_buckets < 1:
        problems.append(f"trainer.length_buckets={t.length_buckets} must be >= 1: use e.g. 6")
    if t.batching != "budget":
        return
    for setting in budget_batching_contradictions(cfg):
        problems.append(
            f"trainer.batching=budget contradicts {setting} (the batch plan is sized by the memory model and "
            "proven by the preflight; generation batches are not shaped): drop it or set trainer.batching=fixed"
        )


def budget_batching_contradictions(cfg: DictConfig) -> list[str]:
    """The run's settings that rule budget-shaped batches out: their plan is sized by the memory model and proven
    by the preflight, and generation batches are not shaped."""
    settings = {
        "trainer.predict_with_generate=true": cfg.trainer.predict_with_generate,
        "preflight.enabled=false": not cfg.preflight.enabled,
        "calibration.enabled=false": str(cfg.calibration.enabled).lower() == "false",
        "estimate_only=true": cfg.estimate_only,
    }
    return [setting for setting, present in settings.items() if present]


def _validate_budget(cfg: DictConfig, problems: list[str]) -> None:
    _positive(problems, "budget.gib", cfg.budget.gib, "give the memory budget in GiB, e.g. budget.gib=24, or null")
    margin, gib = cfg.budget.margin_gib, cfg.budget.gib
    if margin < 0:
        problems.append(f"budget.margin_gib={margin} must be >= 0: use e.g. 0.5")
    elif isinstance(gib, int | float) and gib > 0 and (problem := margin_problem("budget.gib", gib, margin)):
        problems.append(problem)


def margin_problem(key: str, gib: float, margin_gib: float) -> str | None:
    """A budget that the margin kept below it leaves nothing of: every peak would be judged against <= 0 GiB."""
    if gib > margin_gib:
        return None
    return (
        f"budget.margin_gib={margin_gib:g} leaves nothing of {key}={gib:g} to judge peaks against: "
        f"raise {key}, or lower the margin (e.g. budget.margin_gib={gib / 10:.2g})"
    )


def _validate_preflight(cfg: DictConfig, problems: list[str]) -> None:
    _positive(problems, "preflight.steps", cfg.preflight.steps, "use 2 (the second step holds optimizer state)")
    _positive(problems, "preflight.max_batch_limit", cfg.preflight.max_batch_limit, "use e.g. 512")
    _positive(problems, "preflight.max_search_seconds", cfg.preflight.max_search_seconds, "use e.g. 40 or null")
    if not 0 <= cfg.preflight.min_coverage <= 1:
        problems.append(f"preflight.min_coverage={cfg.preflight.min_coverage} must be in [0, 1]: use e.g. 0.9")
    if cfg.preflight_only and not cfg.preflight.enabled:
        problems.append("preflight_only=true with preflight.enabled=false has nothing to do: enable the preflight")
    _positive(problems, "forensics.max_entries", cfg.forensics.max_entries, "use e.g. 100000")
    if str(cfg.calibration.enabled).lower() not in CALIBRATION_SETTINGS:
        problems.append(
            f"calibration.enabled={cfg.calibration.enabled} is not one of {', '.join(CALIBRATION_SETTINGS)}: "
            "use auto (calibrate on CUDA only)"
        )
    _positive(problems, "calibration.probe_tokens", cfg.calibration.probe_tokens, "use e.g. 4096")
    if cfg.estimate_only and cfg.preflight_only:
        problems.append("estimate_only=true and preflight_only=true: pick one (estimate predicts, preflight measures)")


def _validate_tracking(cfg: DictConfig, problems: list[str]) -> None:
    _choice(problems, "tracking.backend", cfg.tracking.backend, TRACKING_BACKENDS)


def _validate_device_needs(cfg: DictConfig, problems: list[str], cuda_available: bool) -> None:
    """Knob values that only exist on a CUDA device (their Knob.cuda_only) fail here, not after the model is loaded."""
    on_cuda = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and cuda_available)
    if cfg.trainer.device == "cuda" and not cuda_available:
        problems.append("trainer.device=cuda but no CUDA device is visible: use trainer.device=auto or cpu")
    if on_cuda and _fragments_budget_batches(cfg):
        problems.append(expandable_segments_problem())
    chosen = {name: knob for name, knob in memory_knobs().items() if cfg.memory[name] in knob.cuda_only}
    for name, knob in chosen.items():
        setting = f"memory.{name}={_text(cfg.memory[name])}"
        if not on_cuda:
            problems.append(f"{setting} needs a CUDA GPU: {knob.on_cpu}")
        elif knob.package and importlib.util.find_spec(knob.package) is None:
            wheel = knob.package.replace("_", "-")
            problems.append(f"{setting} needs {wheel}: pip install 'memfit[gpu]', or {knob.without_package}")


def expandable_segments_on(memory: DictConfig) -> bool:
    """Whether CUDA's allocator grows segments in place: PYTORCH_CUDA_ALLOC_CONF's setting where it names one (the
    user's, which memory.policy.apply_allocator_env leaves as it is), else the knob."""
    for option in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower().split(","):
        name, _, value = option.partition(":")
        if name == "expandable_segments":
            return value == "true"
    return bool(memory.expandable_segments)


def expandable_segments_problem() -> str:
    """Budget-shaped batches meet dozens of shapes an epoch. Without expandable segments the allocator carves a new
    segment for a request no cached block fits and splits cached ones for smaller requests, so free memory scatters
    over segments that live tensors pin and reserved memory outgrows what the preflight proved: a proven plan OOMed
    at step 25, twice (pegasus_large, memory=off, 24 GiB), and trained its epoch with them 0.21 GiB under
    the judged worst case (benchmarks/results/budget_batching_pegasus_large_24_seed1_c_memory_off_h100.json and
    ..._memory_off_expandable_h100.json)."""
    return (
        "trainer.batching=budget on CUDA needs memory.expandable_segments=true: without it the allocator's cache "
        "fragments over the plan's many shapes and outgrows the proof; set it, or set trainer.batching=fixed"
    )


def _needs_cuda(cfg: DictConfig) -> bool:
    """Whether a setting's validity depends on the device: a CUDA-only knob, or budget-shaped batches without
    expandable segments (fine on CPU, refused on CUDA)."""
    cuda_only = any(cfg.memory[name] in knob.cuda_only for name, knob in memory_knobs().items())
    return cuda_only or _fragments_budget_batches(cfg)


def _fragments_budget_batches(cfg: DictConfig) -> bool:
    return cfg.trainer.batching == "budget" and not expandable_segments_on(cfg.memory)


def _unknown_keys(cfg: DictConfig) -> list[str]:
    """Keys that `+key=value` added and nothing reads: a typo, or a preset that was never found (`+preset=<name>`
    becomes a plain key where the launch directory has no sweeps/preset/), would otherwise train the defaults."""
    import dataclasses

    from memfit.config.schema import TrainConfig

    known = {f.name for f in dataclasses.fields(TrainConfig)} | {"hydra"}
    problems = []
    for key in sorted(set(cfg.keys()) - known):
        if key == "preset":
            problems.append(
                f"preset={cfg.preset}: no sweeps/preset/ under {Path.cwd()}: run the command the sweep printed last "
                "(--config-dir <its sweep directory>), or launch where hydra.sweeper.export_to=sweeps/preset put it"
            )
        else:
            problems.append(f"{key} is not a config key (python train.py --cfg job lists them): remove +{key}")
    return problems


def _text(value: Any) -> str:
    """A value as the user types it on the command line."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _cuda_available() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    import torch  # only when a device-dependent knob needs the answer

    return torch.cuda.is_available()


def validate(cfg: DictConfig, cuda_available: bool | None = None) -> None:
    """Check the composed config in one pass; raise ConfigError listing every problem. A local checkpoint's task
    and position limit (model=local) are read into the config first."""
    resolve_local_model(cfg)
    if unread := unresolved_problems(cfg.model):  # the rest needs the task and the position limit
        raise ConfigError(unread)
    problems: list[str] = _unknown_keys(cfg)
    _validate_model(cfg, problems)
    _validate_lengths(cfg, problems)
    _validate_memory(cfg, problems)
    _validate_trainer(cfg, problems)
    _validate_budget(cfg, problems)
    _validate_preflight(cfg, problems)
    _validate_tracking(cfg, problems)
    problems.extend(check_data_source(cfg.data, cfg.model.task))
    if cuda_available is None:
        cuda_available = _cuda_available() if (_needs_cuda(cfg) or cfg.trainer.device == "cuda") else False
    _validate_device_needs(cfg, problems, cuda_available)
    if problems:
        raise ConfigError(problems)
