"""Progress of a model load, by bytes read from the checkpoint.

On a terminal, a rich progress bar on stderr (transient: it disappears when the load ends); when
stderr is not a terminal (a container, a log file), a structlog `loading_weights` event at the
start and then at most every `LOG_EVERY_SECONDS` seconds instead. Fed by the weight source's read hooks
(`compute_service.weights.checkpoint.WeightSource.hooks`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from compute_service.weights.checkpoint import WeightSource
from pagedkv.runtime.logs import get_logger

log = get_logger("compute_service")

#: Seconds between two `loading_weights` log events when stderr is not a terminal.
LOG_EVERY_SECONDS = 5.0


@contextmanager
def load_progress(source: WeightSource, model: str) -> Iterator[None]:
    """Show the progress of reading `source` (every tensor once) while the block runs.

    Args:
        source: the checkpoint being read; its hooks report each tensor's stored bytes.
        model: the model's name, shown with the bar or logged with each event.
    """
    total = source.stored_nbytes()
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        with Progress(
            TextColumn("loading {task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
            console=Console(file=sys.stderr), transient=True,
        ) as bar:  # fmt: skip
            task = bar.add_task(model, total=total)

            def hook(name: str, nbytes: int) -> None:
                bar.advance(task, nbytes)

            with _hooked(source, hook):
                yield
        return

    done, last = 0, time.monotonic()
    log.info("loading_weights", model=model, read_bytes=0, total_bytes=total, percent=0.0)

    def hook(name: str, nbytes: int) -> None:
        nonlocal done, last
        done += nbytes
        now = time.monotonic()
        if now - last >= LOG_EVERY_SECONDS:
            last = now
            log.info("loading_weights", model=model, read_bytes=done, total_bytes=total,
                     percent=round(100 * done / max(total, 1), 1))

    with _hooked(source, hook):
        yield


@contextmanager
def _hooked(source: WeightSource, hook) -> Iterator[None]:
    source.hooks.append(hook)
    try:
        yield
    finally:
        source.hooks.remove(hook)
