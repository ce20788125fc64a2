"""memory.recompute_lora_dropout: LoRA's dropout without a dropped copy of each adapted projection's input.

peft computes `lora_B(lora_A(dropout(x)))` beside each adapted projection. For the backward pass that keeps, per
adapter, dropout's mask and the dropped copy of x that lora_A's weight gradient needs, and under autocast a cast of
it too: the adapters of one layer's q, k, v, gate and up projections read the same x, yet each keeps a copy of its
own. Here an adapter's down-projection keeps x itself (one tensor, shared by every adapter that reads it) and the
one-byte mask, and recomputes the dropped input from the two in the backward pass: one elementwise product more
per adapter. The mask is drawn as torch's dropout draws it (native_dropout), so a seeded step gives the same
gradients. The adapter's weight and its state-dict name are unchanged (the module stays an nn.Linear, its class
swapped for one with this forward), and the dropout module moves under it, so train() and eval() still reach it.

Imported by memfit.models when a model is built, never at start-up: torch is imported here at the top.
"""

from __future__ import annotations

from typing import Any

import torch


class _DroppedProjection(torch.autograd.Function):
    """linear(dropout(x), weight), keeping x and the mask for the backward pass instead of the dropped x."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, p: float) -> torch.Tensor:
        autocast = torch.is_autocast_enabled(x.device.type)
        dropped, mask = torch.native_dropout(x if autocast else x.to(weight.dtype), p, True)
        ctx.save_for_backward(x, mask, weight)
        ctx.scale = 1.0 / (1.0 - p)
        return torch.nn.functional.linear(dropped, weight)  # under autocast as nn.Linear would run

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, mask, weight = ctx.saved_tensors
        dtype = grad.dtype  # the product's dtype: autocast's, else the weight's
        grad_x = grad_weight = None
        # native_dropout_backward: the product by the mask and the scale in one kernel, not two
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.aten.native_dropout_backward(grad @ weight.to(dtype), mask, ctx.scale)
            grad_x = grad_x.to(x.dtype)
        if ctx.needs_input_grad[1]:
            dropped = torch.ops.aten.native_dropout_backward(x.to(dtype), mask, ctx.scale)
            grad_weight = (grad.reshape(-1, grad.shape[-1]).T @ dropped.reshape(-1, x.shape[-1])).to(weight.dtype)
        return grad_x, grad_weight, None


class DroppedDownProjection(torch.nn.Linear):
    """A LoRA down-projection (lora_A) that applies its adapter's dropout itself (see the module's docstring)."""

    dropout: torch.nn.Dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout.training and self.dropout.p > 0 and torch.is_grad_enabled():
            return _DroppedProjection.apply(x, self.weight, self.dropout.p)
        return super().forward(self.dropout(x.to(self.weight.dtype)))


def recompute_lora_dropout(model: Any) -> int:
    """Give every LoRA adapter with a real dropout (p > 0) a down-projection that keeps its input and mask instead
    of the dropped input; returns how many adapters changed."""
    changed = 0
    for layer in model.modules():
        dropouts = getattr(layer, "lora_dropout", None)
        if not isinstance(dropouts, torch.nn.ModuleDict):
            continue
        for name, dropout in list(dropouts.items()):
            down = layer.lora_A[name] if name in layer.lora_A else None  # noqa: SIM401 - a ModuleDict has no get
            if not isinstance(dropout, torch.nn.Dropout) or type(down) is not torch.nn.Linear or down.bias is not None:
                continue
            down.__class__ = DroppedDownProjection
            down.dropout = dropout
            dropouts[name] = torch.nn.Identity()
            layer.cast_input_dtype_enabled = False  # x reaches lora_A as it is, so the adapters share it
            changed += 1
    return changed
