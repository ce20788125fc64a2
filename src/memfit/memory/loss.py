"""The loss knob (memory.loss): cross-entropy over a language-model head without the full logits (`chunked`, and
`fused`, Liger Kernel's fused linear cross-entropy on CUDA).

A head of vocabulary V over N label positions makes logits of N × V: for pegasus_large (V = 96,103) at batch 4 ×
1024 labels that is 1.47 GiB in float32, and the standard loss keeps them (or their log-softmax) until the backward
pass, besides their gradient. Here the head and the loss run together, a chunk of rows at a time: the forward keeps
only each row's log-sum-exp, the backward recomputes one chunk's logits at a time and turns them into the gradients
of the hidden states and of the head's weight and bias. The peak then holds one chunk of logits, not N, for one more
matrix product per chunk. Plain PyTorch, so it runs on every device and every head: a seq2seq decoder's (with T5's
tied-embedding rescaling applied to the hidden states before), a causal LM's, with label smoothing and -100 labels.

`fused` hands the same captured head (hidden states, weight, bias) to liger-kernel's Triton kernel, which computes
the loss and the gradients chunk by chunk in the forward pass. Liger patches only decoder-only model classes; memfit
calls its function on the head directly, so every model memfit builds (Pegasus, BART, T5, Qwen2.5) gets it. CUDA
only (Triton), from the `gpu` extra.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

IGNORE = -100
# float32 logits held per chunk: label positions per chunk = CHUNK_BYTES / (4 × vocabulary), so that any vocabulary
# holds as much (pegasus_large's 96,103 entries: 174 positions; Qwen2.5's 151,936: 110); smaller chunks hold less
# for more, smaller head products
CHUNK_BYTES = 64 * 2**20


def chunked_saving(logits: int) -> int:
    """Bytes memory.loss=chunked holds less than the standard loss, for `logits` bytes of one float32 copy of a
    batch's logits: the standard loss holds them and their log-softmax, then their gradient; the chunked one a
    chunk of them (tiny_seq2seq on CPU, batch 4 × 304 labels: 160 MiB less, batch 16: 1.4 GiB less;
    benchmarks/loss_memory_cpu.py)."""
    return max(2 * logits - 2 * CHUNK_BYTES, 0)


def rows_per_chunk(vocab_size: int) -> int:
    return max(1, CHUNK_BYTES // (4 * vocab_size))


def fused_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """chunked_cross_entropy's result through liger-kernel's fused linear cross-entropy (CUDA): the head's product in
    the hidden states' dtype (as the chunked loss runs it), its gradients accumulated in float32."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    return liger_fused_linear_cross_entropy(
        flat_hidden,
        weight.to(flat_hidden.dtype),
        labels.reshape(-1),
        bias=None if bias is None else bias.to(flat_hidden.dtype),
        ignore_index=IGNORE,
        label_smoothing=label_smoothing,
        accum_dtype=torch.float32,
    ).float()


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One chunk's logits in float32; `weight` already in the hidden states' dtype (as the head runs under autocast)."""
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    return logits.float()  # the loss in float32, as the standard loss upcasts


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        chunk: int,
        smoothing: float,
    ) -> torch.Tensor:
        valid = labels != IGNORE
        count = valid.sum().clamp(min=1)
        total = hidden.new_zeros((), dtype=torch.float32)
        lse_parts = []
        cast = weight.to(hidden.dtype)  # once, not per chunk (no copy where the dtypes agree)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = _chunk_logits(hidden[rows], cast, bias)
            lse = torch.logsumexp(logits, dim=-1)
            lse_parts.append(lse)
            target = labels[rows].clamp(min=0)
            nll = lse - logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)
            if smoothing:
                nll = (1 - smoothing) * nll + smoothing * (lse - logits.mean(dim=-1))
            total = total + (nll * valid[rows]).sum()
        ctx.save_for_backward(hidden, weight, bias, labels, torch.cat(lse_parts), count)
        ctx.chunk, ctx.smoothing = chunk, smoothing
        return total / count

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, weight, bias, labels, lse, count = ctx.saved_tensors
        chunk, smoothing = ctx.chunk, ctx.smoothing
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias = (
            torch.zeros_like(bias, dtype=torch.float32) if bias is not None and ctx.needs_input_grad[2] else None
        )
        scale = grad_output.float() / count
        vocab = weight.shape[0]
        cast = weight.to(hidden.dtype)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = _chunk_logits(hidden[rows], cast, bias)
            grad = torch.exp(logits - lse[rows].unsqueeze(-1))  # softmax, in place of the logits
            del logits
            valid = labels[rows] != IGNORE
            target = labels[rows].clamp(min=0).unsqueeze(-1)
            grad.scatter_add_(-1, target, torch.full_like(target, -(1 - smoothing), dtype=grad.dtype))
            if smoothing:
                grad -= smoothing / vocab
            grad *= (valid * scale).unsqueeze(-1)
            if grad_hidden is not None:
                grad_hidden[rows] = grad.to(hidden.dtype) @ cast
            if grad_weight is not None:
                grad_weight += (grad.t().to(hidden.dtype) @ hidden[rows]).float()
            if grad_bias is not None:
                grad_bias += grad.sum(dim=0)
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
        )


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk: int = 1024,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Mean cross-entropy over the labels that are not -100 of `hidden @ weight.T + bias`, as
    `torch.nn.functional.cross_entropy(logits.float(), labels, label_smoothing=...)` gives it, holding at most
    `chunk` rows of logits at a time. `hidden`: (..., d) hidden states entering the head; `labels`: (...)."""
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    return _ChunkedCrossEntropy.apply(flat_hidden, weight, bias, labels.reshape(-1), int(chunk), float(label_smoothing))


@dataclass
class _Head:
    weight: torch.Tensor
    bias: torch.Tensor | None
    hidden: torch.Tensor | None = None


def _base(model: Any) -> Any:
    """The transformers model under a peft wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@contextlib.contextmanager
def _head_captured(model: Any) -> Iterator[_Head]:
    """While the model runs its forward, its output projection keeps its input (the hidden states entering the head)
    and returns a (..., 1) placeholder instead of the logits; BART/Pegasus's final_logits_bias is held aside too, so
    that nothing of the vocabulary's size is made. Everything is put back after."""
    head, base = model.get_output_embeddings(), _base(model)
    extra = getattr(base, "final_logits_bias", None)  # (1, V), added to the head's output by BART and Pegasus
    bias = head.bias if getattr(head, "bias", None) is not None else None
    if extra is not None:
        bias = extra.reshape(-1) if bias is None else bias + extra.reshape(-1)
    captured = _Head(head.weight, bias)

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        captured.hidden = hidden
        return hidden.new_zeros(()).expand(*hidden.shape[:-1], 1)

    head.forward = forward
    if extra is not None:
        base.final_logits_bias = extra.new_zeros(1, 1)
    try:
        yield captured
    finally:
        del head.forward  # the class's own forward again
        if extra is not None:
            base.final_logits_bias = extra


def model_loss(
    model: Any,
    batch: dict[str, Any],
    task: str,
    label_smoothing: float = 0.0,
    chunk: int | None = None,
    kind: str = "chunked",
) -> Any:
    """The mean loss per label token of a batch (labels -100 left out), computed without the full logits: the model's
    own forward up to its head (autocast, checkpointing and LoRA as configured), then chunked_cross_entropy (or, with
    `kind` "fused", fused_cross_entropy) over the hidden states entering it. A causal LM's labels are its inputs
    shifted by one, as transformers shifts them."""
    labels = batch["labels"]
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    if task == "seq2seq" and "decoder_input_ids" not in inputs:
        inputs["decoder_input_ids"] = _base(model).prepare_decoder_input_ids_from_labels(labels=labels)
    with _head_captured(model) as head:
        model(**inputs)
    hidden = head.hidden
    if task == "causal":
        hidden, labels = hidden[:, :-1], labels[:, 1:]
    if kind == "fused":
        return fused_cross_entropy(hidden, head.weight, labels, head.bias, label_smoothing)
    rows = chunk or rows_per_chunk(head.weight.shape[0])
    return chunked_cross_entropy(hidden, head.weight, labels, head.bias, rows, label_smoothing)
