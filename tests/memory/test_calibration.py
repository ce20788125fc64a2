"""Calibration of the memory model: real probes on a tiny model (host memory on CPU), the cache and its key."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from memfit.data.audit import BatchShape
from memfit.memory.calibration import (
    Calibration,
    cached,
    calibrate,
    calibration_key,
    fit_peak,
    identity,
    wanted,
)
from memfit.memory.model import COUNTED_TERMS, WINDOW_TERMS, Architecture, describe_architecture
from memfit.memory.probe import _BranchMarker, probe
from memfit.memory.probe_shapes import calibration_shapes, probe_plan
from memfit.memory.state import model_state_bytes
from tests.conftest import FAST
from tests.memory.test_preflight import _setup

TINY = ("model=tiny_seq2seq", *FAST, "tracking=none", "calibration.enabled=true", "calibration.probe_tokens=512")


def _calibrate(cfg, probed: list | None = None):
    setup, _ = _setup(cfg)
    arch = describe_architecture(setup.model, cfg.model.task)
    state = model_state_bytes(setup.model, "adamw")
    return calibrate(cfg, setup, arch, state, on_probe=(probed.append if probed is not None else None))


def test_calibration_probes_once_then_comes_from_the_cache(compose_cfg, tmp_path):
    cfg = compose_cfg(*TINY, f"calibration.cache_dir={tmp_path}/cal")
    probed: list = []
    first = _calibrate(cfg, probed)
    arch = first.architecture
    assert probed == calibration_shapes(arch, 512, cfg.memory.pad_to_multiple_of) and not first.from_cache
    assert len(first.probes) == 6 and all(p["allocated"] > 0 and p["step_allocated"] > 0 for p in first.probes)
    assert first.fit.reserved_ratio > 0 and first.fit.step_allocated == max(p["step_allocated"] for p in first.probes)
    assert fit_peak(arch, first.probes) == first.fit  # the file's probes refit to its model (benchmarks refit them)
    files = list((tmp_path / "cal").glob("*.json"))
    assert [f.stem for f in files] == [first.key]

    again: list = []
    second = _calibrate(cfg, again)
    assert again == [] and second.from_cache and second.fit == first.fit  # no probe ran
    assert cached(cfg, "cpu").key == first.key
    shape = probed[-1]
    assert second.estimate(shape) == first.estimate(shape)


def test_a_checkpointed_causal_lm_probes_six_token_counts(compose_cfg, tmp_path):
    cfg = compose_cfg(
        *TINY, "model=tiny_causal", "memory.gradient_checkpointing=true", f"calibration.cache_dir={tmp_path}/cal"
    )
    probed: list = []
    calibration = _calibrate(cfg, probed)
    multiple, positions = cfg.memory.pad_to_multiple_of, cfg.model.max_positions
    assert probed == calibration_shapes(calibration.architecture, 512, multiple, 4, positions, checkpointed=True)
    assert len({shape.batch * shape.source for shape in probed}) == 6  # two lines in tokens, each over two or more


def test_a_damaged_cache_file_is_fitted_again(compose_cfg, tmp_path):
    cfg = compose_cfg(*TINY, f"calibration.cache_dir={tmp_path}/cal")
    first = _calibrate(cfg)
    (tmp_path / "cal" / f"{first.key}.json").write_text("{not json")
    probed: list = []
    assert not _calibrate(cfg, probed).from_cache and len(probed) == 6
    assert Calibration.from_json((tmp_path / "cal" / f"{first.key}.json").read_text()).key == first.key


def test_a_calibration_under_way_in_another_process_is_not_repeated_and_a_dead_ones_lock_is_taken_over(
    compose_cfg, tmp_path, caplog
):
    """Two trials of a multi-GPU sweep start together: one calibrates, the other goes on without a prediction."""
    import subprocess
    import sys

    cfg = compose_cfg(*TINY, f"calibration.cache_dir={tmp_path}/cal")
    key = calibration_key(identity(cfg, "cpu", 512))
    lock = tmp_path / "cal" / f"{key}.lock"
    lock.parent.mkdir()
    holder = (
        "import sys, time; from filelock import FileLock; lock = FileLock(sys.argv[1]); lock.acquire();"
        " print('held', flush=True); time.sleep(60)"
    )
    other = subprocess.Popen([sys.executable, "-c", holder, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        probed: list = []
        with caplog.at_level("INFO", logger="memfit.memory.calibration"):
            assert _calibrate(cfg, probed) is None and probed == []
        assert "another process is calibrating" in caplog.text
    finally:
        other.kill()
        other.wait()
    probed = []
    fitted = _calibrate(cfg, probed)  # the holder died: the OS released its lock
    assert fitted is not None and fitted.key == key and len(probed) == 6


def test_the_key_changes_with_model_policy_device_and_versions(compose_cfg, monkeypatch):
    base = compose_cfg(*TINY)
    key = calibration_key(identity(base, "cpu", 512))
    changed = {
        "policy": compose_cfg(*TINY, "memory.gradient_checkpointing=true"),
        "optimizer": compose_cfg(*TINY, "memory.optimizer=adafactor"),
        "model": compose_cfg(*TINY, "model.architecture.d_model=64"),
        "accumulation": compose_cfg(*TINY, "trainer.gradient_accumulation_steps=4"),
    }
    for what, cfg in changed.items():
        assert calibration_key(identity(cfg, "cpu", 512)) != key, what
    assert calibration_key(identity(base, "NVIDIA H200", 512)) != key
    # what a calibration predicts over does not change it: batch size, lengths, the budget
    same = compose_cfg(*TINY, "trainer.batch_size=16", "memory.max_label_length=256", "budget.gib=8")
    assert calibration_key(identity(same, "cpu", 512)) == key
    import memfit.memory.calibration as calibration

    monkeypatch.setattr(calibration, "library_versions", lambda cfg: {"torch": "9.9", "transformers": "9.9"})
    assert calibration_key(identity(base, "cpu", 512)) != key


@pytest.mark.parametrize("task", ["causal", "seq2seq"])
def test_eager_attention_under_checkpointing_is_not_calibrated(compose_cfg, tmp_path, caplog, task):
    cfg = compose_cfg(*TINY, "memory.gradient_checkpointing=true", f"calibration.cache_dir={tmp_path}")
    eager = Architecture(task, 100, 0 if task == "causal" else 2, 2, 2, quadratic_attention=True)
    setup = SimpleNamespace(device="cpu")  # nothing is probed
    assert calibrate(cfg, setup, eager, None) is None
    assert "models for T5 only" in caplog.text and not list(tmp_path.glob("*.json"))


TINY_T5 = (
    "model=t5_base",
    *(f"model.architecture.{k}={v}" for k, v in dict(d_model=32, d_kv=8, d_ff=64, num_heads=2).items()),
    "model.architecture.num_layers=2",
    "model.architecture.num_decoder_layers=2",
    *TINY[1:],
)


def test_t5_under_checkpointing_is_calibrated_window_by_window(compose_cfg, tmp_path):
    """Each probe measures six windows of the step apart (hooks on the stacks' outputs and their gradients); each
    window is fitted alone, the position bias counted; the cached file gives back the same model."""
    cfg = compose_cfg(*TINY_T5, "memory.gradient_checkpointing=true", f"calibration.cache_dir={tmp_path}/cal")
    probed: list = []
    fitted = _calibrate(cfg, probed)
    arch = fitted.architecture
    assert arch.relative_position_bias and probed == calibration_shapes(arch, 512, 8, 4, checkpointed=True)
    for p in fitted.probes:
        windows = [p[f"{window}_allocated"] for window in _BranchMarker.WINDOWS]
        assert min(windows) > 0 and max(windows) == p["allocated"]  # six windows cover the step
        assert max(p[f"{window}_reserved"] for window in _BranchMarker.WINDOWS) == p["reserved"]
    assert list(fitted.fit.windows) == list(WINDOW_TERMS) == list(_BranchMarker.WINDOWS)
    for window in fitted.fit.windows.values():
        assert window.coefficients["position_biases"] == COUNTED_TERMS["position_biases"] == 1.0
    assert "decoder_scores" in fitted.fit.windows["decoder_backward"].coefficients
    assert "decoder_tokens" not in fitted.fit.windows["encoder_backward"].coefficients
    again = Calibration.from_json((tmp_path / "cal" / f"{fitted.key}.json").read_text())
    assert again.fit == fitted.fit
    shape = probed[-1]
    assert again.estimate(shape) == fitted.estimate(shape)
    phases = {window.replace("_", " ") for window in WINDOW_TERMS} | {"optimizer step"}
    assert fitted.estimate(shape).phase in phases


def test_a_bart_like_model_under_checkpointing_is_calibrated_window_by_window_from_six_shapes(compose_cfg, tmp_path):
    """tiny_seq2seq (sdpa: no scores kept) probes the six shapes, each measured in six windows; no window has a
    scores term."""
    cfg = compose_cfg(*TINY, "memory.gradient_checkpointing=true", f"calibration.cache_dir={tmp_path}/cal")
    probed: list = []
    fitted = _calibrate(cfg, probed)
    arch = fitted.architecture
    assert not arch.quadratic_attention and probed == calibration_shapes(arch, 512, 8, 4, checkpointed=True)
    assert len(probed) == 6 and probed == calibration_shapes(arch, 512, 8, 4)  # the six, measured by window
    for p in fitted.probes:  # the windows hold the probe's peak (host RSS may grow a page after the last one closes)
        assert 0 <= p["allocated"] - max(p[f"{window}_allocated"] for window in _BranchMarker.WINDOWS) <= 2**20
    assert list(fitted.fit.windows) == list(WINDOW_TERMS)
    assert not any(name.endswith("_scores") for w in fitted.fit.windows.values() for name in w.coefficients)


def test_when_to_calibrate_and_how_large_the_probes_are(compose_cfg):
    assert not wanted(compose_cfg("calibration.enabled=auto").calibration, "cpu")
    assert wanted(compose_cfg("calibration.enabled=auto").calibration, "cuda")
    assert wanted(compose_cfg("calibration.enabled=true").calibration, "cpu")
    assert not wanted(compose_cfg("calibration.enabled=false").calibration, "cuda")
    # checkpointed activations are small: four times the batch, halved before the lengths when a probe does not fit
    assert probe_plan(compose_cfg("memory.gradient_checkpointing=true"), None) == [
        (4096, 4),
        (4096, 2),
        (4096, 1),
        (2048, 1),
    ]
    assert probe_plan(compose_cfg("calibration.probe_tokens=1024"), None) == [(1024, 1), (512, 1), (256, 1)]
    arch = Architecture("seq2seq", 100, 2, 2, 2, quadratic_attention=False)
    shapes = calibration_shapes(arch, 8192, multiple=8, batch_scale=2, max_positions=512)
    assert max(max(s.source, s.label) for s in shapes) <= 512 and min(s.batch for s in shapes) == 2  # 1 × scale


def test_estimate_only_predicts_without_training(compose_cfg, tmp_path, capsys):
    from memfit.run import run

    cfg = compose_cfg(*TINY, "estimate_only=true", "data.max_train_samples=6", f"output_dir={tmp_path}")
    report = run(cfg)
    shown = capsys.readouterr().out
    assert report.status == "ok" and report.steps == 0 and report.predicted_peak_gib > 0
    assert "estimate (memory model" in shown and "fitted from 6 probes" in shown and "breakdown: weights" in shown
    calibration = Calibration.from_json(Path(report.calibration).read_text())
    limit = int(report.limit_gib * 1024**3)
    upper = min(cfg.preflight.max_batch_limit, cfg.data.max_train_samples)  # larger would repeat samples
    assert report.max_batch == calibration.largest_batch(64, 32, limit, upper) == 6  # never past the split
    told = ">= 6 (all 6 training samples in one batch; larger not tried)"  # the search's cap, said as preflight_only
    assert f"largest batch predicted to fit at source 64 × labels 32: {told}" in shown
    again = run(cfg)  # a second run reuses the calibration
    assert "reused from its cache" in capsys.readouterr().out and again.calibration == report.calibration

    analytic = run(compose_cfg(*TINY, "estimate_only=true", "calibration.enabled=false", f"output_dir={tmp_path}"))
    shown = capsys.readouterr().out
    assert analytic.predicted_peak_gib is None and analytic.calibration is None
    assert "analytic part only" in shown and "activations not estimated" in shown
    assert json.loads(json.dumps(analytic.to_dict()))["status"] == "ok"


def test_estimate_only_says_what_the_chunked_loss_would_save(compose_cfg, tmp_path, capsys, long_tail_jsonl):
    """The long tail's worst batch, 4 × 304 labels over 30,522 entries: 148 MiB of float32 logits, held twice by the
    standard loss (logits and gradient) against a chunk of 549 rows (64 MiB) twice by the chunked one."""
    from memfit.run import run

    long_labels = [
        *TINY,
        "data=jsonl",
        f"data.path={long_tail_jsonl}",
        "memory.max_label_length=512",
        "trainer.batch_size=4",
    ]
    run(compose_cfg(*long_labels, "estimate_only=true", "calibration.enabled=false", f"output_dir={tmp_path}"))
    assert "memory.loss=chunked would hold ~155.3 MiB less at this batch" in capsys.readouterr().out
    run(compose_cfg(*long_labels, "estimate_only=true", "calibration.enabled=false", "memory.loss=chunked"))
    assert "memory.loss=chunked would hold" not in capsys.readouterr().out  # already chunked: nothing to offer


def test_bad_calibration_settings_are_one_line_each(compose_cfg):
    from memfit.config import ConfigError, validate

    with pytest.raises(ConfigError) as err:
        validate(
            compose_cfg(
                "calibration.enabled=sometimes",
                "calibration.probe_tokens=0",
                "estimate_only=true",
                "preflight_only=true",
            )
        )
    text = str(err.value)
    assert "calibration.enabled=sometimes" in text and "calibration.probe_tokens" in text
    assert "estimate_only=true and preflight_only=true" in text


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A tiny model's config and the calibration file a sweep's first trial reports (made once for the module)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from memfit.config import register_configs
    from tests.conftest import CONF

    tmp = tmp_path_factory.mktemp("calibrated")
    # host RSS is coarse: probes of 2048 tokens make the per-token growth stand out of the allocator's noise
    settings = [o for o in TINY if not o.startswith("calibration.probe_tokens")]
    overrides = [f"output_dir={tmp / 'outputs'}", *settings, "calibration.probe_tokens=2048"]
    overrides += ["data.max_train_samples=48", f"calibration.cache_dir={tmp / 'cal'}"]
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    GlobalHydra.instance().clear()
    calibration = _calibrate(cfg)  # what the sweep's first trial does in its own process
    return cfg, str(tmp / "cal" / f"{calibration.key}.json")


@pytest.mark.xdist_group("calibrated")  # one worker calibrates once for both
def test_the_sweeper_tells_a_configuration_predicted_far_over_budget_without_running_it(calibrated):
    import optuna
    from omegaconf import OmegaConf

    from memfit.sweep.predict import MemoryPredictor
    from memfit.sweep.screen import data_lengths
    from memfit.sweep.telling import TrialTeller
    from memfit.sweep.trials import TrialResult

    cfg, path = calibrated
    space = {
        "trainer.batch_size": optuna.distributions.CategoricalDistribution([2, 512]),
        "memory.gradient_checkpointing": optuna.distributions.CategoricalDistribution([False, True]),
    }
    predictor = MemoryPredictor(data_lengths(space, cfg), cfg, margin=0.1, effective_batch=None)
    settings = OmegaConf.create({"coverage_floor": 0.0, "predict_margin": 0.1})
    sweep = TrialTeller(settings, cfg, ["throughput"], predictor=predictor)
    study = optuna.create_study(direction="maximize")

    def ask(batch: int, checkpointing: bool = False):
        study.enqueue_trial({"trainer.batch_size": batch, "memory.gradient_checkpointing": checkpointing})
        return study.ask(space)

    first = ask(2)
    assert not sweep.told_without_running(study, first, None)  # nothing calibrated yet: it runs
    small = predictor.signature(first.params)
    report = {"status": "ok", "tokens_per_s": 100.0, "worst_case_peak_gib": 1.0, "limit_gib": 1.5, "calibration": path}
    sweep.budget_gib = 2.0
    sweep.tell(study, first, TrialResult(report, None, 3.0), None)
    assert predictor.calibrations[small][1] == first.number

    big_gib = predictor.predicted_gib({"trainer.batch_size": 512, "memory.gradient_checkpointing": False})[0]
    small_gib = predictor.predicted_gib(first.params)[0]
    assert big_gib > small_gib  # 256 times the rows, on top of the process itself
    sweep.budget_gib = big_gib / 1.5  # the big one is over budget by more than the 10% margin
    big = ask(512)
    assert sweep.told_without_running(study, big, None)
    told = study.trials[big.number]
    assert told.user_attrs["status"] == "predicted_infeasible" and told.user_attrs["predicted"] is True
    assert told.user_attrs["not_run"] and told.user_attrs["device_seconds"] == 0.0
    assert told.user_attrs["calibration_from"] == first.number and "safety margin" in told.user_attrs["reason"]
    limit = sweep.budget_gib - cfg.budget.margin_gib
    assert told.constraints["memory_gib"] == pytest.approx(big_gib - limit) and told.constraints["memory_gib"] > 0

    # over budget, but within the margin: left to the measurement
    assert predictor.over_budget(big.params, big_gib / 1.05) is None
    # another policy (checkpointing) has no calibration of its own: it runs
    assert not sweep.told_without_running(study, ask(512, checkpointing=True), None)


@pytest.mark.xdist_group("calibrated")  # one worker calibrates once for both
def test_once_calibrated_the_fullest_predicted_fit_is_tried_next_for_a_throughput_objective(calibrated):
    """Tokens/s grows with the work a step does, which is what fills memory: the configuration predicted to fill the
    most of the limit without passing it is queued for the next ask, fill_budget times per study; a preflight that
    finds it over makes the next fullest the next one. Not while a part of the space has no calibration yet."""
    import optuna
    from omegaconf import OmegaConf

    from memfit.sweep.predict import MemoryPredictor
    from memfit.sweep.screen import data_lengths
    from memfit.sweep.telling import TrialTeller
    from memfit.sweep.trials import TrialResult

    cfg, path = calibrated
    batches = [1, 2, 8, 32, 128, 512]
    space = {
        "trainer.batch_size": optuna.distributions.CategoricalDistribution(batches),
        "memory.gradient_checkpointing": optuna.distributions.CategoricalDistribution([False, True]),
    }
    predictor = MemoryPredictor(data_lengths(space, cfg), cfg, margin=0.1, effective_batch=None)
    settings = OmegaConf.create(
        {"coverage_floor": 0.0, "predict_margin": 0.1, "fill_budget": 2, "effective_batch": None}
    )
    sweep = TrialTeller(settings, cfg, ["throughput"], 100.0, predictor=predictor)
    study = optuna.create_study(direction="maximize")
    assert not sweep.queue_fullest_fit(study, space)  # nothing calibrated yet: the sampler proposes

    def run(params: dict, status: str, peak: float, calibration: str | None = None):
        study.enqueue_trial(params)
        trial = study.ask(space)
        report = {"status": status, "tokens_per_s": 10.0, "worst_case_peak_gib": peak, "limit_gib": 1.5}
        sweep.tell(study, trial, TrialResult({**report, "calibration": calibration}, None, 3.0), None)

    run({"trainer.batch_size": 1, "memory.gradient_checkpointing": False}, "ok", 1.0, calibration=path)
    gib = {
        b: predictor.predicted_gib({"trainer.batch_size": b, "memory.gradient_checkpointing": False})[0]
        for b in batches
    }
    assert [gib[b] for b in batches] == sorted(gib.values()) and gib[128] < gib[512]
    # a limit between batch 128's prediction and batch 512's
    sweep.budget_gib = (gib[128] + gib[512]) / 2 + cfg.budget.margin_gib
    limit = sweep.limit_gib
    # checkpointing has no calibration of its own yet, and may hold a fuller fit: no fill
    assert not sweep.queue_fullest_fit(study, space)
    # once its outcome is known (batch 1 did not fit, so no larger batch does), the fill goes ahead
    run({"trainer.batch_size": 1, "memory.gradient_checkpointing": True}, "preflight_failed", limit + 1)

    def fill_then_tell(status: str) -> int:
        assert sweep.queue_fullest_fit(study, space)
        trial = study.ask(space)
        assert trial.user_attrs["fills_budget"] is True and not trial.params["memory.gradient_checkpointing"]
        peak = limit + (0.5 if status == "preflight_failed" else -0.5)
        report = {"status": status, "tokens_per_s": 50.0, "worst_case_peak_gib": peak, "limit_gib": limit}
        sweep.tell(study, trial, TrialResult(report, None, 3.0), None)
        return trial.params["trainer.batch_size"]

    assert fill_then_tell("preflight_failed") == 128  # the prediction was low: measured over the limit
    assert fill_then_tell("ok") == 32  # the next fullest; 128 is measured, 512 dominated and predicted over
    assert not sweep.queue_fullest_fit(study, space)  # fill_budget=2 spent: the sampler proposes from here
    assert not study.trials[0].user_attrs.get("fills_budget")

    # a loss objective (or a Pareto front) is not maximised by filling memory: never queued
    sweep.settings.fill_budget = 3
    sweep.objectives = ["loss"]
    assert not sweep.queue_fullest_fit(study, space)
    sweep.objectives = ["throughput"]
    assert sweep.queue_fullest_fit(study, space)
    # the fullest of those not tried yet (on CPU the smallest batches can predict the same: the process dominates)
    assert gib[study.ask(space).params["trainer.batch_size"]] == max(gib[b] for b in (2, 8))


def test_a_frozen_encoder_leaves_t5_under_checkpointing_uncalibrated(compose_cfg, tmp_path, caplog):
    """With no gradient reaching the encoder's output the probe cannot tell the decoder's backward from the
    encoder's: the windows are not reported and the model says why, rather than fitting a wrong split. (memfit's
    own checkpointed builds make the embeddings' output require grad, so a gradient reaches the encoder's output
    even when its weights are frozen; the model here is built without that hook.)"""
    cfg = compose_cfg(*TINY_T5, f"calibration.cache_dir={tmp_path}")
    setup, _ = _setup(cfg)
    for param in [*setup.model.get_encoder().parameters(), setup.model.get_input_embeddings().weight]:
        param.requires_grad_(False)
    windows = probe(replace(setup, split_branches=True), BatchShape(2, 32, 16))[0].branch_peaks
    assert windows is None
    arch = describe_architecture(setup.model, cfg.model.task)
    checkpointed = compose_cfg(*TINY_T5, "memory.gradient_checkpointing=true", f"calibration.cache_dir={tmp_path}")
    assert calibrate(checkpointed, setup, arch, model_state_bytes(setup.model, "adamw")) is None
    assert "no gradient reached the encoder's output" in caplog.text and not list(tmp_path.glob("*.json"))


def _estimate_only_at_the_long_tail(compose_cfg, tmp_path, capsys, jsonl, *overrides: str) -> tuple[str, int, int]:
    """tiny_causal's estimate_only in fp32 over the long-tail JSONL: what it printed, and its worst batch's rows and
    tokens."""
    from memfit.run import run

    run(
        compose_cfg(
            "model=tiny_causal",
            *FAST,
            "tracking=none",
            "data=jsonl",
            f"data.path={jsonl}",
            "memory.precision=fp32",
            "estimate_only=true",
            "calibration.enabled=false",
            f"output_dir={tmp_path}",
            *overrides,
        )
    )
    out = capsys.readouterr().out
    worst = next(line for line in out.splitlines() if line.startswith("  worst "))
    rows, tokens = (int(n) for n in re.search(r"batch (\d+) × (\d+)", worst).groups())
    return out, rows, tokens


def test_estimate_only_says_what_recomputing_lora_dropout_would_save(compose_cfg, tmp_path, capsys, long_tail_jsonl):
    """tiny_causal with dropout on its q and v adapters (one input, hidden 32) at the long tail's worst batch: one
    dropped copy beyond the shared input, 4 bytes an element in fp32."""
    lora = (compose_cfg, tmp_path, capsys, long_tail_jsonl, "model.lora.dropout=0.1")
    out, rows, tokens = _estimate_only_at_the_long_tail(*lora, "memory.recompute_lora_dropout=false")
    saving = rows * tokens * 32 * 2 * 4  # two layers
    assert f"memory.recompute_lora_dropout=true would hold ~{saving / 2**20:.1f} MiB less at this batch" in out
    out, _, _ = _estimate_only_at_the_long_tail(*lora, "memory.recompute_lora_dropout=true")
    assert "memory.recompute_lora_dropout=true would hold" not in out  # already recomputed


def test_estimate_only_says_what_a_shared_attention_mask_would_save(compose_cfg, tmp_path, capsys, long_tail_jsonl):
    """tiny_causal (two layers) at the long tail's worst batch, in fp32: one batch × length² mask copy beyond the
    shared one, 4 bytes an element."""
    causal = (compose_cfg, tmp_path, capsys, long_tail_jsonl)
    masked = "memory.causal_padding_mask=true"  # the padded batch carries its mask to every layer
    out, rows, tokens = _estimate_only_at_the_long_tail(*causal, masked, "memory.shared_attention_mask=false")
    saving = rows * tokens * tokens * 4  # (2 - 1) layers
    assert f"memory.shared_attention_mask=true would hold ~{saving / 2**20:.1f} MiB less at this batch" in out
    out, _, _ = _estimate_only_at_the_long_tail(*causal, masked, "memory.shared_attention_mask=true")
    assert "memory.shared_attention_mask=true would hold" not in out  # already shared
    # balanced's causal batches go without their padding mask: there is no mask to share
    out, _, _ = _estimate_only_at_the_long_tail(*causal, "memory.shared_attention_mask=false")
    assert "memory.shared_attention_mask=true would hold" not in out


def _probes(peak, arch: Architecture, convex: bool = True) -> list[dict]:
    """calibration_shapes' causal probes (six token counts; three without `convex`) with peaks from `peak(tokens)`."""
    return [
        {"batch": s.batch, "source": s.source, "label": s.label, "allocated": peak(s.batch * s.source)}
        | {"reserved": 1.1 * peak(s.batch * s.source), "step_allocated": 1.0, "step_reserved": 1.0}
        for s in calibration_shapes(arch, 16384, checkpointed=convex)
    ]


def test_a_checkpointed_causal_lm_peaks_in_the_larger_of_two_lines_in_tokens():
    # qwen2_5_0_5b, chunked head, checkpointing (run 16): +52 KB a token up to 8,192 tokens, +111 KB beyond; one
    # line through the probes at 4,096, 8,192 and 16,384 tokens reads the rows between 4k and 8k 4% high
    arch = Architecture("causal", 151936, 0, 24, 14, quadratic_attention=False)

    def convex(tokens: int) -> float:  # the two lines meet at the middle probes' 8,192 tokens
        return 2.0e9 + 52e3 * tokens + max(59e3 * (tokens - 8192), 0)

    probes = _probes(convex, arch)
    two = fit_peak(arch, probes, checkpointed=True)
    assert set(two.windows) == {"backward", "backward_at_more_tokens"}
    for tokens in (5120, 7168, 12288, 20480):  # between the probes, and past the most
        assert two.allocated(1, tokens, tokens, arch) == pytest.approx(convex(tokens), rel=1e-6)
    one = fit_peak(arch, _probes(convex, arch, convex=False), checkpointed=False)  # without: one line, as before
    assert set(one.windows) == {"backward"} and one.allocated(1, 7168, 7168, arch) > 1.02 * convex(7168)
    assert Calibration.from_json(_calibration_of(probes, arch, two).to_json()).fit == two  # cached and read back


def test_two_lines_in_tokens_wherever_they_meet_between_the_probes():
    # qwen2_5_0_5b's kink in run 17 lay at ~10.7k tokens, between probes: six token counts put two on each side
    arch = Architecture("causal", 151936, 0, 24, 14, quadratic_attention=False)

    def convex(tokens: int) -> float:
        return 2.0e9 + max(52e3 * tokens, 150e3 * tokens - 1.05e9)

    levels = sorted({p["batch"] * p["source"] for p in _probes(convex, arch)})
    assert len(levels) == 6 and levels[0] == 16384 // 4 and levels[-1] == 16384
    two = fit_peak(arch, _probes(convex, arch), checkpointed=True)
    for tokens in (5120, 9152, 11648, 14336, 20480):
        assert two.allocated(1, tokens, tokens, arch) == pytest.approx(convex(tokens), rel=1e-6)
    three_counts = fit_peak(arch, _probes(convex, arch, convex=False), checkpointed=True)
    assert three_counts.allocated(1, 11648, 11648, arch) > 1.03 * convex(11648)  # the kink on the wrong side


def test_one_line_where_the_peaks_are_a_line_or_bend_the_other_way():
    arch = Architecture("causal", 151936, 0, 24, 14, quadratic_attention=False)
    linear = fit_peak(arch, _probes(lambda t: 2.0e9 + 60e3 * t, arch), checkpointed=True)
    concave = fit_peak(arch, _probes(lambda t: min(2.0e9 + 90e3 * t, 2.4e9 + 40e3 * t), arch), checkpointed=True)
    assert set(linear.windows) == {"backward"} and set(concave.windows) == {"backward"}


def _calibration_of(probes: list[dict], arch: Architecture, fit) -> Calibration:
    from memfit.memory.state import ModelStateBytes

    return Calibration("k", {}, arch, ModelStateBytes(1, 0, 0), fit, probes)
