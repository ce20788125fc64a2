"""The layer-kernels knob (memory.layer_kernels): liger-kernel's Triton kernels for a decoder's RMSNorm and SwiGLU MLP.

A causal LM without gradient checkpointing keeps, per layer, what its norms and MLP save for the backward pass:
the norms' float32 copies of the hidden states, and the MLP's gate and up projections, the gate's SiLU and their
product, each tokens × intermediate size. Liger's RMSNorm keeps only its input and the inverse RMS; its SwiGLU keeps
the two projections and recomputes the SiLU and the product in the backward pass. For qwen2_5_1_5b LoRA at 4 × 2048
that is the largest part of the activations (benchmarks/README.md, step_variants_gpu.py).

Liger patches a model instance's modules in place, and also swaps its family's RMSNorm and MLP classes in the
transformers module, which would change every model of that family built later in the process (a sweep's in-process
trials, the tests); memfit puts those module names back, so only the instance it was given changes. RoPE is left
as transformers has it: Liger's is a module-level function, so it cannot be applied to one instance alone, and it
saves time rather than memory. The loss is memory.loss's concern (memfit.memory.loss), not this knob's.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from typing import Any


def _liger_patchers() -> dict[str, Any]:
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return MODEL_TYPE_TO_APPLY_LIGER_FN


def liger_supports(model_type: str | None) -> bool:
    """Whether liger-kernel is installed and patches this model family (a config's `model_type`)."""
    if model_type is None or importlib.util.find_spec("liger_kernel") is None:
        return False
    return model_type in _liger_patchers()


def apply_liger_layers(model: Any) -> None:
    """Liger's RMSNorm and SwiGLU MLP on this model instance's layers, nothing else: no RoPE, no loss, and the
    family's classes in its transformers module as they were."""
    patch = _liger_patchers()[model.config.model_type]  # memfit.preconditions checked the family before the build
    wanted = {"rope": False, "cross_entropy": False, "fused_linear_cross_entropy": False, "rms_norm": True,
              "swiglu": True, "geglu": True}  # fmt: skip
    accepted = inspect.signature(patch).parameters
    module = sys.modules[type(model).__module__]
    before = dict(vars(module))
    patch(model=model, **{name: value for name, value in wanted.items() if name in accepted})
    for name, value in before.items():
        if vars(module).get(name) is not value:
            setattr(module, name, value)
