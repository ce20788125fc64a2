"""The study's storage: opening it (workers racing to create a fresh database), the sampler, heartbeats, and the
recovery of trials whose worker or sweeper died. Built on Optuna's own heartbeat and failed-trial machinery:
RDBStorage's heartbeat, `fail_stale_trials` and its stale-trial callback."""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from memfit.sweep import proposals
from memfit.sweep.proposals import counts_as_run, pending_params
from memfit.sweep.space import SweepConfigError
from memfit.tracking import HOST, pid_alive

log = logging.getLogger("memfit.sweep")

OWNER_ATTR = "memfit:owner"  # a running trial's system attribute: [host, pid] of the sweeper that runs it


def make_sampler(name: str, seed: int | None, n_trials: int = 16, n_jobs: int = 1) -> Any:
    """TPE tuned for a few expensive trials: multivariate (batch size and lengths act on memory together), a short
    random start (Optuna's default of 10 random trials would be most of a GPU sweep), and constant liar when
    trials run in parallel, so that concurrent asks do not pile onto one point. Grouped: a budget-shaped trial draws
    the plan's knobs and a fixed one the batch size (space.suggest), and TPE models each such group of params apart."""
    import warnings

    import optuna

    if name == "tpe":
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning, message=".*group.*")
        return optuna.samplers.TPESampler(
            seed=seed,
            multivariate=True,
            group=True,
            n_startup_trials=min(10, max(4, n_trials // 4)),
            constant_liar=n_jobs > 1,
        )
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise SweepConfigError(f"hydra.sweeper.sampler={name!r}: use tpe or random")


def storage_url(settings: DictConfig, config: DictConfig) -> str:
    return settings.storage or f"sqlite:///{Path(config.output_dir).resolve() / 'optuna.db'}"


def worker_seed(settings: DictConfig) -> int | None:
    """The sampler's seed. On a storage the user named (shared by workers, possibly), each worker mixes in its host
    and process id: workers seeded alike would propose the same configurations. The default sqlite study, one
    worker's, stays reproducible."""
    if settings.seed is None or not settings.storage:
        return settings.seed
    import zlib

    return zlib.crc32(f"{settings.seed}:{HOST}:{os.getpid()}".encode())


# PostgreSQL drivers SQLAlchemy knows, the one it assumes for a bare postgresql:// first (2.1: psycopg 3)
POSTGRES_DRIVERS = (("psycopg", "postgresql+psycopg"), ("psycopg2", "postgresql+psycopg2"))


def with_installed_driver(url: str) -> str:
    """A postgresql:// URL names no driver, and SQLAlchemy 2.1 takes it for psycopg 3: it gets the driver that is
    installed (memfit's postgres extra installs psycopg2); none installed is one line. Other URLs are as given."""
    scheme, sep, rest = url.partition("://")
    if scheme not in ("postgresql", "postgres") or not sep:
        return url
    for module, dialect in POSTGRES_DRIVERS:
        if importlib.util.find_spec(module) is not None:
            return f"{dialect}://{rest}"
    raise SweepConfigError(
        "hydra.sweeper.storage is a PostgreSQL URL, but no PostgreSQL driver is installed: pip install "
        "'memfit[postgres]' (psycopg2) or psycopg"
    )


def _storage(url: str, heartbeat_s: float | None, on_stale: Callable[[Any, Any], None]) -> Any:
    """With a heartbeat, a trial whose worker dies (a killed process, a lost machine) is failed by any other worker
    once its heartbeat is `grace` seconds old, and `on_stale` is told. On sqlite a write waits up to a minute for
    another process's lock (sqlite retries it), not the driver's default 5 s."""
    from optuna.storages import RDBStorage

    url = with_installed_driver(url)
    engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite:") else None
    if not heartbeat_s:
        return RDBStorage(url, engine_kwargs=engine)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "experimental feature": heartbeats are Optuna's own pattern since 2.x
        return RDBStorage(
            url,
            engine_kwargs=engine,
            heartbeat_interval=max(1, int(heartbeat_s)),
            grace_period=max(3, int(3 * heartbeat_s)),
            heartbeat_stale_trial_callback=on_stale,
        )


def open_study(
    name: str,
    url: str,
    settings: DictConfig,
    directions: list[str],
    on_stale: Callable[[Any, Any], None],
    attempts: int = 4,
    choose_name: Callable[[Any], str] | None = None,
) -> tuple[Any, Any]:
    """(study, its storage): create or load the study. Workers that start together on a fresh database race to
    create Optuna's tables (PostgreSQL: duplicate key in pg_type); the losers find them made on the next attempt.
    A storage URL that cannot be opened, or a study of this name with other directions, is a SweepConfigError.
    `choose_name(storage)`, where given, names the study from what the open storage holds (sweep.naming)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    parallel = max(settings.n_jobs, len(settings.devices or []))
    for attempt in range(attempts):
        try:
            with _creating(url):
                storage = _storage(url, settings.heartbeat_s, on_stale)
                name = choose_name(storage) if choose_name is not None else name
                study = optuna.create_study(
                    study_name=name,
                    storage=storage,
                    sampler=make_sampler(settings.sampler, worker_seed(settings), settings.n_trials, parallel),
                    directions=directions,
                    load_if_exists=True,
                )
            return study, storage
        except SweepConfigError:
            raise
        except ValueError as err:  # an existing study with other directions
            raise SweepConfigError(
                f"hydra.sweeper.study_name={name}: {err}; use a new study_name for a different objective"
            ) from None
        except Exception as err:  # noqa: BLE001 - SQLAlchemy cannot open the URL: driver, host, credentials, path
            if _racing(err) and attempt < attempts - 1:
                time.sleep(0.5 + attempt)
                continue
            raise _cannot_open(url, err) from None
    raise AssertionError("unreachable")


def _racing(err: Exception) -> bool:
    """Whether opening failed because another worker was creating the same tables (PostgreSQL: duplicate key)."""
    return any(word in str(err).lower() for word in ("duplicate", "already exists", "unique"))


def _cannot_open(url: str, err: Exception) -> SweepConfigError:
    from memfit.tracking import mask_credentials

    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    return SweepConfigError(
        f"hydra.sweeper.storage={mask_credentials(url)} cannot be opened ({mask_credentials(first)[:200]}):"
        " check the URL, the server and its credentials, or leave storage null for sqlite under output_dir"
    )


def peek(url: str) -> Any | None:
    """The storage at `url` opened to read what it holds before the sweep opens its study (None where there is no
    sqlite file or PostgreSQL's tables are being created: no study is recorded yet); a storage that cannot be opened
    is the SweepConfigError open_study would give, said before any job runs."""
    try:
        if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
            return None
        with _creating(url):
            return _storage(url, None, lambda study, trial: None)
    except Exception as err:  # noqa: BLE001 - SQLAlchemy cannot open the URL: driver, host, credentials, path
        if _racing(err):  # another worker is creating the tables
            return None
        raise _cannot_open(url, err) from None


@contextmanager
def _creating(url: str) -> Iterator[None]:
    """A sqlite study's tables are created (and migrated) by one sweeper at a time, under a lock beside the file;
    PostgreSQL's races are retried instead (open_study)."""
    if not url.startswith("sqlite:///"):
        yield
        return
    from filelock import FileLock

    path = Path(url.removeprefix("sqlite:///"))
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"):
        yield


def trial_id(storage: Any, study_name: str, number: int) -> int:
    """A trial's id in the storage, through the storage's public lookups (Optuna's Trial keeps its own private)."""
    return storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study_name), number)


def mark_owner(trial: Any) -> None:
    """Note on a running trial which sweeper process runs it, for `interrupted`."""
    tid = trial_id(trial.storage, trial.study.study_name, trial.number)
    trial.storage.set_trial_system_attr(tid, OWNER_ATTR, [HOST, os.getpid()])


def interrupted(study: Any) -> list[Any]:
    """RUNNING trials whose sweeper process on this host is gone (another live worker's, or another host's, are not
    ours to judge)."""
    import optuna

    found = []
    for frozen in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        owner = frozen.system_attrs.get(OWNER_ATTR)
        if owner is not None and owner[0] == HOST and not pid_alive(owner[1]):
            found.append(frozen)
    return found


def running_here(study: Any) -> list[Any]:
    """RUNNING trials that this sweeper process runs."""
    import optuna

    mine = [HOST, os.getpid()]
    running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    return [t for t in running if t.system_attrs.get(OWNER_ATTR) == mine]


def fail_and_requeue(study: Any, storage: Any, frozen: Any, reason: str) -> None:
    """FAIL an interrupted trial with its reason and queue its configuration again (once: a retry is not retried)."""
    import optuna

    tid = trial_id(storage, study.study_name, frozen.number)
    storage.set_trial_user_attr(tid, "status", "interrupted")
    storage.set_trial_user_attr(tid, "reason", reason)
    study.tell(frozen.number, state=optuna.trial.TrialState.FAIL)
    requeue(study, frozen, reason)


def requeue(study: Any, frozen: Any, reason: str) -> None:
    if not frozen.user_attrs.get("retry_of"):
        study.enqueue_trial(frozen.params, user_attrs={"retry_of": frozen.number, "retry_reason": reason})


def fail_stale(study: Any, heartbeat_s: float | None) -> None:
    """Fail other workers' trials whose heartbeat stopped (the stale callback queues them again)."""
    if heartbeat_s:
        from optuna.storages import fail_stale_trials

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # experimental API warning
            fail_stale_trials(study)


@contextmanager
def beating(trials: list[Any], heartbeat_s: float | None) -> Iterator[None]:
    """Record the trials' heartbeats while the block runs (what Study.optimize does for its own trials; ask/tell
    has no public helper for it, so this is one thread over the storage's public `record_heartbeat`)."""
    if not heartbeat_s or not trials:
        yield
        return
    storage = trials[0].storage
    ids = [trial_id(storage, t.study.study_name, t.number) for t in trials]
    stop = threading.Event()

    def beat() -> None:
        while True:
            for tid in ids:
                storage.record_heartbeat(tid)
            if stop.wait(max(1, int(heartbeat_s))):
                return

    thread = threading.Thread(target=beat, name="memfit-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


# --- what the study holds now -------------------------------------------------------------------------------------
def trials_in(study: Any, *states: Any) -> list[Any]:
    """The study's trials in these states, uncopied."""
    return study.get_trials(deepcopy=False, states=states)


def trials_run(study: Any) -> int:
    """Trials this study ran to the end (every worker's), none a retry stands in for: n_trials counts these."""
    return len([t for t in proposals.measured(study.trials) if t.state.is_finished()])


def running(study: Any) -> int:
    import optuna

    return len([t for t in trials_in(study, optuna.trial.TrialState.RUNNING) if counts_as_run(t)])


def waiting_retries(study: Any) -> int:
    """Configurations queued again after their trial was killed or interrupted, not yet asked for."""
    import optuna

    return len([t for t in trials_in(study, optuna.trial.TrialState.WAITING) if "retry_of" in t.user_attrs])


def pending(study: Any) -> list[dict[str, Any]]:
    """Configurations queued or running now (proposals.pending_params)."""
    import optuna

    return pending_params(trials_in(study, optuna.trial.TrialState.WAITING, optuna.trial.TrialState.RUNNING))


def over_quota(study: Any, trial: Any, n_trials: int) -> bool:
    """proposals.over_quota over the study's started trials and its queued retries (each stands in for a trial
    that was killed or interrupted)."""
    import optuna

    states = optuna.trial.TrialState
    retries = [t for t in trials_in(study, states.WAITING) if "retry_of" in t.user_attrs]
    return proposals.over_quota(
        trial, trials_in(study, states.RUNNING, states.COMPLETE, states.FAIL) + retries, n_trials
    )


def tell_surplus(study: Any, trial: Any) -> None:
    import optuna

    trial.set_user_attr("not_run", True)
    trial.set_user_attr("status", "surplus")
    trial.set_user_attr("reason", "not run: other workers had already taken the study's n_trials")
    study.tell(trial, state=optuna.trial.TrialState.FAIL)
