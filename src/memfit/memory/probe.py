"""A probe: a batch of exactly one padded shape through forward, backward and the run's real optimizer step
(twice, so the optimizer's state exists), measured by the meter. The preflight and the memory model's calibration
both measure through it. It leaves the model's weights, the RNG state and the Trainer's optimizer as they were.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from memfit.config import GIB
from memfit.data.audit import BatchShape
from memfit.memory.meter import MemoryPeak


@dataclass
class Probe:
    """One measured attempt at a batch shape."""

    shape: BatchShape
    phase: str  # train | eval
    peak: MemoryPeak | None  # None when it ran out of memory
    static_bytes: int = 0  # allocated after the steps: weights + optimizer state
    attempted_bytes: int | None = None  # on OOM: what was in use plus what it tried to allocate
    predicted_bytes: int | None = None  # on OOM, with a calibrated memory model: the peak reserved it predicts
    not_run: str | None = None  # a shape not probed, and why (on CPU: expected past the budget, memfit.run.worst_case)
    seconds: float = 0.0
    # training probes: the peak of forward + backward and the peak of the optimizer's step, apart (the memory model
    # fits the first over shapes; the second does not depend on the shape)
    backward_peak: MemoryPeak | None = None
    step_peak: MemoryPeak | None = None
    # training probes: each optimizer step's wall seconds, the device synchronised (the first meets a new shape)
    step_seconds: tuple[float, ...] = ()
    # with ProbeSetup.split_branches: the peak of each of _BranchMarker.WINDOWS (the stacks' forwards, the backward
    # through the logits, the decoder and the encoder)
    branch_peaks: dict[str, MemoryPeak] | None = None

    @property
    def oom(self) -> bool:
        return self.peak is None

    @property
    def judged_bytes(self) -> int:
        """Reserved memory is what the device must hold; on OOM, what was attempted."""
        return self.peak.reserved if self.peak else (self.attempted_bytes or 0)


_TRIED = re.compile(r"Tried to allocate ([\d.]+) (GiB|MiB|KiB)")


def _attempted_bytes(err: BaseException, in_use: int) -> int | None:
    match = _TRIED.search(str(err))
    if not match:
        return None
    scale = {"GiB": GIB, "MiB": 1024**2, "KiB": 1024}[match.group(2)]
    return in_use + int(float(match.group(1)) * scale)


def make_batch(shape: BatchShape, collator: Any, task: str, vocab_size: int, device: str) -> dict[str, Any]:
    """A batch of exactly `shape`, padded by the run's own collator, of ordinary (non-special) token ids.

    Its last input row is one token short wherever the collator pads it back to `shape`, so the batch carries a
    padding mask, as real batches of rows of unequal length do. Attention over a padding mask is another path than
    over none (an explicit 4-D mask, and SDPA's kernels that take one), and it holds more memory: the padded
    probe measured 0.15-0.63 GiB more than one of equal rows (pegasus_large, qwen2_5_1_5b;
    benchmarks/results/preflight_padding_mask.json). Where the collator would not pad the short row back (one row, no
    pad multiple), real batches of that shape carry no padding either, and every row is full.
    """
    padded = _collate(shape, collator, task, vocab_size, short_last=True)
    if padded["input_ids"].shape[1] != shape.source:
        padded = _collate(shape, collator, task, vocab_size, short_last=False)
    return {k: v.to(device) for k, v in padded.items()}


def _collate(shape: BatchShape, collator: Any, task: str, vocab_size: int, short_last: bool) -> dict[str, Any]:
    rng = np.random.default_rng(0)  # its own generator: the global RNG state is not touched
    low = min(1000, vocab_size // 2)

    def ids(n: int) -> list[int]:
        return rng.integers(low, vocab_size, size=n).tolist()

    features = []
    for row in range(shape.batch):
        length = shape.source - 1 if short_last and row == shape.batch - 1 and shape.source > 1 else shape.source
        source = ids(length)
        labels = list(source) if task == "causal" else ids(shape.label)
        features.append({"input_ids": source, "attention_mask": [1] * length, "labels": labels})
    return collator(features)


class _Preserved:
    """Trainable weights and RNG state copied to the host before probing, restored bit for bit after."""

    def __init__(self, model: Any):
        import torch

        self.model = model
        self.weights = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad}
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        self.training = model.training

    def restore(self) -> None:
        import torch

        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if name in self.weights:
                    param.copy_(self.weights[name])
                param.grad = None
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        self.model.train(self.training)


# The step knobs Trainer applies (Knob.applied_by "trainer", Knob.step), and the Trainer's own piece through which
# the probe applies each (memfit.run.worst_case.probe_setup builds them from the run's Trainer), so that nothing is
# written twice. A new such knob must reach the probe through one of them, or the preflight would not measure it
# (a test compares this with the schema).
APPLIED_AS_TRAINER = {
    "precision": "the Trainer's accelerator wraps the model's forward (ProbeSetup.forward_as_trained)",
    "optimizer": "the run's own optimizer, built by trainer.create_optimizer (ProbeSetup.make_optimizer)",
    "loss": "the Trainer's own compute_loss (ProbeSetup.compute_loss), memory.loss included",
}


def _own_loss(model: Any, batch: dict[str, Any]) -> Any:
    return model(**batch).loss


@dataclass
class ProbeSetup:
    model: Any
    make_optimizer: Callable[[], Any]
    collator: Any
    meter: Any
    device: str
    task: str
    vocab_size: int
    steps: int = 2
    accumulation: int = 1  # gradient accumulation: with it, a forward runs while the last micro-batch's grads exist
    generate: bool = False  # evaluation generates (predict_with_generate): probe generation of the full label length
    split_branches: bool = False  # also measure the six windows of _BranchMarker apart (T5 under checkpointing)
    # the model's forward as training runs it (mixed precision), for the probe's duration; nothing in fp32
    forward_as_trained: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    # (model, batch) -> the loss training computes (the Trainer's compute_loss); the model's own loss by default
    compute_loss: Callable[[Any, dict[str, Any]], Any] = _own_loss


class _BranchMarker:
    """Splits a seq2seq step's forward + backward into six windows, in the order they run: the encoder's forward;
    the decoder's; the head's (logits and loss); the backward through the head (until the gradient reaches the
    decoder's output); through the decoder (until it reaches the encoder's output); through the encoder. Hooks on
    the two stacks' outputs mark those moments; the marker only reads and resets the meter's window. (Under
    checkpointing each window peaks on its own transients, one layer's attention or the logits, over what the step
    keeps; read together they would mix a sum with a maximum.)"""

    WINDOWS = (
        "encoder_forward",
        "decoder_forward",
        "head_forward",
        "head_backward",
        "decoder_backward",
        "encoder_backward",
    )

    def __init__(self, model: Any, meter: Any):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.meter = meter
        self.peaks = {window: MemoryPeak(0, 0) for window in self.WINDOWS}
        self.backwards = self.reached = 0  # backward passes, and those in which the gradient reached the encoder
        self._reached_now = False
        self._handles = [
            base.get_encoder().register_forward_hook(self._on_encoder_output),
            base.get_decoder().register_forward_hook(self._on_decoder_output),
        ]

    def _close(self, window: str) -> None:
        """Ends `window`, the one open, and opens the next."""
        self.peaks[window] = self.peaks[window].max(self.meter.window_peak())
        self.meter.reset_window()

    def _on_encoder_output(self, module: Any, args: Any, output: Any) -> None:
        self._close("encoder_forward")
        hidden = output[0]
        if hidden.requires_grad:
            hidden.register_hook(self._on_encoder_gradient)

    def _on_decoder_output(self, module: Any, args: Any, output: Any) -> None:
        self._close("decoder_forward")
        hidden = output[0]
        if hidden.requires_grad:
            hidden.register_hook(lambda grad: self._close("head_backward"))

    def _on_encoder_gradient(self, grad: Any) -> None:
        self._close("decoder_backward")
        self._reached_now = True

    def forward_done(self) -> None:
        self._close("head_forward")

    def backward_done(self) -> MemoryPeak:
        """Closes this backward's last window; the peak over every window so far."""
        self._close("encoder_backward" if self._reached_now else "decoder_backward")
        self.backwards += 1
        self.reached += self._reached_now
        self._reached_now = False
        return functools.reduce(MemoryPeak.max, self.peaks.values())

    def close(self) -> dict[str, MemoryPeak] | None:
        for handle in self._handles:
            handle.remove()
        return self.peaks if self.backwards and self.reached == self.backwards else None


def _synchronize(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def _train_steps(setup: ProbeSetup, shape: BatchShape, batch: dict[str, Any], optimizer: Any, marker: Any) -> Probe:
    """`setup.steps` optimizer steps on the batch, each over two micro-batches when training accumulates gradients
    (so a forward runs while gradients are held); the forward + backward peak and the optimizer step's apart."""
    backward = step = MemoryPeak(0, 0)
    start = time.perf_counter()
    step_seconds = []
    for _ in range(setup.steps):
        began = time.perf_counter()
        setup.meter.reset_window()
        for _ in range(min(setup.accumulation, 2)):  # the second micro-batch runs on top of held grads
            loss = setup.compute_loss(setup.model, dict(batch))  # a copy: Trainer's may pop the labels from it
            if marker is not None:
                marker.forward_done()
            loss.backward()
            del loss
            if marker is not None:
                backward = backward.max(marker.backward_done())
        backward = backward.max(setup.meter.window_peak())
        setup.meter.reset_window()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step = step.max(setup.meter.window_peak())
        _synchronize(setup.device)
        step_seconds.append(time.perf_counter() - began)
    static = setup.meter.current_bytes()  # weights + optimizer state (on CPU: the whole process)
    elapsed = time.perf_counter() - start
    return Probe(
        shape,
        "train",
        backward.max(step),
        static,
        seconds=elapsed,
        backward_peak=backward,
        step_peak=step,
        step_seconds=tuple(step_seconds),
        branch_peaks=marker.close() if marker is not None else None,
    )


def _eval_forward(setup: ProbeSetup, shape: BatchShape, static: int) -> Probe:
    """An eval forward with the optimizer state still held, as in training; generation too where evaluation
    generates (as Seq2SeqTrainer does: every row to the label length)."""
    import torch

    batch = make_batch(shape, setup.collator, setup.task, setup.vocab_size, setup.device)
    setup.model.eval()
    setup.meter.reset_window()
    start = time.perf_counter()
    with torch.no_grad():
        setup.model(**batch)
        if setup.generate:
            setup.model.generate(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                max_new_tokens=shape.label,
                min_new_tokens=shape.label,
                num_beams=1,
                do_sample=False,
            )
    return Probe(shape, "eval", setup.meter.window_peak(), static, seconds=time.perf_counter() - start)


def probe(setup: ProbeSetup, shape: BatchShape, eval_shape: BatchShape | None = None) -> list[Probe]:
    """Training steps on `shape` (_train_steps), then optionally an eval forward on `eval_shape`; an OOM ends the
    probe with what was attempted. Weights and RNG are restored afterwards."""
    import torch

    preserved = _Preserved(setup.model)
    optimizer = marker = None
    results: list[Probe] = []
    phase, current = "train", shape
    try:
        _free(setup.device)
        batch = make_batch(shape, setup.collator, setup.task, setup.vocab_size, setup.device)
        setup.model.train()
        optimizer = setup.make_optimizer()
        marker = _BranchMarker(setup.model, setup.meter) if setup.split_branches else None
        with setup.forward_as_trained():
            results.append(_train_steps(setup, shape, batch, optimizer, marker))
            marker = None  # closed by _train_steps
            del batch
            if eval_shape is not None:
                phase, current = "eval", eval_shape
                results.append(_eval_forward(setup, eval_shape, results[0].static_bytes))
    except torch.OutOfMemoryError as err:
        in_use = setup.meter.current_bytes()
        results.append(Probe(current, phase, None, attempted_bytes=_attempted_bytes(err, in_use)))
    finally:
        if marker is not None:  # an OOM left its hook in place
            marker.close()
        del optimizer
        preserved.restore()
        _free(setup.device)
    return results
