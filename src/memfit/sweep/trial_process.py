"""The process a trial runs in, and how it ends.

By default (`hydra.sweeper.fork_trials=true`) a trial's process is forked from the sweep's fork server
(multiprocessing's forkserver), which imported torch, transformers, MLflow and the rest once, when the sweep began
(memfit.sweep.warm_imports). A trial then starts in milliseconds instead of paying 8-15 CPU-seconds of imports, and
the sweep pays them once rather than once per trial. The server touches no device (torch initialises CUDA lazily;
a trial stops with one line if an import did initialise it), so each trial's process is as fresh on the device as
one started from scratch: its own CUDA context, allocator state and cap, its own config composed from its own argv.

With fork_trials=false, each trial is a new interpreter: `python -m memfit.sweep.trial_process <script> <args>`.

Either way, when the trial has returned (its report.json written, its MLflow run ended), the process ends at once:
non-daemon threads joined and atexit handlers run (MLflow's and logging's flushes), but not the interpreter's
teardown of every module and object, which took 1.5 s after a tiny CPU trial and 2.3-3.6 s after a pegasus_large
trial on the GPU host, time in which the device waits for its next trial.
"""

from __future__ import annotations

import atexit
import gc
import os
import runpy
import signal
import sys
import threading
import traceback
from dataclasses import dataclass


@dataclass(frozen=True)
class TrialJob:
    """What a forked trial process needs: the app's argv (script first, overrides included), where its output goes
    (stderr with stdout unless `errors` names a file of its own), the environment a fresh process would have had,
    and the cores it may use (None: all)."""

    argv: list[str]
    log: str
    env: dict[str, str]
    cores: list[int] | None = None
    errors: str | None = None


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


def _run(argv: list[str]) -> None:
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # what `python <script>` puts first on the path
    exit_now(run_script(argv[0]))


def _die_with_sweeper() -> None:
    """SIGKILL this process when the sweeper that started it dies, however it dies: the trial's parent is the fork
    server, so the OS's parent-death signal would not fire, but multiprocessing hands the trial a sentinel of the
    process that started it, ready once that process is gone."""
    import multiprocessing
    from multiprocessing.connection import wait

    sweeper = multiprocessing.parent_process()
    if sweeper is None or sweeper.sentinel is None:
        return

    def watch() -> None:
        wait([sweeper.sentinel])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="memfit-die-with-sweeper", daemon=True).start()


def map_in_shared_pages(server: int) -> int:
    """Map into this process the file-backed pages its fork server has mapped (read from /proc's pagemap), and
    return how many: the pages a fresh process would hold after the same imports.

    A forked process shares them but does not count them in its RSS until it touches them (Linux copies no page
    table entries of file mappings at fork), so on CPU, where host RSS is the budget, a forked trial measured ~14%
    less than the same run started fresh (tiny_seq2seq: 0.75 against 0.86-0.89 GiB), and a configuration it called
    feasible could fail as a preset. Mapped in, it measured 0.86-0.89 GiB; 40k pages took 0.06-0.08 s. Nothing
    where /proc does not say (not Linux)."""
    import ctypes

    import numpy as np

    page = os.sysconf("SC_PAGE_SIZE")
    touched = 0
    try:
        with open(f"/proc/{server}/maps") as maps, open(f"/proc/{server}/pagemap", "rb", buffering=0) as pagemap:
            for line in maps:
                fields = line.split()
                if len(fields) < 6 or not fields[5].startswith("/") or "r" not in fields[1]:
                    continue
                start, end = (int(x, 16) for x in fields[0].split("-"))
                pagemap.seek(start // page * 8)
                entries = np.frombuffer(pagemap.read((end - start) // page * 8), dtype=np.uint64)
                for index in np.flatnonzero(entries >> np.uint64(63)):  # bit 63: present in the server
                    _ = ctypes.c_char.from_address(start + int(index) * page).value  # a read maps the page
                    touched += 1
    except OSError:
        return touched
    return touched


def _as_if_fresh(job: TrialJob, server: int) -> None:
    """Undo what being forked from the server changed, so the trial sees what a fresh `python <script>` would."""
    import multiprocessing

    multiprocessing.set_start_method(None, force=True)  # the default method, not the server's forkserver: a
    # multiprocessing lock the trial makes (tqdm's) is then unlinked at once, as in a fresh process, not left to
    # the sweeper's resource tracker
    os.environ.clear()
    os.environ.update(job.env)
    for stream in (sys.stdout, sys.stderr):  # written as it goes, as a fresh trial's are (PYTHONUNBUFFERED): what a
        stream.reconfigure(line_buffering=True, write_through=True)  # trial killed mid-way printed stays in its log
    if job.cores is not None:
        os.sched_setaffinity(0, job.cores)
    threads = job.env.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():  # read by OpenMP when torch was imported, in the server: applied here
        import torch

        torch.set_num_threads(int(threads))
    map_in_shared_pages(server)
    # The server's imports (~700k objects) live as long as the process: moved out of the collector's sight, every
    # full collection in the trial (the preflight's and accelerate's gc.collect, the automatic ones) skips them, and
    # their pages stay shared with the server. Measured on CPU, a tiny-model trial: 4.3 -> 3.3 s.
    gc.freeze()


def run_forked(job: TrialJob) -> None:
    """The target of a trial's process forked from the fork server: run the app as `python <argv>` would, its
    stdout and stderr in the trial's log."""
    server = os.getppid()
    _die_with_sweeper()
    for target, path in ((1, job.log), (2, job.errors or job.log)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, target)
        os.close(fd)
    from memfit.sweep import warm_imports

    if warm_imports.CUDA_INITIALISED:  # pragma: no cover - a library that initialises CUDA on import
        print("an import initialised CUDA in the sweep's fork server: set hydra.sweeper.fork_trials=false", flush=True)
        os._exit(1)
    _as_if_fresh(job, server)
    _run(job.argv)


def main() -> None:
    """`python -m memfit.sweep.trial_process <script> <args>`: a trial in a fresh interpreter (fork_trials=false)."""
    _run(sys.argv[1:])


if __name__ == "__main__":
    main()
