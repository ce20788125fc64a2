"""Where a run's records live: the tracking URI (sqlite under output_dir by default), its artifact root, and a
new sqlite store made ready once (migrated, under a lock) before runs open it."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sqlite3
from pathlib import Path

from omegaconf import DictConfig

log = logging.getLogger("memfit.tracking")


def default_tracking_uri(output_dir: str) -> str:
    """MLflow's own default backend, sqlite, in a file under outputs/."""
    return f"sqlite:///{(Path(output_dir).resolve() / 'mlflow.db')}"


def artifact_location(uri: str, output_dir: str) -> str | None:
    """Artifacts of a local store go under output_dir too (MLflow would put them in ./mlruns of the cwd);
    a tracking server keeps its own artifact root."""
    if uri.startswith(("sqlite:", "file:")) or "://" not in uri:
        return (Path(output_dir).resolve() / "mlartifacts").as_uri()
    return None


def tracking_uri(cfg: DictConfig) -> str:
    uri = cfg.tracking.uri or default_tracking_uri(cfg.output_dir)
    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        _create_sqlite_store(uri)
    return uri


_READY_STORES: set[str] = set()


def _create_sqlite_store(uri: str) -> None:
    """Create and migrate a sqlite store once, under a lock beside it: runs started together on a new store would
    otherwise each run MLflow's schema migration, and all but one fail (`duplicate column name`). A new store starts
    as a copy of an empty one MLflow migrated (empty_store_template); opening it verifies its schema and adds the
    Default experiment, as for any store."""
    if uri in _READY_STORES:
        return
    from filelock import FileLock
    from mlflow.tracking import MlflowClient

    path = Path(uri.removeprefix("sqlite:///"))
    with FileLock(f"{path}.lock"):
        if not path.exists():
            try:
                shutil.copyfile(empty_store_template(), path)
            except (OSError, sqlite3.Error) as err:  # a cache it cannot write: MLflow migrates the new store itself
                log.debug("no MLflow store template (%s): migrating %s", err, path)
                path.unlink(missing_ok=True)
        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)  # opening the store migrates it
    _READY_STORES.add(uri)


def empty_store_template() -> Path:
    """An empty sqlite store of this MLflow version, migrated once and kept in memfit's cache
    ($XDG_CACHE_HOME/memfit, else ~/.cache/memfit). Migrating a new store runs every MLflow schema revision since
    1.x: ~2 CPU-s and as long again in disk syncs, where copying this file takes 0.07 s (this 2-core host), which
    was most of a tiny run's tracking start-up. The template holds no experiment: whoever opens a copy creates the
    Default experiment with its own artifact root, as MLflow does in a store it creates."""
    import mlflow
    from filelock import FileLock
    from mlflow.tracking import MlflowClient

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "memfit"
    template = cache / f"mlflow-{mlflow.__version__}-empty.db"
    if template.exists():
        return template
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{template}.lock"):
        if not template.exists():
            building = template.with_suffix(f".{os.getpid()}.tmp")
            MlflowClient(tracking_uri=f"sqlite:///{building}").search_experiments(max_results=1)
            with contextlib.closing(sqlite3.connect(building)) as db, db:
                db.execute("DELETE FROM experiments WHERE experiment_id = 0")  # the Default experiment, see above
            os.replace(building, template)
    return template
