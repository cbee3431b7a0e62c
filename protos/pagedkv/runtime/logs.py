"""structlog configuration shared by every pagedkv process.

JSON lines on stderr with ISO timestamps; level from ``--log-level`` (the flag group
:func:`pagedkv.config.flags.add_logging_args`), else ``PAGEDKV_LOG_LEVEL`` (default ``info``). One
event per RPC is logged at debug, state changes at info.
"""

from __future__ import annotations

import logging
import sys

import structlog

from pagedkv.config.envs import env

_configured: str | None = None


def configure_logging(level: str | None = None) -> None:
    """Configure structlog for this process at ``level`` (default ``PAGEDKV_LOG_LEVEL``). Without a
    level, a call after the first is a no-op; with one (a service's ``--log-level``, parsed before
    anything logs), it sets that level for every logger not used yet."""
    global _configured
    if _configured is not None and (level is None or level.upper() == _configured):
        return
    name = (level or env("PAGEDKV_LOG_LEVEL")).upper()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, name, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    _configured = name


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A structlog logger with ``component=name``; it takes the configuration in place when it first
    logs (a module-level logger thus follows a ``--log-level`` parsed after its import)."""
    configure_logging()
    return structlog.get_logger(component=name)
