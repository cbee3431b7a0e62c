"""Poisoning probes against real services: a second caller cannot make the worker write or the
prefix cache hold KV that is not of the tokens it claims (grants and receipts, docs/security.md).

The attacker here holds a lease and the victim's cache salt (the worst case: at the gRPC plane a
salt is not a secret) and talks to the memory service and a worker directly.
"""

from __future__ import annotations

import uuid

import pytest
from helpers.refusals import refusal

from client import SamplingParams
from client.engine.core import Engine
from client.request import Request
from client.services import MemoryClient, WorkerClient
from client.tokenizer import encode_prompt
from pagedkv.compute.v1 import compute_service_pb2 as cpb
from pagedkv.grant.v1 import grant_pb2
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.model.tokenizer import load_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def run(engine: Engine, req: Request) -> list[int]:
    engine.add(req)
    while engine.has_work():
        engine.step()
    return req.seqs[0].generated


def step(worker: WorkerClient, generation: int, seq: int, tokens: list[int], start: int, table,
         grant) -> cpb.StepResponse:
    return worker.step(cpb.StepRequest(pool_generation=generation, sequences=[cpb.StepSequence(
        seq_id=seq, token_ids=tokens, positions=range(start, start + len(tokens)), block_ids=table, grant=grant)]))


denied = refusal  # a sequence outside its grant is refused alone; a fault of the whole step fails the call


@pytest.fixture
def victim(stack):
    memory = MemoryClient(stack.memory.address)
    engine = Engine(memory, [WorkerClient(stack.worker_addresses[0])], load_tokenizer("smollm2"))
    yield engine
    engine.close()
    memory.close()


def test_prefix_cache_cannot_be_poisoned(stack, victim):
    tok = victim.tokenizer
    salt = uuid.uuid4().hex
    france = encode_prompt(tok, [{"role": "user", "content": "What is the capital of France?"}])
    japan = encode_prompt(tok, [{"role": "user", "content": "What is the capital of Japan?"}])
    japan = (japan + [japan[-1]] * len(france))[:len(france)]
    assert len(france) > 32 and japan != france
    reference = run(victim, Request("ref", france, GREEDY, cache_salt=salt + "-ref"))

    m, w = MemoryClient(stack.memory.address), WorkerClient(stack.worker_addresses[1])
    lease = m.create_lease().lease_id
    gen = m.pool().generation
    claim = mpb.SequenceAllocation(num_tokens=len(france), token_ids=france, model_id=victim.model_id, cache_salt=salt)
    # 1. Claim France's tokens, compute Japan's: the grant binds the tokens.
    a = m.allocate(lease, [claim])
    assert "tokens are not the ones" in denied(
        lambda: step(w, gen, a.sequences[0].seq_id, japan, 0, a.sequences[0].block_ids, a.grants[0]))
    # 2. Report the blocks computed without computing them: only receipts count.
    assert "receipt" in denied(lambda: m.stub.CommitComputedTokens(mpb.CommitComputedTokensRequest(
        lease_id=lease, sequences=[mpb.ComputedTokens(seq_id=a.sequences[0].seq_id, num_computed_tokens=len(france))]),
        timeout=10, metadata=m._lease_md(lease)))
    forged = grant_pb2.StepReceipt(pool_generation=gen, seq_id=a.sequences[0].seq_id, start=0, end=len(france),
                                   block_ids=a.sequences[0].block_ids, block_epochs=a.grants[0].block_epochs,
                                   signature=b"\1" * 32)
    assert "not a worker's receipt" in denied(lambda: m.commit(lease, [forged]))
    # 3. A sequence whose tokens the memory service does not know may compute anything, but its
    #    receipt never matches France's tokens: nothing enters the cache.
    b = m.allocate(lease, [mpb.SequenceAllocation(num_tokens=len(france))])
    assert b.grants[0].token_digest == b""
    out = step(w, gen, b.sequences[0].seq_id, japan, 0, b.sequences[0].block_ids, b.grants[0])
    taken = m.commit(lease, [out.results[0].receipt])
    assert (taken.blocks_registered, taken.grants[0].readable_tokens) == (0, len(france))
    # 4. The victim fills the cache; the attacker then hits France's blocks and tries to rewrite them
    #    (its grant starts after them) or to write into the victim's own blocks (not its table).
    hits = m.stats().prefix_cache_hits
    assert run(victim, Request("v1", france, GREEDY, cache_salt=salt)) == reference
    c = m.allocate(lease, [claim])
    cached = c.sequences[0].num_cached_tokens
    assert cached >= 32 and m.stats().prefix_cache_hits - hits == cached
    assert "writes positions [0," in denied(
        lambda: step(w, gen, c.sequences[0].seq_id, japan, 0, c.sequences[0].block_ids, c.grants[0]))
    assert "block table is not" in denied(lambda: step(
        w, gen, c.sequences[0].seq_id, japan[cached:], cached, a.sequences[0].block_ids, c.grants[0]))
    m.release_lease(lease)
    # The victim's next run hits the cache and answers as before.
    hits = m.stats().prefix_cache_hits
    assert run(victim, Request("v2", france, GREEDY, cache_salt=salt)) == reference
    assert m.stats().prefix_cache_hits - hits == cached
    m.close()
    w.close()


def test_a_replayed_copy_on_write_grant_cannot_rewrite_a_cached_block(stack, victim):
    # A grant with a copy, replayed after its sequence wrote further and the block entered the cache,
    # would re-copy the source's current KV over the cached positions. The receipt spent the grant.
    salt = uuid.uuid4().hex
    prompt = encode_prompt(victim.tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    other = encode_prompt(victim.tokenizer, "Tokyo " * 12)[:12]
    reference = run(victim, Request("cow-ref", prompt, GREEDY, cache_salt=salt + "-ref"))
    m, w = MemoryClient(stack.memory.address), WorkerClient(stack.worker_addresses[1])
    lease = m.create_lease().lease_id
    gen = m.pool().generation

    def step_of(seq, tokens, start, grant, copies=()):
        return w.step(cpb.StepRequest(pool_generation=gen, copies=[cpb.BlockCopy(src=c.src, dst=c.dst) for c in copies],
                                      sequences=[cpb.StepSequence(seq_id=seq, token_ids=tokens, skip_sampling=True,
                                                                  positions=range(start, start + len(tokens)),
                                                                  block_ids=grant.block_ids, grant=grant)]))

    def go(seq, tokens, start, grant, copies=()):
        return m.commit(lease, [step_of(seq, tokens, start, grant, copies).results[0].receipt])

    a = m.allocate(lease, [mpb.SequenceAllocation(num_tokens=20, token_ids=prompt[:20], model_id=victim.model_id,
                                                  cache_salt=salt)])
    parent = a.sequences[0].seq_id
    go(parent, prompt[:20], 0, a.grants[0])
    child = m.fork(lease, [parent]).children[0].seq_id
    first = m.append(lease, [(child, 4, prompt[20:24])])  # copy-on-write of the shared, partly filled block
    assert len(first.copies) == 1
    go(child, prompt[20:24], 20, first.grants[0], first.copies)
    second = m.append(lease, [(child, 8, prompt[24:32])])
    assert go(child, prompt[24:32], 24, second.grants[0]).blocks_registered == 1  # the copied block, now full
    theirs = m.append(lease, [(parent, 12, other)])
    go(parent, other, 20, theirs.grants[0])  # the copy's source now holds other tokens' KV
    assert "handed out anew" in denied(lambda: step_of(child, prompt[20:24], 20, first.grants[0], first.copies))
    m.release_lease(lease)
    hits = m.stats().prefix_cache_hits
    assert run(victim, Request("cow-victim", prompt, GREEDY, cache_salt=salt)) == reference
    assert m.stats().prefix_cache_hits - hits == 32  # it read the two blocks the attacker cached
    m.close()
    w.close()
