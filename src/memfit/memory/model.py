"""The memory model's per-token part: activations and logits as linear terms of a batch shape, fitted from a few
probes on the device (memory.calibration runs them), and the peak it predicts on top of the model state
(memory.state).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memfit.memory.bisection import largest_fitting
from memfit.memory.state import ModelStateBytes

# ---------------------------------------------------------------------------------------------------------------
# The per-token part: activations and logits, fitted from a few probes on the device (memfit.memory.calibration)


@dataclass(frozen=True)
class Architecture:
    """What the per-token terms need to know of a model: its task, depth, heads, vocabulary and attention kind."""

    task: str  # seq2seq | causal
    vocab_size: int
    encoder_layers: int  # 0 for causal models
    decoder_layers: int
    heads: int
    # attention keeps b·heads·q·k scores: eager attention, or a learned position bias added to them (T5). With
    # memory-efficient kernels (SDPA, flash) attention memory is linear in tokens and this term is left out.
    quadratic_attention: bool
    # whether the decoder's cross-attention keeps its scores too: with eager attention it does; T5's cross-attention
    # has no learned bias and takes the memory-efficient kernel (measured: ~0.4 bytes per score per layer, against ~9
    # for its self-attention; benchmarks/results/memory_model_run15_chunked.json)
    cross_attention_scores: bool = False
    # T5's relative position bias: computed once per sequence, not per batch row, as a (q, k, heads) lookup in the
    # weights' dtype from (q, k) int64 buckets, and kept by every layer of its stack
    relative_position_bias: bool = False
    bias_element_bytes: int = 4  # the position bias's dtype: the weights' (float32 under mixed precision)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _first(config: Any, *names: str, default: int = 0) -> int:
    for name in names:
        value = getattr(config, name, None)
        if value:
            return int(value)
    return default


def describe_architecture(model: Any, task: str) -> Architecture:
    """The Architecture of a built model (a peft model is read through its base model)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    if getattr(config, "encoder", None) is not None and getattr(config, "decoder", None) is not None:
        encoder, decoder = config.encoder, config.decoder  # EncoderDecoderModel (bert2bert)
    else:
        encoder = decoder = config
    attention = getattr(encoder, "_attn_implementation", None) or "eager"
    position_bias = getattr(config, "relative_attention_num_buckets", None) is not None
    bias_weights = [m.relative_attention_bias.weight for m in base.modules() if hasattr(m, "relative_attention_bias")]
    if task == "causal":
        encoder_layers = 0
        decoder_layers = _first(config, "num_hidden_layers", "num_layers", "n_layer")
    else:
        encoder_layers = _first(encoder, "encoder_layers", "num_layers", "num_hidden_layers")
        decoder_layers = _first(decoder, "decoder_layers", "num_decoder_layers", "num_layers", "num_hidden_layers")
    return Architecture(
        task=task,
        vocab_size=_first(decoder, "vocab_size"),
        encoder_layers=encoder_layers,
        decoder_layers=decoder_layers,
        heads=_first(decoder, "decoder_attention_heads", "num_heads", "num_attention_heads", "n_head", default=1),
        quadratic_attention=attention == "eager" or position_bias,
        cross_attention_scores=attention == "eager" and task == "seq2seq",
        relative_position_bias=position_bias,
        bias_element_bytes=bias_weights[0].element_size() if bias_weights else 4,
    )


def shape_terms(batch: int, source: int, label: int, arch: Architecture) -> dict[str, float]:
    """The regressors of one padded batch: a constant, tokens per stack, and where attention keeps its scores, one
    term counting every kept score (b·heads·q·k per layer, summed over the kinds of attention that keep them). The
    kinds share one coefficient: a score costs the same bytes in encoder and decoder self-attention (T5:
    8.7 and 8.9 fitted apart, benchmarks/results/memory_model_run15_chunked.json); T5's cross-attention, whose scores
    the kernel does not keep, has its own.

    Causal models see one sequence (`source` positions, labels are the same positions)."""
    terms = {"constant": 1.0}
    heads = arch.heads * batch
    if arch.task == "causal":
        terms["tokens"] = float(batch * source)
        if arch.quadratic_attention:
            terms["attention_scores"] = float(heads * arch.decoder_layers * source * source)
        return terms
    terms["encoder_tokens"] = float(batch * source)
    terms["decoder_tokens"] = float(batch * label)
    if arch.quadratic_attention:
        scores = arch.encoder_layers * source * source + arch.decoder_layers * label * label
        if arch.cross_attention_scores:
            scores += arch.decoder_layers * label * source
        terms["attention_scores"] = float(heads * scores)
    if arch.relative_position_bias and not arch.cross_attention_scores:
        # T5's cross-attention under SDPA: each layer adds the padding mask to its zero bias (transformers'
        # create_position_bias_mask), a (b, heads, l, s) tensor the kernel keeps for its backward: a few bytes a
        # score against self-attention's ~9, so a coefficient of its own (~3 bytes per score and layer; left to
        # the other terms, they missed by up to 5%: benchmarks/results/memory_model_run15_chunked.json)
        terms["cross_attention_scores"] = float(heads * arch.decoder_layers * label * source)
    return terms


def logits_bytes(batch: int, source: int, label: int, arch: Architecture) -> int:
    """One float32 copy of the vocabulary logits, which the loss takes (the least the logits hold at the peak)."""
    positions = source if arch.task == "causal" else label
    return 4 * batch * positions * arch.vocab_size


# Terms counted, not fitted, with their coefficients: `position_biases` is already in bytes (_bias_bytes)
COUNTED_TERMS = {"position_biases": 1.0}


def _bias_bytes(arch: Architecture, source_bias: int, label_bias: int, cross: int, source: int, label: int) -> float:
    """Bytes of T5's relative position biases, which hold no batch dimension (transformers 5 keeps each stack's as
    (1, heads, q, k) and adds the mask inside attention): `source_bias`/`label_bias` count each stack's (q, k)
    lookup in the bias's dtype (1: kept; 2: and its gradient) plus the int64 buckets its embedding's backward keeps;
    `cross` counts the decoder's zero bias over the source (1, heads, l, s), in the same dtype."""
    element, heads = arch.bias_element_bytes, arch.heads
    per_score = {0: 0.0, 1: element + 8.0 / heads, 2: 2 * element + 8.0 / heads}
    return heads * (
        per_score[source_bias] * source * source
        + per_score[label_bias] * label * label
        + cross * element * label * source
    )


def splits_branches(arch: Architecture, gradient_checkpointing: bool) -> bool:
    """Whether a step's peak is the largest of six windows rather than a sum of terms (WINDOW_TERMS): a seq2seq model
    under gradient checkpointing holds only checkpoints (and T5's position biases) between layers, so each window
    peaks on its own transients (one layer's recomputation, or the logits), one at a time. Pegasus with the
    full logits read as one sum under-predicted its few-label rows by up to 6.1%
    (benchmarks/results/memory_model_run17_pegasus_ckpt_standard.json),
    the window of the forward's end that no probe's sum showed. Attention that keeps its scores without position
    biases (eager) under checkpointing is not modelled by windows."""
    return (
        gradient_checkpointing
        and arch.task == "seq2seq"
        and (arch.relative_position_bias or not arch.quadratic_attention)
    )


def _window_terms(
    batch: int, source: int, label: int, arch: Architecture, names: tuple[str, ...], biases: tuple[int, int, int]
) -> dict[str, float]:
    """The terms a window keeps: a constant; `names` of tokens per stack (checkpoints, and in the head the logits)
    and one layer's attention scores of the stack it runs in (b·heads·n², where attention keeps them); and,
    counted, T5's position biases (`biases`: _bias_bytes's source, label and cross counts)."""
    values = {
        "encoder_tokens": float(batch * source),
        "decoder_tokens": float(batch * label),
        "encoder_scores": float(batch * arch.heads * source * source),
        "decoder_scores": float(batch * arch.heads * label * label),
    }
    kept = [name for name in names if arch.quadratic_attention or not name.endswith("_scores")]
    terms = {"constant": 1.0, **{name: values[name] for name in kept}}
    if arch.relative_position_bias:
        terms["position_biases"] = _bias_bytes(arch, *biases, source, label)
    return terms


def encoder_forward_terms(batch: int, source: int, label: int, arch: Architecture) -> dict[str, float]:
    """The encoder's forward: its checkpoints and one layer's scores, over its kept position bias."""
    return _window_terms(batch, source, label, arch, ("encoder_tokens", "encoder_scores"), (1, 0, 0))


def decoder_forward_terms(batch: int, source: int, label: int, arch: Architecture) -> dict[str, float]:
    """The decoder's forward: every checkpoint so far and one decoder layer's scores, over the kept biases."""
    names = ("encoder_tokens", "decoder_tokens", "decoder_scores")
    return _window_terms(batch, source, label, arch, names, (1, 1, 1))


def head_terms(batch: int, source: int, label: int, arch: Architecture) -> dict[str, float]:
    """The head's forward (logits and loss) and its backward, until the gradient reaches the decoder's output:
    every checkpoint and the logits, per token, over the kept biases."""
    return _window_terms(batch, source, label, arch, ("encoder_tokens", "decoder_tokens"), (1, 1, 1))


def decoder_backward_terms(batch: int, source: int, label: int, arch: Architecture) -> dict[str, float]:
    """The backward through the decoder: checkpoints, one decoder layer recomputed with its scores, and the
    decoder's biases with their gradients (the self-attention's and the zero cross-attention one)."""
    names = ("encoder_tokens", "decoder_tokens", "decoder_scores")
    return _window_terms(batch, source, label, arch, names, (1, 2, 2))


def encoder_backward_terms(batch: int, source: int, label: int, arch: Architecture) -> dict[str, float]:
    """The backward through the encoder, after the decoder's memory is freed: its checkpoints, one encoder layer
    recomputed with its scores, its position bias with its gradient."""
    return _window_terms(batch, source, label, arch, ("encoder_tokens", "encoder_scores"), (2, 0, 0))


def convex_in_tokens(arch: Architecture, gradient_checkpointing: bool) -> bool:
    """Whether a step's peak is the larger of two lines in tokens rather than one (fit_convex_in_tokens): a causal LM
    under gradient checkpointing keeps only checkpoints between layers, and its probes' peaks grow faster past a
    point (the head's loss window, then one layer's recomputation, the slopes suggest; not measured window by
    window). One line through both read qwen2_5_0_5b's rows between them up to 4.3% high
    (benchmarks/results/memory_model_run16_chunked.json)."""
    return gradient_checkpointing and arch.task == "causal" and not arch.quadratic_attention


Terms = Callable[[int, int, int, Architecture], dict[str, float]]

# The windows of a step that splits (preflight._BranchMarker measures each apart), in the order they run: each is
# fitted alone over its own terms, and the step's peak is the largest. Without a split there is one window,
# "backward" (forward + backward), over shape_terms.
WINDOW_TERMS: dict[str, Terms] = {
    "encoder_forward": encoder_forward_terms,
    "decoder_forward": decoder_forward_terms,
    "head_forward": head_terms,
    "head_backward": head_terms,
    "decoder_backward": decoder_backward_terms,
    "encoder_backward": encoder_backward_terms,
}
# the second line of a step convex in tokens (convex_in_tokens): the one fitted to the probes of the most tokens
MORE_TOKENS = "backward_at_more_tokens"
# two lines replace one only where they fit the probes closer by more than this share of their mean peak (a tenth
# of the memory model's 1% goal): probes on one line with noise keep one line
CONVEX_GAIN = 0.001
# the windows in which the float32 logits exist (for the breakdown)
LOGITS_WINDOWS = ("backward", MORE_TOKENS, "head_forward", "head_backward")


def window_terms(window: str) -> Terms:
    return shape_terms if window in ("backward", MORE_TOKENS) else WINDOW_TERMS[window]


@dataclass(frozen=True)
class LinearFit:
    """Peak bytes as a linear function of a shape's terms, fitted by least squares."""

    coefficients: dict[str, float]

    def predict(self, terms: dict[str, float]) -> float:
        return sum(self.coefficients.get(name, 0.0) * value for name, value in terms.items())


def fit_terms(rows: list[dict[str, float]], peaks: list[float], fixed: dict[str, float] | None = None) -> LinearFit:
    """Least squares of measured peaks on their shapes' terms; `fixed` terms keep the coefficients given (counted,
    not fitted). Needs at least as many probes as free terms, and probes that vary them independently
    (memfit.memory.calibration chooses such shapes)."""
    import numpy as np

    fixed = {name: value for name, value in (fixed or {}).items() if name in rows[0]}
    peaks = [
        peak - sum(value * row[name] for name, value in fixed.items()) for row, peak in zip(rows, peaks, strict=True)
    ]
    names = [name for name in rows[0] if name not in fixed]
    if len(rows) < len(names):
        raise ValueError(f"fitting {len(names)} terms ({', '.join(names)}) needs as many probes, got {len(rows)}")
    design = np.array([[row[name] for name in names] for row in rows], dtype=np.float64)
    scale = np.abs(design).max(axis=0)  # columns span 1 to ~1e9: scale them so the solve is well conditioned
    if np.linalg.matrix_rank(design / scale) < len(names):
        raise ValueError(f"the probes do not vary the terms {', '.join(names)} independently")
    solution, *_ = np.linalg.lstsq(design / scale, np.asarray(peaks, dtype=np.float64), rcond=None)
    fitted = {name: float(value / s) for name, value, s in zip(names, solution, scale, strict=True)}
    return LinearFit({**fitted, **fixed})


def fit_convex_in_tokens(rows: list[dict[str, float]], peaks: list[float]) -> dict[str, LinearFit]:
    """Peaks as the larger of two lines in tokens (shape_terms without attention scores): the probes at fewer
    tokens fit "backward", those at more MORE_TOKENS, split at a token count both share or between two (each line
    over at least two token counts). The split with the least error is kept where the second line is the steeper (a
    convex peak) and it lowers the root-mean-square error by more than CONVEX_GAIN of the mean peak; else one line
    over all probes."""

    def squared_error(fits: list[LinearFit]) -> float:
        return sum((max(f.predict(row) for f in fits) - peak) ** 2 for row, peak in zip(rows, peaks, strict=True))

    def rms(error: float) -> float:
        return math.sqrt(error / len(peaks))

    def fit(low: float, high: float) -> LinearFit:
        chosen = [(row, peak) for row, peak in zip(rows, peaks, strict=True) if low <= row["tokens"] <= high]
        return fit_terms([row for row, _ in chosen], [peak for _, peak in chosen])

    one = fit(-math.inf, math.inf)
    best, error = {"backward": one}, squared_error([one])
    enough = rms(error) - CONVEX_GAIN * sum(peaks) / len(peaks)
    levels = sorted({row["tokens"] for row in rows})
    shared = [(meet, meet) for meet in levels[1:-1]]
    between = list(zip(levels[1:-2], levels[2:-1], strict=True))
    for last, first in shared + between:
        fewer, more = fit(levels[0], last), fit(first, levels[-1])
        split = squared_error([fewer, more])
        if more.coefficients["tokens"] > fewer.coefficients["tokens"] and split < error and rms(split) < enough:
            best, error = {"backward": fewer, MORE_TOKENS: more}, split
    return best


@dataclass(frozen=True)
class PeakEstimate:
    """A predicted peak and what it is made of. weights/gradients/optimizer are the analytic counts; logits is the
    float32 logits copy; activations is the fitted per-token rest; `other` is the fitted constant beyond the model
    state (kernel workspaces, allocator rounding; negative where not every gradient exists at the peak). `phase`
    says where the peak falls: in forward + backward (in the forward, the decoder's or the encoder's backward where
    those are modelled apart), or in the optimizer step."""

    allocated: int
    reserved: int
    weights: int
    gradients: int
    optimizer: int
    logits: int
    activations: int
    other: int
    phase: str = "backward"

    def breakdown(self) -> dict[str, int]:
        return {
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "logits": self.logits,
            "other": self.other,
        }


@dataclass(frozen=True)
class FittedPeak:
    """Peak memory of a training step as calibrated. Each window of the step (one, "backward", or the six of
    WINDOW_TERMS where the step splits) is linear in its terms, and the forward + backward peak is the largest; the
    optimizer step's peak does not depend on the batch and is the floor (with checkpointing or small batches it can
    be the higher one). Reserved memory is the allocated peak times the caching allocator's overhead, plus what it
    keeps cached per byte of logits: their blocks, the step's largest, are freed and seldom reused whole."""

    windows: dict[str, LinearFit]
    step_allocated: int
    reserved_ratio: float
    reserved_per_logits_byte: float = 0.0

    def branches(self) -> list[tuple[str, LinearFit, Terms]]:
        return [(window, fit, window_terms(window)) for window, fit in self.windows.items()]

    def backward_peak(self, batch: int, source: int, label: int, arch: Architecture) -> tuple[str, LinearFit, float]:
        """The window that peaks highest, its fit and its predicted peak."""
        predicted = [
            (name, fit, fit.predict(terms(batch, source, label, arch))) for name, fit, terms in self.branches()
        ]
        return max(predicted, key=lambda branch: branch[2])

    def allocated(self, batch: int, source: int, label: int, arch: Architecture) -> float:
        return max(self.backward_peak(batch, source, label, arch)[2], self.step_allocated)

    def reserved(self, batch: int, source: int, label: int, arch: Architecture) -> float:
        return self.reserved_from(self.allocated(batch, source, label, arch), logits_bytes(batch, source, label, arch))

    def reserved_from(self, allocated: float, logits: int) -> float:
        """Reserved for a step whose peak allocated is `allocated` and whose float32 logits take `logits` bytes."""
        return allocated * self.reserved_ratio + logits * self.reserved_per_logits_byte


def estimate_peak(
    batch: int, source: int, label: int, arch: Architecture, state: ModelStateBytes, fit: FittedPeak
) -> PeakEstimate:
    window, branch, backward = fit.backward_peak(batch, source, label, arch)
    allocated = max(backward, fit.step_allocated)
    constant = branch.coefficients.get("constant", 0.0)
    every_logit = logits_bytes(batch, source, label, arch)
    logits = every_logit if window in LOGITS_WINDOWS else 0  # held at the peak
    return PeakEstimate(
        allocated=round(allocated),
        reserved=round(fit.reserved_from(allocated, every_logit)),
        weights=state.weights,
        gradients=state.gradients,
        optimizer=state.optimizer,
        logits=logits,
        activations=round(backward - constant - logits),
        other=round(constant - state.total),
        phase=window.replace("_", " ") if backward >= fit.step_allocated else "optimizer step",
    )


def largest_batch(fit: FittedPeak, source: int, label: int, arch: Architecture, limit: int, upper: int) -> int:
    """The largest batch whose predicted peak *reserved* (what the preflight judges) is within `limit` at these
    lengths (0: not even one row), at most `upper`."""
    return largest_fitting(lambda batch: fit.reserved(batch, source, label, arch) <= limit, upper)
