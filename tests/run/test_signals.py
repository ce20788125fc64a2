"""Stop signals end a run as Ctrl-C does; a second one while stopping exits at once."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

SLOW_SHUTDOWN = """
import sys, time
from memfit.run.signals import Stopped, stop_on_signals
try:
    with stop_on_signals():
        print("ready", flush=True)
        time.sleep(60)
except Stopped as stop:
    print(stop, flush=True)
    time.sleep(60)  # a shutdown that takes long: a second signal must not wait for it
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_stop_signal_raises_stopped_and_a_second_one_exits_at_once(sig):
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SHUTDOWN], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(sig)
        assert proc.stdout.readline().strip() == f"stopped by {signal.Signals(sig).name}"
        started = time.monotonic()
        proc.send_signal(sig)
        assert proc.wait(timeout=10) == 128 + sig and time.monotonic() - started < 5
    finally:
        proc.kill()
        proc.wait()


def test_a_stop_signal_that_python_drops_in_a_weakref_callback_is_raised_at_the_next_check():
    """Where the signal lands while the main thread runs a weakref callback (garbage collection: often, in torch code),
    Python prints the Stopped and drops it; raise_if_stopped, called at every training micro-batch, raises it again."""
    import os
    import weakref

    from memfit.run.signals import Stopped, raise_if_stopped, stop_on_signals

    class Held:
        pass

    dropped = []
    with pytest.raises(Stopped) as err, stop_on_signals():
        raise_if_stopped()  # no signal yet: nothing
        held = Held()
        ref = weakref.ref(held, lambda _: os.kill(os.getpid(), signal.SIGTERM))  # the handler runs in the callback
        del held  # the callback runs, its Stopped is dropped ("Exception ignored in ...")
        dropped.append(ref() is None)  # reached: the signal did not stop the block
        raise_if_stopped()
    assert dropped == [True] and err.value.name == "SIGTERM"


def test_a_run_after_a_stopped_one_starts_with_no_stop_pending():
    from memfit.run.signals import raise_if_stopped, stop_on_signals

    with stop_on_signals():
        raise_if_stopped()
