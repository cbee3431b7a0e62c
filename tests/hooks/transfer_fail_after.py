"""A worker's node transfers fail after k block pairs: ``PAGEDKV_TRANSFER_FAIL_AFTER=k``.

At ``transfer.read_blocks``: a read given more than k pairs transfers only its first k and then
raises ``TransferError(blocks_done=k)``; a read of at most k pairs runs normally; unset or empty,
every read runs normally.
"""

from __future__ import annotations

import os

#: The number of block pairs a read transfers before it fails (read at each call).
ENV = "PAGEDKV_TRANSFER_FAIL_AFTER"


def read_limit(*, agent: str, source: str, pairs: list[tuple[int, int]]) -> int | None:
    """k from ``PAGEDKV_TRANSFER_FAIL_AFTER``, or None (no fault).

    Raises:
        ValueError: the variable is not a count >= 0.
    """
    value = os.environ.get(ENV, "")
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"{ENV}={value!r}: need a count of block pairs >= 0")
    return int(value)


HOOKS = {"transfer.read_blocks": read_limit}
