"""Sampling parameters of a generation request (vLLM's ``SamplingParams`` names and defaults).

Validated at the edge, in ``__post_init__``: a bad value raises ``ValueError``
with what was wrong, before anything is sent to a service.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

from pagedkv.limits import MAX_LOGPROBS

#: The worker's StepRequest carries top_k as int32 and temperature / top_p as float32.
_INT32_MAX = 2**31 - 1


def _as_float32(x: float) -> float:
    """``x`` rounded to float32, as the worker will see it (inf when out of range)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.inf


@dataclass(slots=True)
class SamplingParams:
    """How to generate. Defaults follow vLLM: temperature 1, 16 new tokens.

    Beam search (``num_beams > 1``) follows Hugging Face transformers' semantics
    (``length_penalty``, ``early_stopping``) and is deterministic: temperature,
    top-k/top-p and seed are ignored. Blocks are shared between beams through
    fork and copy-on-write (vLLM paper, section 4.4).
    """

    #: Most new tokens per output sequence (>= 1).
    max_tokens: int = 16
    #: Softmax temperature; 0 = greedy.
    temperature: float = 1.0
    #: Nucleus sampling mass in (0, 1]; 1 = off.
    top_p: float = 1.0
    #: Keep the k most likely tokens; 0 = off.
    top_k: int = 0
    #: Seed of the draws; the n samples use seed, seed + 1, ...; None = random.
    seed: int | None = None
    #: Strings that end a sequence (not included in the text).
    stop: list[str] = field(default_factory=list)
    #: Token ids that end a sequence (included in token_ids).
    stop_token_ids: list[int] = field(default_factory=list)
    #: Keep generating past the model's end-of-sequence token.
    ignore_eos: bool = False
    #: Parallel samples: the prompt is prefilled once and forked (copy-on-write).
    n: int = 1
    #: Return this many top log-probabilities per token (0..20); None = off.
    logprobs: int | None = None
    #: Beam width; > 1 runs beam search.
    num_beams: int = 1
    #: Beam score = sum of logprobs / generated_length ** length_penalty.
    length_penalty: float = 1.0
    #: Beam search stops as soon as num_beams hypotheses are finished.
    early_stopping: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(_as_float32(self.temperature))
                and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite float32 >= 0 (0 = greedy), got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < _as_float32(self.top_p) and self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (and > 0 in float32), got {self.top_p!r}")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= _INT32_MAX:
            raise ValueError(f"top_k must be an integer in [0, {_INT32_MAX}] (0 = off), got {self.top_k!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers >= 0, got {self.stop_token_ids!r}")
        if not isinstance(self.n, int) or not 1 <= self.n <= 64:
            raise ValueError(f"n must be an integer in [1, 64], got {self.n!r}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        if not isinstance(self.num_beams, int) or not 1 <= self.num_beams <= MAX_LOGPROBS // 2:
            raise ValueError(f"num_beams must be an integer in [1, {MAX_LOGPROBS // 2}], got {self.num_beams!r}")
        if self.num_beams > 1 and self.n > self.num_beams:
            raise ValueError(f"with beam search, n ({self.n}) must be <= num_beams ({self.num_beams})")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty!r}")

    @property
    def use_beam_search(self) -> bool:
        return self.num_beams > 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
