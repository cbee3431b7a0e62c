"""KV reservation policies: how much KV a request holds from its admission.

pagedkv allocates blocks on demand (:class:`Paged`, the default): a sequence grows
by AppendSlots as it computes tokens. The other policies exist to compare with
systems that reserve contiguous space per request, the vLLM paper's Orca baselines
(section 6.2): they allocate the whole reservation at admission and never append,
and take n=1 requests without beam search. Only the benchmarks pass them in
(``SchedulerConfig(reservation=OrcaMax(2048))``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol


class ReservationPolicy(Protocol):
    """Tokens a request reserves at admission."""

    #: Short name for messages and benchmark results ("paged", "max", "pow2", "oracle").
    name: ClassVar[str]

    def reserve(self, prompt_len: int, max_tokens: int) -> int | None:
        """Tokens to allocate at admission for the whole request; None: blocks on demand."""


@dataclass(frozen=True, slots=True)
class Paged:
    """Blocks on demand (pagedkv, the vLLM paper's PagedAttention): nothing is reserved."""

    name: ClassVar[str] = "paged"

    def reserve(self, prompt_len: int, max_tokens: int) -> None:
        return None


@dataclass(frozen=True, slots=True)
class OrcaMax:
    """Orca-Max: every request reserves ``max_model_len`` tokens (its final length if longer)."""

    name: ClassVar[str] = "max"
    #: Tokens reserved per request (the paper's Orca-Max: 2048).
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1 token, got {self.max_model_len}")

    def reserve(self, prompt_len: int, max_tokens: int) -> int:
        return max(self.max_model_len, prompt_len + max_tokens)


@dataclass(frozen=True, slots=True)
class OrcaPow2:
    """Orca-Pow2: the final length (prompt + max_tokens) rounded up to a power of two."""

    name: ClassVar[str] = "pow2"

    def reserve(self, prompt_len: int, max_tokens: int) -> int:
        return 1 << (prompt_len + max_tokens - 1).bit_length()


@dataclass(frozen=True, slots=True)
class OrcaOracle:
    """Orca-Oracle: exactly the final length, prompt + max_tokens (an oracle knows it)."""

    name: ClassVar[str] = "oracle"

    def reserve(self, prompt_len: int, max_tokens: int) -> int:
        return prompt_len + max_tokens
