"""The sweeper predicts the batches a trial's own length audit finds, null lengths resolved the same way."""

from __future__ import annotations

import optuna
import pytest

from memfit.config import effective_lengths
from memfit.data import load_and_tokenize
from memfit.models import build_tokenizer
from memfit.sweep.predict import MemoryPredictor
from memfit.sweep.screen import data_lengths


@pytest.mark.parametrize("model", ["tiny_causal", "tiny_seq2seq"])
def test_the_predicted_worst_batches_are_the_audited_ones_when_lengths_are_null(compose_cfg, model):
    cfg = compose_cfg(
        f"model={model}",
        "memory.max_source_length=null",
        "memory.max_label_length=null",
        "data.max_train_samples=64",
        "trainer.batch_size=2",
    )
    audit = load_and_tokenize(cfg, build_tokenizer(cfg.model)).audit
    space = {"trainer.batch_size": optuna.distributions.CategoricalDistribution([2])}
    predictor = MemoryPredictor(data_lengths(space, cfg), cfg, margin=0.1, effective_batch=None)
    assert predictor.worst_batches({}) == audit.worst_train
    source, _ = effective_lengths(cfg)
    if model == "tiny_causal":  # prompt and response share the positions: null gives each half of them
        assert source == cfg.model.max_positions // 2 < audit.source_raw.max  # the cut matters on this data


def test_a_budget_shaped_trial_is_judged_by_one_row_of_its_longest_sample(compose_cfg):
    """Its plan shrinks long micro-batches down to one row before the trial cannot fit: a batch of 16 worst cases
    would tell it 'predicted over budget' without running it."""
    cfg = compose_cfg("model=tiny_seq2seq", "data.max_train_samples=64", "trainer.batch_size=16")
    space = {"trainer.batching": optuna.distributions.CategoricalDistribution(["fixed", "budget"])}
    predictor = MemoryPredictor(data_lengths(space, cfg), cfg, margin=0.1, effective_batch=None)
    fixed = predictor.worst_batches({"trainer.batching": "fixed"})
    shaped = predictor.worst_batches({"trainer.batching": "budget"})
    assert {s.batch for s in fixed} == {16} and {s.batch for s in shaped} == {1}
    assert max(s.source for s in shaped) == max(s.source for s in fixed)  # the same longest lengths
    assert predictor.signature({"trainer.batching": "budget"})[-1] == ("accumulates", True)
