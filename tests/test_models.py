"""memfit.models: LoRA's frozen base weights are stored in bf16 where the step runs in bf16 (memory.frozen_dtype);
adapters and full fine-tunes keep what memory.weights_dtype says; liger's layer kernels only for the families it
patches (memory.layer_kernels); LoRA's dropout recomputed in the backward pass (memory.recompute_lora_dropout)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from omegaconf import OmegaConf

from memfit import lora_dropout, models
from memfit.memory.savings import dropped_copies
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


LORA_WITH_DROPOUT = (
    "model=tiny_causal",
    "memory=balanced",
    "model.lora.dropout=0.1",
    "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",
)
# adapters whose input another adapter of the layer also reads (q_proj's, gate_proj's): keeping that input once
# instead of a dropped copy per adapter saves at least these adapters' copies
SHARED_INPUT = ("k_proj", "v_proj", "up_proj")


def _step(compose_cfg, caplog, *overrides: str) -> tuple[int, float, dict[str, torch.Tensor], torch.nn.Module]:
    """One forward and backward of the built model: the bytes its autograd graph keeps, the loss and the adapters'
    gradients."""
    cfg = compose_cfg("trainer.device=cpu", *LORA_WITH_DROPOUT, *overrides)
    torch.manual_seed(0)
    with caplog.at_level("INFO"):
        model = build_model(cfg, build_tokenizer(cfg.model), "cpu").model
    model.train()
    ids = torch.randint(0, 1000, (4, 128))
    kept: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    torch.manual_seed(1)  # the same dropout masks in both runs
    autocast = cfg.memory.precision == "bf16"
    with (
        torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
    ):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    return sum(kept.values()), loss.item(), grads, model


@pytest.mark.parametrize(("precision", "copy_bytes", "tolerance"), [("fp32", 4, 1e-6), ("bf16", 2, 2e-2)])
def test_recomputed_lora_dropout_gives_the_same_gradients_and_keeps_less(
    compose_cfg, caplog, precision, copy_bytes, tolerance
):
    kept, loss, grads, model = _step(
        compose_cfg, caplog, f"memory.precision={precision}", "memory.recompute_lora_dropout=false"
    )
    assert "LoRA's dropped inputs are recomputed" not in caplog.text
    kept_recomputed, loss_recomputed, grads_recomputed, recomputing = _step(
        compose_cfg, caplog, f"memory.precision={precision}", "memory.recompute_lora_dropout=true"
    )
    assert (
        "memory.recompute_lora_dropout=true: LoRA's dropped inputs are recomputed in the backward pass" in caplog.text
    )
    assert loss_recomputed == pytest.approx(loss, abs=tolerance)  # the same masks
    assert grads_recomputed.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grads_recomputed[name], grad, rtol=tolerance, atol=tolerance, msg=name)
    tokens = 4 * 128
    copies = sum(
        tokens * module.in_features * copy_bytes
        for name, module in model.named_modules()
        if hasattr(module, "lora_A") and name.endswith(SHARED_INPUT)
    )
    assert kept - kept_recomputed >= copies > 0
    # the preflight's and estimate_only's estimate of the saving promises no more than it saves
    estimated = dropped_copies(model).bytes(4, 128, 128, "causal", precision)
    assert 0 < estimated <= kept - kept_recomputed
    assert dropped_copies(recomputing).bytes(4, 128, 128, "causal", precision) == 0
    # saved adapters keep their names; eval() still reaches the dropout, which then does nothing
    assert recomputing.state_dict().keys() == model.state_dict().keys()
    recomputing.eval()
    assert not any(module.training for module in recomputing.modules())
    with torch.no_grad():
        ids = torch.randint(0, 1000, (2, 16))
        torch.testing.assert_close(recomputing(input_ids=ids).logits, recomputing(input_ids=ids).logits)


def test_recompute_leaves_adapters_without_dropout_alone(compose_cfg, caplog):
    cfg = compose_cfg("trainer.device=cpu", "model=tiny_causal", "memory=balanced")  # tiny_causal: dropout 0
    with caplog.at_level("INFO"):
        model = build_model(cfg, build_tokenizer(cfg.model), "cpu").model
    assert cfg.memory.recompute_lora_dropout and "LoRA's dropped inputs are recomputed" not in caplog.text
    assert lora_dropout.recompute_lora_dropout(model) == 0
