"""The callback that puts peak memory beside loss at every logged step, and what stops training from it: a
non-finite loss, and on CPU a host peak past the budget."""

from __future__ import annotations

import math
import time
from typing import Any

from memfit.config import GIB
from memfit.data import CountingCollator
from memfit.memory.meter import CudaMeter, HostMeter
from memfit.training.throughput import Window

# Trainer log keys → memfit metric names (`train/...`, `eval/...`), so the MLflow UI groups them.
_RENAMES = {"loss": "train/loss", "learning_rate": "train/learning_rate", "grad_norm": "train/grad_norm"}
# Trainer's timing of an evaluation: noise beside memfit's own tokens/s, and three more columns in the MLflow UI
_EVAL_TIMINGS = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second")


def _metric_name(key: str) -> str | None:
    if key in _RENAMES:
        return _RENAMES[key]
    if key.startswith("eval_") and key not in _EVAL_TIMINGS:
        return "eval/" + key.removeprefix("eval_")
    return None


def _trainer_callback_base() -> type:
    from transformers import TrainerCallback

    return TrainerCallback


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite: training stops at once instead of burning the rest of its budget."""


class OverBudget(RuntimeError):
    """On CPU, where no allocator cap enforces the budget, training's host memory passed budget.gib: the run stops
    as an over-budget CUDA step would (docs/preflight.md)."""


class MemoryLoggingCallback:
    """At each Trainer log: the window's peak allocated/reserved memory, tokens/s and the Trainer's own numbers.

    Cheap by design: reading the allocator's peak counters does not synchronise the GPU, token counts come
    from the collator on CPU, and the tracker buffers metrics and writes them in batches.
    """

    def __init__(
        self,
        meter: CudaMeter | HostMeter,
        tracker: Any,
        collator: CountingCollator,
        max_train_tokens: int | None,
        host_budget_gib: float | None = None,
    ):
        self.meter, self.tracker, self.collator = meter, tracker, collator
        self.max_train_tokens = max_train_tokens
        self.host_budget_gib = host_budget_gib  # on CPU: budget.gib, which training's peak RSS must not pass
        self._last_time = 0.0
        self._last = (0, 0, 0, 0, 0)  # the collator's tokens, padded tokens, micro-batches, new shapes, rows: last log
        self.windows: list[Window] = []  # between a train log and the log before it
        self._retries_before = 0

    @property
    def steady_tokens_per_s(self) -> float | None:
        """Tokens/s after the first logged window: the first step builds optimizer state and grows the allocator,
        which a short timed segment (a sweep trial's) would otherwise count as slowness. Later windows that met a
        new padded shape (`train/new_shapes`) stay in: leaving them out did not bring 5- or 10-step estimates
        closer to a long run's throughput (benchmarks/results/trial_throughput_segment.json)."""
        steady = self.windows[1:]
        seconds = sum(w.seconds for w in steady)
        return sum(w.tokens for w in steady) / seconds if steady and seconds > 0 else None

    @property
    def tokens_per_s_spread(self) -> float | None:
        """How much the steady windows' tokens/s vary: their standard deviation over their mean (0.05: ±5%), with
        two windows or more after the first; how far a short segment's rate can be trusted."""
        import statistics

        rates = [w.tokens / w.seconds for w in self.windows[1:] if w.seconds > 0]
        if len(rates) < 2 or statistics.fmean(rates) <= 0:
            return None
        return statistics.stdev(rates) / statistics.fmean(rates)

    @property
    def alloc_retries(self) -> int:
        """Allocator retries since training began (the preflight's probes near the cap are not counted)."""
        return self.meter.alloc_retries() - self._retries_before

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._retries_before = self.meter.alloc_retries()
        # what training starts from (weights, and anything the preflight left): each micro-batch's peak builds on it
        start = self.meter.current_bytes() / GIB
        self.tracker.log_facts({"mem/train_start_allocated_gib": start})
        self.meter.reset_window()
        self.meter.reset_overall()  # the run's peaks are training's: the preflight's probes are reported apart
        self._last_time, self._last = time.perf_counter(), self._counts()

    def _counts(self) -> tuple[int, int, int, int, int]:
        c = self.collator
        return c.tokens, c.padded_tokens, c.micro_batches, c.new_shapes, c.rows

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.tracker.flush()  # a checkpoint's steps are in MLflow: a resumed run's history has no gap

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.max_train_tokens and self.collator.tokens >= self.max_train_tokens:
            control.should_training_stop = True  # the token budget is spent: the same data for every batch size

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        logs = logs or {}
        if "train_runtime" in logs:  # Trainer's end-of-training summary: memfit logs its own summary
            return
        metrics = {name: float(v) for k, v in logs.items() if (name := _metric_name(k)) and isinstance(v, int | float)}
        peak = self.meter.window_peak()
        self.meter.reset_window()
        prefix = "mem/eval_" if any(k.startswith("eval_") for k in logs) else "mem/"
        metrics[prefix + "peak_allocated_gib"] = peak.allocated_gib
        metrics[prefix + "peak_reserved_gib"] = peak.reserved_gib
        metrics[prefix + "alloc_retries"] = self.alloc_retries  # cumulative since training began
        now, counts = time.perf_counter(), self._counts()
        if "loss" in logs and now > self._last_time:
            tokens, padded_tokens, micro_batches, new_shapes, rows = (
                a - b for a, b in zip(counts, self._last, strict=True)
            )
            window = Window(tokens, now - self._last_time, padded_tokens, micro_batches, new_shapes)
            metrics["train/tokens_per_s"] = window.tokens / window.seconds
            metrics["train/window_s"] = window.seconds  # wall seconds since the last log (one step at logging_steps=1)
            metrics["train/new_shapes"] = window.new_shapes  # > 0: paid a new shape's warm-up
            metrics["train/padding_share"] = 1 - window.tokens / window.padded_tokens if window.padded_tokens else 0.0
            metrics["train/tokens"] = window.tokens  # real tokens of the window's steps
            metrics["train/micro_batches"] = micro_batches  # forward + backward passes in the window
            metrics["train/micro_batch_size"] = rows / micro_batches if micro_batches else 0.0  # mean rows of each
            metrics["train/samples"] = rows  # the window's samples (a step's vary with effective_batch=tokens)
            self.windows.append(window)
        self._last_time, self._last = now, counts
        self.tracker.log_metrics(metrics, step=state.global_step)
        loss = metrics.get("train/loss", metrics.get("eval/loss"))
        if loss is not None and not math.isfinite(loss):
            self.tracker.flush()  # the non-finite step is in the store before the run ends
            raise NonFiniteLoss(f"nan_loss: loss is {loss} at step {state.global_step}")
        if self.host_budget_gib is not None and peak.reserved_gib > self.host_budget_gib:
            self.tracker.flush()
            raise OverBudget(
                f"over_budget: host memory (RSS) reached {peak.reserved_gib:.2f} GiB at step {state.global_step}, "
                f"over budget.gib={self.host_budget_gib:g}: on CPU nothing caps it, so the run stops here; "
                "checkpoints are kept (trainer.resume=true), a smaller trainer.batch_size or budget.gib fits"
            )


def make_callback(
    meter: CudaMeter | HostMeter,
    tracker: Any,
    collator: CountingCollator,
    max_train_tokens: int | None = None,
    host_budget_gib: float | None = None,
) -> Any:
    """The callback as a real TrainerCallback subclass (transformers is imported only here)."""
    cls = type("MemfitMemoryCallback", (MemoryLoggingCallback, _trainer_callback_base()), {})
    return cls(meter, tracker, collator, max_train_tokens, host_budget_gib)
