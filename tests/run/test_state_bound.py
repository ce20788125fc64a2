"""Weights that cannot fit end the run as a failed preflight before any weight loads."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from memfit.models import build_model, build_tokenizer
from memfit.run import run
from memfit.run.state_bound import state_bound
from memfit.tracking import default_tracking_uri, run_facts
from tests.conftest import FAST


@pytest.mark.parametrize(("model", "full"), [("tiny_seq2seq", True), ("tiny_causal", False)])
def test_the_weightless_count_is_the_built_models(compose_cfg, model, full):
    cfg = compose_cfg(f"model={model}")
    bound = state_bound(cfg)
    built = build_model(cfg, build_tokenizer(cfg.model), "cpu")
    base = built.model.get_base_model() if hasattr(built.model, "get_base_model") else built.model
    lora = sum(p.numel() for n, p in base.named_parameters() if "lora_" in n)
    assert bound.parameters == built.total_params - lora and bound.full is full
    assert bound.bytes == bound.parameters * (8 if full else 2)  # fp32 weights and gradients; bf16 frozen weights


def test_weights_over_the_budget_fail_the_preflight_before_loading(compose_cfg):
    cfg = compose_cfg("model=tiny_seq2seq", *FAST, "budget.gib=0.005", "budget.margin_gib=0")
    report = run(cfg)
    assert report.status == "preflight_failed" and report.steps == 0
    assert report.reason.startswith("preflight: model=tiny_seq2seq: its weights and their gradients alone take")
    assert "store them in bf16 (memory.weights_dtype=bf16); raise budget.gib" in report.reason
    assert report.worst_case_peak_gib > report.limit_gib == pytest.approx(0.005, abs=1e-6)  # a sweep: infeasible
    recorded = MlflowClient(default_tracking_uri(cfg.output_dir)).get_run(report.run_id)
    assert recorded.info.status == "FAILED"
    client = MlflowClient(default_tracking_uri(cfg.output_dir))
    assert "startup/model_s" not in run_facts(client, report.run_id)  # no model was built
