"""Several sweep workers on one study in a real PostgreSQL, logging to one real MLflow server: each trial runs once,
none is lost, and a worker killed mid-trial leaves its trial failed while the others finish the study."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import optuna
import pytest
from mlflow.tracking import MlflowClient

from .conftest import ROOT, free_port, serving, train_py_env
from .test_sweep import SMALL_SWEEP

pytestmark = pytest.mark.slow

STUDY = "shared"


def _worker(index: int, n_trials: int, storage: str, tracking: str, tmp_path) -> list[str]:
    """One worker's command: its own output directory (another machine, as far as it knows), the shared study
    and tracking server."""
    return [
        sys.executable,
        str(ROOT / "train.py"),
        *SMALL_SWEEP,
        "hydra.sweeper.isolation=none",  # the workers are the processes here; trials run inside them
        f"hydra.sweeper.n_trials={n_trials}",
        f"hydra.sweeper.storage={storage}",
        f"hydra.sweeper.study_name={STUDY}",
        "hydra.sweeper.heartbeat_s=1",  # stale after 3 s, so the killed worker's trial is failed quickly
        "hydra.sweeper.poll_s=0.5",
        "tracking=mlflow_server",
        f"tracking.uri={tracking}",
        f"output_dir={tmp_path}/worker{index}",
        f"hydra.sweep.dir={tmp_path}/worker{index}/sweep",
        f"hydra.sweeper.preset_dir={tmp_path}/worker{index}/preset",
    ]


def _start(command: list[str], tmp_path, index: int) -> subprocess.Popen:
    log = open(tmp_path / f"worker{index}.log", "w")  # noqa: SIM115 - the process owns it until it ends
    return subprocess.Popen(command, cwd=ROOT, env=train_py_env(), stdout=log, stderr=subprocess.STDOUT)


def _trials_run(storage: str) -> list:
    study = optuna.load_study(study_name=STUDY, storage=storage)
    return [t for t in study.trials if "not_run" not in t.user_attrs]


def _check_study_and_mlflow(storage: str, tracking: str, n_trials: int) -> list:
    """Exactly n_trials trials ran, each a distinct configuration with a distinct number and a result; each has
    exactly one MLflow run in the one store, and none is left RUNNING."""
    trials = _trials_run(storage)
    finished = [t for t in trials if t.state.is_finished()]
    assert len(finished) == n_trials == len(trials), [(t.number, t.state.name) for t in trials]
    assert len({t.number for t in trials}) == n_trials
    seeds = [t.params["trainer.seed"] for t in trials if "retry_of" not in t.user_attrs]
    assert len(set(seeds)) == len(seeds)  # no configuration measured twice (a retry re-measures a killed one)
    complete = [t for t in finished if t.state == optuna.trial.TrialState.COMPLETE]
    assert all(t.values and t.user_attrs["status"] == "ok" for t in complete)
    client = MlflowClient(tracking)
    runs = client.search_runs([client.get_experiment_by_name("memfit").experiment_id])
    trial_runs = [r for r in runs if "memfit.trial" in r.data.tags]
    assert sorted(int(r.data.tags["memfit.trial"]) for r in trial_runs) == sorted(t.number for t in trials)
    assert not [r for r in runs if r.info.status == "RUNNING"]
    return trials


@pytest.mark.parametrize("workers", [2, 4])
def test_workers_share_one_postgres_study_and_one_mlflow_server(postgres, tmp_path, workers):
    storage, n_trials, port = postgres("workers"), 2 * workers, free_port()
    store = f"sqlite:///{tmp_path}/mlflow-server.db"
    command = ["mlflow", "server", "--backend-store-uri", store, "--host", "127.0.0.1", "--port", str(port)]
    with serving(command, port, cwd=tmp_path) as tracking:
        procs = [_start(_worker(i, n_trials, storage, tracking, tmp_path), tmp_path, i) for i in range(workers)]
        for index, proc in enumerate(procs):
            assert proc.wait(timeout=600) == 0, (tmp_path / f"worker{index}.log").read_text()[-3000:]
        trials = _check_study_and_mlflow(storage, tracking, n_trials)
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    owners = {tuple(t.system_attrs["memfit:owner"]) for t in trials}
    assert len(owners) > 1  # the work was shared, not done by one worker while the others waited


def test_a_killed_worker_leaves_its_trial_failed_and_the_study_goes_on(postgres, tmp_path):
    storage, n_trials, port = postgres("killed"), 5, free_port()
    store = f"sqlite:///{tmp_path}/mlflow-server.db"
    command = ["mlflow", "server", "--backend-store-uri", store, "--host", "127.0.0.1", "--port", str(port)]
    with serving(command, port, cwd=tmp_path) as tracking:
        victim, survivor = (_start(_worker(i, n_trials, storage, tracking, tmp_path), tmp_path, i) for i in (0, 1))
        killed = _running_trial_of(victim, storage)
        os.kill(victim.pid, signal.SIGKILL)  # mid-trial: it can neither tell Optuna nor end its MLflow run
        victim.wait()
        assert survivor.wait(timeout=600) == 0, (tmp_path / "worker1.log").read_text()[-3000:]
        trials = _check_study_and_mlflow(storage, tracking, n_trials)
        killed_run = MlflowClient(tracking).get_run(killed.user_attrs["run_id"])
    by_number = {t.number: t for t in trials}
    assert by_number[killed.number].state == optuna.trial.TrialState.FAIL
    assert killed_run.info.status == "KILLED" and "no heartbeat" in killed_run.data.tags["memfit.reason"]
    retried = [t for t in trials if t.user_attrs.get("retry_of") == killed.number]
    assert len(retried) <= 1 and all(t.state == optuna.trial.TrialState.COMPLETE for t in retried)


def _running_trial_of(proc: subprocess.Popen, storage: str, timeout: float = 300):
    """The trial `proc` is running, once it runs one (the owner the sweeper records on each trial)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the worker ended before it could be killed"
        for trial in _study_trials(storage):
            owner = trial.system_attrs.get("memfit:owner")
            mine = trial.state == optuna.trial.TrialState.RUNNING and owner and owner[1] == proc.pid
            if mine and trial.user_attrs.get("run_id"):
                return trial
        time.sleep(0.2)
    raise AssertionError("the worker never started a trial")


def _study_trials(storage: str) -> list:
    try:
        return optuna.load_study(study_name=STUDY, storage=storage).trials
    except KeyError:  # not created yet
        return []
