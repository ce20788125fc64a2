"""The search space when batches may be budget-shaped: each trial draws only the params that change it."""

from __future__ import annotations

import optuna
import pytest
from omegaconf import OmegaConf

from memfit.sweep import parse_search
from memfit.sweep.space import SweepConfigError, configurations, held_step, relevant, segment_steps, suggest

SPACE, _ = parse_search(
    [
        "trainer.batching=choice(fixed,budget)",
        "trainer.batch_size=choice(2,8)",
        "trainer.micro_batch_fill=choice(0.8,1.0)",
        "memory.max_label_length=choice(32,256)",
    ],
    {},
)


def test_a_fixed_configuration_has_a_batch_size_and_a_budget_shaped_one_the_plans_knobs():
    every = configurations(SPACE, effective_batch=16)
    fixed = [p for p in every if p["trainer.batching"] == "fixed"]
    shaped = [p for p in every if p["trainer.batching"] == "budget"]
    assert len(fixed) == 4 and all(
        set(p) == {"trainer.batching", "trainer.batch_size", "memory.max_label_length"} for p in fixed
    )
    assert len(shaped) == 4 and all(
        set(p) == {"trainer.batching", "trainer.micro_batch_fill", "memory.max_label_length"} for p in shaped
    )
    # without a held effective batch, the batch size is a budget-shaped step's sample count: it applies there too
    assert len(configurations(SPACE)) == 4 + 8


def test_a_fixed_batching_on_the_command_line_leaves_the_plans_knobs_out():
    space, _ = parse_search(["trainer.batch_size=choice(2,8)", "trainer.micro_batch_fill=choice(0.8,1.0)"], {})
    assert configurations(space, batching="fixed", effective_batch=16) == [
        {"trainer.batch_size": 2},
        {"trainer.batch_size": 8},
    ]
    assert configurations(space, batching="budget", effective_batch=16) == [
        {"trainer.micro_batch_fill": 0.8},
        {"trainer.micro_batch_fill": 1.0},
    ]


def test_how_a_budget_shaped_step_is_counted_is_one_of_the_plans_knobs():
    """At a roomy budget steps of samples ran 1.22x steps of tokens (pegasus_large, 40 GiB, H200; at 24 GiB steps
    of tokens were faster): a sweep can search it, and only where batches are budget-shaped."""
    space, _ = parse_search(
        [
            "trainer.batching=choice(fixed,budget)",
            "trainer.batch_size=choice(2,8)",
            "trainer.effective_batch=choice(tokens,samples)",
        ],
        {},
    )
    every = configurations(space, effective_batch=16)
    assert [p for p in every if p["trainer.batching"] == "budget"] == [
        {"trainer.batching": "budget", "trainer.effective_batch": "tokens"},
        {"trainer.batching": "budget", "trainer.effective_batch": "samples"},
    ]
    assert all("trainer.effective_batch" not in p for p in every if p["trainer.batching"] == "fixed")


def test_an_asked_trial_draws_only_what_applies_to_it_and_takes_an_enqueued_configuration_as_given():
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    drawn = []
    for _ in range(12):
        trial = study.ask()
        drawn.append(suggest(trial, SPACE, "fixed", 16))
        assert trial.params == drawn[-1] == relevant(drawn[-1], "fixed", 16)
        study.tell(trial, 1.0)
    assert {p["trainer.batching"] for p in drawn} == {"fixed", "budget"}
    queued = {"trainer.batching": "budget", "trainer.micro_batch_fill": 0.8, "memory.max_label_length": 256}
    study.enqueue_trial(queued)
    trial = study.ask()
    assert suggest(trial, SPACE, "fixed", 16) == queued


def test_a_budget_shaped_trial_steps_over_the_effective_batch_and_a_fixed_one_accumulates_to_it():
    assert held_step({"trainer.batching": "budget"}, 32) == {
        "trainer.batch_size": 32,
        "trainer.gradient_accumulation_steps": 1,
    }
    assert held_step({"trainer.batching": "fixed", "trainer.batch_size": 5}, 32) == {
        "trainer.gradient_accumulation_steps": 7
    }
    assert held_step({}, 32, batching="budget") == {"trainer.batch_size": 32, "trainer.gradient_accumulation_steps": 1}
    assert held_step({"trainer.batch_size": 4}, None) == {}  # nothing held
    assert held_step({"trainer.batch_size": 4, "trainer.gradient_accumulation_steps": 2}, 32) == {}  # searched


def test_a_timed_segment_in_micro_batches_times_fewer_steps_of_a_small_batch():
    """hydra.sweeper.segment_micro_batches=40 at effective batch 32: batch 1 (32 micro-batches a step) times 3
    steps, not 10; batch 4 (8 a step) 5; batch 16 (2 a step) keeps trainer.max_steps, 10, its ceiling."""
    trainer = OmegaConf.create({"max_steps": 10, "gradient_accumulation_steps": 1, "batching": "fixed"})
    steps = {}
    for batch in (1, 4, 16):
        params = {"trainer.batch_size": batch}
        steps[batch] = segment_steps(params, held_step(params, 32), 40, trainer)["trainer.max_steps"]
    assert steps == {1: 3, 4: 5, 16: 10}
    assert segment_steps({"trainer.batch_size": 4}, {}, None, trainer) == {}  # not set: trainer.max_steps steps
    assert segment_steps({"trainer.batching": "budget"}, {}, 40, trainer) == {}  # the plan's micro-batches
    assert segment_steps({"trainer.max_steps": 7}, {}, 40, trainer) == {}  # the trial's own
    assert segment_steps({}, {}, 40, trainer) == {"trainer.max_steps": 10}  # accumulation 1: 40 steps, at most 10
    two = OmegaConf.create({"max_steps": 2, "gradient_accumulation_steps": 1, "batching": "fixed"})
    assert segment_steps({"trainer.batch_size": 1}, {"trainer.gradient_accumulation_steps": 32}, 40, two) == {
        "trainer.max_steps": 2  # never more steps than the user's trainer.max_steps, even below the usual least
    }


def test_bounds_optuna_refuses_are_one_line_naming_the_override():
    with pytest.raises(SweepConfigError) as err:
        parse_search(["trainer.learning_rate=tag(log,interval(-1,1e-3))"], {})
    assert str(err.value) == (
        "trainer.learning_rate=tag(log,interval(-1,1e-3)): `low > 0` must hold for `log=True`, but got "
        "(low=-1.0, high=0.001): fix the bounds"
    )
