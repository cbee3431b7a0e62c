"""Test hooks: named points in production code where a test may pause, slow or fail a process.

Production modules call :func:`call` at the points of :data:`POINTS` (a worker's step, a node
transfer's read, a tier copy's block); with no hook installed, a call is one check of an empty
dict and returns None. A test installs hook modules into a service process by naming them in
``PAGEDKV_TEST_HOOKS`` (comma-separated; a dotted module name such as ``tests.hooks.slow_step``,
importable from the process's working folder or ``PYTHONPATH``, or a path to a ``.py`` file):
each service's ``main`` calls :func:`install_from_env` once at start. Within one process a test
uses :func:`installed` or :func:`register`.

A hook module holds ``HOOKS``, a dict from point name to a function called with the point's
keyword arguments. Fault injection lives there, never in production code: a hook may sleep
(pause a worker inside a step), raise (stop a copy half-way), or return a value the point
documents (the first non-None result of a point's hooks is :func:`call`'s result).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

from pagedkv.config import env_text

#: The environment variable naming the hook modules a process installs at start (test-only).
ENV = "PAGEDKV_TEST_HOOKS"

#: Every hook point: name -> when it is called, its keyword arguments, and what a result means.
POINTS: dict[str, str] = {
    "worker.step_begin": "a worker's step starts, under the worker's step lock (one step at a time): "
                         "request (compute.v1 StepRequest). A hook that sleeps pauses the worker inside the step.",
    "worker.step_checked": "a worker's step has checked its grants and not yet copied or written anything: "
                           "request. A hook that sleeps here is a worker that wakes up mid-step after the "
                           "scheduler failed over from it.",
    "worker.step_end": "a worker's step ends, its response built, still under the step lock: request, "
                       "response (compute.v1 StepResponse).",
    "transfer.read_blocks": "a node transfer's read (compute_service.transfer_agent.TransferAgent.read_blocks), "
                            "its pairs checked, before any byte moves: agent (the reader's name), source (the "
                            "peer's name), pairs (list of (source block, local block)). An int k: read only the "
                            "first k pairs, then raise TransferError(blocks_done=k).",
    "disk.between_payload_and_header": "a disk-tier slot write (compute_service.disk_io.SlabIO.write) has "
                                       "written the block's bytes and not yet its header: slot. A hook that "
                                       "raises (or a SIGKILL here) leaves a torn slot, whose old header then "
                                       "fails its checksum at the next read.",
    "tier.copy_block": "before each whole-block copy between the pool and a tier (kernels.copy_blocks_between; "
                       "with a hook installed the copies go block by block): src, dst (the tensors), src_block, "
                       "dst_block, index (of this block in the call), count (blocks in the call). A hook that "
                       "raises stops the copy there: the earlier blocks are written, the later ones not.",
}

_hooks: dict[str, list[Callable[..., object]]] = {}  # point -> hooks; empty: every call() returns at once
_from_env: list[str] | None = None  # the modules install_from_env installed (None: not run yet)


def call(point: str, /, **kwargs) -> object | None:
    """Run the hooks of ``point`` with ``kwargs``; the first non-None result, or None (no hooks: at once)."""
    if not _hooks:
        return None
    result = None
    for fn in tuple(_hooks.get(point, ())):
        r = fn(**kwargs)
        if result is None:
            result = r
    return result


def active(point: str) -> bool:
    """Whether a hook is installed at ``point`` (for points that change how they work when one is)."""
    return bool(_hooks) and point in _hooks


def register(point: str, fn: Callable[..., object]) -> Callable[[], None]:
    """Install ``fn`` at ``point``; returns a function that removes it again.

    Raises:
        ValueError: ``point`` is not in :data:`POINTS`.
    """
    if point not in POINTS:
        raise ValueError(f"no test hook point {point!r}; the points are {sorted(POINTS)}")
    _hooks.setdefault(point, []).append(fn)

    def remove() -> None:
        fns = _hooks.get(point, [])
        if fn in fns:
            fns.remove(fn)
        if not fns:
            _hooks.pop(point, None)

    return remove


def load(name: str) -> ModuleType:
    """The hook module ``name``: a dotted module name, or a path to a ``.py`` file.

    Raises:
        ImportError: no such module or file.
        ValueError: the module has no ``HOOKS`` dict.
    """
    if name.endswith(".py") or os.sep in name:
        path = Path(name).resolve()
        spec = importlib.util.spec_from_file_location(f"pagedkv_test_hook_{path.stem}", path)
        if spec is None or not path.is_file():
            raise ImportError(f"no test hook module at {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(name)
    if not isinstance(getattr(module, "HOOKS", None), dict):
        raise ValueError(f"test hook module {name!r} has no HOOKS dict (point name -> function)")
    return module


def install(names: str) -> list[Callable[[], None]]:
    """Install every hook of the comma-separated hook modules ``names``; returns their removers.

    Raises:
        ImportError, ValueError: as :func:`load`, or a hook at an unknown point (nothing installed then).
    """
    modules = [load(n.strip()) for n in names.split(",") if n.strip()]
    for m in modules:
        unknown = sorted(set(m.HOOKS) - set(POINTS))
        if unknown:
            raise ValueError(f"test hook module {m.__name__!r} hooks unknown points {unknown}")
    return [register(point, fn) for m in modules for point, fn in m.HOOKS.items()]


def install_from_env() -> list[str]:
    """Install the hook modules ``PAGEDKV_TEST_HOOKS`` names (each service's ``main`` calls this once
    at start; later calls do nothing). Returns the names installed (empty: none, as in production).

    Raises:
        ImportError, ValueError: as :func:`install`.
    """
    global _from_env
    if _from_env is not None:
        return []
    spec = env_text(ENV) or ""
    _from_env = [n.strip() for n in spec.split(",") if n.strip()]
    if _from_env:
        install(spec)
        from pagedkv.runtime.logs import get_logger

        get_logger("test_hooks").warning("test_hooks_installed", modules=_from_env)
    return list(_from_env)


@contextlib.contextmanager
def installed(names: str) -> Iterator[None]:
    """Within this process, the hooks of the comma-separated hook modules ``names`` for the block."""
    removers = install(names)
    try:
        yield
    finally:
        for remove in removers:
            remove()


__all__ = ["ENV", "POINTS", "active", "call", "install", "install_from_env", "installed", "load", "register"]
