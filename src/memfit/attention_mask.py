"""memory.shared_attention_mask: one attention mask per forward pass, kept once for the backward pass.

transformers hands scaled-dot-product attention a boolean (batch, 1, queries, keys) mask wherever a batch is padded
(the worst batch always is). torch turns a boolean mask into an additive one in the query's dtype inside every
attention call, and the memory-efficient kernel keeps that copy for its backward pass: each layer keeps its own
batch × queries × keys tensor. On CPU the test suite counts them (one float copy per layer); on a GPU the memory
model's fit for qwen2_5_0_5b and qwen2_5_1_5b found 48 and 57 bytes per batch × length²
(benchmarks/results/memory_model_run14_chunked.json): two bytes, one bf16 copy, for each of their 24 and 28 layers.

Here the model's attention implementation is transformers' own SDPA under another name, whose mask function makes the
additive mask once, in the dtype the queries will have (autocast's where it is on), with its rows padded to 16
elements as the memory-efficient kernel wants them aligned: every layer reads, and autograd keeps, that one tensor.
The attention itself is the same call; where a batch needs no mask (no padding, causal) none is made, as before.

Imported by memfit.models when a model is built, never at start-up.
"""

from __future__ import annotations

from typing import Any

import torch

NAME = "memfit_sdpa"
# the memory-efficient kernel copies (pads) a bias whose strides are not multiples of this, once per call
ALIGN = 16


def _additive_mask(*args: Any, dtype: torch.dtype = torch.float32, **kwargs: Any) -> torch.Tensor | None:
    """transformers' SDPA mask, made additive (0 where attended, the dtype's minimum elsewhere) once, in the
    queries' dtype, over storage whose rows are padded to ALIGN; None where SDPA needs no mask."""
    from transformers.masking_utils import sdpa_mask

    mask = sdpa_mask(*args, **kwargs)
    if mask is None or mask.dtype != torch.bool:
        return mask
    device = mask.device.type
    target = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else dtype
    keys = mask.shape[-1]
    storage = torch.zeros((*mask.shape[:-1], -(-keys // ALIGN) * ALIGN), dtype=target, device=mask.device)
    additive = storage[..., :keys]
    return additive.masked_fill_(~mask, torch.finfo(target).min)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, sdpa_attention_forward)
    AttentionMaskInterface.register(NAME, _additive_mask)


def share_attention_mask(model: Any) -> bool:
    """Give `model` (a transformers model on SDPA attention) the one-mask-per-forward attention; False where its
    attention is another (eager, T5's position biases, flash), which is left alone."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    _register()
    model.set_attn_implementation(NAME)
    return True
