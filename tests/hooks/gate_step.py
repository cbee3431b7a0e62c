"""A worker waits inside its step, after its grant check, while a gate file exists.

``PAGEDKV_TEST_GATE_FILE`` names the file. At ``worker.step_checked``, while it exists, the step
waits (polling every 10 ms) before it copies or writes anything; it appends ``paused <pid>`` to
``<gate>.log`` when it starts waiting and ``resumed <pid>`` when the gate is gone, so a test sees
the worker woke up and went on writing.
"""

from __future__ import annotations

import os
import time

#: The gate file (read at each step; unset: no gate).
GATE_ENV = "PAGEDKV_TEST_GATE_FILE"


def wait_at_gate(*, request) -> None:
    """Wait while the gate file exists."""
    gate = os.environ.get(GATE_ENV)
    if not gate or not os.path.exists(gate):
        return
    with open(gate + ".log", "a") as f:
        f.write(f"paused {os.getpid()}\n")
    while os.path.exists(gate):
        time.sleep(0.01)
    with open(gate + ".log", "a") as f:
        f.write(f"resumed {os.getpid()}\n")


HOOKS = {"worker.step_checked": wait_at_gate}
