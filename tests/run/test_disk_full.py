"""A disk that fills up while a checkpoint is written, on a real size-limited tmpfs: the run ends FAILED with the
reason in one line (no traceback), and once space is freed trainer.resume=true passes over the checkpoint that was
not written whole, continues the same MLflow run, clears the failure and logs no step twice."""

from __future__ import annotations

import subprocess

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import FAST, run_train_py

pytestmark = pytest.mark.slow


def test_a_full_disk_ends_the_run_in_one_line_and_resume_continues_it_once_freed(tmpfs, tmp_path):
    small_disk = tmpfs("size=20m")  # one tiny_seq2seq checkpoint (~14 MB with its optimizer state) fits, not two
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = [
        "model=tiny_seq2seq",
        *FAST,
        "trainer.max_steps=4",
        "trainer.save_steps=1",
        "trainer.save_model=none",
        f"output_dir={small_disk}",
        "min_free_disk_gib=0",
        f"tracking.uri={store}",
        "data.tokenized_cache=null",
        f"calibration.cache_dir={tmp_path / 'calibration'}",
    ]
    full = run_train_py(*args)
    assert full.returncode == 1, full.stderr[-2000:]
    assert "Traceback" not in full.stderr
    last = full.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"memfit: disk_full: no space left on device while the run wrote (output_dir={small_disk}): free some "
        "disk, then trainer.resume=true continues from the last checkpoint written whole"
    ), last
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("memfit").experiment_id
    (failed,) = client.search_runs([experiment])
    assert failed.info.status == "FAILED" and "no space left" in failed.data.tags["memfit.reason"]

    subprocess.run(["mount", "-o", "remount,size=200m", str(small_disk)], check=True)  # space freed
    resumed = run_train_py(*args, "trainer.resume=true")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "was not written to the end (no trainer_state.json): resuming from an earlier one" in resumed.stdout
    (run,) = client.search_runs([experiment])
    assert run.info.run_id == failed.info.run_id and run.info.status == "FINISHED"
    assert "memfit.reason" not in run.data.tags
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2, 3, 4]
