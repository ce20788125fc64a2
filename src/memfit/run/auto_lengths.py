"""`auto` max lengths: every token up to the model's limit where the run's smallest batch holds it within the budget
(one row with budget-shaped batches, trainer.batch_size rows with fixed ones); otherwise the longest cut whose
smallest batch the budget proves, chosen by the memory model and measured, the data then tokenized again at it.
The preflight proves the run at the lengths this settles, as it proves any other."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from memfit.config import GIB, auto_lengths, effective_lengths
from memfit.run.context import RunContext, TrainingSetup
from memfit.run.worst_case import budget_and_limit, probe_within_host

log = logging.getLogger("memfit")

# the cut is searched within this share of the limit: the preflight measures the cut batch again, and a measurement
# that lands a little higher than the search's (host RSS, a fresh probe's cache) must not fail the run
SEARCH_SHARE = 0.98


def _lengths(ctx: RunContext) -> Any:
    """Raw lengths of every sample a batch can hold (training's, and evaluation's where it runs), and the max
    lengths the data is cut to now."""
    from memfit.data.length_cut import Lengths

    prepared, cfg = ctx.prepared, ctx.cfg
    source, label = [prepared.source_raw], [prepared.label_raw]
    validation = prepared.datasets.get("validation")
    if cfg.memory.eval_enabled and validation is not None and len(validation):
        source.append(np.asarray(validation["source_len_raw"]))
        label.append(np.asarray(validation["label_len_raw"]))
    max_source, max_label = effective_lengths(cfg)
    return Lengths(np.concatenate(source), np.concatenate(label), max_source, max_label)


def _smallest_batch(ctx: RunContext) -> int:
    """The fewest rows a batch of this run holds: one where budget-shaped batches may hold a single long sample."""
    if ctx.cfg.trainer.batching == "budget":
        return 1
    return max(shape.batch for shape in ctx.prepared.audit.worst_train)


def _choose(ctx: RunContext, probes: Any, calibration: Any, lengths: Any, batch: int) -> tuple[int, int] | None:
    """The model's limit where its batch measures within the limit; else the cut the memory model chooses where it
    measures within the search's share of the limit, else the cut bisected on probes alone."""
    from memfit.data.length_cut import longest_cut, shapes_at

    cfg, (_, limit) = ctx.cfg, budget_and_limit(ctx)
    which, task, multiple = auto_lengths(cfg.memory), cfg.model.task, cfg.memory.pad_to_multiple_of
    measured: dict[Any, Any] = {}

    def fits_measured(shapes: list[Any], within: int) -> bool:
        for shape in shapes:
            if shape not in measured:
                measured[shape] = probe_within_host(ctx, probes, shape)[0]
        return all(not measured[s].oom and measured[s].judged_bytes <= within for s in shapes)

    full = (lengths.max_source, lengths.max_label)
    if fits_measured(shapes_at(lengths, full, batch, task, multiple), limit):
        return full
    search = int(limit * SEARCH_SHARE)
    if calibration is not None:

        def fits_predicted(shapes: list[Any]) -> bool:
            return all(calibration.estimate(shape).reserved <= search for shape in shapes)

        predicted = longest_cut(lengths, which, batch, task, multiple, fits_predicted)
        if predicted is not None and fits_measured(shapes_at(lengths, predicted, batch, task, multiple), search):
            return predicted
    return longest_cut(lengths, which, batch, task, multiple, lambda shapes: fits_measured(shapes, search))


def fit_auto_lengths(ctx: RunContext, setup: TrainingSetup, probes: Any, calibration: Any) -> bool:
    """Settle `auto` max lengths before the preflight: where the run's smallest batch at the model's limit does not
    fit, tokenize the data again at the longest cut that does and hand it to the Trainer (ctx.prepared is replaced).
    Said either way; returns whether the data was cut anew. Where not even the shortest cut fits, the lengths stay
    and the preflight fails with its ways out."""
    from memfit.data import load_and_tokenize, model_columns
    from memfit.data.audit import label_coverage

    cfg = ctx.cfg
    which = auto_lengths(cfg.memory)
    if not any(which):
        return False
    lengths, batch = _lengths(ctx), _smallest_batch(ctx)
    full = (lengths.max_source, lengths.max_label)
    cut = _choose(ctx, probes, calibration, lengths, batch)
    names = [
        f"memory.{knob}" for knob, auto in zip(("max_source_length", "max_label_length"), which, strict=True) if auto
    ]
    if cut is None or cut == full:
        longest = (int(lengths.source.max(initial=0)), int(lengths.label.max(initial=0)))
        log.info(
            "%s=auto: the model's limit (source %d, labels %d tokens): %s",
            ", ".join(names),
            *full,
            f"every token kept, the longest samples (source {longest[0]}, labels {longest[1]}) fit at batch {batch}"
            if cut
            else f"not even the shortest cut fits at batch {batch}; the preflight says the ways out",
        )
        ctx.tracker.set_tags({"memfit.auto_lengths": f"source {full[0]}, labels {full[1]} (the model's limit)"})
        return False
    _, limit = budget_and_limit(ctx)
    log.warning(
        "%s=auto: at the model's limit (source %d, labels %d) a batch of %d does not fit the %.2f GiB limit: cut to "
        "source %d, labels %d, the longest that fits (keeps %.1f%% of label tokens, %.1f%% of source tokens)",
        ", ".join(names),
        *full,
        batch,
        limit / GIB,
        *cut,
        100 * label_coverage(lengths.label, cut[1]),
        100 * label_coverage(lengths.source, cut[0]),
    )
    ctx.prepared = load_and_tokenize(cfg, ctx.tokenizer, lengths=cut)
    trainer = setup.trainer
    trainer.train_dataset = model_columns(ctx.prepared.datasets["train"])
    if trainer.eval_dataset is not None:
        trainer.eval_dataset = model_columns(ctx.prepared.datasets["validation"])
    if getattr(trainer.args, "predict_with_generate", False):
        trainer.args.generation_max_length = cut[1]
    ctx.tracker.set_tags({"memfit.auto_lengths": f"source {cut[0]}, labels {cut[1]} (cut to fit the budget)"})
    return True
