"""The memory model: the analytic part (weights, gradients, optimizer state) by hand and against real steps; the
per-token fit on synthetic measurements; predictions, the optimizer-step floor and the largest batch."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from memfit.memory_model import (
    COUNTED_TERMS,
    Architecture,
    FittedPeak,
    LinearFit,
    ModelStateBytes,
    decoder_branch_terms,
    describe_architecture,
    encoder_branch_terms,
    estimate_peak,
    fit_terms,
    forward_terms,
    largest_batch,
    model_state_bytes,
    optimizer_state_bytes,
    shape_terms,
    splits_branches,
)
from memfit.meter import GIB

from .conftest import FAST


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
    from memfit.calibration import calibration_shapes

    truth = {
        "constant": 9.7e9,
        "tokens": 5.4e6,
        "encoder_tokens": 6.9e5,
        "decoder_tokens": 1.9e6,
        "attention_scores": 8.9,
    }
    shapes = calibration_shapes(arch, 4096)
    rows = [shape_terms(s.batch, s.source, s.label, arch) for s in shapes]
    peaks = [sum(truth[name] * value for name, value in row.items()) for row in rows]
    fit = fit_terms(rows, peaks)
    assert set(fit.coefficients) == set(rows[0])
    for name, value in fit.coefficients.items():
        assert value == pytest.approx(truth[name], rel=1e-6)
    assert len(shapes) == 4  # one probe per term, attention or not


def test_one_attention_term_counts_every_kept_score():
    """b·heads·q·k per layer, over the kinds of attention that keep scores: T5's self-attention in both stacks;
    with eager attention its cross-attention too."""
    batch, source, label, heads = 3, 512, 128, 3 * 12
    t5 = shape_terms(batch, source, label, T5_LIKE)["attention_scores"]
    assert t5 == heads * (12 * source * source + 12 * label * label)
    assert shape_terms(batch, source, label, EAGER)["attention_scores"] == t5 + heads * 12 * label * source
    assert "attention_scores" not in shape_terms(batch, source, label, SEQ2SEQ)


def test_the_fit_refuses_too_few_or_dependent_probes():
    rows = [shape_terms(2, 512, 128, SEQ2SEQ), shape_terms(4, 512, 128, SEQ2SEQ)]
    with pytest.raises(ValueError, match="needs as many probes"):
        fit_terms(rows, [1.0, 2.0])
    # batch 2 and 4 at the same lengths vary encoder and decoder tokens together: they cannot be told apart
    with pytest.raises(ValueError, match="independently"):
        fit_terms([*rows, shape_terms(8, 512, 128, SEQ2SEQ)], [1.0, 2.0, 3.0])


def test_a_peak_is_the_larger_of_backward_and_the_optimizer_step_and_reserved_scales_it():
    backward = LinearFit({"constant": 10 * GIB, "encoder_tokens": 1e5, "decoder_tokens": 1e6})
    fit = FittedPeak(backward, step_allocated=11 * GIB, reserved_ratio=1.05)
    state = ModelStateBytes(2 * GIB, 2 * GIB, 4 * GIB)
    small = estimate_peak(1, 128, 32, SEQ2SEQ, state, fit)  # backward: 10 GiB + 13 MB + 32 MB < the step's 11 GiB
    assert small.phase == "optimizer step" and small.allocated == 11 * GIB
    big = estimate_peak(16, 1024, 256, SEQ2SEQ, state, fit)
    expected = 10 * GIB + 1e5 * 16 * 1024 + 1e6 * 16 * 256
    assert big.phase == "backward" and big.allocated == round(expected)
    assert big.reserved == round(1.05 * big.allocated)
    assert big.logits == 4 * 16 * 256 * SEQ2SEQ.vocab_size
    assert big.activations == round(expected - 10 * GIB - big.logits) and big.other == 10 * GIB - state.total


def test_the_largest_batch_predicted_to_fit_is_on_the_limit():
    backward = LinearFit({"constant": 10 * GIB, "encoder_tokens": 1e5, "decoder_tokens": 1e6})
    fit = FittedPeak(backward, step_allocated=11 * GIB, reserved_ratio=1.05)
    state = ModelStateBytes(0, 0, 0)
    limit = 23.5 * GIB
    batch = largest_batch(fit, 1024, 256, SEQ2SEQ, int(limit), upper=512)
    assert estimate_peak(batch, 1024, 256, SEQ2SEQ, state, fit).reserved <= limit
    assert estimate_peak(batch + 1, 1024, 256, SEQ2SEQ, state, fit).reserved > limit
    assert largest_batch(fit, 1024, 256, SEQ2SEQ, int(11 * GIB), upper=512) == 0  # the step alone is over
    assert largest_batch(fit, 8, 8, SEQ2SEQ, int(limit), upper=64) == 64


# T5 under gradient checkpointing: the larger of two branches of backward
DECODER_TRUTH = {"constant": 4.1e9, "encoder_tokens": 4.0e4, "decoder_tokens": 3.0e5, "attention_scores": 20.0}
ENCODER_TRUTH = {"constant": 3.6e9, "encoder_tokens": 5.5e4, "attention_scores": 16.0}
FORWARD_TRUTH = {"constant": 3.9e9, "encoder_tokens": 3.0e4, "decoder_tokens": 2.5e5, "attention_scores": 9.0}


def _branched_fit() -> FittedPeak:
    counted = COUNTED_TERMS
    decoder, encoder, forward = (LinearFit({**t, **counted}) for t in (DECODER_TRUTH, ENCODER_TRUTH, FORWARD_TRUTH))
    return FittedPeak(decoder, 3.5e9, 1.05, encoder, forward)


def test_only_t5_under_checkpointing_splits_into_windows():
    assert splits_branches(T5_LIKE, True) and not splits_branches(EAGER, True)  # measured for T5 only
    assert not splits_branches(T5_LIKE, False) and not splits_branches(SEQ2SEQ, True)
    assert not splits_branches(Architecture("causal", 100, 0, 2, 2, quadratic_attention=True), True)


def test_each_branch_fit_recovers_known_coefficients_from_the_branch_shapes():
    """Four probes, each measured in three windows: the decoder's four free terms, the encoder's three and the
    forward's four are recovered, the position biases counted rather than fitted."""
    from memfit.calibration import calibration_shapes

    shapes = calibration_shapes(T5_LIKE, 4096, batch_scale=4, branches=True)
    counted = COUNTED_TERMS
    for truth, terms in (
        (DECODER_TRUTH, decoder_branch_terms),
        (ENCODER_TRUTH, encoder_branch_terms),
        (FORWARD_TRUTH, forward_terms),
    ):
        rows = [terms(s.batch, s.source, s.label, T5_LIKE) for s in shapes]
        peaks = [LinearFit({**truth, **counted}).predict(row) for row in rows]
        fit = fit_terms(rows, peaks, counted)
        every = {**truth, **counted}
        assert fit.coefficients == pytest.approx({name: every[name] for name in rows[0]}, rel=1e-6)
    assert len({(s.batch, s.source) for s in shapes}) == 4  # batch and source crossed, no pair probed twice


def test_t5_position_biases_are_counted_without_the_batch():
    """transformers 5 keeps each stack's bias as (1, heads, q, k): the lookup in the bias's dtype (4 bytes in
    float32), its gradient where backward has reached it, the int64 buckets (8 bytes per q·k, over the heads), and
    the decoder's zero cross-attention bias (1, heads, l, s)."""
    heads, s, l = 12, 512, 128  # noqa: E741 - label length
    kept, with_gradient = 4 + 8 / heads, 8 + 8 / heads
    assert encoder_branch_terms(3, s, l, T5_LIKE)["position_biases"] == pytest.approx(heads * with_gradient * s * s)
    assert forward_terms(3, s, l, T5_LIKE)["position_biases"] == pytest.approx(
        heads * (kept * (s * s + l * l) + 4 * l * s)
    )
    assert decoder_branch_terms(3, s, l, T5_LIKE)["position_biases"] == pytest.approx(
        heads * (kept * s * s + 8 * l * s)
    )
    assert decoder_branch_terms(3, s, l, T5_LIKE)["attention_scores"] == heads * l * l  # batch-free here
    bf16 = replace(T5_LIKE, bias_element_bytes=2)
    assert encoder_branch_terms(1, s, l, bf16)["position_biases"] == pytest.approx(heads * (4 + 8 / heads) * s * s)


def test_a_branched_peak_is_the_larger_branch_and_the_largest_batch_the_smaller_over_both():
    fit, state = _branched_fit(), ModelStateBytes(1 * GIB, 1 * GIB, 2 * GIB)
    long_source = estimate_peak(2, 3072, 128, T5_LIKE, state, fit)
    long_label = estimate_peak(2, 256, 2048, T5_LIKE, state, fit)
    assert long_source.phase == "encoder backward" and long_source.logits == 0  # the logits are freed by then
    assert long_label.phase == "decoder backward" and long_label.logits == 4 * 2 * 2048 * T5_LIKE.vocab_size
    encoder = LinearFit({**ENCODER_TRUTH, **COUNTED_TERMS})
    assert long_source.allocated == round(encoder.predict(encoder_branch_terms(2, 3072, 128, T5_LIKE)))
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
