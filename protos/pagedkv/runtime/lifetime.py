"""A child service stops when the process that started it is gone, even after a SIGKILL.

``pagedkv serve`` (its embedded memory service and worker) and the supervisor of ``pagedkv up``
start their services as child processes with ``PAGEDKV_PARENT_PID`` set to their own pid. A
SIGKILLed parent cannot stop them, so each child watches: once its parent process is another
(the orphan was re-parented to init or a subreaper), it sends itself SIGTERM and shuts down
gracefully. Polling ``getppid()`` works for any parent thread and on any POSIX system, unlike
Linux's ``PR_SET_PDEATHSIG``, which fires when the *thread* that forked the child ends.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from pagedkv.config import env
from pagedkv.runtime.logs import get_logger

log = get_logger("lifetime")

#: Seconds between two looks at the parent.
POLL_INTERVAL = 0.5


def child_env(env_vars: dict[str, str] | None = None) -> dict[str, str]:
    """``env_vars`` (default: this process's environment) with ``PAGEDKV_PARENT_PID`` set to this
    process: the environment of a service that must stop when this process is gone."""
    return {**(os.environ if env_vars is None else env_vars), "PAGEDKV_PARENT_PID": str(os.getpid())}


def watch_parent() -> threading.Thread | None:
    """When ``PAGEDKV_PARENT_PID`` is set: a daemon thread that sends this process SIGTERM once its
    parent is not that process any more (at once when it already is not). None when unset.

    Raises:
        ValueError: ``PAGEDKV_PARENT_PID`` is not an integer.
    """
    parent = env("PAGEDKV_PARENT_PID")
    if parent is None:
        return None

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_INTERVAL)
        log.warning("parent_gone", parent_pid=parent, pid=os.getpid())
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread
