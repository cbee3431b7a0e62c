"""A worker's disk-tier writes fail: ENOSPC on every write, or a SIGKILL in the middle of one.

Read at each slot write, between the block's payload and its header (unset: no fault):

- ``PAGEDKV_TEST_DISK_FAULT=enospc``: every write fails there with ENOSPC (a full file system): it
  is reported as failed ("io") and nothing is committed;
- ``PAGEDKV_TEST_DISK_KILL_FILE=<path>``: while that file exists, the next write removes it and
  SIGKILLs its process there, leaving a torn slot: new bytes under the slot's old header.
"""

from __future__ import annotations

import errno
import os
import signal

#: The fault to raise, and the file that arms one SIGKILL.
FAULT_ENV, KILL_FILE_ENV = "PAGEDKV_TEST_DISK_FAULT", "PAGEDKV_TEST_DISK_KILL_FILE"


def fault(*, slot) -> None:
    if os.environ.get(FAULT_ENV, "") == "enospc":
        raise OSError(errno.ENOSPC, "No space left on device (test hook)")
    armed = os.environ.get(KILL_FILE_ENV)
    if armed and os.path.exists(armed):
        os.unlink(armed)
        os.kill(os.getpid(), signal.SIGKILL)


HOOKS = {"disk.between_payload_and_header": fault}
