"""memfit.models: LoRA's frozen base weights are stored in bf16 where the step runs in bf16 (memory.frozen_dtype);
adapters and full fine-tunes keep what memory.weights_dtype says; liger's layer kernels only for the families it
patches (memory.layer_kernels)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from omegaconf import OmegaConf

from memfit import models
from memfit.memory.state import weight_bytes
from memfit.models import build_model, build_tokenizer


def _dtypes(compose_cfg, *overrides: str) -> tuple[set, set, int]:
    cfg = compose_cfg("trainer.device=cpu", *overrides)
    model = build_model(cfg, build_tokenizer(cfg.model), "cpu").model
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    trained = {p.dtype for p in model.parameters() if p.requires_grad}
    return frozen, trained, weight_bytes(model)


def test_lora_base_weights_are_bf16_under_bf16_autocast_and_the_adapters_stay_fp32(compose_cfg, caplog):
    with caplog.at_level("INFO"):
        frozen, trained, stored = _dtypes(compose_cfg, "model=tiny_causal", "memory=balanced")
    assert frozen == {torch.bfloat16} and trained == {torch.float32}
    assert "LoRA base weights stored in bf16 (memory.frozen_dtype=auto)" in caplog.text  # the run says which
    _, _, fp32_stored = _dtypes(compose_cfg, "model=tiny_causal", "memory=off")
    assert stored < 0.6 * fp32_stored  # half the bytes for the frozen base, the small adapters in fp32


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["model=tiny_causal", "memory=off"], torch.float32),  # off keeps every weight in fp32
        (["model=tiny_causal", "memory.precision=fp32"], torch.float32),  # no bf16 step: nothing gained
        (["model=tiny_causal", "memory.precision=fp32", "memory.frozen_dtype=bf16"], torch.bfloat16),  # as asked
        (["model=tiny_seq2seq", "memory=balanced"], torch.float32),  # a full fine-tune keeps weights_dtype
    ],
)
def test_frozen_dtype_applies_to_lora_bases_only(compose_cfg, overrides, expected):
    frozen, trained, _ = _dtypes(compose_cfg, *overrides)
    assert (frozen or trained) == {expected}


def _liger_installed_with_table(monkeypatch, installed: bool = True) -> None:
    """liger-kernel (Triton) is not installed on a CPU machine: its family table, as its monkey_patch module keys it."""
    real = importlib.util.find_spec

    def find_spec(name, *args):
        if name == "liger_kernel":
            return object() if installed else None
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(models, "_liger_patchers", lambda: {"qwen2": None, "llama": None})


def test_liger_layers_on_a_family_liger_lacks_is_one_line_naming_the_model_and_the_fix(monkeypatch):
    _liger_installed_with_table(monkeypatch)
    assert models.check_layer_kernels("liger", "pegasus_large", "pegasus") == [
        "memory.layer_kernels=liger: liger-kernel has no kernels for pegasus_large (model_type pegasus): "
        "use memory.layer_kernels=standard or auto"
    ]
    assert models.check_layer_kernels("liger", "qwen2_5_1_5b", "qwen2") == []
    assert models.check_layer_kernels("standard", "pegasus_large", "pegasus") == []


def test_without_liger_installed_the_check_leaves_the_package_error_to_validation():
    if importlib.util.find_spec("liger_kernel") is not None:
        pytest.skip("liger-kernel is installed here")
    assert models.check_layer_kernels("liger", "pegasus_large", "pegasus") == []


@pytest.mark.parametrize(
    ("model_type", "device", "liger_installed", "expected"),
    [
        ("qwen2", "cuda", True, "liger"),  # a family liger-kernel patches
        ("pegasus", "cuda", True, "standard"),  # no liger kernels for it
        ("qwen2", "cuda", False, "standard"),  # no gpu extra
        ("qwen2", "cpu", True, "standard"),  # Triton: CUDA only
        (None, "cuda", True, "standard"),  # a family memfit cannot tell before the build
    ],
)
def test_auto_layer_kernels_are_liger_only_where_liger_patches_the_family_on_cuda(
    monkeypatch, model_type, device, liger_installed, expected
):
    _liger_installed_with_table(monkeypatch, liger_installed)
    memory = OmegaConf.create({"layer_kernels": "auto"})
    assert models.resolve_layer_kernels(memory, model_type, device) == expected
    assert memory.layer_kernels == expected
    assert models.resolve_layer_kernels(OmegaConf.create({"layer_kernels": "liger"}), "qwen2", "cpu") is None
