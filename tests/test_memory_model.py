"""The memory model's analytic part: weights, gradients and optimizer state, by hand and against real steps."""

from __future__ import annotations

import pytest
import torch

from memfit.memory_model import model_state_bytes, optimizer_state_bytes

from .conftest import FAST


def _real_step(model: torch.nn.Module, optimizer_name: str, inputs: dict) -> tuple[int, int]:
    """One real optimizer step: (bytes of the gradients, bytes of every tensor in the optimizer's state)."""
    from transformers.optimization import Adafactor

    trainable = [p for p in model.parameters() if p.requires_grad]
    if optimizer_name == "adamw":
        optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    else:  # as Trainer builds optim="adafactor"
        optimizer = Adafactor(trainable, lr=1e-4, scale_parameter=False, relative_step=False)
    loss = model(**inputs).loss if inputs else model(torch.ones(2, 8)).sum()
    loss.backward()
    optimizer.step()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in trainable)
    state = sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)
    )
    return grads, state


def test_two_linear_layers_counted_by_hand():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))  # fp32
    weights = (8 * 16 + 16 + 16 * 4 + 4) * 4  # 848 bytes
    state = model_state_bytes(model, "adamw")
    assert (state.weights, state.gradients) == (weights, weights)
    assert state.optimizer == 2 * weights + 4 * 4  # exp_avg, exp_avg_sq, a float32 step per tensor
    # Adafactor factors each matrix into a row and a column: (16 + 8) + (4 + 16) floats; vectors are kept whole;
    # one RMS float per tensor
    assert optimizer_state_bytes(model, "adafactor") == ((16 + 8) + 16 + (4 + 16) + 4) * 4 + 4 * 4
    assert _real_step(model, "adamw", {}) == (weights, state.optimizer)


@pytest.mark.parametrize(
    ("model", "overrides", "optimizer"),
    [
        ("tiny_seq2seq", [], "adamw"),
        ("tiny_seq2seq", [], "adafactor"),
        ("tiny_seq2seq", ["memory.weights_dtype=bf16"], "adamw"),
        ("tiny_causal", [], "adamw"),  # LoRA: only the adapters have gradients and state
    ],
)
def test_gradients_and_optimizer_state_match_a_real_step(compose_cfg, model, overrides, optimizer):
    from memfit.models import build_model, build_tokenizer

    cfg = compose_cfg(f"model={model}", *FAST, "tracking=none", *overrides)
    built = build_model(cfg, build_tokenizer(cfg.model), "cpu")
    ids = torch.randint(5, 100, (2, 12))
    predicted = model_state_bytes(built.model, optimizer)
    assert predicted.gradients == sum(p.numel() * p.element_size() for p in built.model.parameters() if p.requires_grad)
    assert _real_step(built.model, optimizer, {"input_ids": ids, "labels": ids}) == (
        predicted.gradients,
        predicted.optimizer,
    )


def test_an_optimizer_not_modelled_says_so():
    with pytest.raises(ValueError, match="memory.optimizer=adamw_8bit is not modelled yet"):
        optimizer_state_bytes(torch.nn.Linear(2, 2), "adamw_8bit")
