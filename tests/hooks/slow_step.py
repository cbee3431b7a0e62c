"""A worker pauses inside each step: ``PAGEDKV_TEST_SLOW_STEP_S`` seconds (default 1) at
``worker.step_begin``, under the worker's step lock.

With ``PAGEDKV_TEST_SLOW_STEP_MARKER`` naming a file, each step appends two lines to it:
``begin <pid> <step>`` before the pause and ``end <pid> <step> <seconds paused>`` after it (the
pause as measured here), so a test sees the hook ran inside the process and how long it held the step.
"""

from __future__ import annotations

import itertools
import os
import time

#: Seconds each step pauses (a float; read at each step).
SECONDS_ENV = "PAGEDKV_TEST_SLOW_STEP_S"
#: A file each step appends its begin and end lines to (read at each step; unset: none).
MARKER_ENV = "PAGEDKV_TEST_SLOW_STEP_MARKER"

_steps = itertools.count()


def _mark(line: str) -> None:
    path = os.environ.get(MARKER_ENV)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def pause(*, request) -> None:
    """Sleep ``PAGEDKV_TEST_SLOW_STEP_S`` seconds, between a begin and an end line in the marker file."""
    step, pid = next(_steps), os.getpid()
    _mark(f"begin {pid} {step}")
    start = time.monotonic()
    time.sleep(float(os.environ.get(SECONDS_ENV, "1")))
    _mark(f"end {pid} {step} {time.monotonic() - start:.6f}")


HOOKS = {"worker.step_begin": pause}
