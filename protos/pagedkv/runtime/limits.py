"""Limits the client and the services must agree on, defined once.

The memory service answers every call on one event loop, so each call's work is bounded: no call
should hold the loop for more than ~50 ms, or every other caller (keep-alives included) waits.
The bounds below come from ``benchmarks/bench_memory_latency.py`` on a 2-core VM (figures in
docs/benchmarks.md); a call over one is refused with INVALID_ARGUMENT naming the limit, before
anything changes, and the client splits its work into several calls.
"""

from __future__ import annotations

#: Most top log-probabilities one sequence may ask for per output token (vLLM's default
#: ``max_logprobs``); the client refuses more before sending, the worker refuses more on receipt.
MAX_LOGPROBS = 20

#: Most entries one batched memory-service call may carry (sequences allocated, appended, freed,
#: committed, forked). Each allocated, appended or forked sequence also gets a signed grant: an
#: AllocateSequences of 2048 sequences took 60-140 ms on the loop (docs/benchmarks.md), 65,536
#: took ~0.9 s before grants. The engine splits its calls to fit.
MAX_BATCH = 1024

#: Most children one ForkSequences call may create (bounded work per call); the memory service
#: refuses more, the client forks more in several calls. At most :data:`MAX_BATCH`.
MAX_FORK_CHILDREN = 1024

#: Most block-table entries one ForkSequences reply may carry (children x their parents' tables):
#: each is an incref, a reply entry and, in the child's signed grant, a block id with its epoch
#: (256 Ki entries took ~170 ms with grants), so the reply always fits a gRPC message and the call
#: stays near 50 ms.
MAX_FORK_BLOCK_IDS = 1 << 16

#: Most token ids one AllocateSequences or AppendSlots call may carry, over all its entries
#: (~0.2-0.3 us each on the loop: 1 Mi ids took ~0.26 s, 256 Ki ~60-80 ms).
MAX_TOKEN_IDS_PER_CALL = 1 << 17

assert MAX_FORK_CHILDREN <= MAX_BATCH
