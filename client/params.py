"""Sampling parameters of a generation request (vLLM's ``SamplingParams`` names and defaults).

Validated at the edge, in ``__post_init__``: a bad value raises ``ValueError``
with what was wrong, before anything is sent to a service.

``temperature``, ``top_p``, ``top_k`` and ``repetition_penalty`` may be left unset (None): the
model's default then applies, as in vLLM's default ``generation_config="auto"``. The engine
resolves them once, when it admits the request (:meth:`SamplingParams.with_defaults`): from the
model's generation_config.json (GetModelInfo's ``generation_defaults``), else vLLM's own
defaults (:data:`VLLM_DEFAULTS`).
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

from client.structured.params import StructuredOutputsParams
from pagedkv.runtime.limits import MAX_LOGPROBS
from pagedkv.runtime.logs import get_logger

log = get_logger("client")

#: The worker's StepRequest carries top_k as int32 and temperature / top_p / penalties as float32.
_INT32_MAX = 2**31 - 1
#: What an unset field becomes when the model sets no default (vLLM's SamplingParams defaults).
VLLM_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}


def _as_float32(x: float) -> float:
    """``x`` rounded to float32, as the worker will see it (inf when out of range)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.inf


@dataclass(slots=True)
class SamplingParams:
    """How to generate. Defaults follow vLLM: the model's generation defaults (else temperature 1,
    no filter, no penalty), 16 new tokens.

    Penalties follow vLLM (vllm/model_executor/layers/utils.py ``apply_penalties``, applied by the
    worker to the logits before temperature, the filters and greedy's argmax; logprobs stay those
    of the raw logits). ``logit_bias`` and ``min_tokens`` act on the logits before the penalties,
    ``min_p`` after temperature and before top-k/top-p (vLLM v1's sampler and logits processors,
    on the worker: compute_service/logits_processors.py).

    Beam search (``num_beams > 1``) follows Hugging Face transformers' semantics
    (``length_penalty``, ``early_stopping``) and is deterministic: temperature,
    top-k/top-p, seed, stop strings, stop token ids and the model's generation defaults are
    ignored, and penalties are refused (vLLM's beam search has none), as are min_p, logit_bias,
    min_tokens and structured outputs; beams end at the model's end-of-sequence token (a candidate
    like any other with ``ignore_eos``, as in vLLM) or at ``max_tokens``. Blocks are shared between
    beams through fork and copy-on-write (vLLM paper, section 4.4).
    """

    #: Most new tokens per output sequence (>= 1).
    max_tokens: int = 16
    #: Softmax temperature; 0 = greedy; None = the model's default (else 1).
    temperature: float | None = None
    #: Nucleus sampling mass in (0, 1]; 1 = off; None = the model's default (else 1).
    top_p: float | None = None
    #: Keep the k most likely tokens; 0 = off; None = the model's default (else 0).
    top_k: int | None = None
    #: > 0: the logit of every token of the prompt or the output is divided by it when > 0, else
    #: multiplied (CTRL, Keskar et al. 2019); 1 = off; None = the model's default (else 1).
    repetition_penalty: float | None = None
    #: In [-2, 2], subtracted from the logit of every token already generated; 0 = off (OpenAI).
    presence_penalty: float = 0.0
    #: In [-2, 2], subtracted from a token's logit once per time it was generated; 0 = off (OpenAI).
    frequency_penalty: float = 0.0
    #: In [0, 1]: after temperature, tokens less likely than min_p times the most likely one are
    #: dropped (vLLM's min_p); no effect on greedy; 0 = off.
    min_p: float = 0.0
    #: Token id -> added to its logit before the penalties, greedy included (OpenAI's logit_bias; each
    #: bias clamped to [-100, 100], as vLLM does); ids below the model's vocabulary; None = off.
    logit_bias: dict[int, float] | None = None
    #: Generate at least this many tokens: until then the model's end-of-sequence ids and
    #: ``stop_token_ids`` are never drawn, and neither they nor ``stop`` strings end the sequence
    #: (vLLM's); <= max_tokens; 0 = off.
    min_tokens: int = 0
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
    #: Constrain every output sequence to a grammar (client.structured); None = free text.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        t, p, k, rep = self.temperature, self.top_p, self.top_k, self.repetition_penalty
        if t is not None and not (_number(t) and math.isfinite(_as_float32(t)) and t >= 0):
            raise ValueError(f"temperature must be a finite float32 >= 0 (0 = greedy) or None, got {t!r}")
        if p is not None and not (_number(p) and 0 < _as_float32(p) and p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (and > 0 in float32) or None, got {p!r}")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= _INT32_MAX):
            raise ValueError(f"top_k must be an integer in [0, {_INT32_MAX}] (0 = off) or None, got {k!r}")
        if rep is not None and not (_number(rep) and 0 < _as_float32(rep) < math.inf):
            raise ValueError(f"repetition_penalty must be a finite float32 > 0 (1 = off) or None, got {rep!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (_number(v) and -2 <= v <= 2):
                raise ValueError(f"{name} must be a number in [-2, 2] (0 = off), got {v!r}")
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
        if self.num_beams > 1 and (rep not in (None, 1) or self.presence_penalty or self.frequency_penalty):
            raise ValueError("beam search takes no repetition, presence or frequency penalty (nor does vLLM's); "
                             "leave them unset, or sample instead of num_beams > 1")
        self._check_logits_controls()

        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, "
                             f"got {self.structured_outputs!r:.80}")
        if self.num_beams > 1 and self.structured_outputs is not None:
            raise ValueError("beam search takes no structured_outputs (nor does vLLM's); sample instead")

    def _check_logits_controls(self) -> None:
        """min_p, logit_bias and min_tokens (vLLM's ``_verify_args``); logit_bias becomes a dict of
        int ids to float biases clamped to [-100, 100] (vLLM's ``__post_init__``)."""
        if not (_number(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be a number in [0, 1] (0 = off), got {self.min_p!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise ValueError(f"logit_bias must map token ids to biases, got {self.logit_bias!r:.80}")
            for t, b in self.logit_bias.items():
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= _INT32_MAX:
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {t!r:.40}")
                if not (_number(b) and math.isfinite(b)):
                    raise ValueError(f"logit_bias values must be finite numbers, got {b!r:.40} for token {t}")
            self.logit_bias = {t: min(100.0, max(-100.0, float(b))) for t, b in self.logit_bias.items()}
        if self.num_beams > 1 and (self.min_p or self.logit_bias or self.min_tokens):
            raise ValueError("beam search takes no min_p, logit_bias or min_tokens (nor does vLLM's); "
                             "sample instead of num_beams > 1")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError (naming logit_bias) when a ``logit_bias`` token id is not below
        ``vocab_size`` (the model's logits width; vLLM's ``_validate_logit_bias``)."""
        bad = sorted(t for t in self.logit_bias or () if t >= vocab_size)
        if bad:
            raise ValueError(f"logit_bias token id(s) {bad[:8]} are outside the vocabulary [0, {vocab_size})")

    @property
    def use_beam_search(self) -> bool:
        return self.num_beams > 1

    @property
    def resolved(self) -> bool:
        """Whether every field the model may default is set (:meth:`with_defaults` done)."""
        return all(getattr(self, name) is not None for name in VLLM_DEFAULTS)

    @property
    def greedy(self) -> bool:
        """Greedy decoding (temperature 0). An unset temperature is the model's default, unknown
        here: False until :meth:`with_defaults` has set it."""
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """Whether a penalty is on (an unset repetition penalty counts as off)."""
        return self.repetition_penalty not in (None, 1) or bool(self.presence_penalty or self.frequency_penalty)

    def with_defaults(self, defaults: Mapping[str, float | int] | None = None) -> SamplingParams:
        """A copy with every unset field (None) set: from ``defaults`` (a model's
        generation_config.json: ``temperature``, ``top_p``, ``top_k``, ``repetition_penalty``),
        else :data:`VLLM_DEFAULTS`. Beam search takes vLLM's defaults only (it ignores the model's,
        as vLLM's does). Self when nothing is unset.

        Raises:
            ValueError: a model default out of range (``__post_init__``'s checks).
        """
        if self.resolved:
            return self
        source = {} if self.use_beam_search or defaults is None else defaults
        fill = {name: source.get(name, default) for name, default in VLLM_DEFAULTS.items()
                if getattr(self, name) is None}
        return dataclasses.replace(self, **fill)


def model_defaults(generation_defaults, ignored_keys=()) -> dict[str, float | int]:
    """The request defaults a model sets, from GetModelInfo's ``generation_defaults`` (a
    ``pagedkv.compute.v1.GenerationDefaults``: each field present only when generation_config.json
    sets it). A ``top_k`` <= 0 is "off" (0), as in vLLM. A value that is not a valid sampling value
    is dropped with a warning (vLLM's default applies instead), so a bad generation_config.json
    fails no request. ``ignored_keys``: the config's keys the worker did not take (GetModelInfo's
    ``ignored_generation_keys``), named in a warning."""
    out: dict[str, float | int] = {}
    for name in VLLM_DEFAULTS:
        if generation_defaults.HasField(name):
            v = getattr(generation_defaults, name)
            value = max(0, int(v)) if name == "top_k" else float(v)
            try:
                SamplingParams(**{name: value})
            except ValueError as e:
                log.warning("generation_default_ignored", key=name, value=value, error=str(e))
                continue
            out[name] = value
    if ignored_keys:
        log.warning("generation_config_keys_ignored", keys=list(ignored_keys),
                    honoured="temperature, top_p, top_k, repetition_penalty")
    return out


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
