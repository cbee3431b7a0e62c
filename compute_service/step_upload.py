"""A step's metadata to the device in one copy.

A step's model inputs are seven small arrays built on the host (token ids, positions, slot
mapping, block tables, query start locations, sequence lengths, logits indices). Seven separate
``tensor.to("cuda")`` calls of pageable memory are seven synchronous copies, each through a
driver staging buffer. :class:`StepUpload` packs them into one page-locked host buffer, each at a
16-byte aligned offset, queues one non-blocking copy on the current stream, and hands out views of
the device buffer in each array's dtype and shape (vLLM's persistent input batch does the same
with its pinned CPU tensors).

The host buffer is reused by the next step. That is safe because the worker fences every step
(compute_service.device_sync.StepFence) before it returns, so the copy has completed before the
buffer is written again.

On a CPU device the arrays are wrapped as tensors without a copy, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

#: Byte alignment of each array in the packed buffer (the widest dtype's, and a cache line's quarter).
ALIGN = 16


class StepUpload:
    """Moves a step's host arrays to ``device``: on CUDA in one packed copy, elsewhere without a copy.

    Args:
        device: the model's device.
        staged: pack and copy even on a CPU device (tests of the packing).
    """

    def __init__(self, device: torch.device | str, staged: bool | None = None):
        self.device = torch.device(device)
        self.staged = self.device.type == "cuda" if staged is None else staged
        self._host: torch.Tensor | None = None  # uint8, page-locked on CUDA, grown as needed

    def __call__(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """The arrays as tensors on the device, in order, each with its dtype and shape.

        arrays: numpy arrays of int32 or int64 (any shape; made contiguous).
        """
        arrays = [np.ascontiguousarray(a) for a in arrays]
        if not self.staged:
            return [torch.from_numpy(a).to(self.device) for a in arrays]
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // ALIGN) * ALIGN
        host = self._buffer(max(total, ALIGN))
        view = host.numpy()
        for a, off in zip(arrays, offsets):
            view[off:off + a.nbytes] = a.reshape(-1).view(np.uint8)
        # A CPU device (staged tests): a copy of its own, since the host buffer is reused.
        dev = host[:total].to(self.device, non_blocking=True) if self.device.type != "cpu" else host[:total].clone()
        out = []
        for a, off in zip(arrays, offsets):
            out.append(dev[off:off + a.nbytes].view(torch.from_numpy(a).dtype).view(a.shape))
        return out

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if self._host is None or self._host.numel() < nbytes:
            size = 1 << (nbytes - 1).bit_length()  # powers of two: a growing batch reallocates rarely
            self._host = torch.empty(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        return self._host


__all__ = ["ALIGN", "StepUpload"]
