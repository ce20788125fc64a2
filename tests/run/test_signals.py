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
