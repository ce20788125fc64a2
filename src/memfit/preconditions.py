"""What must hold before a run starts that the config alone cannot tell: a writable output_dir with free disk, a
tracking server that answers, LoRA targets the model has, a budget the device can hold.

Each problem is one line naming the field and the fix (a ConfigError), found before any weights are loaded and
before anything is recorded.
"""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from memfit.config import GIB, ConfigError


def _unwritable(path: Path) -> str | None:
    """Why `path` cannot be created and written to, or None where it can."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".memfit-write-check-{uuid.uuid4().hex}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        return str(err.strerror or err)
    return None


def check_output_dir(output_dir: str, min_free_gib: float) -> list[str]:
    """output_dir can be created and written, and its disk has min_free_gib free (checkpoints, the MLflow store)."""
    path = Path(output_dir)
    if why := _unwritable(path):
        return [f"output_dir={output_dir} is not writable ({why}): choose a writable output_dir"]
    free = shutil.disk_usage(path).free / GIB
    if free < min_free_gib:
        return [
            f"output_dir={output_dir} has {free:.2f} GiB free, less than min_free_disk_gib={min_free_gib:g}: "
            "free some disk or choose another output_dir"
        ]
    return []


# SQLAlchemy dialects MLflow's tracking store opens, and its REST schemes; anything else it refuses with a traceback
TRACKING_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks")


def check_tracking_uri(tracking: DictConfig) -> list[str]:
    """A tracking.uri MLflow can use: not MLflow 2's file store (maintenance mode in MLflow 3), a sqlite file in a
    directory that exists and can be written, a scheme MLflow knows."""
    uri = tracking.uri
    if tracking.backend == "none" or not uri:
        return []
    from memfit.tracking import mask_credentials

    scheme = uri.split("://", 1)[0].split("+", 1)[0].lower() if "://" in uri else ""
    if scheme in ("", "file"):
        path = Path(uri.removeprefix("file://") if scheme else uri).expanduser().resolve()
        return [
            f"tracking.uri={uri} is MLflow's file store, in maintenance mode since MLflow 3: use a sqlite store, "
            f"e.g. tracking.uri=sqlite:///{path.parent / 'mlflow.db'}"
        ]
    if scheme not in TRACKING_SCHEMES:
        return [
            f"tracking.uri={mask_credentials(uri)}: MLflow has no '{scheme}' store: use sqlite:///<path>, "
            "postgresql://..., or http://<server>:5000"
        ]
    if scheme == "sqlite":
        directory = Path(uri.removeprefix("sqlite:///")).parent
        if not directory.is_dir():
            return [f"tracking.uri={uri}: the directory {directory} does not exist: create it or point to another"]
        if not os.access(directory, os.W_OK):
            return [f"tracking.uri={uri}: the directory {directory} cannot be written: point to a writable one"]
    return []


SQLITE_HEADER = b"SQLite format 3\x00"


def check_sqlite_store(cfg: DictConfig) -> list[str]:
    """A sqlite tracking store that exists (tracking.uri's, or the default under output_dir) must be a SQLite
    database: MLflow would fail on another file with a traceback after the run started."""
    if cfg.tracking.backend == "none":
        return []
    from memfit.tracking import default_tracking_uri

    uri = cfg.tracking.uri or default_tracking_uri(cfg.output_dir)
    path = Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None
    if path is None or not path.is_file() or path.stat().st_size == 0:
        return []
    try:
        with path.open("rb") as fh:
            header = fh.read(len(SQLITE_HEADER))
    except OSError as err:
        return [f"tracking.uri={uri}: the store cannot be read ({err.strerror}): fix its permissions or use another"]
    if header != SQLITE_HEADER:
        return [f"tracking.uri={uri}: {path} is not a SQLite database: move it away or point tracking.uri elsewhere"]
    return []


def _health_request(uri: str) -> Any:
    """GET <uri>/health, with the URL's user:password sent as HTTP basic auth (as MLflow's client sends them), not
    left in the host name."""
    import base64
    import urllib.parse
    import urllib.request

    parts = urllib.parse.urlsplit(uri.rstrip("/") + "/health")
    host = parts.netloc.rsplit("@", 1)[-1]  # the credentials go as a header, not in the URL
    request = urllib.request.Request(urllib.parse.urlunsplit(parts._replace(netloc=host)))
    if parts.username is not None:
        secret = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        request.add_header("Authorization", "Basic " + base64.b64encode(secret.encode()).decode())
    return request


def check_tracking_server(cfg: DictConfig) -> list[str]:
    """An http(s) tracking URI must answer now, not fail after hours of training (MLflow retries for minutes)."""
    uri = cfg.tracking.uri or ""
    if cfg.tracking.backend == "none" or not uri.startswith(("http://", "https://")):
        return []
    import urllib.error
    import urllib.request

    from memfit.tracking import mask_credentials

    request = _health_request(uri)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            if response.status == 200:
                return []
            why = f"HTTP {response.status}"
    except (urllib.error.URLError, OSError) as err:
        why = str(getattr(err, "reason", err))
    return [
        f"tracking.uri={mask_credentials(uri)} does not answer ({why}): start the server "
        "(mlflow server --host 127.0.0.1 --port 5000), fix the URI, or use tracking=none"
    ]


def _linear_layer_names(model: Any) -> set[str]:
    import torch

    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def check_lora_targets(cfg: DictConfig, model: Any = None) -> list[str]:
    if not cfg.model.lora.enabled or cfg.model.source == "bert2bert":
        return []
    targets = list(cfg.model.lora.target_modules)
    from memfit.models import meta_model

    present = _linear_layer_names(model if model is not None else meta_model(cfg.model))
    missing = [t for t in targets if t not in present]
    if not missing:
        return []
    return [
        f"model.lora.target_modules has {', '.join(missing)}, which {cfg.model.name} does not have: "
        f"its linear layers are {', '.join(sorted(present))}"
    ]


def check_budget(cfg: DictConfig, device: str, device_bytes: int) -> list[str]:
    if cfg.budget.gib is None or cfg.budget.gib * GIB <= device_bytes:
        return []
    where = "this GPU's" if device == "cuda" else "this machine's host"
    return [
        f"budget.gib={cfg.budget.gib:g} is larger than {where} {device_bytes / GIB:.1f} GiB: "
        f"use budget.gib<={int(device_bytes / GIB)} (or null for the whole device)"
    ]


def check_cache_dirs(cfg: DictConfig) -> list[str]:
    """The caches memfit writes beside output_dir, where set elsewhere: each can be created and written."""
    caches = {"data.tokenized_cache": cfg.data.tokenized_cache, "calibration.cache_dir": cfg.calibration.cache_dir}
    return [
        f"{key}={value} is not writable ({why}): choose a writable directory, or {key}=null"
        if key == "data.tokenized_cache"
        else f"{key}={value} is not writable ({why}): choose a writable directory"
        for key, value in caches.items()
        if value and not _inside(Path(value), Path(cfg.output_dir)) and (why := _unwritable(Path(value)))
    ]


def _inside(path: Path, directory: Path) -> bool:
    """Whether `path` lies under `directory` (whose own check covers it)."""
    return path.resolve().is_relative_to(directory.resolve())


def check_before_run(cfg: DictConfig) -> None:
    """The checks that need no device: raise ConfigError with every problem."""
    problems = check_output_dir(cfg.output_dir, cfg.min_free_disk_gib) + check_cache_dirs(cfg)
    problems += check_tracking_uri(cfg.tracking) or check_tracking_server(cfg) or check_sqlite_store(cfg)
    problems += check_lora_targets(cfg)
    if problems:
        raise ConfigError(problems)


try:  # the Hydra callback: output_dir is checked before Hydra creates its run directory inside it
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - hydra is a dependency; this keeps the module importable without it
    Callback = object


class OutputDirCheck(Callback):
    """hydra.callbacks: an unwritable or full output_dir is one line and exit 2, not Hydra's traceback."""

    def _check(self, config: DictConfig) -> None:
        problems = check_output_dir(config.output_dir, config.get("min_free_disk_gib", 0.0))
        if problems:
            for line in problems:
                print(f"memfit: error: {line}", file=sys.stderr)
            sys.exit(2)

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config)


def mask_files(paths: list[Path]) -> None:
    """Credentials in URLs (tracking.uri, hydra.sweeper.storage) masked in files Hydra wrote, where they appear."""
    from memfit.tracking import mask_credentials

    for path in paths:
        if path.is_file() and (text := path.read_text()) != (masked := mask_credentials(text)):
            path.write_text(masked)


class CredentialMask(Callback):
    """hydra.callbacks: Hydra writes the composed config, its own and the overrides into every job's .hydra/ (and
    a multirun's multirun.yaml) before the job runs; a password in a URL is masked there as it is everywhere else."""

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.core.hydra_config import HydraConfig

        hydra = HydraConfig.get()
        if hydra.output_subdir is not None:
            mask_files(sorted((Path(hydra.runtime.output_dir) / hydra.output_subdir).glob("*.yaml")))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        mask_files([Path(config.hydra.sweep.dir) / "multirun.yaml"])
