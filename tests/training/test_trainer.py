"""The Trainer memfit builds: the preflight's probe runs the model's forward as training will."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import FAST


def _dtypes_seen(model) -> tuple[list[torch.dtype], object]:
    """The output dtype of the model's first Linear layer at every forward, and the hook's handle."""
    seen: list[torch.dtype] = []
    layer = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    handle = layer.register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    return seen, handle


@pytest.mark.parametrize(
    ("model", "precision"), [("tiny_seq2seq", "bf16"), ("tiny_causal", "bf16"), ("tiny_seq2seq", "fp32")]
)
def test_the_probes_forward_is_the_one_training_runs(compose_cfg, tmp_path, model, precision):
    """Training runs the forward that accelerate's prepare_model makes: under the accelerator's autocast, its outputs
    converted to float32 (Qwen's head returns bf16 logits under autocast: training holds a float32 copy too).
    forward_as_trained gives the probe that same forward before training starts (layers in bf16, logits in float32
    under bf16; nothing changed in fp32) and gives the model its own back after."""
    from memfit.data import CountingCollator, load_and_tokenize, model_columns
    from memfit.data.audit import BatchShape
    from memfit.memory.policy import training_arguments
    from memfit.memory.probe import make_batch
    from memfit.models import build_model, build_tokenizer
    from memfit.training.trainer import build_trainer, forward_as_trained

    cfg = compose_cfg(f"model={model}", *FAST, f"memory.precision={precision}", "trainer.max_steps=1")
    task = cfg.model.task
    tokenizer = build_tokenizer(cfg.model)
    net = build_model(cfg, tokenizer, "cpu").model
    datasets = {k: model_columns(v) for k, v in load_and_tokenize(cfg, tokenizer).datasets.items()}
    collator = CountingCollator(tokenizer, cfg.memory.pad_to_multiple_of, task)
    args = training_arguments(cfg, "cpu", str(tmp_path), has_eval=False)
    trainer = build_trainer(task, net, tokenizer, datasets, args, collator, [])
    batch = make_batch(BatchShape(2, 16, 8), collator.inner, task, len(tokenizer), "cpu")
    seen, handle = _dtypes_seen(net)

    with forward_as_trained(trainer):
        probed = net(**batch)
    assert "forward" not in vars(net)  # the class's own forward again
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        autocast_only = net(**batch)  # what the probe ran before: autocast around the forward, no float32 copy
    trainer.train()  # one step: the forward accelerate prepared
    handle.remove()

    half = torch.bfloat16 if precision == "bf16" else torch.float32
    assert seen == [half, half, half]  # probe, autocast alone, training
    assert probed.logits.dtype == torch.float32
    if task == "causal":  # BART adds its float32 final_logits_bias: its logits are float32 either way
        assert autocast_only.logits.dtype == half


def test_modes_change_through_the_top_module_without_a_walk_when_unchanged_and_flops_count_parameters_once(
    compose_cfg, tmp_path
):
    """Trainer sets train mode at every micro-batch: where the model already trains, no module is walked; eval and
    train still reach every module. Trainer's FLOPs estimate (6 × input tokens × parameters without embeddings) is
    the same with the parameters counted once, and sums a budget-shaped step's micro-batches."""
    from memfit.data import CountingCollator, load_and_tokenize, model_columns
    from memfit.data.audit import BatchShape
    from memfit.data.packing import MicroBatches
    from memfit.memory.policy import training_arguments
    from memfit.memory.probe import make_batch
    from memfit.models import build_model, build_tokenizer
    from memfit.training.trainer import build_trainer

    cfg = compose_cfg("model=tiny_causal", *FAST, "trainer.max_steps=1")
    tokenizer = build_tokenizer(cfg.model)
    net = build_model(cfg, tokenizer, "cpu").model
    datasets = {k: model_columns(v) for k, v in load_and_tokenize(cfg, tokenizer).datasets.items()}
    collator = CountingCollator(tokenizer, cfg.memory.pad_to_multiple_of, "causal")
    args = training_arguments(cfg, "cpu", str(tmp_path), has_eval=False)
    trainer = build_trainer("causal", net, tokenizer, datasets, args, collator, [])
    leaf = next(m for m in net.modules() if isinstance(m, torch.nn.Linear))
    walked: list[bool] = []
    leaf.train = lambda mode=True: walked.append(mode) or torch.nn.Module.train(leaf, mode)

    assert net.training and net.train() is net and walked == []  # already training: nothing walked
    net.eval()
    assert walked == [False] and not any(m.training for m in net.modules())
    net.train()
    assert walked == [False, True] and all(m.training for m in net.modules())

    one = make_batch(BatchShape(2, 16, 16), collator.inner, "causal", len(tokenizer), "cpu")
    two = make_batch(BatchShape(3, 8, 8), collator.inner, "causal", len(tokenizer), "cpu")
    parameters = net.num_parameters(exclude_embeddings=True)
    assert trainer.floating_point_ops(one) == 6 * one["input_ids"].numel() * parameters
    both = MicroBatches([one, two])
    assert trainer.floating_point_ops(both) == 6 * (32 + 24) * parameters


def test_training_tells_the_loss_the_label_count_the_collator_counted_on_the_host(compose_cfg, tmp_path, monkeypatch):
    """memory.loss=chunked picks the label rows by the count the collator took on the host, for the micro-batch
    that trains (a device read of the count would stall the host); outside training (evaluation, the probes) the
    loss counts them itself."""
    from memfit.data import CountingCollator, load_and_tokenize, model_columns
    from memfit.data.collate import loss_positions
    from memfit.memory import loss
    from memfit.memory.policy import training_arguments
    from memfit.models import build_model, build_tokenizer
    from memfit.training.trainer import build_trainer

    cfg = compose_cfg("model=tiny_causal", *FAST, "trainer.max_steps=2", "trainer.batch_size=3")
    tokenizer = build_tokenizer(cfg.model)
    net = build_model(cfg, tokenizer, "cpu").model
    datasets = {k: model_columns(v) for k, v in load_and_tokenize(cfg, tokenizer).datasets.items()}
    collator = CountingCollator(tokenizer, cfg.memory.pad_to_multiple_of, "causal")
    args = training_arguments(cfg, "cpu", str(tmp_path), has_eval=False)
    trainer = build_trainer("causal", net, tokenizer, datasets, args, collator, [], loss="chunked")
    told: list[tuple[int | None, int]] = []
    label_rows = loss.label_rows

    def counting(hidden, labels, task, positions=None):
        told.append((positions, int(loss_positions(labels, task))))
        return label_rows(hidden, labels, task, positions)

    monkeypatch.setattr(loss, "label_rows", counting)
    trainer.train()
    assert len(told) == 2 and all(given == counted > 0 for given, counted in told)
    assert trainer.loss_positions is None  # nothing left over for a later forward outside training
    for _ in range(3):  # past the batch the loader collated ahead: a batch not counted here claims no count
        collator.consume()
    assert collator.last_loss_positions is None


def test_a_micro_batch_whose_labels_were_all_cut_leaves_the_logged_loss_finite(compose_cfg, tmp_path):
    """A sample whose response truncation cut away entirely has no label token: alone in a micro-batch its mean loss
    is NaN. Trainer's NaN screen keeps it out of the logged loss, which memfit stops a run on when non-finite."""
    from datasets import Dataset

    from memfit.data import CountingCollator
    from memfit.memory.policy import training_arguments
    from memfit.models import build_model, build_tokenizer
    from memfit.training.trainer import build_trainer

    cfg = compose_cfg("model=tiny_causal", *FAST, "trainer.max_steps=3", "trainer.batch_size=1")
    tokenizer = build_tokenizer(cfg.model)
    net = build_model(cfg, tokenizer, "cpu").model
    ids = [[101 + n + k for k in range(12)] for n in range(3)]
    labels = [[-100] * 6 + row[6:] for row in ids]
    labels[1] = [-100] * 12  # its response was cut away
    train = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 12] * 3, "labels": labels})
    collator = CountingCollator(tokenizer, None, "causal")
    args = training_arguments(cfg, "cpu", str(tmp_path), has_eval=False)
    args.data_seed = args.seed  # the unlabelled sample's place in the epoch does not matter
    trainer = build_trainer("causal", net, tokenizer, {"train": train}, args, collator, [])
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
