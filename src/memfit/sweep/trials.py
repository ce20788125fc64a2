"""Running trials: each in a process of its own (default: forked from the sweep's fork server, which imported the
libraries once; or a fresh interpreter), or in the sweeper's process through Hydra's launcher (isolation=launcher).

A process per trial is what makes measured peaks independent of trial order on a GPU: nothing of the previous
trial's allocator cache, fragmentation, CUDA context or allocator cap survives into the next. It also lets a trial
die (OOM-killer, SIGKILL, a hang past the timeout) without taking the sweep with it. The trial writes report.json
into its own directory; its absence, with the exit status, says how it died. A trial is killed with the sweeper
(on Linux, PR_SET_PDEATHSIG for a fresh one; a forked one watches the sweeper), so an interrupted sweep leaves no
orphan training on the device.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("memfit.sweep")


@dataclass
class TrialResult:
    report: dict[str, Any] | None
    error: str | None  # why there is no report (or the run's own reason when it failed)
    seconds: float


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


STOP_GRACE_S = 30.0  # a stopped sweep's running trial gets this long to end its MLflow run before it is killed

# every fresh trial process dies with the sweeper, where the OS lets us ask for it (a forked one watches for it)
CHILD_SETUP = _die_with_parent if sys.platform.startswith("linux") else None


def _last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:500] if lines else ""


def _why(returncode: int | None, timed_out: bool, timeout_s: float | None, log_path: Path) -> str:
    if timed_out:
        return f"timeout: still running after {timeout_s:g} s, killed"
    if returncode is not None and returncode < 0:
        return f"killed: by {signal.Signals(-returncode).name}"
    return f"failed: exit {returncode}: {_last_line(log_path)}"


def cpu_place(cpu: int, sysfs: Path = Path("/sys/devices/system/cpu")) -> tuple[int, int, int]:
    """(NUMA node, socket, physical core) of a logical CPU, from sysfs; (0, 0, cpu) where it does not say."""
    top = sysfs / f"cpu{cpu}"
    node = next((int(p.name[4:]) for p in top.glob("node[0-9]*")), 0)
    try:
        socket = int((top / "topology" / "physical_package_id").read_text())
        core = int((top / "topology" / "core_id").read_text())
    except (OSError, ValueError):
        return (node, 0, cpu)
    return (node, socket, core)


def core_sets(
    count: int, cpus: Iterable[int] | None = None, place: Callable[[int], tuple[int, int, int]] = cpu_place
) -> list[list[int]] | None:
    """The cores this process may use (or `cpus`), cut into `count` disjoint sets, one per device; None where the
    OS cannot pin (no sched_setaffinity) or there are fewer cores than devices.

    A set takes whole physical cores, neighbours on one NUMA node where it can: two hyperthreads of one core
    share its execution units, so a split by CPU number alone (0-15 | 16-31, where cpu N and N+16 are often
    siblings) would put two devices' trials on the same cores."""
    if not hasattr(os, "sched_setaffinity") or count < 1:
        return None
    physical: dict[tuple[int, int, int], list[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0) if cpus is None else cpus):
        physical.setdefault(place(cpu), []).append(cpu)
    groups = [physical[key] for key in sorted(physical)]
    if len(groups) < count:  # fewer physical cores than devices: split the logical CPUs instead
        groups = [[cpu] for group in groups for cpu in group]
    share = len(groups) // count
    if not share:
        return None
    return [sorted(cpu for group in groups[i * share : (i + 1) * share] for cpu in group) for i in range(count)]


def _pinned_setup(cores: list[int]) -> Any:
    def setup() -> None:  # pragma: no cover - runs in the child between fork and exec
        if CHILD_SETUP is not None:
            CHILD_SETUP()
        os.sched_setaffinity(0, cores)

    return setup


class ForkedTrial:
    """A trial's process forked from the fork server (memfit.sweep.trial_process), answering as subprocess.Popen
    does: pid, poll, wait (raising TimeoutExpired), terminate, kill, returncode."""

    def __init__(self, process: Any):
        self.process = process

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired("trial", timeout)
        return self.process.exitcode

    def terminate(self) -> None:
        self.process.terminate()

    def kill(self) -> None:
        self.process.kill()


@functools.cache
def _fork_server() -> Any:
    """multiprocessing's fork server, its imports those of memfit.sweep.warm_imports (one per sweeper process)."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["memfit.sweep.warm_imports"])
    return context


def fork_process(job: Any, name: str) -> ForkedTrial:
    """Start `job` (a memfit.sweep.trial_process.TrialJob) in a process forked from this process's fork server,
    started on first use: `python <job.argv>` as a fresh process would run it, less the imports."""
    from memfit.sweep.trial_process import run_forked

    process = _fork_server().Process(target=run_forked, args=(job,), name=name)
    process.start()
    return ForkedTrial(process)


class ProcessTrials:
    """`python <app> <overrides> hydra.run.dir=<sweep dir>/<job>` per trial, in its own process; up to len(batch)
    at once. With `fork` (hydra.sweeper.fork_trials), the process is forked from the fork server, whose imports
    the sweep paid once; without, it is a new interpreter (memfit.sweep.trial_process)."""

    def __init__(
        self, app_argv: list[str], sweep_dir: Path, timeout_s: float | None, env: dict[str, str], fork: bool = True
    ):
        self.app_argv, self.sweep_dir, self.timeout_s, self.env = app_argv, sweep_dir, timeout_s, env
        self.fork = fork
        self.cores: list[int] | None = None
        self.running: list[Any] = []  # trial processes launched and not yet waited for

    def pinned(self, device: str, cores: list[int] | None = None) -> ProcessTrials:
        """The same trials, their processes seeing only GPU `device` (CUDA_VISIBLE_DEVICES). With `cores`, they run
        only on those (sched_setaffinity), with as many OpenMP threads (unless the user set OMP_NUM_THREADS).

        Without `cores`, concurrent trials keep torch's default of one thread per core each: on a two-GPU host, two
        trials at once took 29.5 s with it and 32.7 s with half the threads each, 33.5 s pinned to halves
        (benchmarks/results/multi_gpu_contention.json); the model build, on the CPU, lost most."""
        env = {**self.env, "CUDA_VISIBLE_DEVICES": device}
        if cores and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(len(cores))
        trials = ProcessTrials(self.app_argv, self.sweep_dir, self.timeout_s, env, self.fork)
        trials.cores = cores or None
        return trials

    def start(self) -> None:
        """Start the fork server now, so that its imports run while the sweeper opens the study and screens the data
        (nothing to start for fresh processes)."""
        if self.fork:
            from multiprocessing import forkserver

            _fork_server()
            forkserver.ensure_running()

    def close(self) -> None:
        """Trials still running (the sweep was stopped) get SIGTERM, so each ends its MLflow run KILLED with its
        metrics flushed; a trial still running STOP_GRACE_S later is killed."""
        for proc in self.running:
            proc.terminate()
        for proc in self.running:
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.running = []

    # --- trials --------------------------------------------------------------------------------------------------
    def launch(self, batch: list[list[str]], first_job: int) -> list[TrialResult]:
        """Run the batch's trials at once and wait for them."""
        started = []
        for offset, overrides in enumerate(batch):
            job_dir = self.sweep_dir / str(first_job + offset)
            job_dir.mkdir(parents=True, exist_ok=True)
            (job_dir / "report.json").unlink(missing_ok=True)
            argv = [*overrides, f"hydra.run.dir={job_dir}"]
            proc = self._start(argv, job_dir / "trial.log")
            started.append((proc, job_dir, time.monotonic()))
            self.running.append(proc)
        results = [self._wait(proc, job_dir, start) for proc, job_dir, start in started]
        self.running = [proc for proc in self.running if proc.poll() is None]
        return results

    def _start(self, overrides: list[str], log_path: Path) -> Any:
        script_argv = [*self.app_argv[1:], *overrides]
        if self.fork:
            from memfit.sweep.trial_process import TrialJob

            log_path.write_text("")  # the trial appends to its own, fresh log
            job = TrialJob(script_argv, str(log_path), dict(self.env), self.cores)
            return fork_process(job, f"trial {log_path.parent.name}")
        setup = _pinned_setup(self.cores) if self.cores else CHILD_SETUP
        with open(log_path, "w") as log_file:  # the child holds its own descriptor
            return subprocess.Popen(
                [self.app_argv[0], "-m", "memfit.sweep.trial_process", *script_argv],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=self.env,
                preexec_fn=setup,
            )

    def _wait(self, proc: Any, job_dir: Path, start: float) -> TrialResult:
        timed_out = False
        try:  # returns as the process ends (no polling interval lost per trial)
            proc.wait(timeout=self.timeout_s - (time.monotonic() - start) if self.timeout_s else None)
        except subprocess.TimeoutExpired:
            proc.kill()
            timed_out = True
            proc.wait()
        seconds = time.monotonic() - start
        report_path = job_dir / "report.json"
        if report_path.exists() and not timed_out:
            report = json.loads(report_path.read_text())
            return TrialResult(report, report.get("reason"), seconds)
        return TrialResult(None, _why(proc.returncode, timed_out, self.timeout_s, job_dir / "trial.log"), seconds)


class InProcessTrials:
    """Hydra's configured launcher (isolation=launcher): the basic one runs trials one after another in this
    process; hydra-submitit-launcher submits each to Slurm (submitit_slurm) or to local processes (submitit_local)."""

    def __init__(self, launcher: Any):
        self.launcher = launcher

    def launch(self, batch: list[list[str]], first_job: int) -> list[TrialResult]:
        from hydra.core.utils import JobStatus

        start = time.monotonic()
        results = []
        for job_return in self.launcher.launch(batch, initial_job_idx=first_job):
            seconds = (time.monotonic() - start) / len(batch)
            if job_return.status == JobStatus.COMPLETED:
                report = job_return.return_value
                results.append(TrialResult(report, (report or {}).get("reason"), seconds))
            else:
                try:
                    _ = job_return.return_value  # a failed job's return_value raises the job's exception
                except Exception as error:  # noqa: BLE001 - a failed trial is a result
                    results.append(TrialResult(None, f"failed: {type(error).__name__}: {error}", seconds))
        return results

    def start(self) -> None:
        """The launcher starts its own processes (or none): nothing to start ahead."""

    def close(self) -> None:
        """Nothing of this runner outlives a launch."""


def app_argv(config: Any) -> list[str]:
    """The command that starts this Hydra app again, for one trial: same script, same config name and dirs."""
    script = Path(config.hydra.runtime.cwd) / sys.argv[0] if not Path(sys.argv[0]).is_absolute() else sys.argv[0]
    argv = [sys.executable, str(script), "--config-name", config.hydra.job.config_name]
    for source in config.hydra.runtime.config_sources:
        if source.provider == "command-line" and source.schema == "file":
            argv += ["--config-dir", source.path]
    return argv


def trial_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("HYDRA_FULL_ERROR", None)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
