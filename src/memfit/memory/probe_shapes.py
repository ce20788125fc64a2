"""Which shapes calibration probes: at least one per fitted term of the memory model (memfit.memory.model), varied
independently, as large as the budget lets them, so the least-squares fit is determined and reaches the shapes
training will hold."""

from __future__ import annotations

from omegaconf import DictConfig

from memfit.data.audit import BatchShape
from memfit.memory.model import Architecture, convex_in_tokens, splits_branches

# Each layout: (batch, source, label), lengths as shares of the probes' tokens; a causal row is its source.
# Causal: the most tokens at two lengths, so long rows' attention shows apart from short rows'.
CAUSAL = ((1, 1 / 4, 0), (2, 1 / 4, 0), (1, 1 / 2, 0), (4, 1 / 16, 0), (2, 1 / 2, 0), (8, 1 / 8, 0))
# Causal, two lines in tokens: six token counts (1/4 to 1 of the most), rows of three lengths so that no length
# stands for a token count.
CAUSAL_TOKEN_COUNTS = ((1, 1 / 4, 0), (3, 1 / 8, 0), (1, 1 / 2, 0), (5, 1 / 8, 0), (3, 1 / 4, 0), (2, 1 / 2, 0))
# Seq2seq: source and labels apart; the first shape's tokens in shorter sequences (scores apart); one long row (its
# scores, and the decoder's over the source); the most tokens last.
SEQ2SEQ = (
    (4, 1 / 8, 1 / 32),
    (4, 1 / 4, 1 / 32),
    (4, 1 / 8, 1 / 8),
    (8, 1 / 16, 1 / 16),
    (1, 1 / 2, 1 / 4),
    (8, 1 / 8, 1 / 16),
)
# T5's windows: batch and source crossed (the encoder's windows), labels apart from them, and one long label (the
# decoder's scores against its tokens).
SCORED_WINDOWS = ((4, 1 / 8, 1 / 32), (4, 1 / 4, 1 / 32), (8, 1 / 8, 1 / 16), (1, 1 / 8, 1 / 2))


def calibration_shapes(
    arch: Architecture,
    tokens: int,
    multiple: int | None = None,
    batch_scale: int = 1,
    max_positions: int | None = None,
    checkpointed: bool = False,
) -> list[BatchShape]:
    """Shapes whose terms vary independently: the constant, tokens per stack and, where attention keeps its
    scores, long against short sequences at the same tokens. `tokens` sizes the probes' lengths (capped at the
    model's positions), `batch_scale` multiplies their batch; every length is a multiple of 8 (or of
    pad_to_multiple_of). Six probes for at most five terms: least squares with a probe to spare, and the last two
    reach `tokens` (the most a step holds), since probes at one or two sizes alone were read as a line and missed
    larger shapes by up to 4% (benchmarks/results/memory_model_run15_chunked.json).
    Under gradient checkpointing (`checkpointed`): a model fitted window by window whose attention keeps its scores
    (T5, memory.model.splits_branches) takes four shapes that vary each window's terms apart, other windowed models
    the six; a causal LM fitted as two lines in tokens (memory.model.convex_in_tokens) takes six token counts, so a
    line on each side of the kink has two of them wherever it lies (three counts placed qwen2_5_0_5b's kink, at
    ~10.7k tokens, on the wrong side: +4.7%; benchmarks/results/memory_model_run17_causal_ckpt_chunked.json)."""
    step = max(8, multiple or 8)

    def length(share: float) -> int:
        n = tokens * share
        return max(step, int(min(n, max_positions or n)) // step * step)

    if arch.task == "causal":
        layout = CAUSAL_TOKEN_COUNTS if convex_in_tokens(arch, checkpointed) else CAUSAL
        return [BatchShape(b * batch_scale, length(source), length(source)) for b, source, _ in layout]
    layout = SCORED_WINDOWS if splits_branches(arch, checkpointed) and arch.quadratic_attention else SEQ2SEQ
    return [BatchShape(b * batch_scale, length(source), length(label)) for b, source, label in layout]


def probe_plan(cfg: DictConfig, arch: Architecture) -> list[tuple[int, int]]:
    """(tokens, batch scale) to try in turn until every probe fits the budget. Checkpointed activations are a few
    times smaller, so their probes run four times the batch to stand clear of the allocator's noise."""
    tokens, scale = int(cfg.calibration.probe_tokens), 4 if cfg.memory.gradient_checkpointing else 1
    plan = [(tokens, scale)]
    while len(plan) < 4 and (scale > 1 or tokens > 256):
        scale, tokens = (scale // 2, tokens) if scale > 1 else (scale, tokens // 2)
        plan.append((tokens, scale))
    return plan
