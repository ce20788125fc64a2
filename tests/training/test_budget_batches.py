"""Training on budget-shaped micro-batches: one optimizer step over micro-batches of different sizes has the
gradient of the mean loss per label token over all of the step's samples (memfit.training.trainer)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memfit.data import CountingCollator
from memfit.data.collate import loss_positions
from memfit.data.packing import MicroBatches, TokenStepSampler, sample_lengths
from memfit.memory.policy import training_arguments
from memfit.models import build_model, build_tokenizer
from memfit.training.trainer import build_trainer
from tests.conftest import FAST

DROPOUTS = {
    "tiny_seq2seq": ("dropout", "attention_dropout", "activation_dropout"),
    "tiny_causal": ("attention_dropout",),
}


def _features(tokenizer, task: str) -> list[dict]:
    """Four samples of unequal sources and labels (a causal LM: prompt masked, response trained on)."""
    features = []
    for n, (source_words, label_words) in enumerate([(3, 2), (9, 7), (5, 12), (14, 4)]):
        source = tokenizer(f"sample {n} " + "word " * source_words)["input_ids"]
        label = tokenizer(text_target="summary " * label_words)["input_ids"]
        if task == "causal":
            features.append({"input_ids": source + label, "labels": [-100] * len(source) + label})
        else:
            features.append({"input_ids": source, "labels": label})
        features[-1]["attention_mask"] = [1] * len(features[-1]["input_ids"])
    return features


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _budget_trainer(compose_cfg, tmp_path, model_name: str) -> tuple:
    """(task, tokenizer, model, collator, trainer, features) of a budget-shaped run of 4 samples a step, without
    dropout (the step and the direct computation see one function)."""
    no_dropout = [f"+model.architecture.{name}=0.0" for name in DROPOUTS[model_name]]
    cfg = compose_cfg(f"model={model_name}", *FAST, *no_dropout, "trainer.batching=budget", "trainer.batch_size=4")
    task = cfg.model.task
    tokenizer = build_tokenizer(cfg.model)
    model = build_model(cfg, tokenizer, "cpu").model
    collator = CountingCollator(tokenizer, None, task)
    args = training_arguments(cfg, "cpu", str(tmp_path), has_eval=False)
    features = _features(tokenizer, task)
    trainer = build_trainer(task, model, tokenizer, {"train": features}, args, collator, [])
    return task, tokenizer, model, collator, trainer, features


@pytest.mark.parametrize("model_name", ["tiny_seq2seq", "tiny_causal"])
def test_a_step_over_unequal_micro_batches_has_the_gradient_of_the_per_token_loss(compose_cfg, tmp_path, model_name):
    task, tokenizer, model, collator, trainer, features = _budget_trainer(compose_cfg, tmp_path, model_name)
    assert trainer.args.per_device_train_batch_size == 4 and trainer.args.gradient_accumulation_steps == 1

    step = MicroBatches([collator([features[0]]), collator(features[1:])])  # micro-batches of 1 and 3 rows
    trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets: one batch per optimizer step
    model.zero_grad()
    loss = trainer.training_step(model, step)
    budget_shaped = _grads(model)

    model.zero_grad()
    whole = collator(features)  # all four samples in one padded batch
    logits = model(**{k: v for k, v in whole.items() if k != "labels"} | {"labels": whole["labels"]}).logits
    labels = whole["labels"]
    if task == "causal":
        logits, labels = logits[:, :-1], labels[:, 1:]
    per_token = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    per_token.backward()
    direct = _grads(model)

    assert loss.item() == pytest.approx(per_token.item(), rel=1e-5)
    assert budget_shaped.keys() == direct.keys() and direct
    for name, grad in direct.items():
        torch.testing.assert_close(budget_shaped[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert collator.micro_batches == 2 and collator.rows == 4  # both micro-batches counted as trained on
    assert int(loss_positions(whole["labels"], task)) == int(labels.ne(-100).sum())


@pytest.mark.parametrize("model_name", ["tiny_seq2seq", "tiny_causal"])
def test_a_micro_batch_with_no_label_tokens_weighs_nothing_and_passes_no_nan(compose_cfg, tmp_path, model_name):
    """Its mean loss is 0/0: the step's loss and gradients are those of the other micro-batches alone."""
    _, _, model, collator, trainer, features = _budget_trainer(compose_cfg, tmp_path, model_name)
    silent = dict(features[0], labels=[-100] * len(features[0]["labels"]))  # nothing to learn from
    trainer.current_gradient_accumulation_steps = 1

    model.zero_grad()
    loss = trainer.training_step(model, MicroBatches([collator([silent]), collator(features[1:])]))
    with_silent = _grads(model)
    model.zero_grad()
    alone = trainer.training_step(model, MicroBatches([collator(features[1:])]))
    without = _grads(model)

    assert torch.isfinite(loss) and loss.item() == pytest.approx(alone.item(), rel=1e-6)
    for name, grad in without.items():
        assert torch.isfinite(with_silent[name]).all(), name
        torch.testing.assert_close(with_silent[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("model_name", ["tiny_seq2seq"])
def test_steps_counted_in_tokens_reach_training_as_the_sampler_draws_them(compose_cfg, tmp_path, model_name):
    task, tokenizer, model, collator, trainer, features = _budget_trainer(compose_cfg, tmp_path, model_name)
    features = features * 3  # 12 samples, 3 steps of 4
    trainer.train_dataset = features
    collator.capacity = lambda source, label: 3  # at most 3 rows a micro-batch
    source, label = (np.array(side) for side in zip(*(sample_lengths(f, task) for f in features), strict=True))
    trainer.step_sampler = sampler = TokenStepSampler(
        source, label, step_samples=4, capacity=collator.capacity, multiple=None, seed=0
    )
    batches = list(trainer.get_train_dataloader())
    steps = sampler.steps()
    assert len(batches) == len(steps) == 3 and all(isinstance(b, MicroBatches) for b in batches)
    for batch, step in zip(batches, steps, strict=True):
        assert sum(len(micro["input_ids"]) for micro in batch) == len(step)
        assert all(len(micro["input_ids"]) <= 3 for micro in batch)
        assert sum(int(loss_positions(micro["labels"], task)) for micro in batch) == sum(label[i] for i in step)
