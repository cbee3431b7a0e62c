"""A step's receipts ride on the next step's AppendSlots (client.engine.commits): one memory-service round
trip per decode step, the same tokens and the same prefix cache as committing after every step,
and AppendSlots' ``receipts`` taken exactly as CommitComputedTokens takes them. Real services, the
real model (the session's ``stack``)."""

from __future__ import annotations

import uuid

import grpc
import pytest
from helpers.credentials import admin_token

from client.engine.core import Engine
from client.engine.scheduler import SchedulerConfig
from client.errors import ServiceError
from client.params import SamplingParams
from client.request import Request
from client.services import MemoryClient, WorkerClient
from pagedkv.model.tokenizer import load_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
PROMPTS = [[1, 504, 3458, 282, 4098, 314, 253] * 6, [1, 1204, 314, 260, 1345, 30, 2] * 5]  # 42 and 35 tokens


def engine_on(stack) -> tuple[Engine, MemoryClient]:
    memory = MemoryClient(stack.memory.address, admin_token=admin_token(stack.memory))
    engine = Engine(memory, [WorkerClient(stack.worker_addresses[0])], load_tokenizer("smollm2"),
                    config=SchedulerConfig(max_num_batched_tokens=512))
    return engine, memory


def counted(engine: Engine) -> dict:
    """Wrap the engine's AppendSlots and CommitComputedTokens calls; returns their counts and receipts."""
    seen = {"append": 0, "append_receipts": 0, "commit": 0, "commit_receipts": 0}
    memory = engine.memory
    append, commit = memory.append, memory.commit

    def counting_append(lease_id, appends, receipts=()):
        seen["append"] += 1
        seen["append_receipts"] += len(receipts)
        return append(lease_id, appends, receipts)

    def counting_commit(lease_id, receipts):
        seen["commit"] += 1
        seen["commit_receipts"] += len(receipts)
        return commit(lease_id, receipts)

    memory.append, memory.commit = counting_append, counting_commit
    return seen


def run(engine: Engine, salt: str, wait: bool = True) -> list[list[int]]:
    if not wait:
        engine._may_wait = lambda x: False  # every receipt committed after its step, as before
    reqs = [Request(f"r{i}-{salt}", p, GREEDY, cache_salt=salt) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        engine.add(r)
    while engine.has_work():
        engine.step()
    return [r.seqs[0].generated for r in reqs]


def test_one_round_trip_per_step_same_tokens_and_cache(stack):
    engine, memory = engine_on(stack)
    try:
        salt = uuid.uuid4().hex
        seen = counted(engine)
        steps_before = engine.step_count
        out = run(engine, salt)
        steps = engine.step_count - steps_before
        # 1 prefill step (both prompts) + 8 decode steps; both finish in the last one.
        assert steps == 9 and all(len(o) == 9 for o in out)
        # Every step's receipts were handed in exactly once: 2 sequences x 9 steps.
        assert seen["append_receipts"] + seen["commit_receipts"] == 2 * 9
        # The finishing step's commit is the only CommitComputedTokens; the other 8 steps' receipts
        # rode on the next step's AppendSlots (one per decode step).
        assert seen["commit"] == 1 and seen["commit_receipts"] == 2
        assert seen["append"] == 8 and seen["append_receipts"] == 16
        # Committing after every step gives the same tokens and fills the cache alike: a third
        # request with the first prompt and 9 more of its tokens finds the same cached blocks.
        ref_engine, ref_memory = engine_on(stack)
        try:
            other = uuid.uuid4().hex
            assert run(ref_engine, other, wait=False) == out
            hits = []
            for s in (salt, other):
                before = memory.stats().prefix_cache_hits
                req = Request(f"again-{s}", PROMPTS[0] + out[0], SamplingParams(temperature=0, max_tokens=1),
                              cache_salt=s)
                engine.add(req)
                while engine.has_work():
                    engine.step()
                hits.append(memory.stats().prefix_cache_hits - before)
            assert hits[0] == hits[1] == (len(PROMPTS[0]) + 9 - 1) // 16 * 16
        finally:
            ref_engine.close()
            ref_memory.close()
        assert memory.check_invariants().ok
    finally:
        engine.close()
        memory.close()


def test_append_receipts_are_taken_like_a_commit(stack):
    engine, memory = engine_on(stack)
    try:
        req = Request(f"direct-{uuid.uuid4().hex}", PROMPTS[0], GREEDY)
        engine.add(req)
        engine.step()  # the prefill: its receipt now waits for the next AppendSlots
        seq = req.seqs[0]
        assert len(engine.commits) == 1
        receipts = engine.commits.take()
        lease = engine.lease.lease_id
        info = memory.block_table(seq.seq_id, lease)
        tokens = info.num_tokens

        # A forged receipt refuses the whole call: nothing taken, nothing appended.
        forged = type(receipts[0])()
        forged.CopyFrom(receipts[0])
        forged.end += 1
        with pytest.raises(ServiceError) as err:
            memory.append(lease, [(seq.seq_id, 1, [seq.generated[-1]])], [forged])
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert memory.block_table(seq.seq_id, lease).num_tokens == tokens

        # Appends refused (past the pool's capacity) take no receipt either.
        with pytest.raises(ServiceError) as err:
            memory.append(lease, [(seq.seq_id, 512 * 16, None)], receipts)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert memory.block_table(seq.seq_id, lease).num_tokens == tokens
        # The same receipts with appends that fit are taken: the prompt's 2 full blocks are cached.
        resp = memory.append(lease, [(seq.seq_id, 1, [seq.generated[-1]])], receipts)
        assert resp.receipts_skipped == 0 and resp.blocks_registered == len(PROMPTS[0]) // 16
        assert len(resp.grants) == 1 and not resp.committed_grants
        assert memory.block_table(seq.seq_id, lease).num_tokens == tokens + 1
        # Sent again, they are skipped (already taken); nothing is counted twice.
        again = memory.append(lease, [(seq.seq_id, 1, None)], receipts)
        assert again.receipts_skipped == 1 and again.blocks_registered == 0
        assert memory.check_invariants().ok
    finally:
        engine.close()
        memory.close()
