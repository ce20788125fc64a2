"""A trial process started before its trial: it imports the heavy libraries while the previous trial runs, then
waits for its overrides on stdin and runs the app as `python train.py <overrides>` would.

    python -m memfit.sweep.standby [--on-demand] <script> [--config-name ... --config-dir ...]
    stdin: one JSON line {"overrides": [...], "log": "<trial.log path>", "sent": <epoch seconds>}; end of input
    without one: exit 0
    --on-demand: a trial started when it is due, its line already written: no imports ahead of it (the trial
    imports what it uses), and "log" may be left out (the process already writes to the trial's log)

Importing torch, transformers, MLflow and the rest costs a trial 5-7 s before it touches its device; a standby has
paid it while the device was busy with the previous trial. It touches no device before its line arrives (torch
initialises CUDA lazily), so the trial's process is as fresh as one started on demand: its own CUDA context,
allocator state and cap, its own config composed from its own argv. Only imports are shared ahead of time.

When the trial has returned (its report.json written, its MLflow run ended), the process ends at once: non-daemon
threads joined and atexit handlers run (MLflow's and logging's flushes), but not the interpreter's teardown of
every module and object, which took 1.5 s after a tiny CPU trial and 2.3-3.6 s after a pegasus_large trial on the
GPU host, time in which the device waits for its next trial.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import runpy
import sys
import threading
import time
import traceback
from datetime import datetime

from memfit.sweep.trials import STANDBY_FILE  # already loaded: `python -m` imports the package first

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


def readiness(imports_s: float, waited_s: float) -> str:
    """How the standby's imports met its trial: paid before the trial was due (waited_s ≤ 0: by how much), or how
    long the trial waited."""
    if waited_s <= 0:
        return f"standby: imports took {imports_s:.1f} s, done {-waited_s:.1f} s before its trial was due"
    return f"standby: imports took {imports_s:.1f} s; its trial waited {waited_s:.1f} s for them"


def _log_line(message: str) -> None:
    """One line in the trial log's format (Hydra's), before the app has configured logging."""
    stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
    print(f"[{stamp}][memfit.standby][INFO] - {message}", file=sys.stderr, flush=True)


def _redirect_output(log_path: str) -> None:
    """The trial's stdout and stderr go to its own trial.log, as a process started for it would write."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def run_script(script: str) -> int:
    """`python <script>`: its exit status, with an uncaught exception printed as the interpreter would."""
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            return done.code or 0
        print(done.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - what an uncaught exception does to `python <script>`
        traceback.print_exc()
        return 1
    return 0


def exit_now(code: int) -> None:
    """End the process as a normal exit would, less the interpreter's teardown (see the module's docstring)."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # noqa: SLF001 - the handlers a normal exit runs; os._exit skips them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    started = time.time()
    on_demand = sys.argv[1] == "--on-demand"
    script, *app_args = sys.argv[2:] if on_demand else sys.argv[1:]
    if not on_demand:
        import matplotlib

        matplotlib.use("Agg")  # what the trial would pick without a display; set before pyplot is imported
        warm_imports()
        # The imports' ~700k objects live as long as the process: moved out of the collector's sight, every full
        # collection in the trial (the preflight's and accelerate's gc.collect, the automatic ones) skips them.
        # Measured on CPU, a tiny-model trial after warm imports: 4.3 -> 3.3 s. No trial object exists yet, so
        # nothing the trial later drops can be held by the freeze.
        gc.freeze()
    ready = time.time()
    line = sys.stdin.readline()
    if not line.strip():
        return  # the sweep ended (or the sweeper died) before this process was needed
    job = json.loads(line)
    if job.get("log"):
        _redirect_output(job["log"])
    if not on_demand and "sent" in job:  # whether prestarting ahead paid off: in the log, and for the sweeper
        imports_s, waited_s = ready - started, ready - job["sent"]
        _log_line(readiness(imports_s, waited_s))
        if job.get("log"):
            with open(os.path.join(os.path.dirname(job["log"]), STANDBY_FILE), "w") as out:
                json.dump({"imports_s": imports_s, "waited_s": max(0.0, waited_s)}, out)
    sys.argv = [script, *app_args, *job["overrides"]]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # what `python <script>` puts first on the path
    exit_now(run_script(script))


if __name__ == "__main__":
    main()
