"""Running trials: each in a fresh `python train.py` process (default), or in the sweeper's process through Hydra's
launcher (isolation=none).

A fresh process per trial is what makes measured peaks independent of trial order on a GPU: nothing of the
previous trial's allocator cache, fragmentation, CUDA context or allocator cap survives into the next. It also
lets a trial die (OOM-killer, SIGKILL, a hang past the timeout) without taking the sweep with it. The trial writes
report.json into its own directory; its absence, with the exit status, says how it died. On Linux a trial is
killed with the sweeper (PR_SET_PDEATHSIG), so an interrupted sweep leaves no orphan training on the device.
"""

from __future__ import annotations

import contextlib
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


# beside a trial's log, written by its standby (memfit.sweep.standby): how long its imports took and its trial waited
# for them. Not imported from the standby module: `python -m memfit.sweep.standby` imports this package first, and a
# module the package had already imported would run twice (runpy's RuntimeWarning in every standby.log)
STANDBY_FILE = "standby.json"


@dataclass
class TrialResult:
    report: dict[str, Any] | None
    error: str | None  # why there is no report (or the run's own reason when it failed)
    seconds: float
    standby_wait_s: float | None = None  # how long a prestarted process's imports kept its trial waiting


def standby_hint(waits: list[float], ahead: int) -> str | None:
    """Advice when prestarted processes were often still importing when their trials were due (a slow disk or
    a busy host): start them earlier. None when under a quarter of the trials waited a second or more."""
    waited = [w for w in waits if w >= 1.0]
    if not waited or len(waited) * 4 < len(waits):
        return None
    return (
        f"{len(waited)} of {len(waits)} trials waited for their process's imports ({sum(waited) / len(waited):.1f} s "
        f"on average): hydra.sweeper.prestart_ahead={ahead + 1} starts each one a trial earlier"
    )


def _standby_wait(job_dir: Path) -> float | None:
    """What the trial's standby wrote of its wait (memfit.sweep.standby); None for a process started on demand,
    or one killed before it finished writing."""
    try:
        return float(json.loads((job_dir / STANDBY_FILE).read_text())["waited_s"])
    except (OSError, ValueError, KeyError):
        return None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


STOP_GRACE_S = 30.0  # a stopped sweep's running trial gets this long to end its MLflow run before it is killed

# every trial process (and standby) dies with the sweeper, where the OS lets us ask for it
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


def _give(proc: subprocess.Popen, job: dict[str, Any]) -> bool:
    """Write a trial process its one line (memfit.sweep.standby) and close its input; False if it died first."""
    try:
        proc.stdin.write(json.dumps(job) + "\n")
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        return False
    return True


class ProcessTrials:
    """`python <app> <overrides> hydra.run.dir=<sweep dir>/<job>` per trial; up to len(batch) at once.

    With `prestart`, the process for the next trial is started while the current one runs (memfit.sweep.standby):
    it pays the imports then, and takes its overrides when its trial begins. A standby that died is replaced by a
    process started on demand."""

    def __init__(
        self, app_argv: list[str], sweep_dir: Path, timeout_s: float | None, env: dict[str, str], prestart: bool = False
    ):
        self.app_argv, self.sweep_dir, self.timeout_s, self.env = app_argv, sweep_dir, timeout_s, env
        self.prestart = prestart
        self.standbys: list[subprocess.Popen] = []
        self.running: list[subprocess.Popen] = []  # trial processes launched and not yet waited for
        self.child_setup = CHILD_SETUP  # run in each child before it starts: dies with the sweeper (and pins)

    def pinned(self, device: str, cores: list[int] | None = None) -> ProcessTrials:
        """The same trials, their processes seeing only GPU `device` (CUDA_VISIBLE_DEVICES). With `cores`, they run
        only on those (sched_setaffinity), with as many OpenMP threads (unless the user set OMP_NUM_THREADS).

        Without `cores`, concurrent trials keep torch's default of one thread per core each: on a 2 x H200 host, two
        trials at once took 29.5 s with it and 32.7 s with half the threads each, 33.5 s pinned to halves
        (benchmarks/README.md, multi_gpu_sweep.py contention); the model build, on the CPU, lost most."""
        env = {**self.env, "CUDA_VISIBLE_DEVICES": device}
        if cores and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(len(cores))
        trials = ProcessTrials(self.app_argv, self.sweep_dir, self.timeout_s, env, self.prestart)
        if cores:
            trials.child_setup = _pinned_setup(cores)
        return trials

    # --- standby processes ---------------------------------------------------------------------------------------
    def keep_ready(self, count: int) -> None:
        """Start standby processes until `count` are alive (none unless `prestart`)."""
        self.standbys = [p for p in self.standbys if p.poll() is None]
        if not self.prestart:
            return
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        while len(self.standbys) < count:
            with open(self.sweep_dir / "standby.log", "a") as log_file:  # imports' warnings; the trial has its own
                self.standbys.append(self._spawn(log_file))

    def _spawn(self, output: Any, on_demand: bool = False) -> subprocess.Popen:
        """A trial process (memfit.sweep.standby) writing to `output`, waiting for its overrides on stdin."""
        mode = ["--on-demand"] if on_demand else []
        return subprocess.Popen(
            [self.app_argv[0], "-m", "memfit.sweep.standby", *mode, *self.app_argv[1:]],
            stdin=subprocess.PIPE,
            stdout=output,
            stderr=subprocess.STDOUT,
            env=self.env,
            text=True,
            preexec_fn=self.child_setup,
        )

    def _hand_to_standby(self, overrides: list[str], log_path: Path) -> subprocess.Popen | None:
        """Give a trial to a waiting standby; None where none is alive to take it."""
        while self.standbys:
            proc = self.standbys.pop(0)
            job = {"overrides": overrides, "log": str(log_path), "sent": time.time()}
            if proc.poll() is None and _give(proc, job):
                return proc
        return None

    def close(self) -> None:
        """End the standbys no trial will take, at once: one that has taken no trial holds no device and has
        written nothing, and letting it finish its imports would only spend CPU. Trials still running (the sweep
        was stopped) get SIGTERM, so each ends its MLflow run KILLED with its metrics flushed; a trial still
        running STOP_GRACE_S later is killed."""
        for proc in self.standbys + self.running:
            proc.terminate()
        for proc in self.standbys:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        for proc in self.standbys + self.running:
            try:
                proc.wait(timeout=STOP_GRACE_S if proc in self.running else 10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.standbys, self.running = [], []

    # --- trials --------------------------------------------------------------------------------------------------
    def launch(self, batch: list[list[str]], first_job: int, standby: int = 0) -> list[TrialResult]:
        """Run the batch's trials at once and wait for them; then keep `standby` processes ready for the next."""
        started = []
        for offset, overrides in enumerate(batch):
            job_dir = self.sweep_dir / str(first_job + offset)
            job_dir.mkdir(parents=True, exist_ok=True)
            (job_dir / "report.json").unlink(missing_ok=True)
            (job_dir / STANDBY_FILE).unlink(missing_ok=True)
            argv = [*overrides, f"hydra.run.dir={job_dir}"]
            proc = self._hand_to_standby(argv, job_dir / "trial.log") or self._start(argv, job_dir / "trial.log")
            started.append((proc, job_dir, time.monotonic()))
            self.running.append(proc)
        self.keep_ready(standby)
        results = [self._wait(proc, job_dir, start) for proc, job_dir, start in started]
        self.running = [proc for proc in self.running if proc.poll() is None]
        return results

    def _start(self, argv: list[str], log_path: Path) -> subprocess.Popen:
        """A trial process started on demand: the standby module, given its overrides at once, so that every
        trial runs and ends the same way."""
        with open(log_path, "w") as log_file:  # the child holds its own descriptor
            proc = self._spawn(log_file, on_demand=True)
        _give(proc, {"overrides": argv})  # one that died at once is reported by its exit status
        return proc

    def _wait(self, proc: Any, job_dir: Path, start: float) -> TrialResult:
        timed_out = False
        try:  # returns as the process ends (no polling interval lost per trial)
            proc.wait(timeout=self.timeout_s - (time.monotonic() - start) if self.timeout_s else None)
        except subprocess.TimeoutExpired:
            proc.kill()
            timed_out = True
            proc.wait()
        seconds = time.monotonic() - start
        wait = _standby_wait(job_dir)
        report_path = job_dir / "report.json"
        if report_path.exists() and not timed_out:
            report = json.loads(report_path.read_text())
            return TrialResult(report, report.get("reason"), seconds, wait)
        return TrialResult(None, _why(proc.returncode, timed_out, self.timeout_s, job_dir / "trial.log"), seconds, wait)


class InProcessTrials:
    """Hydra's configured launcher (isolation=launcher): the basic one runs trials one after another in this
    process; hydra-submitit-launcher submits each to Slurm (submitit_slurm) or to local processes (submitit_local)."""

    def __init__(self, launcher: Any):
        self.launcher = launcher

    def launch(self, batch: list[list[str]], first_job: int, standby: int = 0) -> list[TrialResult]:
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

    def keep_ready(self, count: int) -> None:
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
