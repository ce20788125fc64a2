"""The loss knob (memory.loss): cross-entropy over a language-model head without the full logits (`chunked`, and
`fused`, Liger Kernel's fused linear cross-entropy on CUDA).

A head of vocabulary V over N label positions makes logits of N × V: for pegasus_large (V = 96,103) at batch 4 ×
1024 labels that is 1.47 GiB in float32, and the standard loss keeps them (or their log-softmax) until the backward
pass, besides their gradient. Here the head, the loss and their gradients run together in the forward pass, a chunk
of rows at a time, as liger-kernel's kernel does: the peak holds one chunk of logits, not N, for as many products
as the standard head's forward and backward, in the dtype autocast gives the head. Plain PyTorch, so it runs on
every device and every head: a seq2seq decoder's (with T5's tied-embedding rescaling applied to the hidden states
before), a causal LM's, with label smoothing and -100 labels.

`fused` hands the same captured head (hidden states, weight, bias) to liger-kernel's Triton kernel. Liger patches only
decoder-only model classes; memfit calls its function on the head directly, so every model memfit builds (Pegasus,
BART, T5, Qwen2.5) gets it. CUDA only (Triton), from the `gpu` extra.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

IGNORE = -100
# float32 log-probabilities held per chunk: label positions per chunk = CHUNK_BYTES / (4 × vocabulary), so that any
# vocabulary holds about as much; smaller chunks hold less, for more, smaller head products
CHUNK_BYTES = 64 * 2**20
# but never fewer rows than this: below it the products are too small to keep the GPU busy and each chunk's fixed work
# (the head weight's gradient added up, the kernels launched) dominates. The loss alone
# (benchmarks/results/loss_kernels_h200.json): pegasus_large's head over 4,096 rows 25.5 ms at 174 rows a chunk, 12.8 at
# 512; Qwen2.5's over 8,188 rows 52.4 ms at 110, 24.4 at 512 (the standard loss: 26.9 and 25.3)
MIN_CHUNK_ROWS = 512


def rows_per_chunk(vocab_size: int) -> int:
    return max(MIN_CHUNK_ROWS, CHUNK_BYTES // (4 * vocab_size))


def chunked_saving(logits: int, vocab_size: int) -> int:
    """Bytes memory.loss=chunked holds less than the standard loss, for `logits` bytes of one float32 copy of a
    batch's logits over a vocabulary of `vocab_size`: the standard loss holds them and their log-softmax, then their
    gradient; the chunked one a chunk of them, twice (tiny_seq2seq on CPU, batch 4 × 304 labels: 160 MiB less,
    batch 16: 1.4 GiB less; benchmarks/loss_memory_cpu.py)."""
    chunk = min(logits, 4 * vocab_size * rows_per_chunk(vocab_size))
    return max(2 * logits - 2 * chunk, 0)


def fused_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """chunked_cross_entropy's result through liger-kernel's fused linear cross-entropy (CUDA): the head's product in
    `dtype` (as the chunked loss runs it), its gradients accumulated in float32."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    flat_hidden = hidden.reshape(-1, hidden.shape[-1]).to(dtype or _compute_dtype(hidden))
    return liger_fused_linear_cross_entropy(
        flat_hidden,
        weight.to(flat_hidden.dtype),
        labels.reshape(-1),
        bias=None if bias is None else bias.to(flat_hidden.dtype),
        ignore_index=IGNORE,
        label_smoothing=label_smoothing,
        accum_dtype=torch.float32,
    ).float()


# the head's rows are padded to a multiple of this: a vocabulary such as pegasus_large's (96,103, odd) otherwise
# leaves every product over it on cuBLAS's slow unaligned kernels
VOCAB_ALIGN = 64


@dataclass
class _AlignedHead:
    """The head as the chunks multiply it: its weight in the compute dtype with its rows padded to VOCAB_ALIGN (the
    weight itself where nothing changes), and a bias (added in the product, in the compute dtype, as the standard
    head adds it) that is -inf on the padding, so that padded columns take no probability and get no gradient."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    vocab: int


def _aligned_head(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> _AlignedHead:
    vocab = weight.shape[0]
    padded = -(-vocab // VOCAB_ALIGN) * VOCAB_ALIGN
    if padded == vocab:
        return _AlignedHead(weight.to(dtype), None if bias is None else bias.to(dtype), vocab)
    aligned = weight.new_zeros((padded, weight.shape[1]), dtype=dtype)
    aligned[:vocab] = weight
    full_bias = torch.full((padded,), float("-inf"), device=weight.device, dtype=dtype)
    full_bias[:vocab] = 0.0 if bias is None else bias
    return _AlignedHead(aligned, full_bias, vocab)


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the head's products run in: autocast's where it is on (the standard head runs there too, in the
    forward and the backward pass alike), else the hidden states' own."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Loss and gradients together, a chunk of rows at a time, in the forward pass (as liger-kernel's fused linear
    cross-entropy does): three products per chunk, as many as the standard head's forward and backward, and no
    logits kept. The backward pass only scales the kept gradients by the loss's own gradient.

    A chunk's logits come out of the product in the compute dtype and pass through few full-size steps (a float32
    log-softmax, and its exponent written back in the compute dtype as the softmax the gradients need): at Qwen2.5's
    vocabulary each such pass over a batch's logits is gigabytes. The 1 / token count that makes the loss a mean is
    one number for every row, so it is applied once, in the backward pass, with the loss's own gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        chunk: int,
        smoothing: float,
        dtype: torch.dtype,
        grads: tuple[bool, bool, bool],
    ) -> torch.Tensor:
        head = _aligned_head(weight, bias, dtype)
        want_hidden, want_weight, want_bias = grads
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(head.weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(head.weight.shape[0], device=weight.device) if want_bias else None
        valid = labels != IGNORE
        count = valid.sum().clamp(min=1)
        total = hidden.new_zeros((), dtype=torch.float32)
        with torch.autocast(hidden.device.type, enabled=False):  # the dtypes are chosen here, as autocast would
            for start in range(0, hidden.shape[0], chunk):
                rows = slice(start, start + chunk)
                x, keep = hidden[rows].to(dtype), valid[rows].unsqueeze(-1)
                logits = x @ head.weight.t() if head.bias is None else torch.addmm(head.bias, x, head.weight.t())
                logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # the loss in float32, as standard
                del logits
                target = labels[rows].clamp(min=0).unsqueeze(-1)
                target_logp = logp.gather(-1, target)
                nll = -target_logp
                if smoothing:
                    nll = (1 - smoothing) * nll - smoothing * logp[:, : head.vocab].mean(dim=-1, keepdim=True)
                total += torch.where(valid[rows], nll.squeeze(-1), 0.0).sum()  # no boolean index: no device read
                if not any(grads):
                    continue
                grad = torch.exp(logp, out=torch.empty(logp.shape, dtype=dtype, device=logp.device))  # softmax
                if smoothing:
                    del grad  # the smoothing's share goes on the float32 softmax, before its one rounding
                    grad = logp.exp_()
                    grad[:, : head.vocab] -= smoothing / head.vocab
                    grad.scatter_add_(-1, target, torch.full_like(target_logp, smoothing - 1))
                    grad = grad.to(dtype)
                else:  # the target's entry, p - 1, from float32, not from p already rounded
                    grad.scatter_(-1, target, (target_logp.exp() - 1).to(dtype))
                del logp
                if grad_bias is not None:
                    grad_bias += (keep.t().to(dtype) @ grad).float().squeeze(0)
                if grad_hidden is not None:
                    grad_hidden[rows] = (grad @ head.weight) * keep
                if grad_weight is not None:
                    grad_weight += grad.t() @ (x * keep)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias, count)
        ctx.vocab, ctx.dtypes = head.vocab, (weight.dtype, None if bias is None else bias.dtype)
        return total / count

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        if getattr(ctx, "spent", False):
            raise RuntimeError("memory.loss=chunked computes its gradients once: a second backward is not supported")
        ctx.spent = True
        grad_hidden, grad_weight, grad_bias, count = ctx.saved_tensors
        scale = grad_output.float() / count
        weight_dtype, bias_dtype = ctx.dtypes
        # scaled in place: the kept gradients are this pass's alone, and a second copy of a head-sized one would
        # raise the backward pass's first, highest moment
        return (
            None if grad_hidden is None else grad_hidden.mul_(scale.to(grad_hidden.dtype)),
            None if grad_weight is None else grad_weight[: ctx.vocab].mul_(scale).to(weight_dtype),
            None if grad_bias is None else grad_bias[: ctx.vocab].mul_(scale).to(bias_dtype),
            None,
            None,
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
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Mean cross-entropy over the labels that are not -100 of `hidden @ weight.T + bias`, as
    `torch.nn.functional.cross_entropy(logits.float(), labels, label_smoothing=...)` gives it, holding at most
    `chunk` rows of logits at a time. `hidden`: (..., d) hidden states entering the head; `labels`: (...);
    `dtype`: what the head's products run in (default: autocast's where it is on here, else the hidden states')."""
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    grad = torch.is_grad_enabled()
    grads = tuple(grad and t is not None and t.requires_grad for t in (hidden, weight, bias))
    return _ChunkedCrossEntropy.apply(
        flat_hidden,
        weight,
        bias,
        labels.reshape(-1),
        int(chunk),
        float(label_smoothing),
        dtype or _compute_dtype(hidden),
        grads,
    )


@dataclass
class _Head:
    weight: torch.Tensor
    bias: torch.Tensor | None
    hidden: torch.Tensor | None = None
    dtype: torch.dtype | None = None  # what the head would have run in: autocast's, inside the model's forward


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
        captured.hidden, captured.dtype = hidden, _compute_dtype(hidden)
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


def label_rows(
    hidden: torch.Tensor, labels: torch.Tensor, task: str, positions: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden states and labels of the positions that have a label: a causal LM's labels shifted by one, as
    transformers shifts them, and every -100 position left out, so the head runs over labels only. A causal LM's
    prompt (its labels are -100) is most of its positions on summarisation data: the standard head makes logits for
    all of them, at Qwen2.5's vocabulary 1.2 MB of float32 a position. Padding goes too. A batch without labels keeps
    its rows (its loss is 0 either way).

    `positions`: how many labels there are, where the host knows it (memfit.data.collate.loss_positions). Then the
    rows are picked without the device telling the host how many there are: that read is a synchronisation, which
    stalls the host's launching of the backward pass until the GPU has finished the forward."""
    if task == "causal":  # each position's target is the next label: the last position has none
        targets = torch.full_like(labels, IGNORE)
        targets[:, :-1] = labels[:, 1:]
        labels = targets
    labelled = (labels != IGNORE).reshape(-1)
    if positions is None:
        positions = int(labelled.sum())
    if positions == 0:
        return hidden, labels
    rows = torch.nonzero_static(labelled, size=positions).squeeze(1)
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows), labels.reshape(-1).index_select(0, rows)


def model_loss(
    model: Any,
    batch: dict[str, Any],
    task: str,
    label_smoothing: float = 0.0,
    chunk: int | None = None,
    kind: str = "chunked",
    positions: int | None = None,
) -> Any:
    """The mean loss per label token of a batch (labels -100 left out), computed without the full logits: the model's
    own forward up to its head (autocast, checkpointing and LoRA as configured), then chunked_cross_entropy (or, with
    `kind` "fused", fused_cross_entropy) over the hidden states entering it at the positions that have a label
    (label_rows)."""
    labels = batch["labels"]
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    if task == "seq2seq" and "decoder_input_ids" not in inputs:
        inputs["decoder_input_ids"] = _base(model).prepare_decoder_input_ids_from_labels(labels=labels)
    with _head_captured(model) as head:
        model(**inputs)
    hidden, labels = label_rows(head.hidden, labels, task, positions)
    if kind == "fused":
        return fused_cross_entropy(hidden, head.weight, labels, head.bias, label_smoothing, head.dtype)
    rows = chunk or rows_per_chunk(head.weight.shape[0])
    return chunked_cross_entropy(hidden, head.weight, labels, head.bias, rows, label_smoothing, head.dtype)
