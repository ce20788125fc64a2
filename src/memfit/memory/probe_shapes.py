"""Which shapes calibration probes: at least one per fitted term of the memory model (memfit.memory.model), varied
independently, as large as the budget lets them, so the least-squares fit is determined and reaches the shapes
training will hold."""

from __future__ import annotations

from omegaconf import DictConfig

from memfit.data.audit import BatchShape
from memfit.memory.model import Architecture


def calibration_shapes(
    arch: Architecture,
    tokens: int,
    multiple: int | None = None,
    batch_scale: int = 1,
    max_positions: int | None = None,
    branches: bool = False,
    convex: bool = False,
) -> list[BatchShape]:
    """Shapes whose terms vary independently: the constant, tokens per stack and, where attention keeps its
    scores, long against short sequences at the same tokens. `tokens` sizes the probes' lengths (capped at the
    model's positions), `batch_scale` multiplies their batch; every length is a multiple of 8 (or of
    pad_to_multiple_of). Six probes for at most five terms: least squares with a probe to spare, and the last two
    reach `tokens` (the most a step holds), since probes at one or two sizes alone were read as a line and missed
    larger shapes by up to 4% (benchmarks/README.md, run 15).
    With `branches` where attention keeps its scores (T5: four), the shapes vary each window's terms independently:
    batch and source length crossed (the encoder's windows), label length apart from them, one long (the
    decoder's); other windowed models take the six. With `convex` (a causal LM fitted as two lines in tokens), six
    token counts from a quarter of `tokens` to all of it, so a line on each side of the kink has two of them
    wherever it lies (three counts placed qwen2_5_0_5b's kink, at ~10.7k tokens, on the wrong side: +4.7%;
    benchmarks/README.md, run 17)."""
    step = max(8, multiple or 8)

    def length(n: float) -> int:
        return max(step, int(min(n, max_positions or n)) // step * step)

    def shape(batch: int, source: float, label: float) -> BatchShape:
        if arch.task == "causal":
            return BatchShape(batch * batch_scale, length(source), length(source))
        return BatchShape(batch * batch_scale, length(source), length(label))

    if arch.task == "causal" and convex:  # rows of three lengths, so no length stands for a token count
        return [
            shape(1, tokens / 4, 0),
            shape(3, tokens / 8, 0),
            shape(1, tokens / 2, 0),
            shape(5, tokens / 8, 0),
            shape(3, tokens / 4, 0),
            shape(2, tokens / 2, 0),  # the most tokens
        ]
    if arch.task == "causal":
        return [
            shape(1, tokens / 4, 0),
            shape(2, tokens / 4, 0),
            shape(1, tokens / 2, 0),
            shape(4, tokens / 16, 0),
            shape(2, tokens / 2, 0),  # the most tokens, at two lengths: long rows' attention apart from short's
            shape(8, tokens / 8, 0),
        ]
    if branches and arch.quadratic_attention:  # the last: one long label, the decoder's scores against its tokens
        return [
            shape(4, tokens / 8, tokens / 32),
            shape(4, tokens / 4, tokens / 32),
            shape(8, tokens / 8, tokens / 16),
            shape(1, tokens / 8, tokens / 2),
        ]
    return [
        shape(4, tokens / 8, tokens / 32),
        shape(4, tokens / 4, tokens / 32),
        shape(4, tokens / 8, tokens / 8),
        shape(8, tokens / 16, tokens / 16),  # the tokens of the first shape in shorter sequences: scores apart
        shape(1, tokens / 2, tokens / 4),  # one long row: its scores, and the decoder's over the source
        shape(8, tokens / 8, tokens / 16),  # the most tokens
    ]


def probe_plan(cfg: DictConfig, arch: Architecture) -> list[tuple[int, int]]:
    """(tokens, batch scale) to try in turn until every probe fits the budget. Checkpointed activations are a few
    times smaller, so their probes run four times the batch to stand clear of the allocator's noise."""
    tokens, scale = int(cfg.calibration.probe_tokens), 4 if cfg.memory.gradient_checkpointing else 1
    plan = [(tokens, scale)]
    while len(plan) < 4 and (scale > 1 or tokens > 256):
        scale, tokens = (scale // 2, tokens) if scale > 1 else (scale, tokens // 2)
        plan.append((tokens, scale))
    return plan
