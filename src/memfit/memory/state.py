"""Memory of one training step, the analytic part: weights, gradients and optimizer state, from the model's
parameters, their dtypes and which of them train.

This is the part that needs no device: it is exact for what it covers (tests/memory/test_model.py checks it
against a real optimizer step). Activations and logits depend on kernels and the allocator and are fitted from
probes on the device (memory.model, memory.calibration).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Optimizer state per trainable parameter, by memory.optimizer.
MODELLED_OPTIMIZERS = ("adamw", "adafactor", "adamw_8bit")
# bitsandbytes' 8-bit optimizers (0.4x-0.50): parameters below MIN_8BIT_SIZE elements keep float32 state; larger ones
# keep uint8 state with a float32 absmax per block, and every 8-bit state shares two 256-entry float32 code maps.
# Trainer registers every nn.Embedding weight for 32-bit state (transformers' create_optimizer), so those keep float32.
MIN_8BIT_SIZE, BLOCK_8BIT, QMAPS_8BIT = 4096, 256, 2 * 256 * 4


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


def _adamw_8bit_state(param: Any, thirty_two_bit: bool = False) -> int:
    # two moments (bitsandbytes AdamW, optim_bits=8, as Trainer's adamw_bnb_8bit builds it); the step is a Python int
    count = param.numel()
    if thirty_two_bit or count < MIN_8BIT_SIZE:
        return 2 * 4 * count
    return 2 * (count + 4 * math.ceil(count / BLOCK_8BIT))


def _embedding_weights(model: Any) -> set[int]:
    import torch

    return {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}


def optimizer_state_bytes(model: Any, optimizer: str) -> int:
    """State the optimizer keeps once it has stepped: memory.optimizer adamw, adafactor or adamw_8bit."""
    if optimizer not in MODELLED_OPTIMIZERS:
        raise ValueError(f"memory.optimizer={optimizer} is not modelled: modelled are {MODELLED_OPTIMIZERS}")
    trainable = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "adamw":
        return sum(_adamw_state(p) for p in trainable)
    if optimizer == "adafactor":
        return sum(_adafactor_state(p) for p in trainable)
    embeddings = _embedding_weights(model)
    eight_bit = [p for p in trainable if id(p) not in embeddings and p.numel() >= MIN_8BIT_SIZE]
    return sum(_adamw_8bit_state(p, id(p) in embeddings) for p in trainable) + (QMAPS_8BIT if eight_bit else 0)


def model_state_bytes(model: Any, optimizer: str) -> ModelStateBytes:
    return ModelStateBytes(weight_bytes(model), gradient_bytes(model), optimizer_state_bytes(model, optimizer))
