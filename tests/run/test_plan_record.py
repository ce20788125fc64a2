"""The plan kept beside a checkpointed run's checkpoints (memfit.run.plan_record): written for a resumed run to
replay, and refused with a warning where it cannot be (the replay itself: tests/run/test_budget_batching.py)."""

from __future__ import annotations

from types import SimpleNamespace

from memfit.run.identity import checkpoint_dir
from memfit.run.plan_record import PLAN_FILE, plan_settings, save_plan, stored_plan

BUDGET = ["model=tiny_seq2seq", "trainer.batching=budget", "trainer.save_steps=2", "tracking.run_name=recorded"]


def _plan():
    return SimpleNamespace(source_edges=(32, 64), label_edges=(16,), batches={(0, 0): 8, (1, 0): 3})


def test_a_checkpointed_run_records_its_plan_and_a_resume_with_the_same_settings_reads_it(compose_cfg, caplog):
    cfg = compose_cfg(*BUDGET)
    settings = plan_settings(cfg)
    with caplog.at_level("INFO", logger="memfit"):
        assert stored_plan(cfg, "checkpoint-2", settings) is None  # checkpoints without a record: a fresh plan
    assert f"no {PLAN_FILE} beside the checkpoints" in caplog.text
    cfg.trainer.effective_batch = "tokens"  # what auto resolved to
    save_plan(cfg, _plan(), settings)
    record = stored_plan(cfg, "checkpoint-2", settings)
    assert record is not None and record.effective_batch == "tokens" and record.settings["effective_batch"] == "auto"
    assert record.batches == [[0, 0, 8], [1, 0, 3]] and record.source_edges == [32, 64]
    assert stored_plan(cfg, None, settings) is None  # no checkpoint to continue: a fresh plan


def test_no_record_is_kept_without_checkpoints_or_training(compose_cfg):
    for overrides in (["trainer.save_steps=null"], ["preflight_only=true"]):
        cfg = compose_cfg(*BUDGET, *overrides)
        save_plan(cfg, _plan(), plan_settings(cfg))
        assert not (checkpoint_dir(cfg) / PLAN_FILE).exists()


def test_changed_settings_or_an_unreadable_record_prove_a_new_plan_and_say_so(compose_cfg, caplog):
    cfg = compose_cfg(*BUDGET, "budget.gib=8")
    save_plan(cfg, _plan(), plan_settings(cfg))
    changed = compose_cfg(*BUDGET, "budget.gib=6", "trainer.micro_batch_fill=0.9")
    with caplog.at_level("WARNING", logger="memfit"):
        assert stored_plan(changed, "checkpoint-2", plan_settings(changed)) is None
    assert "budget_gib 8.0 -> 6.0, micro_batch_fill 1.0 -> 0.9" in caplog.text and "proving a new one" in caplog.text
    (checkpoint_dir(cfg) / PLAN_FILE).write_text('{"settings": {}')  # cut short mid-write
    with caplog.at_level("WARNING", logger="memfit"):
        assert stored_plan(cfg, "checkpoint-2", plan_settings(cfg)) is None
    assert "is unreadable" in caplog.text
