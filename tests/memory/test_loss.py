"""The chunked head + cross-entropy equals the standard loss, in value and gradients, without holding the logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memfit.memory.loss import chunked_cross_entropy


def _head(vocab: int = 97, width: int = 16, rows: tuple[int, int] = (3, 11), bias: bool = True, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*rows, width, generator=generator, requires_grad=True)
    weight = torch.randn(vocab, width, generator=generator, requires_grad=True)
    head_bias = torch.randn(vocab, generator=generator, requires_grad=True) if bias else None
    labels = torch.randint(0, vocab, rows, generator=generator)
    labels[0, 7:] = -100  # padding, as the collator pads labels
    labels[2, 3] = -100
    return hidden, weight, head_bias, labels


def _grads(*tensors: torch.Tensor | None) -> list[torch.Tensor]:
    return [t.grad.clone() for t in tensors if t is not None]


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias", [True, False])  # BART/Pegasus add final_logits_bias; T5 and Qwen heads have none
@pytest.mark.parametrize("chunk", [1, 5, 33, 4096])  # one row, uneven chunks, all rows at once
def test_the_chunked_loss_and_its_gradients_equal_the_standard_ones(smoothing, bias, chunk):
    hidden, weight, head_bias, labels = _head(bias=bias)
    logits = hidden @ weight.t() + (head_bias if bias else 0)
    standard = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), label_smoothing=smoothing
    )
    standard.backward()
    expected = _grads(hidden, weight, head_bias)
    for t in (hidden, weight, head_bias):
        if t is not None:
            t.grad = None

    chunked = chunked_cross_entropy(hidden, weight, labels, head_bias, chunk=chunk, label_smoothing=smoothing)
    chunked.backward()
    torch.testing.assert_close(chunked, standard, rtol=1e-5, atol=1e-6)
    for got, want in zip(_grads(hidden, weight, head_bias), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_t5s_tied_head_rescales_the_hidden_states_before_the_head_and_the_gradient_flows_through_it():
    """T5 with tied embeddings multiplies the decoder's output by d_model ** -0.5 before the head: done by the
    caller on the hidden states, the gradient of that scaling comes back through the chunked loss."""
    hidden, weight, _, labels = _head(bias=False)
    scale = hidden.shape[-1] ** -0.5
    standard = F.cross_entropy(((hidden * scale) @ weight.t()).reshape(-1, weight.shape[0]), labels.reshape(-1))
    standard.backward()
    expected = _grads(hidden, weight)
    hidden.grad = weight.grad = None
    chunked_cross_entropy(hidden * scale, weight, labels, chunk=7).backward()
    for got, want in zip(_grads(hidden, weight), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_only_its_inputs_are_held_for_the_backward_pass_not_the_logits():
    """What a loss keeps between forward and backward is what training holds at its peak: the standard loss keeps
    logits-sized tensors (N × V), the chunked one its inputs and one float per row."""
    hidden, weight, head_bias, labels = _head(vocab=5000, width=8, rows=(4, 64))

    def held_bytes(loss_of) -> int:
        saved: list[int] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saved.append(tensor.numel() * tensor.element_size())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss_of()
        return sum(saved)

    logits_bytes = 4 * 64 * 5000 * 4
    standard = held_bytes(
        lambda: F.cross_entropy((hidden @ weight.t() + head_bias).reshape(-1, 5000), labels.reshape(-1))
    )
    chunked = held_bytes(lambda: chunked_cross_entropy(hidden, weight, labels, head_bias, chunk=32))
    assert standard >= logits_bytes  # at least one N × V float32 tensor
    inputs = sum(t.numel() * t.element_size() for t in (hidden, weight, head_bias, labels))
    assert chunked <= inputs + 4 * 64 * 8 + 64 < logits_bytes / 4


def test_under_autocast_the_heads_products_run_in_its_dtype_as_the_standard_head_does():
    """A run hands the loss float32 hidden states (Pegasus' final LayerNorm runs in float32 under autocast) and a
    float32 weight: the products run in autocast's dtype, as the standard head's would, over an odd vocabulary
    padded for alignment, and the result and gradients are the standard head's within bf16 rounding."""
    hidden, weight, head_bias, labels = _head(vocab=97, width=32, rows=(4, 24))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(hidden, weight, head_bias)
    assert logits.dtype == torch.bfloat16
    standard = F.cross_entropy(logits.reshape(-1, 97).float(), labels.reshape(-1))
    standard.backward()
    expected = _grads(hidden, weight, head_bias)
    for t in (hidden, weight, head_bias):
        t.grad = None
    chunked = chunked_cross_entropy(hidden, weight, labels, head_bias, chunk=7, dtype=torch.bfloat16)
    chunked.backward()
    torch.testing.assert_close(chunked, standard, rtol=2e-2, atol=2e-2)
    for got, want in zip(_grads(hidden, weight, head_bias), expected, strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=5e-2, atol=2e-3)


def test_it_runs_the_standard_heads_three_products_and_one_without_gradients():
    """The gradients are made chunk by chunk in the forward pass: three products over the (padded) vocabulary, as
    the standard head's forward and backward; evaluation (no gradients) runs one."""
    from torch.utils.flop_counter import FlopCounterMode

    hidden, weight, head_bias, labels = _head(vocab=120, width=16, rows=(3, 40), bias=False)
    one_product = 2 * 120 * 128 * 16  # rows × vocabulary padded to 128 × width, a multiply and an add each

    def flops(run) -> int:
        with FlopCounterMode(display=False) as counter:
            run()
        return counter.get_total_flops()

    assert (
        flops(lambda: chunked_cross_entropy(hidden, weight, labels, head_bias, chunk=16).backward()) == 3 * one_product
    )
    with torch.no_grad():
        assert flops(lambda: chunked_cross_entropy(hidden, weight, labels, head_bias, chunk=16)) == one_product


def test_a_second_backward_through_it_is_refused_with_one_line():
    hidden, weight, head_bias, labels = _head()
    loss = chunked_cross_entropy(hidden, weight, labels, head_bias, chunk=5)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


TINY_T5 = (
    "model=t5_base",
    *(f"model.architecture.{k}={v}" for k, v in dict(d_model=32, d_kv=8, d_ff=64, num_heads=2).items()),
    "model.architecture.num_layers=2",
    "model.architecture.num_decoder_layers=2",
)


MODELS = [
    ("model=tiny_seq2seq",),  # BART: final_logits_bias beside the head
    TINY_T5,  # T5: tied embeddings, the decoder's output rescaled before the head
    ("model=tiny_causal",),  # Qwen2 under LoRA: labels shifted, the peft wrapper
]
MODEL_IDS = ["bart", "t5", "qwen2-lora"]


def assert_model_loss_equals_its_own(compose_cfg, overrides: tuple[str, ...], kind: str, device: str) -> None:
    """memfit.memory.loss.model_loss (`kind`: chunked or fused) equals the model's own loss, and its gradients the
    model's own, in fp32, over a padded batch of three samples; the head is the model's own again after."""
    from memfit.data import CountingCollator
    from memfit.memory.loss import model_loss
    from memfit.models import build_model, build_tokenizer
    from tests.conftest import FAST

    cfg = compose_cfg(*overrides, *FAST, "memory.precision=fp32")
    tokenizer = build_tokenizer(cfg.model)
    model = build_model(cfg, tokenizer, device).model.eval()  # eval: no dropout, the two passes see one function
    collator = CountingCollator(tokenizer, None, cfg.model.task)
    features = []
    for n, (source_words, label_words) in enumerate([(3, 2), (9, 7), (5, 12)]):
        source = tokenizer(f"sample {n} " + "word " * source_words)["input_ids"]
        label = tokenizer(text_target="summary " * label_words)["input_ids"]
        if cfg.model.task == "causal":
            features.append({"input_ids": source + label, "labels": [-100] * len(source) + label})
        else:
            features.append({"input_ids": source, "labels": label})
        features[-1]["attention_mask"] = [1] * len(features[-1]["input_ids"])
    batch = {key: value.to(device) for key, value in collator(features).items()}
    trainable = [p for p in model.parameters() if p.requires_grad]

    standard = model(**batch).loss
    expected = torch.autograd.grad(standard, trainable)
    loss = model_loss(model, batch, cfg.model.task, chunk=5, kind=kind)
    got = torch.autograd.grad(loss, trainable)
    torch.testing.assert_close(loss, standard, rtol=1e-5, atol=1e-6)
    for want, have in zip(expected, got, strict=True):
        torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-6)
    assert model(**batch).logits.shape[-1] == model.config.vocab_size  # the head is the model's own again

    # told how many label positions there are, as training tells it (the collator counts them on the host), the loss
    # picks the same rows without reading the labels back from the device
    collator.consume()
    told = model_loss(model, batch, cfg.model.task, chunk=5, kind=kind, positions=collator.last_loss_positions)
    torch.testing.assert_close(told, standard, rtol=1e-5, atol=1e-6)
    for want, have in zip(expected, torch.autograd.grad(told, trainable), strict=True):
        torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("overrides", MODELS, ids=MODEL_IDS)
def test_a_models_chunked_loss_and_gradients_equal_its_own_loss(compose_cfg, overrides):
    assert_model_loss_equals_its_own(compose_cfg, overrides, "chunked", "cpu")


def test_a_causal_lms_head_runs_over_its_label_positions_only(compose_cfg):
    """A causal LM's prompt positions (labels -100) make no logits: two batches of one shape, one labelling 12
    positions and one 4, differ by the head's product over the 8 positions between them (the standard head makes
    logits for all 24 either way)."""
    from torch.utils.flop_counter import FlopCounterMode

    from memfit.memory.loss import VOCAB_ALIGN, model_loss
    from memfit.models import build_model, build_tokenizer
    from tests.conftest import FAST

    cfg = compose_cfg("model=tiny_causal", *FAST, "memory.precision=fp32")
    model = build_model(cfg, build_tokenizer(cfg.model), "cpu").model.eval()
    input_ids = torch.arange(100, 124).unsqueeze(0)

    def head_flops(labelled: int) -> int:
        labels = input_ids.clone()
        labels[:, : 24 - labelled] = -100  # the prompt
        batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model_loss(model, batch, "causal", chunk=5)
        return counter.get_total_flops()

    padded_vocab = -(-model.config.vocab_size // VOCAB_ALIGN) * VOCAB_ALIGN
    assert head_flops(12) - head_flops(4) == 8 * 2 * padded_vocab * model.config.hidden_size


def test_a_run_with_the_chunked_loss_trains_and_evaluates_as_the_standard_one(compose_cfg):
    """The preflight, three training steps and Seq2SeqTrainer's evaluation, with the chunked loss: the same losses as
    with the model's own (the same seed, fp32), and a calibration of its own (memory.loss is part of the calibration
    key). The causal path (labels shifted, LoRA) is checked against its own loss above."""
    model = "tiny_seq2seq"
    from memfit.memory.calibration import POLICY_KNOBS
    from memfit.run import run
    from tests.conftest import FAST

    standard = run(compose_cfg(f"model={model}", *FAST, "tracking=none"))
    chunked = run(compose_cfg(f"model={model}", *FAST, "tracking=none", "memory.loss=chunked"))
    assert standard.status == chunked.status == "ok" and chunked.steps == 3
    assert chunked.final_loss == pytest.approx(standard.final_loss, rel=1e-4)
    assert chunked.eval_loss == pytest.approx(standard.eval_loss, rel=1e-4)
    assert chunked.worst_case_peak_gib > 0 and "loss" in POLICY_KNOBS


@pytest.mark.parametrize("task", ["causal", "seq2seq"])
def test_label_rows_told_the_count_pick_the_rows_that_counting_on_the_device_picks(task):
    """The rows whose loss counts (a causal LM's targets are the next position's labels), picked by position: the
    same rows, in the same order, with the count from the host as without it; a batch without labels keeps its rows."""
    from memfit.data.collate import loss_positions
    from memfit.memory.loss import label_rows

    hidden = torch.randn(3, 7, 4)
    labels = torch.randint(0, 50, (3, 7))
    labels[0, :3] = labels[1, 5:] = labels[2, :] = -100  # a prompt, padding, a row without labels
    rows, targets = label_rows(hidden, labels, task)
    told_rows, told_targets = label_rows(hidden, labels, task, int(loss_positions(labels, task)))
    if task == "causal":
        expected = [(0, 2), (0, 3), (0, 4), (0, 5), (1, 0), (1, 1), (1, 2), (1, 3)]
    else:
        expected = [(0, 3), (0, 4), (0, 5), (0, 6), (1, 0), (1, 1), (1, 2), (1, 3), (1, 4)]
    shift = 1 if task == "causal" else 0
    assert torch.equal(rows, torch.stack([hidden[b, t] for b, t in expected]))
    assert targets.tolist() == [int(labels[b, t + shift]) for b, t in expected]
    assert torch.equal(told_rows, rows) and torch.equal(told_targets, targets)

    unlabelled = torch.full((2, 5), -100)
    kept, kept_labels = label_rows(hidden[:2, :5], unlabelled, task, 0)
    assert kept.shape == (2, 5, 4) and bool((kept_labels == -100).all())
