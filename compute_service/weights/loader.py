"""Turn a checkpoint into a model's tensors and projections, one at a time, in bounded memory.

The model (`compute_service.model.llama`) asks for each tensor or fused projection in turn; nothing is
read before it is needed and no float32 copy of the whole checkpoint is ever made. Projections
that oneDNN packs (`compute_service.model.linear.Linear`) are staged in one reused scratch buffer.
"""

from __future__ import annotations

import torch

from compute_service.model.linear import Linear
from compute_service.weights.checkpoint import WeightSource


class WeightLoader:
    """Builds a model's tensors and projections from a `WeightSource`, one at a time, on the
    model's device and dtype (see `WeightSource.fetch`).

    Args:
        source: the checkpoint, in our naming.
        device, dtype: where and in what the model holds its weights.
        packed: whether projections are packed (`compute_service.model.linear.packed_linear_wanted`).
        scratch_numel: elements of the largest projection weight the model has.

    A projection that oneDNN packs is staged in one scratch buffer, reused for every projection
    and sized for the largest (`scratch_numel` elements): only the packed copy is allocated per
    projection, so host memory peaks at the final weights plus that buffer (no per-tensor
    allocations whose freed memory the C allocator would keep).
    """

    def __init__(self, source: WeightSource, device: torch.device, dtype: torch.dtype, packed: bool,
                 scratch_numel: int) -> None:
        self.source, self.device, self.dtype, self.packed = source, device, dtype, packed
        self.scratch_numel = scratch_numel
        self._scratch: torch.Tensor | None = None

    def __call__(self, names: list[str]) -> torch.Tensor:
        """`names` concatenated along dim 0, a tensor of its own."""
        return self.source.fetch(names, self.device, self.dtype)

    def linear(self, names: list[str], bias_names: list[str] = ()) -> Linear:
        """The projection whose weight is `names` concatenated along dim 0 (W [out, in]), with the
        biases `bias_names` concatenated alike when any is present (zeros for an absent one)."""
        rows = [self.source.shape(n)[0] for n in names]
        bias = None
        if any(n in self.source for n in bias_names):
            bias = self.source.fetch(bias_names, self.device, self.dtype, zero_rows=rows)
        if not self.packed:
            return Linear(self(names), False, bias)
        shape = (sum(rows), self.source.shape(names[0])[1])
        if self._scratch is None:
            self._scratch = torch.empty(self.scratch_numel, dtype=self.dtype, device=self.device)
        staged = self.source.fetch(names, self.device, self.dtype, out=self._scratch[: shape[0] * shape[1]].view(shape))
        return Linear(staged, True, bias)

    def release(self) -> None:
        """Free the scratch buffer."""
        self._scratch = None
