"""Sweeps that outgrow one process: several workers on one study in a real PostgreSQL, logging to one real MLflow
server (each trial runs once, none is lost, a worker killed mid-trial leaves its trial failed while the others finish
the study); one trial per GPU at a time; trials submitted through hydra-submitit-launcher."""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import datetime, timedelta

import optuna
import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import (
    ONE_WORKER,
    ROOT,
    free_port,
    mlflow_server,
    readme_command,
    serving,
    start_train_py,
    sweep_outputs,
    train_py_env,
)
from tests.sweep.test_sweep import SMALL_SWEEP

pytestmark = pytest.mark.slow

STUDY = "shared"


def _worker(
    index: int, n_trials: int, storage: str, tracking: str, tmp_path, base: list[str] | None = None
) -> list[str]:
    """One worker's command: `base` (the README's worker command, or a small sweep) on the shared study and
    tracking server, with its own output directory (another machine, as far as it knows)."""
    if base is None:
        base = [
            *SMALL_SWEEP,
            f"hydra.sweeper.n_trials={n_trials}",
            f"hydra.sweeper.storage={storage}",
            f"hydra.sweeper.study_name={STUDY}",
            "tracking=mlflow_server",
            f"tracking.uri={tracking}",
        ]
    return [
        sys.executable,
        str(ROOT / "train.py"),
        *base,
        "hydra.sweeper.isolation=launcher",  # the workers are the processes here; trials run inside them
        # stale after 6 s, so a killed worker's trial is failed quickly, while four busy workers on two cores do
        # not miss a beat by that much
        "hydra.sweeper.heartbeat_s=2",
        "hydra.sweeper.poll_s=0.5",
        f"output_dir={tmp_path}/worker{index}",
        f"hydra.sweep.dir={tmp_path}/worker{index}/sweep",
        f"hydra.sweeper.preset_dir={tmp_path}/worker{index}/preset",
    ]


def _readme_worker(storage: str, tracking: str) -> list[str]:
    """The README's worker command, its $STUDY_DB and $MLFLOW_URL pointing at this test's servers."""
    command = readme_command("python train.py -m sweep=budget model=tiny_seq2seq budget.gib=null")
    return [arg.replace("$STUDY_DB", storage).replace("$MLFLOW_URL", tracking) for arg in command[2:]]


def _readme_mlflow_server(port: int, tmp_path) -> list[str]:
    """The README's `mlflow server` command on a free port, its store in the test's directory, with one worker
    process (see `tests.conftest.mlflow_server`)."""
    command = readme_command("mlflow server --host 127.0.0.1")
    assert command[command.index("--artifacts-destination") + 1].startswith("outputs/")  # not ./mlartifacts
    return [
        str(port)
        if arg == "5000"
        else arg.replace("sqlite:///outputs/", f"sqlite:///{tmp_path}/").replace(
            "outputs/mlartifacts", f"{tmp_path}/mlartifacts"
        )
        for arg in command
    ] + ONE_WORKER


def _start(command: list[str], tmp_path, index: int):
    """A worker's `python train.py ...`, forked from this test process's fork server (tests.conftest.run_train_py)."""
    assert command[:2] == [sys.executable, str(ROOT / "train.py")]
    return start_train_py(command[2:], tmp_path / f"worker{index}.log", train_py_env())


def _trials_run(storage: str) -> list:
    study = optuna.load_study(study_name=STUDY, storage=storage)
    return [t for t in study.trials if "not_run" not in t.user_attrs]


def _check_study_and_mlflow(storage: str, tracking: str, n_trials: int) -> list:
    """Exactly n_trials trials ran (and the retry of a killed one, which may run past n_trials), each a distinct
    configuration with a distinct number and a result; each has exactly one MLflow run in the one store, and none
    is left RUNNING or WAITING."""
    trials = _trials_run(storage)
    finished = [t for t in trials if t.state.is_finished()]
    retries = [t for t in trials if "retry_of" in t.user_attrs]
    assert len(finished) == len(trials), [(t.number, t.state.name) for t in trials]
    assert len(trials) - len(retries) <= n_trials <= len(trials), [(t.number, t.state.name) for t in trials]
    assert len({t.number for t in trials}) == len(trials)
    configs = [tuple(sorted(t.params.items())) for t in trials if "retry_of" not in t.user_attrs]
    assert len(set(configs)) == len(configs)  # none measured twice (a retry re-measures a killed one)
    complete = [t for t in finished if t.state == optuna.trial.TrialState.COMPLETE]
    assert all(t.values and t.user_attrs["status"] == "ok" for t in complete)
    client = MlflowClient(tracking)
    runs = client.search_runs([client.get_experiment_by_name("memfit").experiment_id])
    trial_runs = [r for r in runs if "memfit.trial" in r.data.tags]
    assert sorted(int(r.data.tags["memfit.trial"]) for r in trial_runs) == sorted(t.number for t in trials)
    assert not [r for r in runs if r.info.status == "RUNNING"]
    return trials


@pytest.mark.xdist_group("postgres")
def test_four_workers_share_one_postgres_study_and_one_mlflow_server(postgres, tmp_path, tiny_seq2seq_calibration):
    workers = 4  # two workers: the test below, where one of them is killed
    storage, n_trials, port = postgres("workers"), 6, free_port()  # n_trials as in the README's command
    for index in range(workers):  # machines that swept this model before: the sizing job fits no memory model
        tiny_seq2seq_calibration(tmp_path / f"worker{index}")
    with serving(_readme_mlflow_server(port, tmp_path), port, cwd=tmp_path) as tracking:
        base = _readme_worker(storage, tracking)
        procs = [_start(_worker(i, n_trials, storage, tracking, tmp_path, base), tmp_path, i) for i in range(workers)]
        for index, proc in enumerate(procs):
            assert proc.wait(timeout=600) == 0, (tmp_path / f"worker{index}.log").read_text()[-3000:]
        trials = _check_study_and_mlflow(storage, tracking, n_trials)
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert any((tmp_path / "mlartifacts").rglob("config.yaml"))  # the server's artifacts where its command says
    owners = {tuple(t.system_attrs["memfit:owner"]) for t in trials}
    assert len(owners) > 1  # the work was shared, not done by one worker while the others waited
    assert not [log for log in tmp_path.rglob("*.log") if "memory model: calibrated" in log.read_text()]


@pytest.mark.xdist_group("postgres")
def test_a_killed_worker_leaves_its_trial_failed_and_the_study_goes_on(postgres, tmp_path):
    storage, n_trials, port = postgres("killed"), 5, free_port()
    store = f"sqlite:///{tmp_path}/mlflow-server.db"
    command = mlflow_server(store, port)
    with serving(command, port, cwd=tmp_path) as tracking:
        victim, survivor = (_start(_worker(i, n_trials, storage, tracking, tmp_path), tmp_path, i) for i in (0, 1))
        killed = _running_trial_of(victim, storage)
        # the survivor is past its start-up (where a same-host dead worker is recovered by its pid) and running a
        # trial: the victim's trial can then only be found by the heartbeat, as on another machine
        _running_trial_of(survivor, storage)
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


def _running_trial_of(proc, storage: str, timeout: float = 300):
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


def _sqlite_trials(tmp_path) -> list:
    study = optuna.load_study(
        study_name="memfit-tiny_seq2seq-aclsum-nobudget", storage=f"sqlite:///{tmp_path}/optuna.db"
    )
    return [t for t in study.trials if "not_run" not in t.user_attrs]


def _sweep_args(tmp_path) -> list[str]:
    return [
        *SMALL_SWEEP,
        "hydra.sweeper.n_trials=2",
        *sweep_outputs(tmp_path),
    ]


def test_one_trial_per_device_at_a_time_each_pinned_to_its_device(tmp_path):
    from memfit.run import core_ranges
    from memfit.sweep.trials import core_sets
    from memfit.tracking import default_tracking_uri
    from tests.conftest import run_train_py

    # a device whose trial ends first waits for the other's, woken when it ends, not after poll_s; each device's
    # trials on their own cores
    pinning = ["hydra.sweeper.devices=[0,1]", "hydra.sweeper.pin_cores=true", "hydra.sweeper.poll_s=300"]
    done = run_train_py(*_sweep_args(tmp_path), *pinning)
    ended = datetime.now()
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = sorted(_sqlite_trials(tmp_path), key=lambda t: t.number)
    assert {first.user_attrs["device"], second.user_attrs["device"]} == {"0", "1"}
    # both devices busy at once: no batch waits for its slowest trial before the next starts
    assert first.datetime_start < second.datetime_complete and second.datetime_start < first.datetime_complete
    assert ended - max(first.datetime_complete, second.datetime_complete) < timedelta(seconds=60)
    client = MlflowClient(default_tracking_uri(str(tmp_path)))
    halves = core_sets(2)  # this machine's cores in two disjoint halves
    for trial in (first, second):
        run = client.get_run(trial.user_attrs["run_id"])
        seen = run.data.tags["memfit.cuda_visible_devices"]  # what the trial saw, and that it trained on CPU here
        assert seen == f"{trial.user_attrs['device']} (unused: the run trained on CPU)"
        # pinned: a thread per core of its own, unless OMP_NUM_THREADS is set (as this suite does under pytest-xdist)
        threads = str(len(halves[int(trial.user_attrs["device"])]))
        assert run.data.tags["memfit.cpu_threads"] == os.environ.get("OMP_NUM_THREADS", threads)
    expected = [core_ranges(cores) for cores in halves]
    tags = {t.user_attrs["device"]: client.get_run(t.user_attrs["run_id"]).data.tags for t in (first, second)}
    assert [tags["0"]["memfit.cpu_cores"], tags["1"]["memfit.cpu_cores"]] == expected


def test_trials_go_through_hydra_submitit_launcher(tmp_path):
    """hydra/launcher=submitit_slurm on a cluster; here submitit's local executor, the same code path."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install -e '.[test]' (or '.[slurm]')")
    from tests.conftest import run_train_py

    launcher = ["hydra.sweeper.isolation=launcher", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10"]
    done = run_train_py(*_sweep_args(tmp_path), *launcher)
    assert done.returncode == 0, done.stderr[-3000:]
    trials = _sqlite_trials(tmp_path)
    assert len(trials) == 2 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert all(t.user_attrs["status"] == "ok" and t.values for t in trials)
    jobs = [p for p in (tmp_path / "sweep" / ".submitit").iterdir() if p.name.isdigit()]
    assert len(jobs) == 2 and all(list(job.glob("*_result.pkl")) for job in jobs)  # each trial a submitit job
