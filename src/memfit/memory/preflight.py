"""Worst-case preflight: before step 1, probe the largest batches the data can produce under the budget, judge
their measured peaks against the limit, and when they do not fit, name the ways out.

The preflight owns no training: it takes a model, an optimizer factory, the worst batch shapes and a budget, and
returns a measured report.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from memfit.config import GIB
from memfit.data.audit import BatchShape, label_coverage
from memfit.memory.probe import Probe


@dataclass
class PreflightReport:
    passed: bool
    probes: list[Probe]
    limit_bytes: int  # budget minus margin
    budget_bytes: int
    meter: str
    task: str
    suggestions: list[str] = field(default_factory=list)
    budget_label: str = "budget"  # what the budget is: budget.gib, or without it the device's memory
    cache_growth: int = 0  # kept below the limit for a long run's allocator cache (memory.meter)
    max_batch: int | None = None
    max_batch_cap: str | None = None  # where the largest-batch search stopped at a cap of its own, or why none fits
    seconds: float = 0.0
    failure: str | None = None  # a preflight that could not judge batches (a batch plan that holds no sample): why

    @property
    def worst(self) -> Probe:
        return max(self.probes, key=lambda p: (p.oom, p.judged_bytes))

    def needed_bytes(self, probe: Probe) -> tuple[int, bool]:
        """(what the probe's batch needs, whether that is exact): its measured peak; after an OOM the memory model's
        prediction, or else the budget it could not fit in (a lower bound: it needed more)."""
        if probe.peak is not None:
            return probe.peak.reserved, True
        if probe.predicted_bytes is not None:
            return probe.predicted_bytes, True
        return max(self.budget_bytes, probe.attempted_bytes or 0), False

    @property
    def headroom_bytes(self) -> int:
        """The limit minus what the worst batch needs: never positive when the batch did not fit."""
        needed = max(self.needed_bytes(p)[0] for p in self.probes)
        return self.limit_bytes - needed

    def metrics(self) -> dict[str, float]:
        if not self.probes:
            return {"preflight/passed": float(self.passed), "preflight/seconds": self.seconds}
        worst = self.worst
        out = {
            "preflight/passed": float(self.passed),
            "preflight/worst_batch": worst.shape.batch,
            "preflight/worst_source": worst.shape.source,
            "preflight/worst_label": worst.shape.label,
            "preflight/seconds": self.seconds,
            "preflight/headroom_gib": self.headroom_bytes / GIB,
        }
        timed = [p for p in self.probes if p.phase == "train" and len(p.step_seconds) > 1]
        if timed:  # a step on a padded shape met for the first time, and one repeating it (issue 4's step times)
            longest = max(timed, key=lambda p: p.shape.tokens)
            out["preflight/first_step_s"] = longest.step_seconds[0]
            out["preflight/repeat_step_s"] = sum(longest.step_seconds[1:]) / (len(longest.step_seconds) - 1)
        if worst.peak:
            out["preflight/peak_allocated_gib"] = worst.peak.allocated_gib
            out["preflight/peak_reserved_gib"] = worst.peak.reserved_gib
        if self.max_batch:
            out["preflight/max_batch"] = self.max_batch
        return out

    def summary(self) -> str:
        if self.failure is not None:
            return f"preflight: {self.failure}"
        lines = []
        for each in self.probes:
            what = each.shape.describe(self.task)
            if each.not_run:
                lines.append(f"  {each.phase} {what}: not probed: {each.not_run}")
            elif each.oom:
                needed, exact = self.needed_bytes(each)
                how = (
                    f"needs ~{needed / GIB:.2f} GiB (memory model)"
                    if exact
                    else f"needs more than {needed / GIB:.2f} GiB"
                )
                lines.append(f"  {each.phase} {what}: OUT OF MEMORY, {how}")
            else:
                lines.append(
                    f"  {each.phase} {what}: peak allocated {each.peak.allocated_gib:.2f} GiB, "
                    f"reserved {each.peak.reserved_gib:.2f} GiB ({each.seconds:.1f} s)"
                )
        verdict = "fits" if self.passed else "does NOT fit"
        head = (
            f"preflight: the worst batch {verdict} the budget: limit {self.limit_bytes / GIB:.2f} GiB "
            f"({self.budget_label} {self.budget_bytes / GIB:.2f} GiB minus margin{growth_note(self.cache_growth)}, "
            f"{self.meter}), "
        )
        if self.passed:
            head += f"headroom {self.headroom_bytes / GIB:+.2f} GiB"
        else:
            exact = all(self.needed_bytes(p)[1] for p in self.probes)
            over = -self.headroom_bytes / GIB
            head += f"over it by {over:.2f} GiB" if exact else f"over it by more than {max(over, 0.0):.2f} GiB"
        lines.insert(0, head)
        if self.max_batch and self.max_batch_cap:
            lines.append(f"  largest batch that fits the worst case: >= {self.max_batch} ({self.max_batch_cap})")
        elif self.max_batch:
            lines.append(f"  largest batch that fits the worst case: {self.max_batch}")
        elif self.max_batch_cap:  # searched, and not even batch 1 fits
            lines.append(f"  largest batch that fits the worst case: none ({self.max_batch_cap})")
        if self.suggestions:
            lines.append("  ways out, largest expected saving first (estimates from the measured peak):")
            lines += [f"    {i}. {s}" for i, s in enumerate(self.suggestions, 1)]
        return "\n".join(lines)


def growth_note(cache_growth: int) -> str:
    """How a limit's text names what it keeps for a long run's allocator cache (nothing where it keeps none)."""
    return f" and {cache_growth / GIB:.2f} GiB for a long run's cache" if cache_growth else ""


def fits(probes: list[Probe], limit: int) -> bool:
    """Every probe ran without OOM and within the limit."""
    return all(not p.oom and p.judged_bytes <= limit for p in probes)


def _shortened(shape: BatchShape, name: str, length: int, task: str) -> BatchShape:
    if task == "causal":  # one sequence: shortening either part shortens it
        return BatchShape(shape.batch, length, length)
    return replace(shape, **{name: length})


def _smaller_batch(
    shape: BatchShape, batch: int, accumulation: int, expected: Callable[[BatchShape], float], limit: int, how: str
) -> tuple[float, str] | None:
    """The largest smaller batch expected to fit (or batch 1), at the same effective batch: (expected peak, text)."""
    effective = batch * accumulation
    for smaller in range(batch - 1, 0, -1):
        peak = expected(replace(shape, batch=smaller))
        if peak <= limit or smaller == 1:
            text = (
                f"trainer.batch_size={smaller} trainer.gradient_accumulation_steps={math.ceil(effective / smaller)}"
                f" (same effective batch {effective}; expected peak ~{peak / GIB:.1f} GiB, {how})"
            )
            return peak, text
    return None


def _shorter(
    shape: BatchShape, name: str, task: str, limit: int, peak: int, per_token: float, predict: Any
) -> tuple[int, float]:
    """(the shorter length for `name`, the bytes it saves): the longest multiple of 8 the memory model fits, or,
    without one, the cut that removes the excess at the measured bytes per token."""
    current = getattr(shape, name)
    if predict:
        fitting = (n for n in range(current - 8, 7, -8) if predict(_shortened(shape, name, n, task)) <= limit)
        shorter = next(fitting, 8)
    else:
        need = peak - limit
        shorter = max(8, current - math.ceil(need / per_token) if need > 0 else current // 2)
    return shorter, peak - _expected_at(shape, name, shorter, task, predict, per_token, peak)


def _shortest_keeping(raw: np.ndarray | None, share: float, current: int) -> int:
    """The shortest multiple of 8 up to `current` whose cut keeps at least `share` of the tokens."""
    return next((n for n in range(8, current + 1, 8) if label_coverage(raw, n) >= share), current)


def _expected_at(
    shape: BatchShape, name: str, length: int, task: str, predict: Any, per_token: float, peak: int
) -> float:
    """The expected peak with `name` cut to `length`: the memory model's, else the measured bytes per token."""
    if predict:
        return predict(_shortened(shape, name, length, task))
    return peak - per_token * (getattr(shape, name) - length)


def _length_way(
    shape: BatchShape,
    name: str,
    knob: str,
    raw: np.ndarray | None,
    configured: int,
    task: str,
    limit: int,
    peak: int,
    per_token: float,
    predict: Any,
    min_coverage: float,
) -> tuple[float, str] | None:
    """(saving, the way out) of a shorter `name` length: the cut that fits, but never one that keeps less than
    `min_coverage` of its tokens (then the shortest that keeps that much, said to be not enough alone)."""
    current = getattr(shape, name)
    if current <= 16:
        return None
    shorter, saving = _shorter(shape, name, task, limit, peak, per_token, predict)
    note = ""
    if label_coverage(raw, shorter) < min_coverage:  # that cut fits, but trains on too little: go no shorter
        shorter = _shortest_keeping(raw, min_coverage, current)
        saving = peak - _expected_at(shape, name, shorter, task, predict, per_token, peak)
        note = f", the shortest that keeps {min_coverage:.0%}: not enough alone"
    if shorter >= current or saving <= 0:
        return None
    kept = f"keeps {label_coverage(raw, shorter):.1%} of {name} tokens{note}"
    return saving, f"{knob}={shorter} ({kept}; {configured} keeps {label_coverage(raw, configured):.1%})"


def _policy_ways(
    memory: Any,
    task: str,
    shape: BatchShape,
    activations: float,
    trainable_params: int,
    lora_enabled: bool,
    savings: dict[str, int],
) -> list[tuple[float, str]]:
    """(expected saving, way out) of the policy's knobs that save memory whatever the batch: those `savings` names
    (memory.savings.knob_savings), gradient checkpointing, the optimizer, LoRA."""
    from memfit.memory.savings import KNOB_WAYS

    ranked = [
        (float(saving), f"{KNOB_WAYS[knob].setting} (~{saving / GIB:.2f} GiB less: {KNOB_WAYS[knob].why})")
        for knob, saving in savings.items()
    ]
    if not memory.gradient_checkpointing:
        ranked.append(
            (
                0.5 * activations,
                "memory.gradient_checkpointing=true (~40-60% less activation memory, ~30% slower steps)",
            )
        )
    if memory.optimizer == "adamw":
        state = f"{8 * trainable_params / GIB:.2f} GiB of state for {trainable_params / 1e6:.0f}M params"
        ranked.append(
            (6.0 * trainable_params, f"memory.optimizer=adamw_8bit on GPU, or adafactor (AdamW keeps {state})")
        )
    if task == "causal" and not lora_enabled:
        ranked.append((0.0, "model.lora.enabled=true, or memory=qlora for 4-bit base weights"))
    return ranked


def suggest(
    report_probes: list[Probe],
    limit: int,
    *,
    batch: int,
    accumulation: int,
    task: str,
    label_raw: np.ndarray,
    max_label: int,
    memory: Any,
    source_raw: np.ndarray | None = None,
    max_source: int = 0,
    trainable_params: int,
    lora_enabled: bool,
    predict: Callable[[BatchShape], float] | None = None,
    min_coverage: float = 0.9,
    savings: Callable[[BatchShape], dict[str, int]] | None = None,
) -> list[str]:
    """Concrete ways out, ranked by expected saving; none cuts a length to keep less than `min_coverage` of its
    tokens. With `predict` (the calibrated memory model: a shape's peak reserved bytes) smaller batches and lengths
    are judged by it; without, activation memory is taken as proportional to the batch's tokens, on top of the
    static part (weights + optimizer state) the probe measured. `savings`: what each memory knob left off would hold
    less at a shape (memory.savings.knob_savings), for their ways out."""
    worst = max(report_probes, key=lambda p: p.judged_bytes)
    peak, shape = worst.judged_bytes, worst.shape
    static = worst.static_bytes or 0
    activations = max(peak - static, 1)
    ranked: list[tuple[float, str]] = []

    def expected(smaller: BatchShape) -> float:
        return predict(smaller) if predict else static + activations * smaller.batch / batch

    how = "memory model" if predict else "scaled from the measured peak"
    if (found := _smaller_batch(shape, batch, accumulation, expected, limit, how)) is not None:
        ranked.append((peak - found[0], found[1]))
    per_token = activations / (shape.source + shape.label)
    lengths = [("label", "memory.max_label_length", label_raw, max_label)]
    if task == "seq2seq":
        lengths.append(("source", "memory.max_source_length", source_raw, max_source))
    for name, knob, raw, configured in lengths:
        way = _length_way(shape, name, knob, raw, configured, task, limit, peak, per_token, predict, min_coverage)
        if way is not None:
            ranked.append(way)
    knobs = savings(shape) if savings is not None else {}
    ranked += _policy_ways(memory, task, shape, activations, trainable_params, lora_enabled, knobs)
    ranked.sort(key=lambda item: -item[0])
    return [text for _, text in ranked]
