"""Where a run finds itself again: trainer.resume with and without a checkpoint to resume from."""

from __future__ import annotations

import logging

from memfit.run.identity import ResumePoint, checkpoint_dir, find_resume_point


def test_resume_without_a_checkpoint_starts_at_step_0_and_says_so(compose_cfg, caplog):
    cfg = compose_cfg("model=tiny_seq2seq", "trainer.resume=true", "trainer.save_steps=null")
    with caplog.at_level(logging.INFO, logger="memfit"):
        assert find_resume_point(cfg) == ResumePoint()
    assert f"no checkpoint under {checkpoint_dir(cfg)} yet, so training starts at step 0" in caplog.text
    assert "trainer.save_steps=null writes no checkpoint" in caplog.text


def test_resume_finds_the_last_checkpoint_and_its_mlflow_run(compose_cfg, caplog):
    cfg = compose_cfg("model=tiny_seq2seq", "trainer.resume=true", "trainer.save_steps=2")
    for step in (2, 4):
        (checkpoint_dir(cfg) / f"checkpoint-{step}").mkdir(parents=True)
    (checkpoint_dir(cfg) / "memfit_run.json").write_text('{"run_id": "abc"}')
    with caplog.at_level(logging.INFO, logger="memfit"):
        point = find_resume_point(cfg)
    assert point == ResumePoint(str(checkpoint_dir(cfg) / "checkpoint-4"), "abc")
    assert "save_steps" not in caplog.text
