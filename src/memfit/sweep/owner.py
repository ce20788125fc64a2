"""Which process owns a running trial (host and pid), so that a trial whose process died can be told apart from
one still running when a sweep resumes."""

from __future__ import annotations

import os
import socket

HOST = socket.gethostname()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
