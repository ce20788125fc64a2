"""Lock files that name their holder (host and pid), so that one whose process died is taken over, not waited on.

Used where two processes would do the same costly work at once: two trials of a multi-GPU sweep, started together,
each calibrating the same memory model.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

HOST = socket.gethostname()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _held_by_another(path: Path, max_age_s: float) -> bool:
    """Whether the lock at `path` belongs to a live process: one on this host that still runs, or one on another
    host (which cannot be asked) that took it less than `max_age_s` ago."""
    try:
        host, pid = path.read_text().split()
        age = time.time() - path.stat().st_mtime
    except (OSError, ValueError):  # gone meanwhile, or half written: ask again
        return path.exists()
    if host == HOST:
        return pid_alive(int(pid))
    return age < max_age_s


@contextlib.contextmanager
def exclusive(path: Path, max_age_s: float = 3600.0) -> Iterator[bool]:
    """Hold the lock at `path` for the block, yielding True; yield False at once (without waiting) where another
    live process holds it. A lock whose holder died is taken over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):  # a second try after clearing a dead holder's lock
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            if _held_by_another(path, max_age_s):
                yield False
                return
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as lock:
            lock.write(f"{HOST} {os.getpid()}")
        try:
            yield True
        finally:
            path.unlink(missing_ok=True)
        return
    yield False  # another process took the dead holder's lock first
