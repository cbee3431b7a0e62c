"""structlog configuration shared by every pagedkv process.

JSON lines on stderr with ISO timestamps; level from ``PAGEDKV_LOG_LEVEL``
(default ``info``). One event per RPC is logged at debug, state changes at info.
"""

from __future__ import annotations

import logging
import sys

import structlog

from pagedkv.config.envs import env

_configured = False


def configure_logging(level: str | None = None) -> None:
    """Configure structlog once per process (later calls are no-ops)."""
    global _configured
    if _configured:
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
    _configured = True


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A structlog logger bound with ``component=name``."""
    configure_logging()
    return structlog.get_logger().bind(component=name)
