"""Which process owns a run (host and pid), so that a run whose process the OS killed can be told apart from one
still running, and ended as it could not end itself."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

log = logging.getLogger("memfit.tracking")

HOST = socket.gethostname()  # with a pid, which process owns a running run or trial (memfit.owner_pid)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


OWNER_TAG = "memfit.owner"  # host:pid of the process that runs the run


def end_orphans(client: Any, experiment: str) -> list[str]:
    """Runs left RUNNING by a process of this host that is gone (the OS's OOM killer, SIGKILL: nothing could end
    them) are ended KILLED, saying so; the ids of those ended. A sweep's trials are left to their sweeper, which
    ends them with what it knows (a timeout, a signal) and queues them again."""
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return []
    query = f"attributes.status = 'RUNNING' and tags.`{OWNER_TAG}` LIKE '{HOST}:%'"
    ended = []
    for orphan in client.search_runs([found.experiment_id], query, max_results=1000):
        pid = int(orphan.data.tags[OWNER_TAG].rsplit(":", 1)[1])
        if pid_alive(pid) or "mlflow.parentRunId" in orphan.data.tags:
            continue
        client.set_tag(
            orphan.info.run_id,
            "memfit.reason",
            f"killed: its process ({pid}) ended without ending it "
            "(the OS's out-of-memory killer or SIGKILL); a checkpointed run continues with trainer.resume=true",
        )
        client.set_terminated(orphan.info.run_id, status="KILLED")
        ended.append(orphan.info.run_id)
    if ended:
        log.warning(
            "ended %d MLflow run(s) KILLED whose process on this host was gone: %s", len(ended), ", ".join(ended)
        )
    return ended
