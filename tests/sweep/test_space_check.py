"""Searched values are validated as a run validates its config, before any trial."""

from __future__ import annotations

import pytest

from memfit.sweep.space import SweepConfigError, parse_search
from memfit.sweep.space_check import check_searched_values


def test_a_value_no_trial_can_run_is_named_and_group_options_are_left_to_their_trials(compose_cfg):
    cfg = compose_cfg("model=tiny_seq2seq")
    space, fixed = parse_search(["memory=choice(balanced,tight)", "trainer.batch_size=choice(2,8)"], {})
    check_searched_values(space, fixed, cfg)  # every value runs; the group's options compose in each trial
    space, fixed = parse_search(["memory.max_label_length=range(32,2048,1000)", "trainer.batch_size=4"], {})
    with pytest.raises(SweepConfigError) as err:
        check_searched_values(space, fixed, cfg)
    assert str(err.value) == (
        "memory.max_label_length=2032 is searched, but no trial can run it: memory.max_label_length=2032 exceeds "
        "tiny_seq2seq's 1024 positions: set memory.max_label_length<=1024"
    )


def test_a_fixed_setting_every_trial_would_stop_on_is_named(compose_cfg):
    cfg = compose_cfg("model=tiny_seq2seq")
    space, fixed = parse_search(["trainer.batch_size=choice(2,8)"], {"trainer.gradient_accumulation_steps": "0"})
    with pytest.raises(SweepConfigError) as err:
        check_searched_values(space, fixed, cfg)
    assert str(err.value).startswith("trainer.gradient_accumulation_steps=0 must be > 0")
    assert str(err.value).endswith("(every trial would stop on it)")


def test_budget_shaped_batches_searched_on_gpus_without_expandable_segments_are_named(compose_cfg, monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    cfg = compose_cfg("model=tiny_seq2seq", "memory=off")
    space, fixed = parse_search(["trainer.batching=choice(fixed,budget)", "trainer.batch_size=4"], {})
    with pytest.raises(SweepConfigError) as err:  # trials on other machines' GPUs (Hydra's launcher)
        check_searched_values(space, fixed, cfg, trials_elsewhere=True)
    assert str(err.value).startswith(
        "trainer.batching=budget is searched, but no trial can run it: trainer.batching=budget on CUDA needs "
        "memory.expandable_segments=true"
    )
    space, fixed = parse_search(["trainer.batching=choice(fixed,budget)", "memory.expandable_segments=true"], {})
    check_searched_values(space, fixed, cfg, trials_elsewhere=True)
