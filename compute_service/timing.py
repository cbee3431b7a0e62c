"""How long a model step spends writing K/V and in paged attention, measured outside the model.

Kept out of the architecture (gpt-fast's model.py times nothing): `AttentionClock` hooks the
`PagedAttention` module of every layer and sums the wall seconds between entering and leaving
it over one forward, plus what the fused decode layers timed inside their native call
(`model.native_attention_seconds`). The worker reports the sum as `StepResponse.attention_seconds`.
"""

from __future__ import annotations

import time

from torch import nn

from compute_service.model.llama import PagedAttention


class AttentionClock:
    """Seconds the last forward of `model` spent in its `PagedAttention` modules, all layers.

    Timed only when the KV cache is on the CPU: CUDA kernels run asynchronously, so wall time
    around a launch measures nothing and a device sync would slow the step; `seconds` is then 0.

    Args:
        model: the decoder; its forward and every `PagedAttention` inside it get hooks.
    """

    def __init__(self, model: nn.Module) -> None:
        self.seconds = 0.0  # wall seconds, summed over layers, of the last forward
        self._entered: float | None = None  # perf_counter() when the current call began; None: untimed
        model.register_forward_pre_hook(self._reset)
        model.register_forward_hook(self._fused)
        for module in model.modules():
            if isinstance(module, PagedAttention):
                module.register_forward_pre_hook(self._enter)
                module.register_forward_hook(self._leave)

    def _reset(self, module: nn.Module, args: tuple) -> None:
        self.seconds = 0.0

    def _fused(self, module: nn.Module, args: tuple, output) -> None:
        # A step whose layers ran as one native call (compute_service.model.fused_decode) timed them inside.
        self.seconds += getattr(module, "native_attention_seconds", 0.0)

    def _enter(self, module: nn.Module, args: tuple) -> None:
        key_cache = args[3]  # PagedAttention.forward(q, k, v, key_cache, value_cache, meta)
        self._entered = time.perf_counter() if key_cache.device.type == "cpu" else None

    def _leave(self, module: nn.Module, args: tuple, output) -> None:
        if self._entered is not None:
            self.seconds += time.perf_counter() - self._entered
