"""What a sweep's preset holds and the command its Use line gives."""

from __future__ import annotations

from memfit.sweep.results import preset_settings


def test_a_preset_holds_the_fixed_memory_settings_and_its_use_line_the_groups_and_data():
    settings, use = preset_settings(
        [
            "model=tiny_seq2seq",
            "memory=tight",
            "data=jsonl",
            "data.path=/data/my.jsonl",
            "data.max_train_samples=48",
            "memory.precision=fp32",
            "tracking=none",
            "hydra/launcher=submitit_local",
            "hydra.sweeper.n_trials=6",
            "output_dir=/tmp/out",
        ]
    )
    assert use == ["model=tiny_seq2seq", "memory=tight", "data=jsonl", "data.path=/data/my.jsonl"]
    assert settings == {"memory.precision": "fp32"}
