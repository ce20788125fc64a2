"""memfit.models: LoRA's frozen base weights are stored in bf16 where the step runs in bf16 (memory.frozen_dtype);
adapters and full fine-tunes keep what memory.weights_dtype says."""

from __future__ import annotations

import pytest
import torch

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
