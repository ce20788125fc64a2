"""The worst-case preflight probes the audit's shape, leaves weights untouched, and stops a run that cannot fit."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from mlflow.tracking import MlflowClient

from memfit.data import CountingCollator
from memfit.data.audit import BatchShape, padded
from memfit.memory.meter import HostMeter
from memfit.memory.probe import ProbeSetup, make_batch, probe
from memfit.models import build_model, build_tokenizer
from memfit.run import run
from memfit.tracking import default_tracking_uri, run_facts
from tests.conftest import FAST, run_train_py


def _setup(cfg):
    tokenizer = build_tokenizer(cfg.model)
    built = build_model(cfg, tokenizer, "cpu")
    optimizers = []

    def make_optimizer():
        optimizers.append(torch.optim.AdamW([p for p in built.model.parameters() if p.requires_grad], lr=1e-3))
        return optimizers[-1]

    collator = CountingCollator(tokenizer, 8, cfg.model.task)
    setup = ProbeSetup(built.model, make_optimizer, collator.inner, HostMeter(), "cpu", cfg.model.task, len(tokenizer))
    return setup, optimizers


def test_probe_batch_has_exactly_the_shape(compose_cfg):
    setup, _ = _setup(compose_cfg("model=tiny_seq2seq"))
    batch = make_batch(BatchShape(3, 40, 24), setup.collator, "seq2seq", setup.vocab_size, "cpu")
    assert tuple(batch["input_ids"].shape) == (3, 40) and tuple(batch["labels"].shape) == (3, 24)
    assert (batch["labels"] != -100).all()  # every label position is a real target: the worst case


@pytest.mark.parametrize("model", ["tiny_seq2seq", "tiny_causal"])
def test_probe_batch_carries_a_padding_mask_as_real_batches_do(compose_cfg, model):
    setup, _ = _setup(compose_cfg(f"model={model}"))
    task = "causal" if model == "tiny_causal" else "seq2seq"
    batch = make_batch(BatchShape(3, 40, 24), setup.collator, task, setup.vocab_size, "cpu")
    assert tuple(batch["input_ids"].shape) == (3, 40)
    # one padded position, in the last row: attention takes its masked path, with the worst shape kept
    assert batch["attention_mask"].sum().item() == 3 * 40 - 1 and batch["attention_mask"][-1, -1] == 0
    single = make_batch(BatchShape(1, 40, 24), setup.collator, task, setup.vocab_size, "cpu")
    assert single["attention_mask"].sum().item() == 39  # a lone row of 39 tokens is padded to the multiple of 8


def test_probe_batch_of_one_row_is_unpadded_where_the_collator_would_not_pad(compose_cfg):
    setup, _ = _setup(compose_cfg("model=tiny_seq2seq"))
    setup.collator.pad_to_multiple_of = None  # padding to the longest row: a single row is never padded
    single = make_batch(BatchShape(1, 37, 24), setup.collator, "seq2seq", setup.vocab_size, "cpu")
    assert tuple(single["input_ids"].shape) == (1, 37) and single["attention_mask"].all()


@pytest.mark.parametrize("model", ["tiny_seq2seq", "tiny_causal"])
def test_probe_leaves_weights_and_rng_exactly_as_before(compose_cfg, model):
    setup, optimizers = _setup(compose_cfg(f"model={model}"))
    before = {n: p.detach().clone() for n, p in setup.model.named_parameters()}
    rng = torch.get_rng_state()
    probes = probe(setup, BatchShape(2, 32, 16), BatchShape(2, 32, 16))
    assert [p.phase for p in probes] == ["train", "eval"] and not any(p.oom for p in probes)
    assert optimizers and optimizers[0].state  # the optimizer really stepped (its state existed)
    train = probes[0]
    assert len(train.step_seconds) == setup.steps and min(train.step_seconds) > 0  # each step timed apart
    assert sum(train.step_seconds) <= train.seconds
    for name, param in setup.model.named_parameters():
        assert torch.equal(param, before[name]), name
        assert param.grad is None
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.slow
def test_training_after_a_passing_preflight_is_identical_to_training_without(compose_cfg):
    losses = []
    for enabled in (False, True):
        cfg = compose_cfg(
            "model=tiny_seq2seq", *FAST, f"preflight.enabled={enabled}", f"tracking.experiment=pf{enabled}"
        )
        report = run(cfg)
        client = MlflowClient(default_tracking_uri(cfg.output_dir))
        losses.append([m.value for m in client.get_metric_history(report.run_id, "train/loss")])
    assert losses[0] == losses[1] and len(losses[0]) == 3


@pytest.mark.slow
def test_preflight_probes_the_longest_padded_shape_and_truncation_changes_it(compose_cfg, long_tail_jsonl):
    base = [
        "model=tiny_seq2seq",
        "data=jsonl",
        f"data.path={long_tail_jsonl}",
        "data.validation_fraction=0",
        "memory.max_source_length=512",
        "memory.pad_to_multiple_of=8",
        "trainer.batch_size=4",
        "preflight_only=true",
        "preflight.max_batch_limit=4",
    ]
    full = run(compose_cfg(*base, "memory.max_label_length=512"))
    assert full.status == "ok" and full.steps == 0  # preflight_only trains nothing
    assert full.worst_case_shape[2] == padded(302, 8)  # the rare 302-token label, padded as the collator pads
    assert full.max_batch is not None and full.max_batch >= 4
    cut = run(compose_cfg(*base, "memory.max_label_length=32", "tracking.experiment=cut"))
    assert cut.worst_case_shape[2] == 32
    assert cut.worst_case_shape[1] == full.worst_case_shape[1]
    assert cut.label_coverage < 1.0 == full.label_coverage


@pytest.mark.slow
def test_a_failing_preflight_exits_before_training_with_ways_out(tmp_path, long_tail_jsonl):
    # On CPU the budget is host memory: 0.3 GiB is less than the Python process itself.
    out = run_train_py(
        "model=tiny_seq2seq",
        "data=jsonl",
        f"data.path={long_tail_jsonl}",
        "budget.gib=0.3",
        "budget.margin_gib=0",
        "memory.max_label_length=512",
        "trainer.device=cpu",
        "memory.precision=fp32",
        f"output_dir={tmp_path}",
        timeout=300,
    )
    assert out.returncode == 3, out.stderr[-2000:]
    assert "the worst batch does NOT fit the budget" in out.stderr
    assert "batch 4 × source" in out.stderr and "labels 304" in out.stderr  # the probed shape is named
    assert "ways out" in out.stderr and "trainer.batch_size=" in out.stderr
    assert "memory.max_label_length=" in out.stderr and "gradient_checkpointing=true" in out.stderr
    assert "memory.loss=chunked (~0.1" in out.stderr  # batch 4 × 304 labels × 30,522 entries: 0.14 GiB
    cuts = re.findall(r"memory\.max_(?:label|source)_length=\d+ \(keeps ([\d.]+)%", out.stderr)
    assert cuts and all(float(kept) >= 90.0 for kept in cuts)  # no way out trains on less than 90% of the tokens
    client = MlflowClient(default_tracking_uri(str(tmp_path)))
    recorded = client.search_runs([client.get_experiment_by_name("memfit").experiment_id])[0]
    assert recorded.info.status == "FAILED"
    assert recorded.data.tags["memfit.reason"].startswith("preflight")
    assert "train/loss" not in recorded.data.metrics  # no training step ran
    assert run_facts(client, recorded.info.run_id)["preflight/passed"] == 0.0


def test_generation_is_probed_when_evaluation_generates(compose_cfg):
    setup, _ = _setup(compose_cfg("model=tiny_seq2seq"))
    shape = BatchShape(2, 32, 16)
    plain = probe(setup, shape, shape)[1]
    setup.generate = True
    before = {n: p.detach().clone() for n, p in setup.model.named_parameters()}
    generating = probe(setup, shape, shape)[1]
    assert generating.phase == "eval" and not generating.oom
    assert generating.seconds > plain.seconds  # 16 decoding steps ran on top of the forward
    assert all(torch.equal(p, before[n]) for n, p in setup.model.named_parameters())


@pytest.mark.slow
def test_a_run_that_evaluates_by_generation(compose_cfg):
    report = run(compose_cfg("model=tiny_seq2seq", *FAST, "trainer.predict_with_generate=true"))
    assert report.status == "ok" and report.worst_case_peak_gib > 0


def test_ways_out_are_judged_by_the_memory_model_when_there_is_one():
    import numpy as np

    from memfit.config import GIB
    from memfit.data.audit import BatchShape
    from memfit.memory.meter import MemoryPeak
    from memfit.memory.preflight import Probe, suggest

    def predict(shape: BatchShape) -> float:  # a calibrated model: 4 GiB + 1 MiB per label token + 0.1 per source
        return 4 * GIB + shape.batch * (shape.label * 2**20 + shape.source * 0.1 * 2**20)

    worst = BatchShape(8, 512, 512)
    measured = Probe(worst, "train", MemoryPeak(int(predict(worst)), int(predict(worst))), static_bytes=3 * GIB)
    limit = 6 * GIB
    memory = SimpleNamespace(gradient_checkpointing=True, optimizer="adafactor")
    ways = suggest(
        [measured],
        limit,
        batch=8,
        accumulation=1,
        task="seq2seq",
        label_raw=np.arange(1, 600),
        max_label=512,
        memory=memory,
        source_raw=np.arange(1, 600),
        max_source=512,
        trainable_params=10**6,
        lora_enabled=False,
        predict=predict,
        min_coverage=0.0,  # any cut: this test is about the memory model's judgement
    )
    batch_way = next(w for w in ways if w.startswith("trainer.batch_size="))
    fitting = max(b for b in range(1, 8) if predict(BatchShape(b, 512, 512)) <= limit)
    assert batch_way.startswith(f"trainer.batch_size={fitting} ") and "memory model" in batch_way
    label_way = next(w for w in ways if w.startswith("memory.max_label_length="))
    shorter = int(label_way.split("=")[1].split()[0])
    assert predict(BatchShape(8, 512, shorter)) <= limit < predict(BatchShape(8, 512, shorter + 8))


def test_a_way_out_never_cuts_a_length_below_the_coverage_it_must_keep():
    """The cut that would fit keeps 66% of the label tokens: with a floor of 90% (the default) or a sweep's 0.95,
    the way out goes no shorter than the floor, says so, and states what it keeps."""
    import numpy as np

    from memfit.config import GIB
    from memfit.data.audit import BatchShape, label_coverage
    from memfit.memory.meter import MemoryPeak
    from memfit.memory.preflight import Probe, suggest

    def predict(shape: BatchShape) -> float:
        return 4 * GIB + shape.batch * (shape.label * 2**20 + shape.source * 0.1 * 2**20)

    worst = BatchShape(8, 512, 512)
    measured = Probe(worst, "train", MemoryPeak(int(predict(worst)), int(predict(worst))), static_bytes=3 * GIB)
    labels = np.arange(1, 600)
    for floor in (0.9, 0.95):
        ways = suggest(
            [measured],
            6 * GIB,
            batch=8,
            accumulation=1,
            task="seq2seq",
            label_raw=labels,
            max_label=512,
            memory=SimpleNamespace(gradient_checkpointing=True, optimizer="adafactor"),
            source_raw=labels,
            max_source=512,
            trainable_params=10**6,
            lora_enabled=False,
            predict=predict,
            min_coverage=floor,
        )
        label_way = next(w for w in ways if w.startswith("memory.max_label_length="))
        shorter = int(label_way.split("=")[1].split()[0])
        assert label_coverage(labels, shorter) >= floor > label_coverage(labels, shorter - 8)
        assert f"the shortest that keeps {floor:.0%}: not enough alone" in label_way
        assert f"keeps {label_coverage(labels, shorter):.1%} of label tokens" in label_way


def test_the_report_logs_the_step_times_of_its_longest_training_shape():
    """A step on a padded shape met for the first time, and one repeating it: what a new shape costs a step
    (issue 4's step-time model), from the probes the preflight runs anyway."""
    from memfit.memory.meter import MemoryPeak
    from memfit.memory.preflight import PreflightReport, Probe

    peak = MemoryPeak(1, 1)
    probes = [
        Probe(BatchShape(4, 64, 16), "train", peak, step_seconds=(0.9, 0.2)),
        Probe(BatchShape(4, 512, 64), "train", peak, step_seconds=(1.5, 0.5, 0.7)),
        Probe(BatchShape(4, 512, 64), "eval", peak),
    ]
    metrics = PreflightReport(True, probes, 10, 10, "test", "seq2seq").metrics()
    assert metrics["preflight/first_step_s"] == 1.5 and metrics["preflight/repeat_step_s"] == pytest.approx(0.6)
    untimed = PreflightReport(True, probes[2:], 10, 10, "test", "seq2seq").metrics()
    assert "preflight/first_step_s" not in untimed


def test_a_refused_batch_is_reported_by_what_it_needs_never_with_a_positive_headroom():
    """After an OOM the allocator's state is not what the batch needs: the verdict says what it needs (the memory
    model's prediction, or more than the budget without one) and by how much it is over the limit."""
    from memfit.config import GIB
    from memfit.memory.meter import MemoryPeak
    from memfit.memory.preflight import PreflightReport, Probe

    shape = BatchShape(16, 512, 512)
    budget, limit = 24 * GIB, int(23.5 * GIB)
    oom = Probe(shape, "train", None, attempted_bytes=int(21.88 * GIB))  # what the allocator held when it struck
    text = PreflightReport(False, [oom], limit, budget, "CUDA", "seq2seq").summary()
    assert "over it by more than 0.50 GiB" in text and "needs more than 24.00 GiB" in text and "+" not in text
    predicted = Probe(shape, "train", None, attempted_bytes=int(21.88 * GIB), predicted_bytes=int(30 * GIB))
    text = PreflightReport(False, [predicted], limit, budget, "CUDA", "seq2seq").summary()
    assert "needs ~30.00 GiB (memory model)" in text and "over it by 6.50 GiB" in text
    measured = Probe(shape, "train", MemoryPeak(int(24.23 * GIB), int(24.23 * GIB)))
    report = PreflightReport(False, [measured], limit, budget, "CUDA", "seq2seq")
    assert "over it by 0.73 GiB" in report.summary() and report.metrics()["preflight/headroom_gib"] < 0
    fitting = Probe(BatchShape(4, 512, 512), "train", MemoryPeak(int(20 * GIB), int(20 * GIB)))
    assert "headroom +3.50 GiB" in PreflightReport(True, [fitting], limit, budget, "CUDA", "seq2seq").summary()


def test_the_largest_batch_search_stops_at_the_training_samples_and_says_so(compose_cfg, caplog):
    """A batch larger than the training split would repeat samples: the search's cap is the smaller of
    preflight.max_batch_limit and the number of samples, a cap between two doublings is tried itself, and a result
    at the cap says that larger batches were not tried."""
    cfg = compose_cfg("model=tiny_seq2seq", *FAST, "data.max_train_samples=6", "preflight_only=true", "tracking=none")
    with caplog.at_level("INFO", logger="memfit"):
        report = run(cfg)
    assert report.max_batch == 6  # 4, then 8 is past the 6 samples: 6 itself is tried, not left at 4
    assert "largest-batch search from the configured batch, doubling: probed batches 2, 4, 6\n" in caplog.text
    assert "largest batch that fits the worst case: >= 6 (all 6 training samples in one batch" in caplog.text


def test_with_a_memory_model_the_largest_batch_search_starts_from_its_prediction(compose_cfg, caplog, tmp_path):
    """Where a calibration exists, the search's first probe is the memory model's predicted largest batch: here
    every batch fits and the prediction is the cap, six samples, so one probe answers what doubling from the
    configured batch 2 took three probes for (2, 4, 6)."""
    cfg = compose_cfg(
        "model=tiny_seq2seq",
        *FAST,
        "data.max_train_samples=6",
        "preflight_only=true",
        "tracking=none",
        "calibration.enabled=true",
        f"calibration.cache_dir={tmp_path}",
    )
    with caplog.at_level("INFO", logger="memfit"):
        report = run(cfg)
    assert report.max_batch == 6
    assert "largest-batch search from the memory model's prediction, 6: probed batches 6\n" in caplog.text


def test_the_largest_batch_search_stops_before_a_probe_past_its_time_bound_and_says_which(compose_cfg, caplog):
    """On CPU a probe of hundreds of rows takes minutes: the search does not start a probe that its last one, scaled
    by batch size, expects to end past preflight.max_search_seconds, and says which batch it did not try. The first
    probe runs whatever the bound (a bound shorter than the time to reach it skipped it on a loaded host)."""
    cfg = compose_cfg(
        "model=tiny_seq2seq", *FAST, "preflight_only=true", "tracking=none", "preflight.max_search_seconds=1e-9"
    )
    with caplog.at_level("INFO", logger="memfit"):
        bounded = run(cfg)
    assert bounded.status == "ok" and bounded.max_batch == 2  # the configured batch fits; 4 is expected to take longer
    assert re.search(
        r"largest batch that fits the worst case: >= 2 \(batch 4 not tried: its probe would take ~[\d.]+ s more, past "
        r"preflight.max_search_seconds=1e-09; raise it to search further\)",
        caplog.text,
    ), caplog.text[-2000:]


def test_preflight_only_searches_even_when_the_configured_batch_does_not_fit_and_says_what_batch_1_needs(
    compose_cfg,
):
    """ "How large a batch can I afford?" matters most when the configured one does not fit: the search runs below
    it, down to batch 1, and where none fits it says what batch 1 needs (0.3 GiB of host memory holds no Python)."""
    cfg = compose_cfg(
        "model=tiny_seq2seq", *FAST, "budget.gib=0.3", "budget.margin_gib=0", "preflight_only=true", "tracking=none"
    )
    report = run(cfg)
    assert report.status == "preflight_failed" and report.max_batch is None
    line = next(x for x in report.reason.splitlines() if "largest batch that fits the worst case" in x)
    assert re.search(
        r"largest batch that fits the worst case: none \(no batch fits: batch 1 × source \d+ × "
        r"labels \d+ needs ~\d+\.\d\d GiB\)",
        line,
    ), line


def _ways_at_qwen_shape(**knobs) -> list[str]:
    """The ways out of a qwen2_5_1_5b-like LoRA step (28 layers, bf16) measured at 30 GiB (4 × 2048) against a 24
    GiB limit, with the policy's memory knobs `knobs` (the rest on) and its dropped copies those of 28 layers' k, v
    and up adapters (6,144 input features each layer)."""
    import numpy as np

    from memfit.config import GIB
    from memfit.data.audit import BatchShape
    from memfit.memory.meter import MemoryPeak
    from memfit.memory.model import Architecture
    from memfit.memory.preflight import Probe, suggest
    from memfit.memory.savings import DroppedCopies, knob_savings

    memory = SimpleNamespace(
        gradient_checkpointing=True,
        optimizer="adamw",
        precision="bf16",
        loss="fused",
        **{"recompute_lora_dropout": True, "shared_attention_mask": True, "causal_padding_mask": True, **knobs},
    )
    arch = Architecture("causal", 151936, 0, 28, 12, quadratic_attention=False)
    copies = DroppedCopies(source_width=0, target_width=6144 * 28)
    measured = Probe(BatchShape(4, 2048, 2048), "train", MemoryPeak(30 * GIB, 30 * GIB), static_bytes=3 * GIB)
    return suggest(
        [measured],
        24 * GIB,
        batch=4,
        accumulation=1,
        task="causal",
        label_raw=np.arange(1, 2049),
        max_label=2048,
        memory=memory,
        trainable_params=10**7,
        lora_enabled=True,
        min_coverage=0.99,
        savings=lambda shape: knob_savings(memory, arch, copies, shape),
    )


@pytest.mark.parametrize(
    ("knob", "saving"),
    [
        ("recompute_lora_dropout", "(~2.62 GiB less:"),  # 4 × 2048 × 6,144 × 28 bf16 copies
        ("shared_attention_mask", "(~0.84 GiB less:"),  # 27 layers' 4 × 2048² bf16 masks beyond the one kept
    ],
)
def test_a_knob_left_off_is_a_way_out_ranked_by_its_saving(knob, saving):
    off = _ways_at_qwen_shape(**{knob: False})
    way = next(w for w in off if w.startswith(f"memory.{knob}=true"))
    assert saving in way
    assert off.index(way) < off.index(next(w for w in off if w.startswith("memory.optimizer=")))  # more than 0.06 GiB
    assert not [w for w in _ways_at_qwen_shape() if knob in w]


def test_no_shared_mask_is_promised_where_a_causal_batch_goes_without_its_mask():
    maskless = _ways_at_qwen_shape(shared_attention_mask=False, causal_padding_mask=False)
    assert not [w for w in maskless if "shared_attention_mask" in w]
