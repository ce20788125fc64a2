"""Where a run finds itself again: trainer.resume with and without a checkpoint to resume from."""

from __future__ import annotations

import json
import logging
import re
import shutil

import pytest

from memfit.config import ConfigError
from memfit.run.identity import ResumePoint, checkpoint_dir, find_resume_point
from tests.conftest import write_jsonl


def test_resume_without_a_checkpoint_starts_at_step_0_and_says_so(compose_cfg, caplog):
    cfg = compose_cfg("model=tiny_seq2seq", "trainer.resume=true", "trainer.save_steps=null")
    with caplog.at_level(logging.INFO, logger="memfit"):
        assert find_resume_point(cfg) == ResumePoint()
    assert f"no checkpoint under {checkpoint_dir(cfg)} yet, so training starts at step 0" in caplog.text
    assert "trainer.save_steps=null writes no checkpoint" in caplog.text


def test_resume_finds_the_last_checkpoint_and_its_mlflow_run(compose_cfg, caplog):
    cfg = compose_cfg("model=tiny_seq2seq", "trainer.resume=true", "trainer.save_steps=2")
    for step in (2, 4, 6):
        (checkpoint_dir(cfg) / f"checkpoint-{step}").mkdir(parents=True)
        if step < 6:  # checkpoint-6 was cut short (a full disk): Trainer writes its state last
            (checkpoint_dir(cfg) / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (checkpoint_dir(cfg) / "memfit_run.json").write_text('{"run_id": "abc"}')
    with caplog.at_level(logging.INFO, logger="memfit"):
        point = find_resume_point(cfg)
    assert point == ResumePoint(str(checkpoint_dir(cfg) / "checkpoint-4"), "abc")
    assert (
        "checkpoint-6 was not written to the end (no trainer_state.json): resuming from an earlier one" in caplog.text
    )
    assert "save_steps" not in caplog.text


def _checkpointed(cfg, identity_of) -> None:
    """Checkpoints as a run wrote them, with the identity of the config `identity_of`."""
    from memfit.run.identity import run_identity

    (checkpoint_dir(cfg) / "checkpoint-2").mkdir(parents=True)
    (checkpoint_dir(cfg) / "checkpoint-2" / "trainer_state.json").write_text("{}")
    marker = {"run_id": "abc", "identity": run_identity(identity_of)}
    (checkpoint_dir(cfg) / "memfit_run.json").write_text(json.dumps(marker))


def test_resume_refuses_checkpoints_another_runs_data_wrote_and_force_takes_them(compose_cfg, tmp_path):
    mine = write_jsonl(tmp_path / "mine.jsonl", [{"source": "a b c", "target": "d"}] * 8)
    theirs = write_jsonl(tmp_path / "theirs.jsonl", [{"source": "a b c", "target": "e"}] * 8)
    common = ("data=jsonl", "trainer.save_steps=2", "tracking.run_name=same")
    wrote = compose_cfg(*common, f"data.path={theirs}")
    cfg = compose_cfg(*common, f"data.path={mine}", "trainer.resume=true")
    _checkpointed(cfg, wrote)
    with pytest.raises(ConfigError) as err:
        find_resume_point(cfg)
    (line,) = err.value.problems
    assert line.startswith(f"trainer.resume=true: the checkpoints under {checkpoint_dir(cfg)} belong to another run")
    assert f"data.path {theirs} -> {mine}" in line and "data.path contents " in line
    assert line.endswith("(tracking.run_name=...) or continue them anyway with trainer.resume=force")
    forced = compose_cfg(*common, f"data.path={mine}", "trainer.resume=force")
    assert find_resume_point(forced).checkpoint == str(checkpoint_dir(cfg) / "checkpoint-2")


def test_resume_refuses_another_model_or_batch_and_the_same_file_edited(compose_cfg, tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", [{"source": "a b c", "target": "d"}] * 8)
    common = ("data=jsonl", f"data.path={data}", "trainer.save_steps=2", "tracking.run_name=same")
    wrote = compose_cfg("model=tiny_seq2seq", *common)
    for changed, named in (("model=tiny_causal", "model.name tiny_seq2seq -> tiny_causal"),
                           ("trainer.batch_size=8", "trainer.batch_size 4 -> 8")):  # fmt: skip
        cfg = compose_cfg("model=tiny_seq2seq", *common, changed, "trainer.resume=true")
        shutil.rmtree(checkpoint_dir(cfg), ignore_errors=True)
        _checkpointed(cfg, wrote)
        with pytest.raises(ConfigError, match=re.escape(named)):
            find_resume_point(cfg)
    same = compose_cfg("model=tiny_seq2seq", *common, "trainer.resume=true", "trainer.max_steps=99")
    shutil.rmtree(checkpoint_dir(same))
    _checkpointed(same, wrote)
    assert find_resume_point(same).run_id == "abc"  # more steps of the same run continue it
    write_jsonl(data, [{"source": "a b c", "target": "edited"}] * 8)
    with pytest.raises(ConfigError, match="data.path contents"):
        find_resume_point(same)


def test_a_local_or_hub_checkpoint_names_its_runs(compose_cfg, tmp_path):
    from memfit.run.identity import run_name

    cfg = compose_cfg("model=local", f"model.name_or_path={tmp_path / 'my-model'}")
    assert run_name(cfg) == "local-my-model-balanced-b4"
    assert run_name(compose_cfg("model=qwen2_5_0_5b", "model.name_or_path=Qwen/Qwen2.5-0.5B")).startswith(
        "qwen2_5_0_5b-Qwen2.5-0.5B-"
    )
