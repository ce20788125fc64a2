"""Real Trainer steps on tiny models, recorded in a temporary sqlite MLflow store."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from memfit.run import run
from memfit.tracking import default_tracking_uri, run_facts
from tests.conftest import FAST, run_train_py

pytestmark = pytest.mark.slow


def _runs(output_dir):
    client = MlflowClient(default_tracking_uri(str(output_dir)))
    experiment = client.get_experiment_by_name("memfit")
    return client, client.search_runs([experiment.experiment_id])


@pytest.mark.parametrize("model", ["tiny_seq2seq", "tiny_causal"])
def test_tiny_run_records_loss_beside_peak_memory(compose_cfg, tmp_path, model):
    from transformers import TrainerCallback

    class StepCounter(TrainerCallback):  # a caller's callback (a benchmark's clock) sees every step
        steps: list[int] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    cfg = compose_cfg(f"model={model}", *FAST)
    counter = StepCounter()
    report = run(cfg, callbacks=[counter])
    assert report.status == "ok" and report.steps == 3
    assert counter.steps == [1, 2, 3]
    client, runs = _runs(cfg.output_dir)
    assert len(runs) == 1
    recorded = runs[0]
    assert recorded.info.status == "FINISHED"
    for metric in ("train/loss", "mem/peak_allocated_gib", "mem/peak_reserved_gib", "train/tokens_per_s"):
        history = client.get_metric_history(recorded.info.run_id, metric)
        assert [m.step for m in history] == [1, 2, 3], metric
        assert all(m.value > 0 for m in history), metric
    retries = client.get_metric_history(recorded.info.run_id, "mem/alloc_retries")
    assert [(m.step, m.value) for m in retries] == [(1, 0), (2, 0), (3, 0)]  # the host has no caching allocator
    assert report.alloc_retries == 0
    summary, facts = recorded.data.metrics, run_facts(client, recorded.info.run_id)
    assert summary["summary/peak_allocated_gib"] >= max(
        m.value for m in client.get_metric_history(recorded.info.run_id, "mem/peak_allocated_gib")
    )
    assert facts["summary/train_tokens"] > 0 and "eval/loss" in summary
    assert summary["summary/tokens_per_s"] > 0 and facts["summary/tokens_per_s_with_warmup"] > 0
    # steps 2 and 3 give two steady rates: their spread, standard deviation over mean, says how far to trust them
    assert report.tokens_per_s_spread == facts["summary/tokens_per_s_spread"] >= 0
    assert report.epoch_tokens_per_s == summary["summary/epoch_tokens_per_s"] > 0  # the epoch's, from its plan
    assert summary["summary/label_coverage"] == report.label_coverage
    assert summary["summary/worst_case_peak_gib"] == pytest.approx(report.worst_case_peak_gib)
    # what training reserved beyond the preflight's worst case (here the process's RSS, which grows as it trains)
    growth = report.peak_reserved_gib - report.worst_case_peak_gib
    assert report.reserved_over_preflight_gib == pytest.approx(growth)
    assert facts["summary/reserved_over_preflight_gib"] == pytest.approx(growth)
    startup = {k: v for k, v in facts.items() if k.startswith("startup/")}  # every phase before the preflight
    phases = ("checks", "tokenizer", "data", "device", "tracking", "audit", "model", "trainer")
    assert set(startup) == {f"startup/{phase}_s" for phase in phases} and all(v >= 0 for v in startup.values())
    assert startup["startup/data_s"] == facts["audit/seconds"]
    # the MLflow UI's columns and charts: per-step series (train/, mem/, eval/) and a few single numbers
    single = [key for key in summary if not key.startswith(("train/", "mem/", "eval/"))]
    assert len(single) <= 10 and all(key.startswith("summary/") for key in single), single
    assert not [key for key in summary if key.endswith(("_runtime", "per_second"))]  # Trainer's timing noise
    assert facts["audit/label_coverage"] == report.label_coverage and facts["preflight/passed"] == 1.0
    padding = [m.value for m in client.get_metric_history(recorded.info.run_id, "train/padding_share")]
    assert len(padding) == 3 and all(0 <= share < 1 for share in padding)
    assert recorded.data.params["memory.name"] == "balanced"
    assert recorded.data.params["trainer.batch_size"] == "2"
    assert recorded.data.tags["memfit.model"] == model
    assert recorded.data.tags["memfit.meter"] == "host RSS (CPU)"
    assert recorded.data.tags["memfit.optimizer"] == "torch.optim.adamw.AdamW"  # the optimizer that really ran
    artifacts = [a.path for a in client.list_artifacts(recorded.info.run_id)]
    assert "config.yaml" in artifacts
    assert recorded.info.artifact_uri.startswith((Path(cfg.output_dir) / "mlartifacts").as_uri())  # not ./mlruns


def test_the_preflight_keeps_what_a_long_runs_cache_grows_below_its_limit(compose_cfg, monkeypatch, caplog):
    """The meter's cache_growth (what a long run's allocator cache holds beyond a fresh probe: 64 MiB on CUDA, none
    for host RSS) comes off the limit every peak is judged against, the preflight says so, and the run reports its
    judged worst case, the measured worst batch plus what was kept, against budget minus margin; training's growth
    is read past that."""
    from memfit.config import GIB
    from memfit.memory.meter import HostMeter

    kept = 0.25
    monkeypatch.setattr(HostMeter, "cache_growth", int(kept * GIB))
    cfg = compose_cfg("model=tiny_seq2seq", *FAST, "budget.gib=6")
    with caplog.at_level("INFO", logger="memfit"):
        report = run(cfg)
    assert report.status == "ok"
    assert "limit 5.25 GiB (budget 6.00 GiB minus margin and 0.25 GiB for a long run's cache" in caplog.text
    assert report.limit_gib == pytest.approx(6 - cfg.budget.margin_gib, abs=1e-6)
    client, runs = _runs(cfg.output_dir)
    measured = run_facts(client, runs[0].info.run_id)["preflight/peak_reserved_gib"]
    assert report.worst_case_peak_gib == pytest.approx(measured + kept)
    assert report.reserved_over_preflight_gib == pytest.approx(report.peak_reserved_gib - report.worst_case_peak_gib)


def test_lora_trains_only_the_adapters(compose_cfg):
    cfg = compose_cfg("model=tiny_causal", *FAST, "tracking=none")
    from memfit.models import build_model, build_tokenizer

    built = build_model(cfg, build_tokenizer(cfg.model), "cpu")
    names = [n for n, p in built.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert built.trainable_params < built.total_params / 10


def test_a_failing_run_ends_failed_with_its_reason(compose_cfg):
    # 30 hidden units cannot split into 4 heads: the model build itself fails, after the run started.
    cfg = compose_cfg(
        "model=tiny_seq2seq", *FAST, "model.architecture.encoder_attention_heads=4", "model.architecture.d_model=30"
    )
    with pytest.raises(ValueError):
        run(cfg)
    _, runs = _runs(cfg.output_dir)
    assert runs[0].info.status == "FAILED"
    assert runs[0].data.tags["memfit.reason"].startswith("failed: ValueError")


def test_a_local_checkpoint_is_loaded_instead_of_random_weights(compose_cfg, tmp_path):
    from memfit.models import build_model, build_tokenizer

    cfg = compose_cfg("model=tiny_seq2seq", *FAST, "tracking=none")
    tokenizer = build_tokenizer(cfg.model)
    saved = build_model(cfg, tokenizer, "cpu").model
    saved.save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    cfg = compose_cfg("model=tiny_seq2seq", *FAST, "tracking=none", f"model.name_or_path={tmp_path / 'ckpt'}")
    loaded = build_model(cfg, build_tokenizer(cfg.model), "cpu")
    assert not loaded.random_weights
    for (name, a), (_, b) in zip(saved.named_parameters(), loaded.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_throughput_leaves_the_first_steps_warm_up_out():
    from memfit.memory.meter import HostMeter
    from memfit.tracking import NullTracker
    from memfit.training.callback import MemoryLoggingCallback
    from memfit.training.throughput import Window

    callback = MemoryLoggingCallback(HostMeter(), NullTracker(), collator=None, max_train_tokens=None)
    assert callback.steady_tokens_per_s is None  # nothing trained yet: the run falls back to tokens / wall time
    callback.windows = [Window(100, 10.0, 120, 1, 1)]  # one window only: all warm-up, nothing steady to report
    assert callback.steady_tokens_per_s is None
    # a slow first step (optimizer state, autotuning), then steady
    callback.windows += [Window(100, 1.0, 120, 1, 0), Window(300, 1.0, 320, 1, 0)]
    assert callback.steady_tokens_per_s == 200.0


def test_the_collator_counts_micro_batches_of_a_padded_shape_not_taken_before(compose_cfg):
    from memfit.data import CountingCollator
    from memfit.models import build_tokenizer

    collator = CountingCollator(build_tokenizer(compose_cfg("model=tiny_seq2seq").model), pad_to_multiple_of=8)
    sample = {"input_ids": [5] * 9, "attention_mask": [1] * 9, "labels": [6] * 3}
    for batch in ([sample, sample], [sample, {**sample, "labels": [6] * 5}], [sample, {**sample, "labels": [6] * 9}]):
        collator(batch)
        collator.consume()
    assert collator.new_shapes == 2  # labels 3 and 5 both pad to 8: one shape; labels 9 pad to 16: a second


BUDGET_RESUME = ["trainer.batching=budget", "trainer.max_micro_batch=1", "calibration.probe_tokens=1024"]
# 6 samples: 3 steps an epoch, so checkpoint-4 lies one step into the second epoch (a new shuffle)
TOKEN_STEPS = [*BUDGET_RESUME, "data.max_train_samples=6", "trainer.effective_batch=tokens"]


@pytest.mark.parametrize(
    ("batching", "kill_at", "checkpoint"),
    [
        ([], 3, "checkpoint-2"),
        (TOKEN_STEPS, 5, "checkpoint-4"),
        ([*BUDGET_RESUME, "trainer.effective_batch=samples"], 3, "checkpoint-2"),
        ([*TOKEN_STEPS, "trainer.pad_tolerance=0.1"], 5, "checkpoint-4"),
    ],
    ids=["fixed", "budget-tokens", "budget-samples", "budget-pad-tolerance"],
)
def test_a_killed_run_resumes_from_its_checkpoint_in_the_same_mlflow_run(
    tmp_path, monkeypatch, batching, kill_at, checkpoint
):
    """SIGKILLed after a checkpoint; rerun with trainer.resume=true: the steps after it are exactly those of an
    uninterrupted run (step, optimizer, scheduler, RNG and data position restored) and MLflow holds one run. With
    budget-shaped batches too (micro-batches of one row), steps counted in tokens (resumed inside the second
    epoch: its own shuffle, the step already trained skipped; with a pad tolerance, its own bands) or in samples."""
    common = ["model=tiny_seq2seq", *FAST, "trainer.max_steps=6", "trainer.save_steps=2", "tracking.run_name=resumable"]
    common += [*batching, f"calibration.cache_dir={tmp_path / 'calibration'}"]
    straight = run_train_py(*common, f"output_dir={tmp_path / 'straight'}")
    assert straight.returncode == 0, straight.stderr[-2000:]

    monkeypatch.setenv("MEMFIT_FAULTS", f"resumable=kill@{kill_at}")
    killed = run_train_py(*common, f"output_dir={tmp_path / 'resumed'}")
    monkeypatch.delenv("MEMFIT_FAULTS")
    assert killed.returncode == -9  # SIGKILL: nothing of memfit ran after it
    resumed = run_train_py(*common, "trainer.resume=true", f"output_dir={tmp_path / 'resumed'}")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    replayed = "the resumed run replays the plan beside its checkpoints" in resumed.stdout + resumed.stderr
    assert replayed == bool(batching)  # budget-shaped: the plan the killed run trained (test_budget_batching.py)

    client, runs = _runs(tmp_path / "resumed")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"  # continued, not forked
    assert runs[0].data.tags["memfit.resumed_from"] == checkpoint
    loss = {m.step: m.value for m in client.get_metric_history(runs[0].info.run_id, "train/loss")}
    reference_client, reference = _runs(tmp_path / "straight")
    expected = {m.step: m.value for m in reference_client.get_metric_history(reference[0].info.run_id, "train/loss")}
    assert sorted(loss) == [1, 2, 3, 4, 5, 6]
    after = range(kill_at, 7)
    assert [loss[s] for s in after] == pytest.approx([expected[s] for s in after], rel=1e-5)


def test_sigterm_ends_the_run_killed_with_its_metrics_and_it_resumes(tmp_path, monkeypatch):
    """SIGTERM (a preemption, docker stop) at the end of step 4, after the step-2 checkpoint: exit 143 with one line,
    the run KILLED with the signal as its reason, and step 3's metrics, buffered since the checkpoint wrote steps 1-2,
    flushed; trainer.resume=true continues it from checkpoint-2 to the end."""
    common = ["model=tiny_seq2seq", *FAST, "trainer.max_steps=5", "trainer.save_steps=2", "tracking.run_name=preempted"]
    monkeypatch.setenv("MEMFIT_FAULTS", "preempted=term@4")
    stopped = run_train_py(*common, f"output_dir={tmp_path}")
    monkeypatch.delenv("MEMFIT_FAULTS")
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    assert "Traceback" not in stopped.stderr
    assert stopped.stderr.strip().splitlines()[-1].startswith("memfit: stopped by SIGTERM: the run ended KILLED")
    client, (run,) = _runs(tmp_path)
    assert run.info.status == "KILLED" and "stopped by SIGTERM" in run.data.tags["memfit.reason"]
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert steps == [1, 2, 3]  # step 4 was cut short before it was logged

    resumed = run_train_py(*common, "trainer.resume=true", f"output_dir={tmp_path}")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    client, (run,) = _runs(tmp_path)
    assert run.info.status == "FINISHED" and run.data.tags["memfit.resumed_from"] == "checkpoint-2"
    assert "memfit.reason" not in run.data.tags  # the stop it recovered from is no longer why it ended
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert steps == [1, 2, 3, 4, 5]  # step 3, trained again after checkpoint-2, is logged once


def _host_rss_gib() -> float:
    from memfit.config import GIB

    status = Path("/proc/self/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")) / GIB


@pytest.mark.parametrize("spike_to", ["past_the_limit", "past_the_budget"])
def test_on_cpu_training_past_what_the_preflight_proved_warns_and_past_the_budget_stops(compose_cfg, caplog, spike_to):
    """Host memory that training takes beyond the preflight's worst batch (here a buffer a callback fills at step 2,
    as a growing process would): past budget minus margin it is said when the run ends; past budget.gib the run
    stops there, FAILED with the reason, as an over-budget step stops on CUDA."""
    import numpy as np
    from transformers import TrainerCallback

    budget = round(_host_rss_gib() + 1.5, 1)
    target = budget - 0.25 if spike_to == "past_the_limit" else budget + 0.25

    class Spike(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                buffer = np.ones(int((target - _host_rss_gib()) * 2**30), dtype=np.uint8)  # touched: resident
                del buffer

    cfg = compose_cfg("model=tiny_seq2seq", *FAST, f"budget.gib={budget}")
    with caplog.at_level("INFO", logger="memfit"):
        report = run(cfg, callbacks=[Spike()])
    client, runs = _runs(cfg.output_dir)
    if spike_to == "past_the_limit":
        assert report.status == "ok" and report.peak_reserved_gib > report.limit_gib
        assert f"training's host memory (RSS) reached {report.peak_reserved_gib:.2f} GiB" in caplog.text
        assert "past budget.gib the run stops" in caplog.text
        return
    assert report.status == "over_budget" and report.saved_model is None
    assert report.reason.startswith("over_budget: host memory (RSS) reached") and "at step 2" in report.reason
    assert runs[0].info.status == "FAILED" and runs[0].data.tags["memfit.reason"] == report.reason
    assert not (Path(cfg.output_dir) / "models").exists()


def test_a_batch_larger_than_the_data_is_clipped_to_it_and_said(compose_cfg, caplog):
    cfg = compose_cfg("model=tiny_seq2seq", *FAST, "trainer.batch_size=100000", "trainer.max_steps=1", "tracking=none")
    with caplog.at_level("INFO", logger="memfit"):
        report = run(cfg)
    assert report.status == "ok" and report.steps == 1
    rows = report.worst_case_shape[0]  # the preflight's worst batch: the samples there are, not 100,000 rows
    assert 1 < rows <= 24 and f"training samples: every batch holds at most {rows} rows" in caplog.text
