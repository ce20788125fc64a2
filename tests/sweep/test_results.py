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


def test_a_preset_never_replaces_a_different_one_silently(tmp_path, caplog):
    from memfit.sweep.results import write_keeping_other

    path = tmp_path / "preset" / "tiny_seq2seq-aclsum-1.7gib.yaml"
    write_keeping_other(path, "trainer:\n  batch_size: 8\n")
    write_keeping_other(path, "trainer:\n  batch_size: 8\n")  # the same preset again: nothing kept aside
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    with caplog.at_level("WARNING"):
        write_keeping_other(path, "trainer:\n  batch_size: 16\n")
    (kept,) = [p for p in path.parent.iterdir() if p != path]
    assert kept.name.startswith("tiny_seq2seq-aclsum-1.7gib-") and kept.read_text() == "trainer:\n  batch_size: 8\n"
    assert path.read_text().endswith("16\n") and f"kept as {kept.name}" in caplog.text
