"""The epoch throughput estimate: the epoch's batch plan against the Trainer's own batches, and the step-time fit."""

from __future__ import annotations

import pytest

from memfit.training.throughput import EpochPlan, StepTimeModel, Window, epoch_plan, epoch_tokens_per_s


def _trainer_epoch(cfg, tmp_path):
    """The real tokens, padded tokens, micro-batches and distinct padded shapes of one epoch of the Trainer's own
    dataloader (collated as training collates, no step taken), and the training data."""
    from memfit.data import CountingCollator, load_and_tokenize, model_columns
    from memfit.memory.policy import training_arguments
    from memfit.models import build_model, build_tokenizer
    from memfit.training.trainer import build_trainer

    tokenizer = build_tokenizer(cfg.model)
    prepared = load_and_tokenize(cfg, tokenizer)
    datasets = {"train": model_columns(prepared.datasets["train"])}
    model = build_model(cfg, tokenizer, "cpu").model
    collator = CountingCollator(tokenizer, cfg.memory.pad_to_multiple_of, cfg.model.task)
    args = training_arguments(cfg, "cpu", str(tmp_path / "trainer"), has_eval=False)
    trainer = build_trainer(cfg.model.task, model, tokenizer, datasets, args, collator, [])
    for _ in trainer.get_train_dataloader():
        collator.consume()
    return collator, datasets["train"]


@pytest.mark.parametrize(("model", "memory"), [("tiny_seq2seq", "balanced"), ("tiny_causal", "balanced")])
def test_the_epoch_plan_holds_the_trainers_own_batches(compose_cfg, tmp_path, model, memory):
    cfg = compose_cfg(
        f"model={model}",
        f"memory={memory}",
        "trainer.device=cpu",
        "trainer.batch_size=4",
        "trainer.gradient_accumulation_steps=2",
        "memory.max_source_length=1024",
        "memory.max_label_length=256",
        "data.max_train_samples=200",
        "tracking=none",
    )
    trained, data = _trainer_epoch(cfg, tmp_path)
    source = [len(ids) for ids in data["input_ids"]]
    label = [len(ids) for ids in data["labels"]]
    plan = epoch_plan(
        source,
        label,
        batch=4,
        accumulation=2,
        multiple=cfg.memory.pad_to_multiple_of,
        task=cfg.model.task,
        group_by_length=cfg.memory.group_by_length,
        seed=cfg.trainer.seed,
    )
    assert plan.real_tokens == trained.tokens and plan.micro_batches == trained.micro_batches
    # another permutation than the Trainer's, the same megabatch-sorted statistics: padding within a few percent
    assert plan.padded_tokens == pytest.approx(trained.padded_tokens, rel=0.05)
    assert plan.distinct_shapes == pytest.approx(len(trained.seen_shapes), rel=0.35)
    ungrouped = epoch_plan(
        source, label, batch=4, accumulation=2, multiple=8, task=cfg.model.task, group_by_length=False
    )
    assert ungrouped.padded_tokens > plan.padded_tokens  # random batches pad more: why memory policies group


def test_the_step_time_fit_recovers_known_costs_and_drops_a_term_it_cannot_see():
    truth = StepTimeModel(per_padded_token_s=2e-5, per_micro_batch_s=0.01, per_new_shape_s=0.3)
    steps = [(4000, 2, 1), (9000, 2, 0), (6000, 2, 2), (12000, 2, 0), (5000, 2, 1), (8000, 2, 0)]
    windows = [Window(int(p * 0.8), truth.seconds(p, m, n), p, m, n) for p, m, n in steps]
    fitted = StepTimeModel.fit(windows)
    assert fitted.per_padded_token_s == pytest.approx(2e-5) and fitted.per_new_shape_s == pytest.approx(0.3)
    assert fitted.per_micro_batch_s == pytest.approx(0.01)
    # no step met a new shape: that cost cannot be fitted, and is not made up
    steady = [Window(w.tokens, w.seconds - 0.3 * w.new_shapes, w.padded_tokens, 2, 0) for w in windows]
    assert StepTimeModel.fit(steady).per_new_shape_s == 0.0
    assert StepTimeModel.fit(windows[:1]) is None  # one window says nothing about how time scales

    plan = EpochPlan(real_tokens=80_000, padded_tokens=100_000, micro_batches=20, distinct_shapes=5)
    expected = 80_000 / (2e-5 * 100_000 + 0.01 * 20 + 0.3 * 5)
    assert epoch_tokens_per_s(truth, plan) == pytest.approx(expected)
