"""A worker's disk-tier writes fail with ENOSPC (a full file system).

With ``PAGEDKV_TEST_DISK_FAULT=enospc`` (read at each write; unset: no fault), every slot write
fails after its payload, before its header: the write is reported as failed ("io") and nothing is
committed.
"""

from __future__ import annotations

import errno
import os

#: Which fault (read at each write).
FAULT_ENV = "PAGEDKV_TEST_DISK_FAULT"


def fault(*, slot) -> None:
    if os.environ.get(FAULT_ENV, "") == "enospc":
        raise OSError(errno.ENOSPC, "No space left on device (test hook)")


HOOKS = {"disk.between_payload_and_header": fault}
