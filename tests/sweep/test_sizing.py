"""trainer.batch_size: fits: batch choices from the memory model's largest predicted batch, sized before any trial."""

from __future__ import annotations

import pytest

from memfit.sweep.derive import search_space
from memfit.sweep.sizing import Sizing, sizing_overrides
from memfit.sweep.space import SweepConfigError


@pytest.mark.parametrize(
    ("largest", "cap", "choices"),
    [
        (24, 48, [1, 2, 4, 8, 16, 32]),  # powers of two up to the prediction and one past it
        (16, 512, [1, 2, 4, 8, 16, 32]),  # a prediction on a power of two: the next one too
        (48, 48, [1, 2, 4, 8, 16, 32, 48]),  # the prediction reached the cap (the training samples): it is a choice
        (32, 48, [1, 2, 4, 8, 16, 32, 48]),  # the next power of two is past the cap: the cap is the one past
        (300, 300, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]),
        (0, 48, [1]),  # not even batch 1 is predicted to fit: its trial says what binds
        (5, None, [1, 2, 4, 8]),
    ],
)
def test_choices_are_powers_of_two_to_one_past_the_prediction_within_the_cap(largest, cap, choices):
    assert Sizing(largest, cap, {}).choices() == choices


def test_the_sizing_job_runs_the_shortest_lengths_at_batch_1_as_a_trial_would_and_records_nothing(compose_cfg):
    cfg = compose_cfg("model=tiny_seq2seq")
    recipe = {"trainer.batch_size": "fits", "memory.max_label_length": "choice(256,32,64)"}
    searched = search_space(["memory.max_source_length=128"], recipe, cfg)
    assert searched.to_size and "trainer.batch_size" not in searched.space
    overrides = sizing_overrides(searched.space, searched.fixed, 24, effective_batch=32)
    assert overrides[:2] == ["memory.max_source_length=128", "memory.max_label_length=32"]
    assert {"trainer.batch_size=1", "trainer.batching=fixed", "estimate_only=true", "budget.gib=24"} <= set(overrides)
    assert "tracking.backend=none" in overrides and "calibration.enabled=true" in overrides
    # it steps as a trial of batch 1 does, so its cached calibration is the one trials look up
    assert "trainer.gradient_accumulation_steps=32" in overrides
    assert not [o for o in sizing_overrides(searched.space, [], None, None) if "accumulation" in o or "budget" in o]


def test_fits_is_sized_only_where_a_trial_trains_fixed_batches_and_the_command_line_wins(compose_cfg):
    cfg = compose_cfg("model=tiny_seq2seq")
    recipe = {"trainer.batch_size": "fits", "trainer.seed": "choice(1,2)"}
    assert not search_space(["trainer.batch_size=choice(2,4)"], recipe, cfg).to_size
    assert not search_space(["trainer.batch_size=8"], recipe, cfg).to_size
    assert not search_space(["trainer.batching=budget"], recipe, compose_cfg("trainer.batching=budget")).to_size
    shaped_or_fixed = search_space(["trainer.batching=choice(fixed,budget)"], recipe, cfg)
    assert shaped_or_fixed.to_size
    with pytest.raises(SweepConfigError, match=r"^memory.max_label_length=fits: only trainer.batch_size is sized"):
        search_space([], {"memory.max_label_length": "fits"}, cfg)


def test_a_study_another_worker_sized_first_keeps_its_choices(compose_cfg):
    """Workers sharing a study each size their batches (each calibrating on its own device): whichever opens the study
    second searches the choices it recorded, and one that recorded at the same instant adopts what the study kept; a
    sweep that measures something else keeps its own."""
    import json

    from memfit.sweep.naming import what_it_measures
    from memfit.sweep.sizing import adopt_recorded, settle

    cfg = compose_cfg("model=tiny_seq2seq")
    recipe = {"trainer.batch_size": "fits", "memory.max_label_length": "choice(32,64)"}
    first, second = search_space([], recipe, cfg), search_space([], recipe, cfg)
    first.sized(Sizing(8, 48, {}))
    second.sized(Sizing(16, 48, {}))

    def measured(searched):
        return what_it_measures(searched, ["throughput"], 32, 0.99)

    recorded = json.loads(json.dumps(measured(first)))  # as the study's storage gives it back
    assert adopt_recorded(second, recorded, measured, "shared") and not second.sized_here
    assert second.space["trainer.batch_size"].choices == (1, 2, 4, 8, 16)
    assert "trainer.batch_size: [1, 2, 4, 8, 16] (as study shared recorded them)" in second.describe()
    # workers that created the study together: each reads back what the study kept after recording its own
    racing = search_space([], recipe, cfg)
    racing.sized(Sizing(16, 48, {}))
    settle(racing, json.loads(json.dumps(measured(racing))), measured, "shared")  # its own write stood: kept
    assert racing.sized_here and racing.space["trainer.batch_size"].choices == (1, 2, 4, 8, 16, 32)
    settle(racing, recorded, measured, "shared")  # the other worker's write stood: adopted before any trial
    assert not racing.sized_here and racing.space["trainer.batch_size"].choices == (1, 2, 4, 8, 16)
    other = search_space(["memory.max_label_length=choice(32,128)"], recipe, cfg)
    other.sized(Sizing(16, 48, {}))
    assert not adopt_recorded(other, recorded, measured, "shared")
    assert other.space["trainer.batch_size"].choices == (1, 2, 4, 8, 16, 32) and other.sized_here


def test_searched_knobs_that_change_a_step_are_sized_one_job_per_combination(compose_cfg, caplog):
    """A knob that saves memory may afford a larger batch than the config's own setting: each combination of the
    searched step knobs' choices gets a sizing job (MAX_JOBS at most), and knobs a step does not depend on none."""
    from memfit.sweep.sizing import MAX_JOBS, sizing_jobs

    cfg = compose_cfg("model=tiny_seq2seq")
    recipe = {"trainer.batch_size": "fits", "memory.max_label_length": "choice(64,32)"}
    searched = search_space(
        ["memory.gradient_checkpointing=choice(true,false)", "memory.optimizer=choice(adamw,adafactor)"], recipe, cfg
    )
    jobs = sizing_jobs(searched.space, searched.fixed, 24, 32)
    assert len(jobs) == 4 == MAX_JOBS
    assert [job.at for job in jobs][:2] == [
        {"memory.max_label_length": "32", "memory.gradient_checkpointing": "true", "memory.optimizer": "adamw"},
        {"memory.max_label_length": "32", "memory.gradient_checkpointing": "true", "memory.optimizer": "adafactor"},
    ]
    assert all("memory.gradient_checkpointing=false" in job.overrides for job in jobs[2:])
    not_a_step_knob = search_space(["memory.group_by_length=choice(true,false)"], recipe, cfg)
    assert len(sizing_jobs(not_a_step_knob.space, not_a_step_knob.fixed, 24, 32)) == 1
    too_many = search_space(
        [
            "memory.gradient_checkpointing=choice(true,false)",
            "memory.optimizer=choice(adamw,adafactor)",
            "memory.precision=choice(fp32,bf16)",
        ],
        recipe,
        cfg,
    )
    (only,) = sizing_jobs(too_many.space, too_many.fixed, 24, 32)
    assert only.at == {"memory.max_label_length": "32"} and "8 combinations of" in caplog.text
