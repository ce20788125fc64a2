"""The memory model: the analytic part (weights, gradients, optimizer state) by hand and against real steps; the
per-token fit on synthetic measurements; predictions, the optimizer-step floor and the largest batch."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from memfit.config import GIB
from memfit.memory.model import (
    COUNTED_TERMS,
    WINDOW_TERMS,
    Architecture,
    FittedPeak,
    LinearFit,
    decoder_backward_terms,
    decoder_forward_terms,
    describe_architecture,
    encoder_backward_terms,
    encoder_forward_terms,
    estimate_peak,
    fit_terms,
    head_terms,
    largest_batch,
    logits_bytes,
    shape_terms,
    splits_branches,
)
from memfit.memory.state import ModelStateBytes, model_state_bytes, optimizer_state_bytes
from tests.conftest import FAST


def _real_step(model: torch.nn.Module, optimizer_name: str, inputs: dict) -> tuple[int, int]:
    """One real optimizer step: (bytes of the gradients, bytes of every tensor in the optimizer's state)."""
    from transformers.optimization import Adafactor

    trainable = [p for p in model.parameters() if p.requires_grad]
    if optimizer_name == "adamw":
        optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    else:  # as Trainer builds optim="adafactor"
        optimizer = Adafactor(trainable, lr=1e-4, scale_parameter=False, relative_step=False)
    loss = model(**inputs).loss if inputs else model(torch.ones(2, 8)).sum()
    loss.backward()
    optimizer.step()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in trainable)
    state = sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)
    )
    return grads, state


def test_two_linear_layers_counted_by_hand():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))  # fp32
    weights = (8 * 16 + 16 + 16 * 4 + 4) * 4  # 848 bytes
    state = model_state_bytes(model, "adamw")
    assert (state.weights, state.gradients) == (weights, weights)
    assert state.optimizer == 2 * weights + 4 * 4  # exp_avg, exp_avg_sq, a float32 step per tensor
    # Adafactor factors each matrix into a row and a column: (16 + 8) + (4 + 16) floats; vectors are kept whole;
    # one RMS float per tensor
    assert optimizer_state_bytes(model, "adafactor") == ((16 + 8) + 16 + (4 + 16) + 4) * 4 + 4 * 4
    assert _real_step(model, "adamw", {}) == (weights, state.optimizer)


@pytest.mark.parametrize(
    ("model", "overrides", "optimizer"),
    [
        ("tiny_seq2seq", [], "adamw"),
        ("tiny_seq2seq", [], "adafactor"),
        ("tiny_seq2seq", ["memory.weights_dtype=bf16"], "adamw"),
        ("tiny_causal", [], "adamw"),  # LoRA: only the adapters have gradients and state
    ],
)
def test_gradients_and_optimizer_state_match_a_real_step(compose_cfg, model, overrides, optimizer):
    from memfit.models import build_model, build_tokenizer

    cfg = compose_cfg(f"model={model}", *FAST, "tracking=none", *overrides)
    built = build_model(cfg, build_tokenizer(cfg.model), "cpu")
    ids = torch.randint(5, 100, (2, 12))
    predicted = model_state_bytes(built.model, optimizer)
    assert predicted.gradients == sum(p.numel() * p.element_size() for p in built.model.parameters() if p.requires_grad)
    assert _real_step(built.model, optimizer, {"input_ids": ids, "labels": ids}) == (
        predicted.gradients,
        predicted.optimizer,
    )


def test_eight_bit_adamw_state_counted_by_hand():
    # bitsandbytes: uint8 moments + a float32 absmax per 256-block for tensors of >= 4096 elements, float32 moments
    # below that and for every nn.Embedding (Trainer registers them for 32-bit state), two shared 1 KiB code maps.
    # The GPU benchmark checks the same count against a real step (benchmarks/README.md).
    model = torch.nn.Sequential(torch.nn.Embedding(100, 64), torch.nn.Linear(64, 128))
    embedding = 8 * 100 * 64
    weight = 2 * (64 * 128 + 4 * (64 * 128 // 256))
    bias = 8 * 128
    assert optimizer_state_bytes(model, "adamw_8bit") == embedding + weight + bias + 2 * 256 * 4


def test_an_optimizer_not_modelled_says_so():
    with pytest.raises(ValueError, match="memory.optimizer=sgd is not modelled"):
        optimizer_state_bytes(torch.nn.Linear(2, 2), "sgd")


# --- the per-token part ------------------------------------------------------------------------------------------
SEQ2SEQ = Architecture("seq2seq", 32128, 12, 12, 12, quadratic_attention=False)
T5_LIKE = Architecture("seq2seq", 32128, 12, 12, 12, quadratic_attention=True, relative_position_bias=True)
EAGER = Architecture("seq2seq", 32128, 12, 12, 12, quadratic_attention=True, cross_attention_scores=True)
CAUSAL = Architecture("causal", 151936, 0, 28, 12, quadratic_attention=False)


@pytest.mark.parametrize("arch", [SEQ2SEQ, T5_LIKE, EAGER, CAUSAL], ids=["seq2seq", "t5-like", "eager", "causal"])
def test_the_fit_recovers_known_coefficients_from_the_calibration_shapes(arch):
    from memfit.memory.probe_shapes import calibration_shapes

    truth = {
        "constant": 9.7e9,
        "tokens": 5.4e6,
        "encoder_tokens": 6.9e5,
        "decoder_tokens": 1.9e6,
        "attention_scores": 8.9,
        "cross_attention_scores": 3.1,
    }
    shapes = calibration_shapes(arch, 4096)
    rows = [shape_terms(s.batch, s.source, s.label, arch) for s in shapes]
    peaks = [sum(truth[name] * value for name, value in row.items()) for row in rows]
    fit = fit_terms(rows, peaks)
    assert set(fit.coefficients) == set(rows[0])
    for name, value in fit.coefficients.items():
        assert value == pytest.approx(truth[name], rel=1e-6)
    assert len(shapes) == 6 > len(rows[0])  # a probe to spare for every model
    # the fifth probe is the longest row, the sixth holds the most tokens: the fit reaches the sizes a step holds
    tokens = [s.batch * (s.source + (s.label if arch.task == "seq2seq" else 0)) for s in shapes]
    assert shapes[4].source == max(s.source for s in shapes) and tokens[5] == max(tokens)


def test_one_attention_term_counts_every_kept_score():
    """b·heads·q·k per layer, over the kinds of attention that keep scores: T5's self-attention in both stacks;
    with eager attention its cross-attention too."""
    batch, source, label, heads = 3, 512, 128, 3 * 12
    t5 = shape_terms(batch, source, label, T5_LIKE)["attention_scores"]
    assert t5 == heads * (12 * source * source + 12 * label * label)
    assert shape_terms(batch, source, label, EAGER)["attention_scores"] == t5 + heads * 12 * label * source
    assert "attention_scores" not in shape_terms(batch, source, label, SEQ2SEQ)
    # T5's cross-attention keeps a mask-and-bias tensor per layer, not its scores: a term of its own
    assert shape_terms(batch, source, label, T5_LIKE)["cross_attention_scores"] == heads * 12 * label * source
    assert "cross_attention_scores" not in shape_terms(batch, source, label, EAGER)


def test_the_fit_refuses_too_few_or_dependent_probes():
    rows = [shape_terms(2, 512, 128, SEQ2SEQ), shape_terms(4, 512, 128, SEQ2SEQ)]
    with pytest.raises(ValueError, match="needs as many probes"):
        fit_terms(rows, [1.0, 2.0])
    # batch 2 and 4 at the same lengths vary encoder and decoder tokens together: they cannot be told apart
    with pytest.raises(ValueError, match="independently"):
        fit_terms([*rows, shape_terms(8, 512, 128, SEQ2SEQ)], [1.0, 2.0, 3.0])


def test_a_peak_is_the_larger_of_backward_and_the_optimizer_step_and_reserved_scales_it():
    backward = LinearFit({"constant": 10 * GIB, "encoder_tokens": 1e5, "decoder_tokens": 1e6})
    fit = FittedPeak({"backward": backward}, step_allocated=11 * GIB, reserved_ratio=1.05)
    state = ModelStateBytes(2 * GIB, 2 * GIB, 4 * GIB)
    small = estimate_peak(1, 128, 32, SEQ2SEQ, state, fit)  # backward: 10 GiB + 13 MB + 32 MB < the step's 11 GiB
    assert small.phase == "optimizer step" and small.allocated == 11 * GIB
    big = estimate_peak(16, 1024, 256, SEQ2SEQ, state, fit)
    expected = 10 * GIB + 1e5 * 16 * 1024 + 1e6 * 16 * 256
    assert big.phase == "backward" and big.allocated == round(expected)
    assert big.reserved == round(1.05 * big.allocated)
    cached = replace(fit, reserved_per_logits_byte=0.5)  # the allocator keeps half a byte cached per logits byte
    assert estimate_peak(16, 1024, 256, SEQ2SEQ, state, cached).reserved == round(1.05 * big.allocated + big.logits / 2)
    assert big.logits == 4 * 16 * 256 * SEQ2SEQ.vocab_size
    assert big.activations == round(expected - 10 * GIB - big.logits) and big.other == 10 * GIB - state.total


def test_the_largest_batch_predicted_to_fit_is_on_the_limit():
    backward = LinearFit({"constant": 10 * GIB, "encoder_tokens": 1e5, "decoder_tokens": 1e6})
    fit = FittedPeak({"backward": backward}, step_allocated=11 * GIB, reserved_ratio=1.05)
    state = ModelStateBytes(0, 0, 0)
    limit = 23.5 * GIB
    for model in (fit, replace(fit, reserved_per_logits_byte=0.8)):
        batch = largest_batch(model, 1024, 256, SEQ2SEQ, int(limit), upper=512)
        assert 0 < batch < 512
        assert estimate_peak(batch, 1024, 256, SEQ2SEQ, state, model).reserved <= limit
        assert estimate_peak(batch + 1, 1024, 256, SEQ2SEQ, state, model).reserved > limit
    assert largest_batch(fit, 1024, 256, SEQ2SEQ, int(11 * GIB), upper=512) == 0  # the step alone is over
    assert largest_batch(fit, 8, 8, SEQ2SEQ, int(limit), upper=64) == 64


# T5 under gradient checkpointing: the largest of six windows of the step (coefficients of the size fitted on an H200)
WINDOW_TRUTH = {
    "encoder_forward": {"constant": 3.9e9, "encoder_tokens": 5.5e4, "encoder_scores": 9.6},
    "decoder_forward": {"constant": 4.2e9, "encoder_tokens": 5.0e4, "decoder_tokens": 4.2e4, "decoder_scores": 10.7},
    "head_forward": {"constant": 4.2e9, "encoder_tokens": 4.9e4, "decoder_tokens": 3.0e5},
    "head_backward": {"constant": 3.7e9, "encoder_tokens": 4.9e4, "decoder_tokens": 3.6e5},
    "decoder_backward": {"constant": 3.8e9, "encoder_tokens": 5.9e4, "decoder_tokens": 8.2e4, "decoder_scores": 14.1},
    "encoder_backward": {"constant": 3.85e9, "encoder_tokens": 5.4e4, "encoder_scores": 15.8},
}


def _windowed_fit() -> FittedPeak:
    windows = {window: LinearFit({**truth, **COUNTED_TERMS}) for window, truth in WINDOW_TRUTH.items()}
    return FittedPeak(windows, 3.5e9, 1.08, reserved_per_logits_byte=1.1)


def test_seq2seq_under_checkpointing_splits_into_windows_unless_eager_attention_keeps_its_scores():
    assert splits_branches(T5_LIKE, True) and splits_branches(SEQ2SEQ, True) and not splits_branches(EAGER, True)
    assert not splits_branches(T5_LIKE, False) and not splits_branches(SEQ2SEQ, False)
    assert not splits_branches(Architecture("causal", 100, 0, 2, 2, quadratic_attention=True), True)


def test_windows_without_kept_scores_are_fitted_from_the_six_shapes():
    """Pegasus/BART (sdpa): no window has a scores term, so the six shapes recover each window's two or three, and
    the step peaks where the forward's end holds more than the head's backward at few label tokens."""
    from memfit.memory.calibration import fit_peak
    from memfit.memory.probe_shapes import calibration_shapes

    shapes = calibration_shapes(SEQ2SEQ, 4096, batch_scale=4, checkpointed=True)
    assert len(shapes) == 6
    truth = {w: {k: v for k, v in terms.items() if not k.endswith("_scores")} for w, terms in WINDOW_TRUTH.items()}
    truth["head_forward"] = {"constant": 5.0e9, "encoder_tokens": 3.0e4, "decoder_tokens": 1.0e5}
    measured = [
        {"batch": s.batch, "source": s.source, "label": s.label, "step_allocated": 1.0}
        | {
            f"{w}_allocated": LinearFit(t).predict(WINDOW_TERMS[w](s.batch, s.source, s.label, SEQ2SEQ))
            for w, t in truth.items()
        }
        for s in shapes
    ]
    for m in measured:
        m["allocated"] = max(m[f"{w}_allocated"] for w in truth)
        m["reserved"] = 1.1 * m["allocated"]
    fit = fit_peak(SEQ2SEQ, measured, checkpointed=True)
    for window, terms in truth.items():
        assert fit.windows[window].coefficients == pytest.approx(terms, rel=1e-6)
    few_labels, many = (4, 960, 32), (16, 512, 512)
    assert fit.backward_peak(*few_labels, SEQ2SEQ)[0] == "head_forward"
    assert fit.backward_peak(*many, SEQ2SEQ)[0] == "head_backward"


def test_each_window_fit_recovers_known_coefficients_from_the_branch_shapes():
    """Four probes, each measured in six windows: every window's three or four free terms are recovered, the
    position biases counted rather than fitted."""
    from memfit.memory.probe_shapes import calibration_shapes

    shapes = calibration_shapes(T5_LIKE, 4096, batch_scale=4, checkpointed=True)
    counted = COUNTED_TERMS
    assert list(WINDOW_TERMS) == list(WINDOW_TRUTH)  # the order the marker measures them in
    for window, terms in WINDOW_TERMS.items():
        truth = {**WINDOW_TRUTH[window], **counted}
        rows = [terms(s.batch, s.source, s.label, T5_LIKE) for s in shapes]
        assert set(rows[0]) == set(truth)
        fit = fit_terms(rows, [LinearFit(truth).predict(row) for row in rows], counted)
        assert fit.coefficients == pytest.approx(truth, rel=1e-6)
    assert len({(s.batch, s.source) for s in shapes}) == 4  # batch and source crossed, no pair probed twice


def test_t5_position_biases_are_counted_without_the_batch():
    """transformers 5 keeps each stack's bias as (1, heads, q, k): the lookup in the bias's dtype (4 bytes in
    float32), its gradient where backward has reached it, the int64 buckets (8 bytes per q·k, over the heads), and
    the decoder's zero cross-attention bias (1, heads, l, s)."""
    heads, s, l = 12, 512, 128  # noqa: E741 - label length
    kept, with_gradient = 4 + 8 / heads, 8 + 8 / heads

    def biases(terms) -> float:
        return terms(3, s, l, T5_LIKE)["position_biases"]

    assert biases(encoder_forward_terms) == pytest.approx(heads * kept * s * s)
    assert biases(decoder_forward_terms) == biases(head_terms)
    assert biases(head_terms) == pytest.approx(heads * (kept * (s * s + l * l) + 4 * l * s))
    assert biases(decoder_backward_terms) == pytest.approx(heads * (kept * s * s + with_gradient * l * l + 8 * l * s))
    assert biases(encoder_backward_terms) == pytest.approx(heads * with_gradient * s * s)
    assert decoder_backward_terms(3, s, l, T5_LIKE)["decoder_scores"] == 3 * heads * l * l  # one layer's, per row
    bf16 = replace(T5_LIKE, bias_element_bytes=2)
    assert encoder_backward_terms(1, s, l, bf16)["position_biases"] == pytest.approx(heads * (4 + 8 / heads) * s * s)


def test_a_windowed_peak_is_the_largest_window_and_the_largest_batch_the_smallest_over_them():
    fit, state = _windowed_fit(), ModelStateBytes(1 * GIB, 1 * GIB, 2 * GIB)
    long_source = estimate_peak(2, 3072, 128, T5_LIKE, state, fit)
    long_label = estimate_peak(4, 256, 2048, T5_LIKE, state, fit)
    many_rows = estimate_peak(64, 256, 256, T5_LIKE, state, fit)
    assert long_source.phase == "encoder backward" and long_source.logits == 0  # the logits are freed by then
    assert long_label.phase == "decoder backward" and long_label.logits == 0
    assert many_rows.phase == "head backward" and many_rows.logits == logits_bytes(64, 256, 256, T5_LIKE)
    encoder = LinearFit({**WINDOW_TRUTH["encoder_backward"], **COUNTED_TERMS})
    assert long_source.allocated == round(encoder.predict(encoder_backward_terms(2, 3072, 128, T5_LIKE)))
    assert long_source.reserved == round(1.08 * long_source.allocated + 1.1 * logits_bytes(2, 3072, 128, T5_LIKE))
    small = estimate_peak(1, 64, 16, T5_LIKE, state, fit)
    assert small.phase == "optimizer step" or small.allocated >= 3.5e9
    limit = int(20 * GIB)
    for source, label in ((3072, 128), (256, 2048), (1024, 512)):
        batch = largest_batch(fit, source, label, T5_LIKE, limit, upper=512)
        assert 0 < batch < 512
        assert estimate_peak(batch, source, label, T5_LIKE, state, fit).reserved <= limit
        assert estimate_peak(batch + 1, source, label, T5_LIKE, state, fit).reserved > limit
    # the batch-free position bias alone over the limit: not one row fits
    assert largest_batch(fit, 40000, 128, T5_LIKE, limit, upper=512) == 0


def test_architectures_are_read_from_built_models(compose_cfg):
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    from memfit.models import build_model, build_tokenizer

    for name, expected in [("tiny_seq2seq", ("seq2seq", 2, 2, 2)), ("tiny_causal", ("causal", 0, 2, 2))]:
        cfg = compose_cfg(f"model={name}", *FAST, "tracking=none")
        arch = describe_architecture(build_model(cfg, build_tokenizer(cfg.model), "cpu").model, cfg.model.task)
        assert (arch.task, arch.encoder_layers, arch.decoder_layers, arch.heads) == expected
        assert not arch.quadratic_attention and arch.vocab_size == cfg.model.architecture.vocab_size
    t5 = AutoModelForSeq2SeqLM.from_config(
        AutoConfig.for_model("t5", d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, vocab_size=64)
    )
    t5_arch = describe_architecture(t5, "seq2seq")
    assert t5_arch.quadratic_attention and t5_arch.relative_position_bias  # its position bias is kept per score
    assert t5_arch.bias_element_bytes == 4 and describe_architecture(t5.bfloat16(), "seq2seq").bias_element_bytes == 2
    # T5's cross-attention has no learned bias: unless attention is eager it takes the memory-efficient kernel
    assert t5_arch.cross_attention_scores == (t5.config._attn_implementation == "eager")
