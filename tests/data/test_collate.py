"""memory.causal_padding_mask: a causal LM's right-padded batch without its padding mask trains the same."""

from __future__ import annotations

import pytest
import torch

from memfit.data import CountingCollator
from memfit.models import build_model, build_tokenizer
from tests.conftest import draw_lora_up_weights

# three rows of unequal length: the shorter two are padded on the right
ROWS = [list(range(1000, 1000 + n)) for n in (24, 17, 9)]


def _features() -> list[dict]:
    return [{"input_ids": r, "attention_mask": [1] * len(r), "labels": list(r)} for r in ROWS]


def _model_and_tokenizer(compose_cfg):
    cfg = compose_cfg("trainer.device=cpu", "model=tiny_causal", "memory=balanced", "memory.precision=fp32")
    tokenizer = build_tokenizer(cfg.model)
    torch.manual_seed(0)
    model = build_model(cfg, tokenizer, "cpu").model
    draw_lora_up_weights(model)
    return model.train(), tokenizer


def _loss_and_grads(model, batch: dict) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_a_right_padded_causal_batch_without_its_mask_gives_the_same_loss_and_gradients(compose_cfg):
    model, tokenizer = _model_and_tokenizer(compose_cfg)
    masked = CountingCollator(tokenizer, 8, "causal", padding_mask=True)
    unmasked = CountingCollator(tokenizer, 8, "causal", padding_mask=False)
    with_mask, without = masked.pad(_features()), unmasked.pad(_features())
    assert unmasked.drops_padding_mask and not masked.drops_padding_mask
    assert "attention_mask" in with_mask and "attention_mask" not in without
    assert not with_mask["attention_mask"].bool().all()  # the batch is padded: the mask says something
    torch.testing.assert_close(with_mask["input_ids"], without["input_ids"])

    loss, grads = _loss_and_grads(model, with_mask)
    loss_unmasked, grads_unmasked = _loss_and_grads(model, without)
    assert loss_unmasked == pytest.approx(loss, abs=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_unmasked[name], grad, rtol=1e-5, atol=1e-6, msg=name)

    # left padding: the causal mask would let real tokens attend to the padding before them, so the mask stays
    tokenizer.padding_side = "left"
    assert "attention_mask" in CountingCollator(tokenizer, 8, "causal", padding_mask=False).pad(_features())


def test_seq2seq_batches_keep_their_mask(compose_cfg):
    cfg = compose_cfg("trainer.device=cpu", "model=tiny_seq2seq")
    collator = CountingCollator(build_tokenizer(cfg.model), 8, "seq2seq", padding_mask=False)
    assert not collator.drops_padding_mask
    assert "attention_mask" in collator.pad(_features())


def test_the_preflight_s_probe_batches_are_padded_as_training_takes_them(compose_cfg):
    from memfit.data.audit import BatchShape
    from memfit.memory.probe import make_batch

    cfg = compose_cfg("trainer.device=cpu", "model=tiny_causal")
    tokenizer = build_tokenizer(cfg.model)
    for padding_mask in (True, False):
        collator = CountingCollator(tokenizer, 8, "causal", padding_mask=padding_mask)
        batch = make_batch(BatchShape(3, 16, 16), collator.pad, "causal", len(tokenizer), "cpu")
        assert batch["input_ids"].shape == (3, 16)
        assert ("attention_mask" in batch) is padding_mask  # the probe's short last row is padded, as in training
