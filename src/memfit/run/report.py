"""What a run returns: a structured report (not a bare float), which a sweeper reads back from Hydra's job return,
and the exit codes of a single run."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

EXIT_BAD_INPUT, EXIT_RUN_FAILED, EXIT_PREFLIGHT_FAILED = 2, 1, 3


@dataclass
class RunReport:
    status: str  # ok | oom | over_budget | preflight_failed | nan_loss | disk_full | failed | invalid
    reason: str | None = None
    objective: float | None = None  # tokens/s of training
    peak_allocated_gib: float | None = None
    peak_reserved_gib: float | None = None
    # the preflight's judged worst case: its measured peak reserved on the worst batch, plus what it keeps for a long
    # run's allocator cache on CUDA (memory.meter's cache_growth, 64 MiB; none on the host)
    worst_case_peak_gib: float | None = None
    limit_gib: float | None = None  # what the judged worst case must stay within: budget minus margin
    worst_case_shape: list[int] | None = None  # [batch, source, label]
    max_batch: int | None = None
    max_batch_cap: int | None = None  # where the largest-batch search stopped looking (limit or training samples)
    label_coverage: float | None = None
    source_coverage: float | None = None
    tokens_per_s: float | None = None
    tokens_per_s_spread: float | None = None  # the steady steps' tokens/s: standard deviation over mean
    epoch_tokens_per_s: float | None = None  # a whole epoch's, from the segment's steps and the epoch's batch plan
    final_loss: float | None = None  # the last logged training loss
    eval_loss: float | None = None  # evaluation loss at the last step, when there is validation data
    train_tokens: int | None = None
    steps: int = 0
    run_id: str | None = None
    meter: str | None = None
    # the memory model's prediction (reserved) for the worst batch, judged as worst_case_peak_gib is
    predicted_peak_gib: float | None = None
    calibration: str | None = None  # the memory model's calibration file, for the sweeper's predictions
    alloc_retries: int | None = None  # times training's allocator freed its cache to stay under the cap (slow steps)
    # training's peak reserved minus the preflight's judged worst case: > 0 where a long run's allocator cache grew
    # past it (held under budget.gib by the cap on CUDA, docs/preflight.md)
    reserved_over_preflight_gib: float | None = None
    mean_micro_batch: float | None = None  # rows per micro-batch that training took, on average
    peak_where: str | None = None  # the step and micro-batch (padded shape) training's allocated peak was on
    saved_model: str | None = None  # where the trained model (or adapter) was saved (trainer.save_model)
    phase_seconds: dict[str, float] = field(default_factory=dict)  # start-up phases, preflight, training

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class OutOfMemoryInTraining(RuntimeError):
    """An OOM during training, after the forensics were recorded."""


def is_oom(err: BaseException) -> bool:
    import torch

    return isinstance(err, torch.OutOfMemoryError | OutOfMemoryInTraining) or "out of memory" in str(err).lower()
