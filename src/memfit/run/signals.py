"""Stopping on a signal: SIGTERM (Slurm preemption, `docker stop`, systemd), SIGHUP (a closed terminal) and SIGINT
(Ctrl-C) all end a run or a sweep the way Ctrl-C does, as a `Stopped` exception in the main thread, so that the
MLflow run is ended KILLED with the signal as its reason and buffered metrics are flushed. A second signal while
stopping exits at once, with the shell's code for it (128 + the signal's number)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class Stopped(KeyboardInterrupt):
    """A stop signal arrived: raised where the main thread was, like KeyboardInterrupt (which it is)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """While the block runs (in the main thread), the stop signals raise Stopped; a second one exits at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopping = False

    def handler(signum: int, frame: object) -> None:
        nonlocal stopping
        if stopping:  # shutting down already (writing to MLflow, stopping trials): the user wants out now
            os._exit(128 + signum)
        stopping = True
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        if not stopping:  # once stopping, the handler stays: the rest of the shutdown exits at once on a second
            for sig, old in previous.items():
                signal.signal(sig, old)
