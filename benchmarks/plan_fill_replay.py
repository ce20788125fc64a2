"""How full budget-shaped micro-batches are, replayed on CPU over a GPU run's data and memory model (seconds).

    cd benchmarks && python plan_fill_replay.py results/budget_batching_pegasus_large_24_seed1_shuffled_packing.json

A budget-shaped micro-batch holds the rows its plan cell allows at the cell's upper edges, so a cell whose samples
sit well below its edge leaves part of the limit unused. This replays one recorded budget_batching_gpu.py run on
this machine: the same long-tail data (its model, sample count and data seed), tokenized as memfit tokenizes it, the
memory model read off the run's own plan table (a least-squares line of predicted GiB over the micro-batch's padded
tokens, plus one per (source, label) for seq2seq), and the plan sized and packed by memfit's own functions for each
`trainer.length_buckets` asked for: with the quantile edges the GPU run had and, for a causal LM, with the edges
memfit now fits to the memory model (`memfit.memory.edges.fitted_edges`); `--pad-tolerance` adds the shipped edges
at 8 buckets with micro-batches drawn among samples of like length (`trainer.pad_tolerance`), `--steps-of-samples`
the plan's epoch with `trainer.effective_batch=samples`, with transformers' length grouping and without, and
`trainer.effective_batch=auto`'s pick with the micro-batch cost at which it would turn. It reports
the plan's cells and proof shapes (the preflight's probes), the epoch's micro-batches and their real and padded
tokens, and the tokens/s a step-time model predicts: seconds per micro-batch and per padded token fitted by least
squares to the run's three arms (train phase seconds against their replayed epochs). The prediction is a model's,
not a measurement: the GPU run of the chosen setting measures it.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from long_tail_gpu import build_dataset, epoch_overrides  # noqa: E402
from memory_model_gpu import compose  # noqa: E402

GIB = 1024**3
ROW = re.compile(r"│\s*(\d+)-(\d+)\s*│(?:\s*(\d+)-(\d+)\s*│)?\s*(\d+)\s*│\s*([\d.]+)\s*│")


def plan_table_model(run: dict, task: str):
    """Predicted bytes of a (batch, source, label) shape: a line fitted to the run's plan table (predicted GiB
    against padded tokens, and for seq2seq source and label tokens apart)."""
    rows = []
    for line in run["plan_table"]:
        if (m := ROW.match(line)) is None:
            continue
        if task == "causal":
            source, label, batch = int(m[2]), 0, int(m[5])
        else:
            source, label, batch = int(m[2]), int(m[4]), int(m[5])
        rows.append((batch, source, label, float(m[6])))
    columns = (lambda b, s, lab: [1.0, b * s]) if task == "causal" else (lambda b, s, lab: [1.0, b * s, b * lab])
    x = np.array([columns(b, s, lab) for b, s, lab, _ in rows])
    coef, *_ = np.linalg.lstsq(x, np.array([gib for *_, gib in rows]), rcond=None)
    return lambda shape: float(np.dot(columns(shape.batch, shape.source, shape.label), coef)) * GIB, coef, len(rows)


def tokenized_lengths(cfg, task: str) -> tuple[np.ndarray, np.ndarray]:
    from memfit.data import load_and_tokenize
    from memfit.data.packing import dataset_lengths
    from memfit.models import build_tokenizer

    prepared = load_and_tokenize(cfg, build_tokenizer(cfg.model))
    return dataset_lengths(prepared.datasets["train"], task)


def setting(run: dict, name: str) -> str | None:
    found = [o.split("=", 1)[1] for o in run["overrides"] if o.startswith(f"{name}=")]
    return found[-1] if found else None


def fixed_epoch(source, label, run: dict, task: str, multiple: int | None, group_by_length: bool):
    """A fixed-batch arm's epoch as Trainer's sampler orders it (another seed than the run's: same statistics)."""
    from memfit.training.throughput import epoch_plan

    return epoch_plan(
        source,
        label,
        batch=int(setting(run, "trainer.batch_size")),
        accumulation=int(setting(run, "trainer.gradient_accumulation_steps") or 1),
        multiple=multiple,
        task=task,
        group_by_length=group_by_length,
        seed=42,
    )


def budget_epoch(
    source,
    label,
    predict,
    *,
    task: str,
    buckets: int,
    limit: int,
    cap: int,
    step: int,
    multiple,
    quantiles=False,
    tolerance=None,
):
    """The epoch of trainer.batching=budget with trainer.effective_batch=tokens over a plan of `buckets` edges a
    length (0: no cells, each micro-batch sized at its own padded lengths: what finer cells tend to)."""
    from memfit.data.audit import BatchShape
    from memfit.data.packing import token_steps
    from memfit.memory.bisection import largest_fitting
    from memfit.memory.plan import grid, size
    from memfit.training.throughput import epoch_plan

    kwargs = dict(task=task, buckets=buckets, multiple=multiple, limit_bytes=limit, fill=1.0, cap=cap)
    plan = grid(source, label, **kwargs, predict=None if quantiles else predict)
    size(plan, predict)
    capacity = plan.capacity
    if buckets == 0:  # no cells: each micro-batch as many rows as the model allows at its own padded lengths

        def capacity(s: int, lab: int) -> int:
            return largest_fitting(lambda rows: predict(BatchShape(rows, s, lab)) <= limit, cap)

    counted = source if task == "causal" else label
    steps = token_steps(
        source, counted, step_samples=step, capacity=capacity, multiple=multiple, seed=42, tolerance=tolerance
    )
    epoch = epoch_plan(
        source,
        label,
        batch=step,
        accumulation=1,
        multiple=multiple,
        task=task,
        group_by_length=False,
        capacity=capacity,
        steps=steps,
    )
    return plan, epoch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("result", help="a budget_batching_gpu.py result with arms a, b and c")
    parser.add_argument("--buckets", type=int, nargs="+", default=[8, 12, 16, 24, 32])
    parser.add_argument("--data-seed", type=int, help="replay on another data seed than the run's (held apart)")
    parser.add_argument("--work", default="/tmp/memfit-plan-fill")
    parser.add_argument("--pad-tolerance", type=float, nargs="*", default=[], help="also replay trainer.pad_tolerance")
    parser.add_argument(
        "--steps-of-samples",
        action="store_true",
        help="also replay trainer.effective_batch=samples, with transformers' length grouping and without",
    )
    args = parser.parse_args()
    result = json.loads(Path(args.result).read_text())
    budget_key = next(k for k in result if k.endswith("GiB"))
    arms = result[budget_key]
    c_run = arms["c_budget"]
    model = setting(c_run, "model")
    task = "causal" if model.startswith("qwen") else "seq2seq"
    samples = int(re.search(r"--samples (\d+)", result["command"])[1]) if "--samples" in result["command"] else 800
    seed = args.data_seed
    if seed is None:
        seed = int(m[1]) if (m := re.search(r"--data-seed (\d+)", result["command"])) else 0
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = work / f"long_tail_{samples}_{seed}.jsonl"
    build_dataset(data, samples=samples, seed=seed)
    common = [*epoch_overrides(model, data, "cpu"), "tracking=none", f"output_dir={work}/outputs"]
    cfg = compose(common)
    source, label = tokenized_lengths(cfg, task)
    cut = int(setting(arms["b_fixed_cut_labels"], "memory.max_label_length"))
    b_source, b_label = tokenized_lengths(compose([*common, f"memory.max_label_length={cut}"]), task)
    grouped = bool(cfg.memory.group_by_length)
    predict, coef, rows = plan_table_model(c_run, task)
    limit = int(c_run["limit_gib"] * GIB)
    multiple = cfg.memory.pad_to_multiple_of
    step = int(setting(c_run, "trainer.batch_size")) * int(setting(c_run, "trainer.gradient_accumulation_steps"))

    from memfit.training.throughput import StepTimeModel, Window

    budget = functools.partial(
        budget_epoch, source, label, predict, task=task, limit=limit, cap=step, step=step, multiple=multiple
    )

    epochs = {
        "a": fixed_epoch(source, label, arms["a_fixed_full_labels"], task, multiple, grouped),
        "b": fixed_epoch(b_source, b_label, arms["b_fixed_cut_labels"], task, multiple, grouped),
        "c": budget(buckets=8, quantiles=True)[1],  # the GPU run's plan: quantile edges
    }
    names = {"a": "a_fixed_full_labels", "b": "b_fixed_cut_labels", "c": "c_budget"}
    windows = [
        Window(e.real_tokens, arms[names[k]]["phase_seconds"]["train"], e.padded_tokens, e.micro_batches, 0)
        for k, e in epochs.items()
    ]
    time_model = StepTimeModel.fit(windows)
    print(f"{model}, {budget_key}, data seed {seed} ({samples} samples); memory model from {rows} plan rows: {coef}")
    print(
        f"step time: {time_model.per_micro_batch_s:.4f} s per micro-batch, "
        f"{time_model.per_padded_token_s * 1e6:.2f} µs per padded token"
    )
    for k, e in epochs.items():
        run = arms[names[k]]
        modelled = e.real_tokens / time_model.seconds(e.padded_tokens, e.micro_batches, 0)
        print(
            f"  {k}: {e.micro_batches} micro-batches, real {e.real_tokens / e.micro_batches:,.0f} / padded "
            f"{e.padded_tokens / e.micro_batches:,.0f} tokens each; measured {run['tokens_per_s']:,.0f} tokens/s "
            f"(train phase {e.real_tokens / run['phase_seconds']['train']:,.0f}), modelled {modelled:,.0f}"
        )
    a_modelled = epochs["a"].real_tokens / time_model.seconds(epochs["a"].padded_tokens, epochs["a"].micro_batches, 0)
    edges = ["quantile", "fitted"] if task == "causal" else ["quantile"]
    replays = [(b, h, None) for b in args.buckets for h in (edges if b else ["none"])]
    replays += [(8, edges[-1], tolerance) for tolerance in args.pad_tolerance]
    for buckets, how, tolerance in replays:
        plan, e = budget(buckets=buckets, quantiles=how == "quantile", tolerance=tolerance)
        modelled = e.real_tokens / time_model.seconds(e.padded_tokens, e.micro_batches, 0)
        print(
            f"  c, {how} edges, length_buckets={buckets}, pad_tolerance={tolerance}: {len(plan.batches)} cells, "
            f"{len(plan.proof_shapes())} proof shapes, {e.micro_batches} micro-batches, real "
            f"{e.real_tokens / e.micro_batches:,.0f} / padded {e.padded_tokens / e.micro_batches:,.0f} tokens each "
            f"({e.padded_tokens / e.real_tokens:.2f}×); modelled {modelled:,.0f} tokens/s "
            f"({modelled / a_modelled:.2f}× a modelled)"
        )
    if args.steps_of_samples:
        from memfit.data.packing import (
            cheaper_step_count,
            epoch_micro_batches,
            epoch_order,
            step_micro_batches,
            token_steps,
        )
        from memfit.training.throughput import epoch_plan

        plan, _ = budget(buckets=8, quantiles=True)
        counted = source if task == "causal" else label
        steps = token_steps(source, counted, step_samples=step, capacity=plan.capacity, multiple=multiple, seed=42)
        by_tokens = step_micro_batches(source, label, steps, plan.capacity, multiple)
        order = epoch_order(source, step, grouped, 42)
        by_samples = epoch_micro_batches(source, label, order, step, plan.capacity, multiple)
        print(f"  trainer.effective_batch=auto picks {cheaper_step_count(by_tokens, by_samples, task)}")
        print(f"    {break_even(by_tokens, by_samples, task, time_model)}")
        for grouping in (True, False):  # memory.group_by_length: Trainer's sampler orders the steps' samples
            e = epoch_plan(
                source, label, batch=step, accumulation=1, multiple=multiple, task=task,
                group_by_length=grouping, seed=42, capacity=plan.capacity,
            )  # fmt: skip
            modelled = e.real_tokens / time_model.seconds(e.padded_tokens, e.micro_batches, 0)
            print(
                f"  c, steps of {step} samples, group_by_length={grouping}: {e.micro_batches} micro-batches, "
                f"{e.padded_tokens / e.real_tokens:.2f}× padded; modelled {modelled:,.0f} tokens/s "
                f"({modelled / a_modelled:.2f}× a modelled)"
            )


def break_even(by_tokens: list, by_samples: list, task: str, time_model) -> str:
    """The micro-batch cost, in padded tokens, at which auto's pick between the two epochs would turn, beside this
    run's own (its step-time model's seconds per micro-batch over seconds per padded token): how far the host may
    differ from memfit.data.packing.MICRO_BATCH_COST before the pick changes."""
    from memfit.data.packing import MICRO_BATCH_COST, padded_tokens

    saved = padded_tokens(by_tokens, task) - padded_tokens(by_samples, task)  # what steps of samples pad less
    extra = len(by_samples) - len(by_tokens)  # and how many more micro-batches they take
    per_token = time_model.per_padded_token_s
    own = f"{time_model.per_micro_batch_s / per_token:,.0f}" if per_token > 0 else "none (no per-token time fitted)"
    # steps of samples cost less where extra × cost < saved: the pick turns at cost = saved / extra, if positive
    point = saved / extra if extra else 0.0
    if point > 0:
        turn = f"turns at {point:,.0f} padded tokens a micro-batch ({'samples' if extra > 0 else 'tokens'} below)"
    else:  # no positive cost turns it: the pick at the shipped cost holds at every cost
        turn = f"is {'samples' if extra * MICRO_BATCH_COST < saved else 'tokens'} at any cost"
    return f"the pick {turn}; shipped cost {MICRO_BATCH_COST:,}, this run's step-time model {own}"


if __name__ == "__main__":
    main()
