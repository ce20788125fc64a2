"""Credentials never reach MLflow; the flattened config is what gets logged."""

from __future__ import annotations

import os

from omegaconf import OmegaConf

from memfit.tracking import flatten, mask_credentials


def test_credentials_are_masked():
    assert mask_credentials("postgresql://memfit:s3cret@db:5432/optuna") == "postgresql://memfit:***@db:5432/optuna"
    assert mask_credentials("http://127.0.0.1:5000") == "http://127.0.0.1:5000"


def test_flatten_gives_dotted_keys_and_masks():
    cfg = OmegaConf.create({"a": {"b": 1, "c": [1, 2]}, "tracking": {"uri": "http://u:p@h:1"}})
    flat = flatten(cfg)
    assert flat == {"a.b": "1", "a.c": "[1, 2]", "tracking.uri": "http://u:***@h:1"}


def test_tags_are_written_in_batches_masked_and_all_kept(tmp_path):
    from mlflow.tracking import MlflowClient

    from memfit.tracking import MlflowTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MlflowTracker(uri, "memfit", "run", {"memfit.store": "postgresql://me:pw@db/x"})
    tracker.set_tags({f"memfit.tag{i}": i for i in range(150)})  # more than one batch of MLflow's 100
    tags = MlflowClient(uri).get_run(tracker.run_id).data.tags
    assert tags["memfit.store"] == "postgresql://me:***@db/x"
    assert all(tags[f"memfit.tag{i}"] == str(i) for i in range(150))


def _dump(path) -> list[str]:
    """A sqlite file's schema and rows as a multiset of lines, creation times masked: the order of tables, indexes
    and a table's constraints differs between two stores MLflow migrates itself."""
    import contextlib
    import re
    import sqlite3

    with contextlib.closing(sqlite3.connect(path)) as db:
        statements = [re.sub(r",\d{13},\d{13},", ",TIME,TIME,", line) for line in db.iterdump()]
    return sorted(line.strip().rstrip(",") for statement in statements for line in statement.splitlines())


def test_a_new_store_holds_what_mlflow_writes_into_a_store_it_creates(tmp_path, monkeypatch):
    """A new store starts as a copy of an empty one MLflow migrated once (kept in memfit's cache): the same schema
    and rows as a store MLflow creates itself, the Default experiment's artifact root where its opener puts it."""
    from mlflow.tracking import MlflowClient

    from memfit.tracking import empty_store_template, tracking_uri

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")  # MLflow's default artifact root is ./mlruns
    ours = tracking_uri(OmegaConf.create({"output_dir": str(tmp_path / "ours"), "tracking": {"uri": None}}))
    assert empty_store_template().parent == tmp_path / "cache" / "memfit"
    MlflowClient(f"sqlite:///{tmp_path / 'mlflow_own.db'}").search_experiments()
    assert _dump(ours.removeprefix("sqlite:///")) == _dump(tmp_path / "mlflow_own.db")
    (default,) = MlflowClient(ours).search_experiments()
    assert default.name == "Default" and default.artifact_location == str(tmp_path / "here" / "mlruns" / "0")


def test_without_a_writable_cache_mlflow_migrates_the_new_store_itself(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from memfit.tracking import tracking_uri

    (tmp_path / "cache").write_text("a file where the cache folder would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    uri = tracking_uri(OmegaConf.create({"output_dir": str(tmp_path), "tracking": {"uri": None}}))
    assert [e.name for e in MlflowClient(uri).search_experiments()] == ["Default"]


ONE_RUN = """
import sys, time
from pathlib import Path
import os

from omegaconf import OmegaConf
from memfit.tracking import start_tracking

out, go, name = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
cfg = OmegaConf.create({"output_dir": out, "tracking": {"backend": "mlflow", "uri": None, "experiment": "memfit",
                        "parent_run_id": None, "run_id": None}})
while not go.exists():  # start together
    time.sleep(0.01)
tracker = start_tracking(cfg, name, {"memfit.test": "concurrent"})
for step in range(1, 21):
    tracker.log_metrics({"train/loss": 1.0 / step, "mem/peak_allocated_gib": 0.1}, step=step)
tracker.finish("FINISHED")
"""


def test_four_runs_started_together_on_a_new_sqlite_store_all_finish(tmp_path):
    """Neither the store nor memfit's empty-store template exists yet: one process builds each under a lock, the
    others wait for it."""
    import os
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient

    from memfit.tracking import default_tracking_uri

    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ONE_RUN, str(tmp_path), str(go), f"run-{i}"],
            stderr=subprocess.PIPE,
            env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")},  # they build memfit's store template too
        )
        for i in range(4)
    ]
    go.touch()
    errors = [proc.communicate(timeout=120)[1].decode() for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0, 0], errors
    client = MlflowClient(default_tracking_uri(str(tmp_path)))
    runs = client.search_runs([client.get_experiment_by_name("memfit").experiment_id])
    assert sorted(r.info.run_name for r in runs) == [f"run-{i}" for i in range(4)]
    assert all(r.info.status == "FINISHED" for r in runs)
    for run in runs:
        assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == list(range(1, 21))


def test_a_write_waits_while_another_process_holds_the_stores_lock(tmp_path):
    """Another process holds the store's write lock for 7 s, past sqlite's default busy timeout of 5 s: the run's
    writes wait and go through (MLflow sets a 20 s busy timeout on its sqlite connections; sqlite retries until then),
    so runs and sweeps writing one store at once do not fail on each other's locks."""
    import subprocess
    import sys
    import time

    from omegaconf import OmegaConf

    from memfit.tracking import start_tracking

    cfg = OmegaConf.create(
        {
            "output_dir": str(tmp_path),
            "tracking": {
                "backend": "mlflow",
                "uri": None,
                "experiment": "memfit",
                "parent_run_id": None,
                "run_id": None,
            },
        }
    )
    tracker = start_tracking(cfg, "patient", {})  # creates the store
    holder = (
        "import sqlite3, sys, time; db = sqlite3.connect(sys.argv[1], isolation_level=None);"
        " db.execute('BEGIN EXCLUSIVE'); print('locked', flush=True); time.sleep(7); db.execute('COMMIT')"
    )
    lock = subprocess.Popen(
        [sys.executable, "-c", holder, str(tmp_path / "mlflow.db")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert lock.stdout.readline().strip() == "locked"
        started = time.monotonic()
        tracker.log_metrics({"train/loss": 1.0}, step=1)
        tracker.finish("FINISHED")  # flushes: the first write into the locked store
        assert time.monotonic() - started > 5  # it did wait for the lock
    finally:
        lock.wait(timeout=30)
    assert tracker.status() == "FINISHED"


def test_a_run_whose_process_died_is_ended_killed_by_the_next_run(tmp_path):
    """A process the OS killed (SIGKILL: no handler ran) leaves its run RUNNING; the next run on this host ends it
    KILLED with the reason, and leaves alone runs whose process lives and a sweep's trials (its sweeper's)."""
    import subprocess
    import sys

    from omegaconf import OmegaConf

    from memfit.tracking import HOST, OWNER_TAG, end_orphans, open_run

    cfg = OmegaConf.create({"output_dir": str(tmp_path), "tracking": {"uri": None, "experiment": "memfit"}})
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    killed = open_run(cfg, "killed", {OWNER_TAG: f"{HOST}:{pid}"})
    trial = open_run(cfg, "trial", {OWNER_TAG: f"{HOST}:{pid}", "mlflow.parentRunId": killed.run_id})
    alive = open_run(cfg, "alive", {OWNER_TAG: f"{HOST}:{os.getpid()}"})
    elsewhere = open_run(cfg, "elsewhere", {OWNER_TAG: f"another-host:{pid}"})
    assert end_orphans(killed.client, "memfit") == [killed.run_id]
    ended = killed.client.get_run(killed.run_id)
    assert ended.info.status == "KILLED"
    assert ended.data.tags["memfit.reason"].startswith(f"killed: its process ({pid}) ended without ending it")
    assert {t.status() for t in (trial, alive, elsewhere)} == {"RUNNING"}


def test_a_shared_run_opened_twice_is_one_run_and_the_second_one_made_is_ended_before_it_is_deleted(tmp_path):
    from omegaconf import OmegaConf

    from memfit.tracking import open_shared_run

    cfg = OmegaConf.create({"output_dir": str(tmp_path), "tracking": {"uri": None, "experiment": "memfit"}})
    tags = {"memfit.sweep": "study-a"}
    first = open_shared_run(cfg, "sweep-study-a", tags, key="memfit.sweep")
    second = open_shared_run(cfg, "sweep-study-a", tags, key="memfit.sweep")
    assert second.run_id == first.run_id
    client = first.client
    made = client.search_runs([client.get_experiment_by_name("memfit").experiment_id], run_view_type=2)  # deleted
    assert len(made) == 1 and made[0].info.status == "FINISHED" and made[0].info.lifecycle_stage == "deleted"
