"""The typed values one run's phases hand down: what its start established (RunContext), what the training phase
built (TrainingSetup), and what the worst-case phase found (WorstCase)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

if TYPE_CHECKING:
    from memfit.data import CountingCollator, PreparedData
    from memfit.memory.calibration import Calibration
    from memfit.memory.plan import BatchPlan
    from memfit.memory.policy import BudgetCap
    from memfit.memory.preflight import PreflightReport
    from memfit.models import BuiltModel
    from memfit.run.identity import ResumePoint
    from memfit.training.callback import MemoryLoggingCallback


class StartupClock:
    """Seconds of each phase, one lap after another, so that every second of a run's start is counted in some phase
    (a phase includes the imports it triggers, none in a sweep trial forked from the fork server): where a short
    sweep trial spends its time, and what two trials at once slow down."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> float:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now
        return self.seconds[phase]

    def summary(self) -> str:
        return ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in self.seconds.items())


@dataclass
class RunContext:
    """What the start of a run established, read by every later phase."""

    cfg: DictConfig
    device: str  # cuda | cpu
    tokenizer: Any
    prepared: PreparedData
    meter: Any  # CudaMeter | HostMeter (memfit.memory.meter)
    cap: BudgetCap
    tracker: Any  # MlflowTracker | NullTracker (memfit.tracking)
    resume: ResumePoint
    clock: StartupClock = field(default_factory=StartupClock)
    callbacks: tuple[Any, ...] = ()  # the caller's TrainerCallbacks, after memfit's own (memfit.run.run)


@dataclass(frozen=True)
class TrainingSetup:
    """Model, collator, callback and Trainer: everything the preflight and training share."""

    built: BuiltModel
    collator: CountingCollator
    callback: MemoryLoggingCallback
    trainer: Any  # transformers.Trainer or Seq2SeqTrainer


@dataclass
class WorstCase:
    """What the worst-case phase found: the preflight's report (None where it did not run), the memory model and
    its prediction for the worst batch."""

    report: PreflightReport | None = None
    calibration: Calibration | None = None
    predicted_peak_gib: float | None = None
    plan: BatchPlan | None = None  # trainer.batching=budget: the proven batch plan
