"""memory.fused_lora_update: each LoRA adapter's update added to its projection inside the up-projection's GEMM.

peft adds an adapter to its projection as `result + lora_B(lora_A(dropout(x))) * scaling`: beside the two small
matmuls, a product by `scaling` and a sum, each one more kernel that reads and writes the projection's whole output
(tokens × out_features), and the product once more in the backward pass; on a GPU these cost as much time as the
matmuls around them. Here the up-projection is `result.addmm_(h, lora_B.T, alpha=scaling)`: the GEMM scales the
rank-r product and adds it into the projection's output in its epilogue, in place, and in the backward pass addmm
hands its gradient to `result` as it is and scales only the rank-r side. The same sum, three full-size kernels and
temporaries fewer per adapter.

Only the plain case takes that path: one active adapter, unmerged, with no DoRA or other variant, no per-sample
adapter names and no bias on lora_B; any other call runs peft's own forward. The module stays a peft `lora.Linear`
(its class swapped for a subclass with this forward), so saving, merging and unloading are peft's.

Imported by memfit.models when a model is built, never at start-up: torch and peft are imported here at the top.
"""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.lora.layer import Linear as LoraLinear


class FusedUpdateLinear(LoraLinear):
    """A peft LoRA Linear whose adapter's update is added inside its up-projection's GEMM (the module's docstring)."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        adapter = self._plain_adapter(args, kwargs)
        if adapter is None:
            return super().forward(x, *args, **kwargs)
        down, up = self.lora_A[adapter], self.lora_B[adapter]
        autocast = torch.is_autocast_enabled(x.device.type)
        if not autocast and not x.dtype == down.weight.dtype == up.weight.dtype == self.base_layer.weight.dtype:
            return super().forward(x, *args, **kwargs)  # peft's casts decide the dtypes of mixed ones
        rows = x.reshape(-1, x.shape[-1])
        result = self.base_layer(rows)  # 2-D, not a view: the update is added into it in place
        rank_side = down(self.lora_dropout[adapter](rows))
        # in place, so no copy of the projection's output is made to add into; an in-place op takes no autocast:
        # the rank-r side and the up-projection in the output's dtype, as autocast would cast them
        weight = up.weight.to(result.dtype).t()
        result.addmm_(rank_side.to(result.dtype), weight, alpha=self.scaling[adapter])
        return result.view(*x.shape[:-1], result.shape[-1])

    def _plain_adapter(self, args: tuple, kwargs: dict) -> str | None:
        """The one active adapter when this call is the plain case, else None (peft's forward then runs)."""
        if args or kwargs or self.disable_adapters or self.merged:
            return None
        active = self.active_adapters
        if len(active) != 1:
            return None
        adapter = active[0]
        variants = getattr(self, "lora_variant", {})  # DoRA and the like (peft >= 0.17 keeps them here)
        if adapter not in self.lora_A or adapter in variants or self.lora_B[adapter].bias is not None:
            return None
        return adapter


def fuse_lora_updates(model: Any) -> int:
    """Give every plain peft LoRA Linear (an nn.Linear base) the fused update; returns how many changed."""
    changed = 0
    for module in model.modules():
        if type(module) is LoraLinear and type(module.base_layer) is torch.nn.Linear:
            module.__class__ = FusedUpdateLinear
            changed += 1
    return changed
