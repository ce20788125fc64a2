"""Tracking: memfit's one owner of the MLflow run lifecycle (start, params, batched metrics, artifacts, end).

Nothing else in memfit calls mlflow. Per-step metrics are buffered and written in one batch every few seconds:
a store write per step, even on MLflow's background thread (which competes for the GIL), slowed a CPU-bound
LoRA step by ~13% (benchmarks/results/slice_gpu_run1_async_mlflow.json). `finish` flushes and always ends the run
FINISHED or FAILED with a reason, never leaving it RUNNING.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

# a run's owner and its store, where callers have always found them
from memfit.tracking.owners import HOST as HOST
from memfit.tracking.owners import OWNER_TAG as OWNER_TAG
from memfit.tracking.owners import end_orphans as end_orphans
from memfit.tracking.owners import pid_alive as pid_alive
from memfit.tracking.store import artifact_location as artifact_location
from memfit.tracking.store import default_tracking_uri as default_tracking_uri
from memfit.tracking.store import empty_store_template as empty_store_template
from memfit.tracking.store import tracking_uri as tracking_uri

log = logging.getLogger(__name__)

_CREDENTIALS = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:/@\s]+):(?P<secret>[^@/\s]+)@")


def mask_credentials(text: str) -> str:
    """postgresql://user:secret@host → postgresql://user:***@host."""
    return _CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)


def flatten(cfg: DictConfig) -> dict[str, str]:
    """The resolved config as dotted keys → strings, credentials masked."""
    flat: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = mask_credentials(str(node))

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return flat


FACTS_FILE = "facts.json"  # a run's single values (MlflowTracker.log_facts)


def run_facts(client: Any, run_id: str) -> dict[str, float]:
    """A run's facts (MlflowTracker.log_facts) read back from its store; {} where it logged none."""
    import tempfile

    from mlflow.exceptions import MlflowException

    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = client.download_artifacts(run_id, FACTS_FILE, tmp)
        except (MlflowException, OSError):
            return {}
        return json.loads(Path(path).read_text())


class NullTracker:
    """tracking=none: the same calls, recorded nowhere."""

    run_id: str | None = None

    def flush(self) -> None:
        pass

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def log_facts(self, facts: dict[str, float]) -> None:
        pass

    def set_tags(self, tags: dict[str, str]) -> None:
        pass

    def log_text(self, text: str, artifact_file: str) -> None:
        pass

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        pass

    def log_artifacts(self, directory: str, artifact_path: str | None = None) -> None:
        pass

    def finish(self, status: str = "FINISHED", reason: str | None = None) -> None:
        pass


def _batches(items: list[Any], size: int) -> list[list[Any]]:
    return [items[start : start + size] for start in range(0, len(items), size)]


def _tag_value(value: Any) -> str:
    """A tag as MLflow stores it: credentials masked, within its 5000-character limit."""
    return mask_credentials(str(value))[:5000]


class MlflowTracker:
    """One MLflow run, held through MlflowClient so that several runs never share global state."""

    flush_every_s = 10.0  # at most this many seconds of metrics are lost if the process is killed
    max_batch = 1000  # MLflow's limit of metrics per log_batch

    def __init__(
        self,
        uri: str,
        experiment: str,
        run_name: str,
        tags: dict[str, str],
        artifact_location: str | None = None,
        run_id: str | None = None,
    ):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        self.continued = bool(run_id)
        self._logged_through = 0  # a resumed run's steps already in its history (from before it was stopped)
        if run_id:  # continue a run someone created (the sweeper, or an interrupted run being resumed)
            self.run_id = run_id
            before = self.client.get_run(run_id).data
            if "train/loss" in before.metrics:  # a run that trained before: a resumed one (not a sweep's new trial)
                self._logged_through = max(m.step for m in self.client.get_metric_history(run_id, "train/loss"))
            self.client.update_run(run_id, status="RUNNING", name=run_name)
            if "memfit.reason" in before.tags:  # why it stopped before: no longer so
                self.client.delete_tag(run_id, "memfit.reason")
            self.set_tags(tags)
        else:
            experiment_id = self._experiment_id(experiment, artifact_location)
            masked = {key: _tag_value(value) for key, value in tags.items()}
            self.run_id = self.client.create_run(experiment_id, run_name=run_name, tags=masked).info.run_id
        self._buffer: list[Any] = []
        self._facts: dict[str, float] = {}
        self._facts_written = True
        self._last_flush = time.monotonic()
        log.info("MLflow run %s (%s) in %s", run_name, self.run_id, mask_credentials(uri))

    def _experiment_id(self, experiment: str, artifact_location: str | None) -> str:
        """The experiment's id, creating it if needed; several sweep workers may create it at the same moment."""
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(experiment)
        if found:
            return found.experiment_id
        try:
            return self.client.create_experiment(experiment, artifact_location)
        except MlflowException as err:  # another process created it first
            found = self.client.get_experiment_by_name(experiment)
            if found is None:
                raise err from None
            return found.experiment_id

    def log_params(self, params: dict[str, Any]) -> None:
        """Params are write-once in MLflow: a continued run keeps the values it started with, and notes in the tag
        `memfit.changed_params` which ones the continuation changed (trainer.resume, for one)."""
        from mlflow.entities import Param

        existing = self.client.get_run(self.run_id).data.params if self.continued else {}
        changed = sorted(k for k, v in params.items() if k in existing and existing[k] != str(v)[:6000])
        if changed:
            self.client.set_tag(self.run_id, "memfit.changed_params", ",".join(changed)[:5000])
        items = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in existing]
        for batch in _batches(items, 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=batch)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Buffered; written in one batch once flush_every_s has passed, and at finish. A resumed run trains again
        the steps between its checkpoint and where it was stopped: those already logged are not logged twice."""
        from mlflow.entities import Metric

        if step and step <= self._logged_through:
            return
        now = int(time.time() * 1000)
        self._buffer.extend(Metric(k, float(v), now, step or 0) for k, v in metrics.items())
        if time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    def log_facts(self, facts: dict[str, float]) -> None:
        """Single values a run establishes once (the audit's percentiles, the preflight's shapes, start-up phases):
        kept in the run's facts.json artifact, not as metrics, so the MLflow UI's charts and columns show what
        users compare (per-step series and a few summary/* numbers). Written with the next flush."""
        self._facts.update({key: float(value) for key, value in facts.items()})
        self._facts_written = False

    def set_tags(self, tags: dict[str, str]) -> None:
        """One write for all of them (a sweep trial sets a dozen on the run the sweeper created: one store
        transaction each, with set_tag, against a store that every concurrent trial writes to)."""
        from mlflow.entities import RunTag

        for batch in _batches([RunTag(key, _tag_value(value)) for key, value in tags.items()], 100):
            self.client.log_batch(self.run_id, tags=batch)  # MLflow takes at most 100 tags per batch

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, mask_credentials(text), artifact_file)

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, path, artifact_path)

    def log_artifacts(self, directory: str, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(self.run_id, directory, artifact_path)

    def flush(self) -> None:
        buffered, self._buffer = self._buffer, []
        for batch in _batches(buffered, self.max_batch):
            self.client.log_batch(self.run_id, metrics=batch)
        if not self._facts_written:
            self.client.log_dict(self.run_id, dict(sorted(self._facts.items())), FACTS_FILE)
            self._facts_written = True
        self._last_flush = time.monotonic()

    def finish(self, status: str = "FINISHED", reason: str | None = None) -> None:
        try:
            self.flush()
        finally:
            if reason:
                self.client.set_tag(self.run_id, "memfit.reason", _tag_value(reason))
            self.client.set_terminated(self.run_id, status=status)

    def status(self) -> str:
        return self.client.get_run(self.run_id).info.status

    def finish_if_running(self, status: str, reason: str) -> bool:
        """End a run whose process died before it could (SIGKILL, a killed sweeper): never left RUNNING."""
        if self.status() != "RUNNING":
            self.flush()
            return False
        self.finish(status, reason)
        return True


def _run_status(cfg: DictConfig, run_id: str) -> str | None:
    """A run's status in the configured store; None where the store has no such run (it lives in another store)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        return MlflowClient(tracking_uri=tracking_uri(cfg)).get_run(run_id).info.status
    except MlflowException:
        return None


def run_exists(cfg: DictConfig, run_id: str) -> bool:
    """Whether the configured store holds this run (a study remembers runs of the store it first logged to)."""
    return _run_status(cfg, run_id) is not None


def end_if_running(cfg: DictConfig, run_id: str, status: str, reason: str) -> bool:
    """End a run whose process could not (a killed or stopped trial), unless it ended itself or is not in this
    store; without reopening it (a continued MlflowTracker marks its run RUNNING)."""
    from mlflow.tracking import MlflowClient

    if _run_status(cfg, run_id) != "RUNNING":
        return False
    client = MlflowClient(tracking_uri=tracking_uri(cfg))
    client.set_tag(run_id, "memfit.reason", _tag_value(reason))
    client.set_terminated(run_id, status=status)
    return True


def open_run(cfg: DictConfig, run_name: str, tags: dict[str, str], run_id: str | None = None) -> MlflowTracker:
    uri = tracking_uri(cfg)
    return MlflowTracker(
        uri, cfg.tracking.experiment, run_name, tags, artifact_location(uri, cfg.output_dir), run_id=run_id
    )


def open_shared_run(cfg: DictConfig, run_name: str, tags: dict[str, str], key: str) -> MlflowTracker:
    """One run per value of tags[key], even when several processes (sweep workers) open it at the same moment:
    each creates its own, then every one keeps the earliest of the last ten minutes and deletes its own."""
    mine = open_run(cfg, run_name, tags)
    client = mine.client
    info = client.get_run(mine.run_id).info
    runs = client.search_runs(
        [info.experiment_id],
        filter_string=f"tags.`{key}` = '{tags[key]}' and attributes.start_time >= {info.start_time - 600_000}",
    )
    first = min(runs, key=lambda r: (r.info.start_time, r.info.run_id), default=None)
    if first is None or first.info.run_id == mine.run_id:
        return mine
    client.set_tag(mine.run_id, "memfit.reason", f"another worker's run {first.info.run_id} records this sweep")
    client.set_terminated(mine.run_id, status="FINISHED")  # ended, then deleted: no RUNNING run left behind
    client.delete_run(mine.run_id)
    return open_run(cfg, run_name, tags, run_id=first.info.run_id)


def start_tracking(
    cfg: DictConfig, run_name: str, tags: dict[str, str], run_id: str | None = None
) -> MlflowTracker | NullTracker:
    """A new run, or the run `run_id` / `tracking.run_id` names (a resumed run continues its own)."""
    if cfg.tracking.backend == "none":
        return NullTracker()
    if cfg.tracking.parent_run_id:
        tags = {**tags, "mlflow.parentRunId": cfg.tracking.parent_run_id}
    tracker = open_run(
        cfg, run_name, {**tags, OWNER_TAG: f"{HOST}:{os.getpid()}"}, run_id=run_id or cfg.tracking.get("run_id")
    )
    if not cfg.tracking.parent_run_id:  # a sweep's trial: its sweeper ends what its trials leave (end_orphans)
        end_orphans(tracker.client, cfg.tracking.experiment)
    return tracker
