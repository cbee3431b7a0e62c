"""Limits the client and the compute worker must agree on, defined once."""

from __future__ import annotations

#: Most top log-probabilities one sequence may ask for per output token (vLLM's default
#: ``max_logprobs``); the client refuses more before sending, the worker refuses more on receipt.
MAX_LOGPROBS = 20
