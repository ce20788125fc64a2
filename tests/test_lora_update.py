"""memory.fused_lora_update: LoRA's update added inside the up-projection's GEMM gives peft's sums and gradients."""

from __future__ import annotations

import pytest
import torch
from peft.tuners.lora.layer import Linear as LoraLinear

from memfit import lora_update
from memfit.models import build_model, build_tokenizer
from tests.conftest import draw_lora_up_weights

TARGETS = "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"
ADAPTERS = 7 * 2  # tiny_causal: two layers of seven adapted projections


class CountAddmm(torch.overrides.TorchFunctionMode):
    """How many times addmm (in place or not) was called."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += func in (torch.addmm, torch.Tensor.addmm_)
        return func(*args, **(kwargs or {}))


def _build(compose_cfg, caplog, *overrides: str) -> torch.nn.Module:
    cfg = compose_cfg("trainer.device=cpu", "model=tiny_causal", "memory=balanced", TARGETS, *overrides)
    torch.manual_seed(0)
    with caplog.at_level("INFO"):
        model = build_model(cfg, build_tokenizer(cfg.model), "cpu").model
    draw_lora_up_weights(model)  # after the seeded build: the same draws in both models
    return model.train()


def _step(model: torch.nn.Module, autocast: bool) -> tuple[float, dict[str, torch.Tensor], int]:
    ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(1)  # the same dropout masks in both models
    counter = CountAddmm()
    with counter, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    return loss.item(), grads, counter.calls


@pytest.mark.parametrize(
    ("precision", "dropout", "tolerance"), [("fp32", 0.1, 1e-6), ("fp32", 0.0, 1e-6), ("bf16", 0.1, 2e-2)]
)
def test_the_fused_update_gives_peft_s_loss_and_gradients(compose_cfg, caplog, precision, dropout, tolerance):
    overrides = (f"memory.precision={precision}", f"model.lora.dropout={dropout}")
    peft_model = _build(compose_cfg, caplog, *overrides, "memory.fused_lora_update=false")
    assert "fused_lora_update" not in caplog.text
    fused_model = _build(compose_cfg, caplog, *overrides, "memory.fused_lora_update=true")
    assert f"memory.fused_lora_update=true: {ADAPTERS} LoRA updates added inside" in caplog.text

    loss, grads, _ = _step(peft_model, precision == "bf16")
    fused_loss, fused_grads, addmm_calls = _step(fused_model, precision == "bf16")
    assert addmm_calls >= ADAPTERS  # every adapter took the fused path
    assert fused_loss == pytest.approx(loss, abs=tolerance)
    assert fused_grads.keys() == grads.keys() and any("lora_A" in name for name in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=tolerance, atol=tolerance, msg=name)
    assert fused_model.state_dict().keys() == peft_model.state_dict().keys()  # saved adapters keep their names


def test_disabled_and_merged_adapters_run_peft_s_forward(compose_cfg, caplog):
    model = _build(compose_cfg, caplog, "memory.precision=fp32").eval()
    assert sum(isinstance(m, lora_update.FusedUpdateLinear) for m in model.modules()) == ADAPTERS
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        fused = model(input_ids=ids).logits
        with model.disable_adapter(), CountAddmm() as counter:
            base = model(input_ids=ids).logits
        assert counter.calls == 0 and not torch.allclose(base, fused)
        model.merge_adapter()
        with CountAddmm() as counter:
            merged = model(input_ids=ids).logits
        assert counter.calls == 0
        torch.testing.assert_close(merged, fused, rtol=1e-5, atol=1e-5)


def test_only_plain_linear_adapters_are_swapped():
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert lora_update.fuse_lora_updates(layer) == 0
    assert all(type(m) is not LoraLinear for m in layer.modules())
