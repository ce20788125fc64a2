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
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)

# the stop signal that arrived, kept after its Stopped was raised: where the main thread was running a finaliser or a
# weakref callback (garbage collection inside torch code, often), Python prints the exception ("Exception ignored in")
# and drops it, and the run would train on to the end (seen in a CI run: the trial ended FINISHED after SIGTERM)
_received: int | None = None


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
    global _received
    stopping, outer = False, _received

    def handler(signum: int, frame: object) -> None:
        global _received
        nonlocal stopping
        if stopping:  # shutting down already (writing to MLflow, stopping trials): the user wants out now
            os._exit(128 + signum)
        stopping, _received = True, signum
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    _received = None
    try:
        yield
    finally:
        if not stopping:  # once stopping, the handler stays: the rest of the shutdown exits at once on a second
            for sig, old in previous.items():
                signal.signal(sig, old)
            _received = outer


def raise_if_stopped() -> None:
    """Raise Stopped for a stop signal whose first Stopped was dropped (see _received): called after each of
    Trainer's accumulation and optimizer steps and between the run's phases, so a dropped one still ends the run
    KILLED, at most one step later."""
    if _received is not None:
        raise Stopped(_received)


def stop_check_callback() -> Any:
    """A TrainerCallback that calls raise_if_stopped after every accumulation and optimizer step (transformers is
    imported only here)."""
    from transformers import TrainerCallback

    class StopCheck(TrainerCallback):
        def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            raise_if_stopped()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            raise_if_stopped()

    return StopCheck()
