"""Memory policy → concrete knobs: allocator environment, the budget cap, and Trainer arguments.

The allocator settings belong in place before CUDA initialises, so `apply_allocator_env` runs first thing in a
run, before torch touches the device (and hands them to an allocator already running).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from memfit.config import GIB, ConfigError

OPTIMIZER_NAMES = {"adamw": "adamw_torch", "adamw_8bit": "adamw_bnb_8bit", "adafactor": "adafactor"}


def resolve_device(cfg: DictConfig) -> str:
    """'cuda' or 'cpu' for trainer.device=auto|cuda|cpu; a ConfigError where auto would fall to CPU only because
    CUDA_VISIBLE_DEVICES hides every GPU the machine has (hidden_gpus_problem)."""
    if cfg.trainer.device != "auto":
        return cfg.trainer.device
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if problem := hidden_gpus_problem(os.environ.get("CUDA_VISIBLE_DEVICES"), _driver_gpus(), cuda_available=False):
        raise ConfigError([problem])
    return "cpu"


def _driver_gpus() -> int:
    """GPUs the NVIDIA driver lists, whatever CUDA_VISIBLE_DEVICES shows (0 without the driver)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return len(list(gpus.iterdir())) if gpus.is_dir() else 0


def hidden_gpus_problem(visible: str | None, driver_gpus: int, cuda_available: bool) -> str | None:
    """Where CUDA_VISIBLE_DEVICES names devices but shows none of the machine's GPUs (a trial pinned by
    hydra.sweeper.devices to a GPU the machine lacks), the run would train on CPU without a word: say so instead.
    None where CUDA sees a GPU, the machine has none (CPU training is what the user asked for) or nothing narrows
    them (an empty CUDA_VISIBLE_DEVICES hides every GPU on purpose)."""
    if not visible or driver_gpus == 0 or cuda_available:
        return None
    return (
        f"CUDA_VISIBLE_DEVICES={visible} shows none of this machine's {driver_gpus} GPUs (0-{driver_gpus - 1}): "
        "list devices it has in hydra.sweeper.devices, or set trainer.device=cpu to train on CPU"
    )


def apply_allocator_env(memory: DictConfig) -> None:
    """expandable_segments lowers fragmentation in long runs (budget-shaped batches OOMed without it:
    benchmarks/results/budget_batching_pegasus_large_24_seed1_c_memory_off_h100.json). The allocator reads
    PYTORCH_CUDA_ALLOC_CONF when CUDA starts; where CUDA has started in this process already (an earlier job of a Hydra
    multirun without the knob, a notebook), the settings are handed to the running allocator too, whose new segments
    expand from then on, so that the run has what its checks
    (config.validate.expandable_segments_on) assume."""
    if not memory.expandable_segments:
        return
    current = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments" in current:
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = settings = ",".join(filter(None, [current, "expandable_segments:True"]))
    torch = sys.modules.get("torch")  # not imported yet: CUDA cannot have started
    if torch is not None and torch.cuda.is_initialized():
        running = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch 2.9 and later
        (running or torch.cuda.memory._set_allocator_settings)(settings)


def cpu_runs_bf16_fast() -> bool:
    """Whether this CPU multiplies bf16 matrices through oneDNN (AVX-512 and newer). Without it torch multiplies
    them in a plain loop: on an AVX2-only EPYC a default-job step under bf16 autocast took 105 s."""
    import torch

    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if check is not None:
        return bool(check())
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def fall_back_to_fp32_on_slow_cpu(memory: DictConfig, device: str) -> list[str]:
    """On a CPU without fast bf16, train in fp32: what bf16 saves is GPU memory, and there it would cost a run
    its speed many times over. The preflight and training then both measure fp32, so the run stays consistent;
    the recorded config says fp32. Returns the knobs changed."""
    if device != "cpu" or cpu_runs_bf16_fast():
        return []
    changed = [knob for knob in ("precision", "weights_dtype", "frozen_dtype") if memory[knob] == "bf16"]
    for knob in changed:
        memory[knob] = "fp32"
    return changed


def resolve_loss(memory: DictConfig, task: str) -> str | None:
    """memory.loss=auto → the loss the measurements favour for this model family
    (benchmarks/results/budget_batching_qwen2_5_1_5b_24_seed1_standard_session30.json): chunked for a causal LM, whose
    head then runs over its labelled positions only (qwen2_5_1_5b LoRA at 24 GiB, budget-shaped batches: 22.5-22.8k
    tokens/s against the standard loss's 13.5-15.5k, and the fused kernel's 21.1k); standard for a seq2seq model, whose
    positions are nearly all labels (pegasus_large: chunked 5-7% slower there). Sets the knob and returns what it chose,
    or None where it was not
    auto."""
    if memory.loss != "auto":
        return None
    memory.loss = "chunked" if task == "causal" else "standard"
    return memory.loss


def resolve_batching(cfg: DictConfig, device: str) -> str | None:
    """trainer.batching=auto → budget on CUDA, where budget-shaped batches trained 1.0-4.9x the tokens/s of the fixed
    batch the worst case allows on every measured long-tail set (pegasus_large and qwen2_5_1_5b at 16, 24 and 40 GiB,
    benchmarks/results/budget_batching_*_session46_h200.json); fixed on CPU (the plan's host-memory calibration costs
    more than it saves on small CPU runs), where the run's settings rule the plan out, and on CUDA without expandable
    segments (config.validate.expandable_segments_problem refuses budget there). Sets the knob and returns what it
    chose, or
    None where it was not auto."""
    from memfit.config.validate import budget_batching_contradictions, expandable_segments_on

    if cfg.trainer.batching != "auto":
        return None
    # preflight_only with fixed batches searches the largest batch that fits: what that command is for
    shaped = device == "cuda" and not cfg.preflight_only and not budget_batching_contradictions(cfg)
    # without expandable segments: fixed, and fragmentation_warning says why
    cfg.trainer.batching = "budget" if shaped and expandable_segments_on(cfg.memory) else "fixed"
    return cfg.trainer.batching


def fragmentation_warning(cfg: DictConfig, device: str) -> str | None:
    """A fixed-batch run on CUDA without expandable segments: the preflight proves its worst batch on the cache as
    the probes left it, and a run's other shapes can fragment the cache past that
    (config.validate.expandable_segments_problem)."""
    from memfit.config.validate import expandable_segments_on

    if device != "cuda" or expandable_segments_on(cfg.memory) or not cfg.preflight.enabled:
        return None
    return (
        "memory.expandable_segments=false: over a run's many batch shapes the allocator's cache can fragment past "
        "what the preflight proved (summary/reserved_over_preflight_gib says how far); set it to true to prevent it"
    )


# This process's own CUDA context (about 0.5 GiB) is outside its allocator's reach too: a GPU only this process
# uses shows that much less than its total, which a budget of the whole device (budget.gib=null) must not be
# warned about.
OWN_CONTEXT_BYTES = GIB


def shared_device_warning(reachable_bytes: int, limit_bytes: int, device: str) -> str | None:
    """Where other processes hold so much of the GPU that this one cannot reach the limit its peaks are judged
    against (budget minus margin; `reachable_bytes`: the meter's, this process's cache and the device's free memory):
    the preflight's probes then run out of memory below the budget, which reads as "does not fit" and sizes batches
    smaller than the budget allows (two 70 GiB runs on one 80 GiB card: a largest-batch search found 1 row where 32 fit
    alone, benchmarks/results/budget_batching_pegasus_large_70_seed1_sequential_search_session50_h100.json)."""
    if device != "cuda" or reachable_bytes + OWN_CONTEXT_BYTES >= limit_bytes:
        return None
    return (
        f"this process can take {reachable_bytes / GIB:.1f} GiB of the GPU, less than the {limit_bytes / GIB:.1f} "
        "GiB this run is judged against (budget minus margin): other processes hold the rest, and the preflight "
        "measures what fits beside them (smaller batches, or a failure below the budget); free the GPU or set "
        f"budget.gib<={reachable_bytes // GIB}"
    )


def apply_attention_kernels(memory: DictConfig, device: str) -> None:
    """Whether scaled-dot-product attention may use cuDNN's kernel. cuDNN builds a plan for each new input shape,
    a host-side cost of a step that meets one, and length-grouped batches padded to a multiple of 8 meet dozens of
    shapes an epoch; torch's memory-efficient kernel, which runs instead, has no such cost."""
    if device != "cuda":
        return
    import torch

    torch.backends.cuda.enable_cudnn_sdp(memory.cudnn_attention)


def pin_one_gpu() -> str | None:
    """Leave this process one GPU, the first it may see, unless a distributed launcher started it.

    memfit's budget, preflight and meter are per device, but Trainer spreads a plain process over every GPU it
    sees with DataParallel: the batch is split across them and the outputs gathered on the first, which then
    holds more than the preflight measured, and the steps counted change. Runs under torchrun or accelerate
    (WORLD_SIZE set) own one device per process already. It has to run before CUDA starts. Returns the device
    kept when it narrowed the choice, else None."""
    if "WORLD_SIZE" in os.environ or "LOCAL_RANK" in os.environ:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else None
    if devices is not None and len(devices) <= 1:
        return None
    kept = devices[0] if devices else "0"
    os.environ["CUDA_VISIBLE_DEVICES"] = kept
    return kept


@dataclass(frozen=True)
class BudgetCap:
    budget_bytes: int | None  # what the run must fit in; None = the whole device
    device_bytes: int
    fraction: float | None  # the allocator cap set on CUDA, None when not capped
    enforced: bool  # True when the device itself refuses allocations past the budget
    device: str = "cuda"

    @property
    def held_bytes(self) -> int:
        """What the run must fit in: the budget, else the allocator cap's share of the device, else all of it."""
        return self.budget_bytes or int((self.fraction or 1.0) * self.device_bytes)

    @property
    def judged_against(self) -> str:
        """What the limit is taken from, for people: the budget, or without one the device's memory."""
        if self.budget_bytes is not None:
            return "budget"
        return "the GPU's memory" if self.device == "cuda" else "the host's free memory now"

    @property
    def label(self) -> str:
        if self.budget_bytes is None:
            return "no budget.gib: the whole GPU" if self.device == "cuda" else "no budget.gib: the host's free memory"
        how = "enforced by the CUDA allocator cap" if self.enforced else "checked against measured peaks"
        return f"{self.budget_bytes / GIB:.2f} GiB ({how})"


def apply_budget(cfg: DictConfig, device: str, device_bytes: int) -> BudgetCap:
    """On CUDA, cap the allocator at min(budget, memory_fraction × device) so an over-budget step is a real OOM.

    On CPU the budget applies to host memory: it is compared with the measured peak RSS, not enforced.
    """
    budget = int(cfg.budget.gib * GIB) if cfg.budget.gib is not None else None
    fractions = [cfg.memory.memory_fraction] if cfg.memory.memory_fraction else []
    if cfg.budget.enforce and budget:
        fractions.append(budget / device_bytes)
    if device != "cuda":
        return BudgetCap(budget, device_bytes, None, enforced=False, device=device)
    import torch

    # Always set: the cap is process-wide and outlives a run, so an earlier run's small budget must not stay.
    fraction = min(1.0, *fractions) if fractions else 1.0
    torch.cuda.set_per_process_memory_fraction(fraction)
    if not fractions:
        return BudgetCap(budget, device_bytes, None, enforced=False)
    return BudgetCap(budget or int(fraction * device_bytes), device_bytes, fraction, enforced=True)


def _sampling_kwargs(args_cls: type, group_by_length: bool) -> dict[str, Any]:
    """transformers 5.x renamed group_by_length to train_sampling_strategy; support both spellings."""
    names = {f.name for f in dataclasses.fields(args_cls)}
    if "train_sampling_strategy" in names:
        return {"train_sampling_strategy": "group_by_length" if group_by_length else "random"}
    return {"group_by_length": group_by_length} if "group_by_length" in names else {}


def optimizer_name(optimizer: str, device: str) -> str:
    """Trainer's `optim` for memory.optimizer: AdamW is fused on CUDA (one kernel per step, no foreach temporaries:
    a lower optimizer-step peak, e.g. 8.98 against 10.67 GiB for checkpointed pegasus_large at 8 × 1024 × 64,
    benchmarks/results/step_variants_h200_call2.json, and faster), foreach or per-tensor elsewhere."""
    if optimizer == "adamw" and device == "cuda":
        return "adamw_torch_fused"
    return OPTIMIZER_NAMES[optimizer]


def training_arguments(cfg: DictConfig, device: str, output_dir: str, has_eval: bool) -> Any:
    """HF (Seq2Seq)TrainingArguments from the trainer config and the memory policy's knobs."""
    from transformers import Seq2SeqTrainingArguments, TrainingArguments

    args_cls = Seq2SeqTrainingArguments if cfg.model.task == "seq2seq" else TrainingArguments
    t, mem = cfg.trainer, cfg.memory
    evaluate = has_eval and mem.eval_enabled
    # null eval_steps = once at the end: at max_steps, or per epoch when training by epochs
    eval_steps = t.eval_steps or (t.max_steps if t.max_steps > 0 else None)
    # budget-shaped batches: Trainer takes one optimizer step's samples as one batch, which the collator packs into
    # micro-batches (memfit.data.packing) and the Trainer runs one by one (memfit.training.trainer)
    step = t.batch_size * t.gradient_accumulation_steps
    budget = t.batching == "budget"
    kwargs: dict[str, Any] = dict(
        output_dir=output_dir,
        per_device_train_batch_size=step if budget else t.batch_size,
        per_device_eval_batch_size=mem.eval_batch_size or (step if budget else t.batch_size),
        gradient_accumulation_steps=1 if budget else t.gradient_accumulation_steps,
        learning_rate=t.learning_rate,
        weight_decay=t.weight_decay,
        warmup_steps=t.warmup_steps,
        max_steps=t.max_steps,
        num_train_epochs=t.num_train_epochs,
        logging_steps=t.logging_steps,
        eval_strategy=("steps" if eval_steps else "epoch") if evaluate else "no",
        eval_steps=eval_steps if evaluate else None,
        save_strategy="steps" if t.save_steps else "no",
        save_steps=t.save_steps or 500,
        seed=t.seed,
        bf16=mem.precision == "bf16",
        fp16=mem.precision == "fp16",
        optim=optimizer_name(mem.optimizer, device),
        torch_empty_cache_steps=mem.empty_cache_steps,
        use_cpu=device == "cpu",
        dataloader_num_workers=t.dataloader_num_workers,
        # batches copied from pinned memory without waiting for the copy, so the host goes on launching kernels
        # while the GPU runs (benchmarks/results/budget_batching_qwen2_5_1_5b_24_sync_free_session39_h100.json).
        # Trainer's NaN screen of each micro-batch's loss (a device read) stays: a micro-batch whose labels were all cut
        # has a NaN mean, which it keeps out of the logged loss that NonFiniteLoss judges
        accelerator_config={"non_blocking": device == "cuda"},
        report_to="none",  # memfit owns the MLflow run (memfit.tracking)
        remove_unused_columns=False,  # datasets hold only model inputs; peft wrappers hide forward's signature
        disable_tqdm=bool(os.environ.get("CI")),
    )
    if t.save_model == "best" and evaluate:  # Trainer loads the best checkpoint at the end: that one is saved
        kwargs.update(load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=False)
    kwargs.update(_sampling_kwargs(args_cls, mem.group_by_length))
    if args_cls is Seq2SeqTrainingArguments and t.predict_with_generate:
        from memfit.config import effective_lengths

        kwargs.update(predict_with_generate=True, generation_max_length=effective_lengths(cfg)[1])
    return args_cls(**kwargs)
