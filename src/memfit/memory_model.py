"""Memory of one training step, the analytic part: weights, gradients and optimizer state, from the model's
parameters, their dtypes and which of them train.

This is the part that needs no device: it is exact for what it covers (tests/test_memory_model.py checks it
against a real optimizer step). Activations and logits depend on kernels and the allocator and are to be fitted
from probes on the device (issue 5); they are not estimated here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Optimizer state per trainable parameter, by memory.optimizer. adamw_8bit (bitsandbytes, GPU only) is not modelled
# yet: its block-wise quantization state has not been checked against a real step here.
MODELLED_OPTIMIZERS = ("adamw", "adafactor")


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes that a training step holds whatever the batch: weights, their gradients, the optimizer's state."""

    weights: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def _bytes(tensor: Any) -> int:
    return tensor.numel() * tensor.element_size()


def weight_bytes(model: Any) -> int:
    """Stored bytes of every parameter and buffer (a 4-bit weight is stored packed, two to a byte)."""
    return sum(_bytes(p) for p in model.parameters()) + sum(_bytes(b) for b in model.buffers())


def gradient_bytes(model: Any) -> int:
    """A gradient per trainable parameter, in the parameter's dtype (frozen base weights under LoRA have none)."""
    return sum(_bytes(p) for p in model.parameters() if p.requires_grad)


def _adamw_state(param: Any) -> int:
    # exp_avg and exp_avg_sq in the parameter's dtype, and a float32 step counter per tensor
    return 2 * _bytes(param) + 4


def _adafactor_state(param: Any) -> int:
    # transformers' Adafactor without first moment (beta1=None, as Trainer builds it): a matrix keeps one row and
    # one column of second-moment statistics (factored), a vector keeps a full one, in the gradient's dtype; and a
    # float32 RMS scalar per tensor
    size = param.element_size()
    if param.dim() >= 2:
        rows, cols = param.shape[:-1].numel(), param.shape[:-2].numel() * param.shape[-1]
        return (rows + cols) * size + 4
    return _bytes(param) + 4


def optimizer_state_bytes(model: Any, optimizer: str) -> int:
    """State the optimizer keeps once it has stepped: memory.optimizer adamw or adafactor."""
    per_param = {"adamw": _adamw_state, "adafactor": _adafactor_state}.get(optimizer)
    if per_param is None:
        raise ValueError(f"memory.optimizer={optimizer} is not modelled yet: modelled are {MODELLED_OPTIMIZERS}")
    return sum(per_param(p) for p in model.parameters() if p.requires_grad)


def model_state_bytes(model: Any, optimizer: str) -> ModelStateBytes:
    return ModelStateBytes(weight_bytes(model), gradient_bytes(model), optimizer_state_bytes(model, optimizer))
