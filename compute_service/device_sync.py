"""The worker and its device's asynchronous work: which GPU a thread launches on, when a step's
writes are done, how long its forward took, and the errors that end a worker.

On CUDA every kernel and copy of a step is queued on the pool device's current stream and runs
later; the step returns to Python long before its writes land. Three rules follow:

- **Launch on the pool's GPU.** Triton launches on the calling thread's current device, which a
  thread does not inherit; :func:`bind_compute_thread` sets it at the start of every step (the
  pool may have been remapped onto another GPU since the last one).
- **Sign after the writes.** A receipt makes positions computed: they enter the prefix cache and
  may be read by another worker, exported over NIXL or handed to a new owner. :class:`StepFence`
  records an event after the step's last write and :meth:`StepFence.wait` blocks on it; the
  worker signs no receipt before that returns. The forward is timed by the same events, not by
  the wall clock around its launches.
- **Close after the device.** A mapping (a CUDA IPC import, a host range page-locked with
  ``cudaHostRegister``) is closed only once nothing queued can still touch it
  (:func:`synchronize`).

A sticky CUDA error (an illegal address, a device-side assert, a launch failure, an ECC error)
poisons the process's CUDA context: every later call fails the same way. :func:`is_fatal_device_error`
recognises one; the worker then reports NOT_SERVING and exits, so its supervisor starts a fresh
process and the engine fails its sequences over (DESIGN: a failure costs the work in flight).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

#: Phrases of CUDA's sticky errors (cudaGetErrorString) as torch and CuPy report them.
_STICKY = ("illegal memory access", "illegal instruction", "misaligned address", "unspecified launch failure",
           "device-side assert", "uncorrectable ecc", "hardware stack error", "invalid program counter",
           "cudaerrorlaunchfailure", "cudaerrorillegaladdress", "cudaerrorassert", "cudaerrorecc")


def bind_compute_thread(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (Triton's launches and torch's
    default stream follow it); nothing on a CPU device."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def synchronize(device: torch.device) -> None:
    """Wait until every kernel and copy queued on ``device`` has completed (nothing on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def is_fatal_device_error(error: BaseException) -> bool:
    """Whether ``error`` is a sticky CUDA error, after which this process's CUDA context is unusable.

    Out-of-memory and invalid-argument errors are not sticky: the step fails, the worker goes on.
    """
    text = str(error).lower()
    return "cuda" in text and any(p in text for p in _STICKY)


class _WallEvent:
    """A stand-in for ``torch.cuda.Event`` on a CPU device, where work is done when the call returns."""

    def __init__(self) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _WallEvent) -> float:
        return (end.at - self.at) * 1e3


class StepFence:
    """Times one step's forward and fences the end of its device work.

    ``begin()`` before the forward and ``end()`` after the step's last write (the forward writes
    K/V; the grant copies are queued before it on the same stream); ``wait()`` blocks until
    everything queued up to ``end()`` has completed and returns the forward's seconds.

    Args:
        device: the pool's device; on CUDA, events on its current stream, elsewhere the wall clock.
        event: makes an event (``record()``, ``synchronize()``, ``elapsed_time(end)`` in ms):
            ``torch.cuda.Event(enable_timing=True)`` on CUDA by default.
    """

    def __init__(self, device: torch.device, event: Callable[[], object] | None = None) -> None:
        if event is None:
            event = (lambda: torch.cuda.Event(enable_timing=True)) if device.type == "cuda" else _WallEvent
        self._event = event
        self._start = self._end = None

    def begin(self) -> None:
        self._start = self._event()
        self._start.record()
        self._end = None

    def end(self) -> None:
        self._end = self._event()
        self._end.record()

    def wait(self) -> float:
        """Block until the work recorded before :meth:`end` is complete; returns the seconds between
        :meth:`begin` and :meth:`end` on the device (0.0 if the step had no forward)."""
        if self._start is None or self._end is None:
            return 0.0
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1e3


__all__ = ["StepFence", "bind_compute_thread", "is_fatal_device_error", "synchronize"]
