"""The batch plan a checkpointed run trains, kept beside its checkpoints, so that a resumed run trains the same one.

A resumed run continues at the step its checkpoint saved, in the same epoch's order; with budget-shaped batches that
order is the plan's packing. A plan proven afresh could size a cell one row differently (a probe measured a little
higher on the host or card the run resumes on), and the epoch's steps would then hold other samples: some seen twice,
some not at all. So the resumed run replays the recorded plan, its proof shapes measured again on this device
(`memfit.memory.plan.replay`), and trains the packing the first run chose (`trainer.effective_batch=auto`'s pick
too). Where the settings that size a plan changed, the data no longer fits its cells, or a proof shape no longer fits
this device, it proves a new plan and says that this epoch's remaining steps are packed anew."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from typing import Any

from memfit.run.identity import checkpoint_dir

log = logging.getLogger("memfit")

PLAN_FILE = "batch_plan.json"


@dataclass(frozen=True)
class PlanRecord:
    settings: dict[str, Any]  # what sized and packed the plan (plan_settings): a resumed run replays only the same
    source_edges: list[int]
    label_edges: list[int]
    batches: list[list[int]]  # [source edge index, label edge index, rows] of each sized cell
    effective_batch: str  # the packing the run trained: tokens | samples (auto's pick, where it was auto)


def plan_settings(cfg: Any) -> dict[str, Any]:
    """The settings that size and pack a plan, as configured (before auto resolves). The budget as set, not the limit
    it gives: on CPU that follows the host's free memory, and the replay proves the plan against today's limit."""
    trainer = cfg.trainer
    return {
        "task": cfg.model.task,
        "budget_gib": cfg.budget.gib,
        "margin_gib": cfg.budget.margin_gib,
        "memory_fraction": cfg.memory.memory_fraction,
        "micro_batch_fill": trainer.micro_batch_fill,
        "max_micro_batch": trainer.max_micro_batch,
        "length_buckets": trainer.length_buckets,
        "step_samples": trainer.batch_size * trainer.gradient_accumulation_steps,
        "pad_to_multiple_of": cfg.memory.pad_to_multiple_of,
        "effective_batch": trainer.effective_batch,
        "pad_tolerance": trainer.pad_tolerance,
        "group_by_length": cfg.memory.group_by_length,
        "seed": trainer.seed,
    }


def stored_plan(cfg: Any, checkpoint: str | None, settings: dict[str, Any]) -> PlanRecord | None:
    """The plan recorded beside the checkpoint a run resumes from, where it was sized with these settings."""
    if checkpoint is None:
        return None
    path = checkpoint_dir(cfg) / PLAN_FILE
    if not path.exists():  # checkpoints of a fixed-batch run, or of a memfit before the record
        log.info("trainer.resume: no %s beside the checkpoints: proving a new batch plan", PLAN_FILE)
        return None
    try:
        record = PlanRecord(**json.loads(path.read_text()))
    except (ValueError, TypeError) as err:  # cut short, or written by another version of memfit
        log.warning(
            "trainer.resume: %s is unreadable (%s): proving a new plan; the rest of this epoch is packed anew",
            path,
            err,
        )
        return None
    changed = sorted(key for key in settings if record.settings.get(key) != settings[key])
    if changed:
        log.warning(
            "trainer.resume: the batch plan beside the checkpoints was sized with other settings (%s): proving a new "
            "one; the rest of this epoch is packed anew",
            ", ".join(f"{key} {record.settings.get(key)} -> {settings[key]}" for key in changed),
        )
        return None
    return record


def save_plan(cfg: Any, plan: Any, settings: dict[str, Any]) -> None:
    """Record the plan a checkpointed run trains (after auto resolved) for a resumed run to replay."""
    if not cfg.trainer.save_steps or cfg.preflight_only:
        return
    record = PlanRecord(
        settings=settings,
        source_edges=list(plan.source_edges),
        label_edges=list(plan.label_edges),
        batches=[[i, j, rows] for (i, j), rows in sorted(plan.batches.items())],
        effective_batch=cfg.trainer.effective_batch,
    )
    directory = checkpoint_dir(cfg)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / PLAN_FILE).write_text(json.dumps(asdict(record)))
