"""The memory service's default limits, and the flag values that set or lift them.

A lease holds at most :data:`DEFAULT_BLOCKS_PER_LEASE` of the pool's blocks unless
``--max-blocks-per-lease`` says otherwise (a count of blocks, or a percent of the pool's), so one
local caller cannot take the whole pool while every other client waits; and one peer (a local
uid, or a client certificate: :mod:`memory_service.peers`) holds at most
:data:`DEFAULT_MAX_LEASES_PER_PEER` live leases (``--max-leases-per-peer``), so it cannot get
round the per-lease share by opening lease after lease. A lease created by the admin (the admin
token, or an admin certificate) is exempt from both: ``pagedkv serve`` creates its lease with the
token when it can read it, and schedules the whole pool. ``0`` or ``none`` lifts a limit.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

#: Share of the pool's blocks one lease may hold unless --max-blocks-per-lease says otherwise.
DEFAULT_BLOCKS_PER_LEASE = "50%"
#: Live leases one peer may hold unless --max-leases-per-peer says otherwise: far more than a
#: scheduler needs (one lease each), far fewer than --max-leases (4,096).
DEFAULT_MAX_LEASES_PER_PEER = 64
#: Words that lift a limit (besides 0).
NO_LIMIT = ("none", "0")


@dataclass(frozen=True, slots=True)
class BlockQuota:
    """``--max-blocks-per-lease``: a count of blocks, a percent of the pool's, or none."""

    #: Blocks (>= 1); None: a percent or none.
    blocks: int | None = None
    #: Percent of the pool's blocks, in (0, 100]; None: a count or none.
    percent: float | None = None

    def resolve(self, num_blocks: int) -> int | None:
        """The quota in block-table entries for a pool of ``num_blocks`` blocks; None: no quota.

        A percent rounds down, to at least one block.
        """
        if self.percent is not None:
            return max(1, math.floor(num_blocks * self.percent / 100 + 1e-9))
        return self.blocks

    def __str__(self) -> str:
        if self.percent is not None:
            return f"{self.percent:g}%"
        return "none" if self.blocks is None else str(self.blocks)


def parse_block_quota(text: str) -> BlockQuota:
    """The value of ``--max-blocks-per-lease``: ``N`` blocks (>= 1), ``P%`` of the pool's blocks
    (0 < P <= 100), or ``0`` / ``none`` for no quota.

    Raises:
        argparse.ArgumentTypeError: anything else, saying what is accepted.
    """
    value = text.strip().lower()
    if value in NO_LIMIT:
        return BlockQuota()
    accepted = "give a count of blocks (e.g. 512), a percent of the pool's blocks (e.g. 50%), or 0 / none for no quota"
    if value.endswith("%"):
        try:
            percent = float(value[:-1])
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a percent; {accepted}") from None
        if not 0 < percent <= 100:  # NaN fails too
            raise argparse.ArgumentTypeError(f"{text!r}: a percent must be in (0, 100]; {accepted}")
        return BlockQuota(percent=percent)
    try:
        blocks = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a block count or a percent; {accepted}") from None
    if blocks < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a block count must be >= 1 (0 for none); {accepted}")
    return BlockQuota(blocks=blocks or None)


def parse_limit(text: str) -> int | None:
    """A count limit such as ``--max-leases-per-peer``: ``N`` >= 1, or ``0`` / ``none`` for no limit (None).

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    value = text.strip().lower()
    if value in NO_LIMIT:
        return None
    try:
        limit = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count; give N >= 1, or 0 / none for no limit") from None
    if limit < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a limit must be >= 1 (0 or none for no limit)")
    return limit or None


__all__ = ["BlockQuota", "DEFAULT_BLOCKS_PER_LEASE", "DEFAULT_MAX_LEASES_PER_PEER", "parse_block_quota",
           "parse_limit"]
