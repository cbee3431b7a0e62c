"""Prefill on one worker, decode on another, on one node: the sequence moves, its KV does not.

The session stack's two workers map one pool; a Client with worker roles ["prefill", "decode"]
admits each request to worker 0 and hands it to worker 1 once its prompt is computed
(client.engine.scheduler.Scheduler.hand_off). Every Step each worker receives is recorded: worker 0 sees
only prompt tokens, worker 1 only decode tokens, no Step carries a copy, and the memory service
counted no copy of any kind; the tokens equal a run that never moves (one worker does both).
"""

from __future__ import annotations

import pytest

from client.api import Client
from client.params import SamplingParams

PROMPTS = [list(range(500 + 37 * i, 540 + 37 * i + 13 * i)) for i in range(4)]  # 40 to 79 tokens
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def record_steps(client: Client) -> list[list]:
    """Per worker, (tokens per sequence, copies in the request and its grants) of every Step it got."""
    seen: list[list] = [[] for _ in client.workers]
    for i, w in enumerate(client.workers):
        step = w.step

        def wrapped(request, i=i, step=step):
            seen[i].append(([len(s.token_ids) for s in request.sequences],
                            len(request.copies) + sum(len(s.grant.copies) for s in request.sequences)))
            return step(request)

        w.step = wrapped
    return seen


def test_prefill_worker_hands_every_request_to_the_decode_worker_without_a_copy(stack):
    addresses = stack.worker_addresses
    with Client(stack.memory_address, addresses, worker_roles=["prefill", "decode"]) as c:
        seen = record_steps(c)
        before = c.stats()
        moved = c.generate(PROMPTS, GREEDY, cache_salt="handoff")
        after = c.stats()
        assert c.engine.scheduler.handoffs == len(PROMPTS)
    prefill, decode = seen
    assert prefill and decode
    assert all(n > 1 for tokens, _ in prefill for n in tokens)  # prompts only (chunks of 40+ tokens)
    assert all(n == 1 for tokens, _ in decode for n in tokens)  # one new token per sequence per step
    assert sum(len(t) for t, _ in decode) == len(PROMPTS) * (GREEDY.max_tokens - 1)
    assert all(copies == 0 for _, copies in prefill + decode)
    for counter in ("offloads", "reloads", "host_cache_hits"):
        assert getattr(after, counter) == getattr(before, counter), counter
    with Client(stack.memory_address, addresses[1:]) as one:
        still = one.generate(PROMPTS, GREEDY, cache_salt="still")
    assert [o.outputs[0].token_ids for o in moved] == [o.outputs[0].token_ids for o in still]


@pytest.mark.parametrize("roles", [["prefill", "prefill"], ["decode", "decode"], ["both"], ["prefill", "fast"]])
def test_worker_roles_need_a_worker_for_each_phase(stack, roles):
    with pytest.raises(ValueError, match="worker roles"):
        Client(stack.memory_address, stack.worker_addresses, worker_roles=roles)
