"""Which micro-batch training's memory peaked on: the meter is marked after every micro-batch (and before each
step's first, so the optimizer step and what else runs between steps are a part of their own), the highest part is
kept with its step and padded shape, and with forensics.micro_batch_peaks every part is kept for a table.

The preflight proves that no micro-batch holds more than a shape it ran within the limit; this is how training
checks that proof, and names the batch where it did not hold (issue 23). Marking reads the allocator's own counters
on the host: no device synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.memory.meter import CudaMeter, HostMeter, MemoryPeak

BETWEEN_STEPS = -1  # a part that is no micro-batch: the optimizer step, an evaluation, loading the next batch


@dataclass(frozen=True)
class MicroBatchPeak:
    step: int  # the optimizer step (1-based) the part belongs to
    index: int  # the micro-batch within its step (0-based), or BETWEEN_STEPS
    shape: dict[str, tuple[int, ...]]  # the padded batch's tensors (the collator's last_shape); empty between steps
    peak: MemoryPeak

    def describe(self) -> str:
        if self.index == BETWEEN_STEPS:
            where = "after its micro-batches (optimizer step, evaluation)"
        else:
            where = f"micro-batch {self.index + 1}"
        shape = f" ({shape_text(self.shape)})" if self.shape else ""
        return f"step {self.step}, {where}{shape}: {self.peak.allocated_gib:.2f} GiB allocated"


def shape_text(shape: dict[str, tuple[int, ...]]) -> str:
    """A collated batch's padded shape: each tensor's name and sizes."""
    return ", ".join(f"{name} {'×'.join(str(n) for n in sizes)}" for name, sizes in sorted(shape.items()))


class MicroBatchPeaks:
    """The peak of every part of training, by allocated bytes: the highest always, every one with `keep_all`."""

    def __init__(self, meter: CudaMeter | HostMeter, keep_all: bool = False):
        self.meter, self.keep_all = meter, keep_all
        self.highest: MicroBatchPeak | None = None
        self.parts: list[MicroBatchPeak] = []
        self._step: int | None = None  # the optimizer step whose micro-batches run now
        self._index = 0  # the next micro-batch's place in its step

    def _record(self, part: MicroBatchPeak) -> None:
        if self.highest is None or part.peak.allocated > self.highest.peak.allocated:
            self.highest = part
        if self.keep_all:
            self.parts.append(part)

    def starting(self, step: int) -> None:
        """A micro-batch of optimizer step `step` starts: at a step's first, mark the span before it (the previous
        step's optimizer step; before training's first micro-batch, the preflight and start-up: not kept)."""
        if step == self._step:
            return
        part = self.meter.mark()
        if self._step is not None:
            self._record(MicroBatchPeak(self._step, BETWEEN_STEPS, {}, part))
        self._step, self._index = step, 0

    def finished(self, shape: dict[str, tuple[int, ...]]) -> None:
        """The micro-batch `starting` announced has run its forward and backward passes."""
        self._record(MicroBatchPeak(self._step or 0, self._index, shape, self.meter.mark()))  # formatted if shown
        self._index += 1

    def after_training(self) -> None:
        """Mark the last optimizer step's span."""
        if self._step is not None:
            self._record(MicroBatchPeak(self._step, BETWEEN_STEPS, {}, self.meter.mark()))
            self._step = None

    def table(self) -> str:
        """Every kept part, tab-separated, for a run's artifacts."""
        lines = ["step\tmicro_batch\tshape\tpeak_allocated_gib\tpeak_reserved_gib"]
        for part in self.parts:
            index = "between" if part.index == BETWEEN_STEPS else str(part.index + 1)
            lines.append(
                f"{part.step}\t{index}\t{shape_text(part.shape)}\t{part.peak.allocated_gib:.3f}\t"
                f"{part.peak.reserved_gib:.3f}"
            )
        return "\n".join(lines) + "\n"
