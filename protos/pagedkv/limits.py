"""Limits the client and the services must agree on, defined once."""

from __future__ import annotations

#: Most top log-probabilities one sequence may ask for per output token (vLLM's default
#: ``max_logprobs``); the client refuses more before sending, the worker refuses more on receipt.
MAX_LOGPROBS = 20

#: Most children one ForkSequences call may create (bounded work per call); the memory service
#: refuses more, the client forks more in several calls.
MAX_FORK_CHILDREN = 4096
