"""A trial process started before its trial: it imports the heavy libraries while the previous trial runs, then
waits for its overrides on stdin and runs the app as `python train.py <overrides>` would.

    python -m memfit.sweep.standby <script> [--config-name ... --config-dir ...]
    stdin: one JSON line {"overrides": [...], "log": "<trial.log path>"}; end of input without one: exit 0

Importing torch, transformers, MLflow and the rest costs a trial 5-7 s before it touches its device; a standby has
paid it while the device was busy with the previous trial. It touches no device before its line arrives (torch
initialises CUDA lazily), so the trial's process is as fresh as one started on demand: its own CUDA context,
allocator state and cap, its own config composed from its own argv. Only imports are shared ahead of time.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import sys

# What a trial imports on every path (run, data, models, training, tracking), heaviest first. A module that is not
# installed is skipped here and reported by the trial itself, as it would be without a standby.
WARM_MODULES = (
    "torch",
    "transformers",
    "transformers.trainer",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "datasets",
    "peft",
    "mlflow",
    "mlflow.store.tracking.sqlalchemy_store",  # what a sqlite or PostgreSQL store opens (0.8 s, lazily imported)
    "matplotlib.pyplot",
    "memfit.run",
)


def warm_imports(modules: tuple[str, ...] = WARM_MODULES) -> None:
    for name in modules:
        with contextlib.suppress(Exception):  # an optional extra or a broken install: the trial reports it
            importlib.import_module(name)


def _redirect_output(log_path: str) -> None:
    """The trial's stdout and stderr go to its own trial.log, as a process started for it would write."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main() -> None:
    script, *app_args = sys.argv[1:]
    import matplotlib

    matplotlib.use("Agg")  # what the trial would pick without a display; set before pyplot is imported
    warm_imports()
    line = sys.stdin.readline()
    if not line.strip():
        return  # the sweep ended (or the sweeper died) before this process was needed
    job = json.loads(line)
    _redirect_output(job["log"])
    sys.argv = [script, *app_args, *job["overrides"]]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # what `python <script>` puts first on the path
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
