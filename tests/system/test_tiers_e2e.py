"""The host tier end to end: real services with a host tier, the real model, a pool too small for two
requests. A prefix offloaded to the host tier is reloaded (only the rest is computed) with the cold
run's output; a request preempted by swap resumes on the undisturbed run's tokens."""

from __future__ import annotations

import uuid

import grpc
import pytest

from client.engine.core import Engine
from client.engine.scheduler import SchedulerConfig
from client.params import SamplingParams
from client.request import Request
from client.services import MemoryClient, WorkerClient
from pagedkv.grant.v1 import grant_pb2
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.memory.v1 import memory_service_pb2_grpc as mpb_grpc
from pagedkv.model.tokenizer import load_tokenizer

PROMPTS = ["The capital of France is", "Three prime numbers are"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
#: For the reload test: a 19-token prompt and its answer fit the 8 blocks (32 tokens).
SHORT = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tier_stack(tmp_path_factory):
    """8 device blocks of 4 tokens (two requests of ~20 tokens cannot both finish), all of them one
    lease's (the pool runs out, not a lease's quota), and a host tier of 4 MiB (22 blocks of SmolLM2's
    fp32 layout)."""
    from conftest import local_stack

    with local_stack(tmp_path_factory.mktemp("tier"), ["--num-blocks", "8", "--block-size", "4",
                                                       "--host-cache-memory", "4MiB", "--max-blocks-per-lease", "none"],
                     name="tier") as s:
        yield s


def run(stack, mode: str, prompts: list[list[int]], salt: str, params: SamplingParams = GREEDY
        ) -> tuple[Engine, list[Request]]:
    """Run ``prompts`` together on one engine to the end; returns the engine (closed) and the requests."""
    memory = MemoryClient(stack.memory.address)
    engine = Engine(memory, [WorkerClient(stack.worker_addresses[0])], load_tokenizer("smollm2"),
                    config=SchedulerConfig(max_num_batched_tokens=64, preemption_mode=mode))
    reqs = [Request(p, p, params, request_id=f"{mode}-{i}", cache_salt=salt) for i, p in enumerate(prompts)]
    try:
        for r in reqs:
            engine.add(r)
        for _ in range(200):
            if not engine.has_work():
                break
            engine.step()
        assert not engine.has_work()
    finally:
        engine.close()
        memory.close()
    return engine, reqs


def test_a_request_preempted_by_swap_resumes_on_the_undisturbed_tokens(tier_stack):
    tok = load_tokenizer("smollm2")
    prompts = [tok.encode(p) for p in PROMPTS]
    # Undisturbed: each request alone (it fits the pool), under a salt of its own (nothing shared).
    expected = [run(tier_stack, "recompute", [p], uuid.uuid4().hex)[1][0].seqs[0].generated for p in prompts]
    memory = MemoryClient(tier_stack.memory.address)
    try:
        before = memory.stats()
        engine, reqs = run(tier_stack, "swap", prompts, uuid.uuid4().hex)
        assert [r.error for r in reqs] == [None, None]
        assert [r.seqs[0].generated for r in reqs] == expected
        p = engine.preemption
        assert p.swaps >= 1 and p.swap_fallbacks == 0 and p.preemptions == p.swaps
        assert sum(r.metrics.swaps for r in reqs) == engine.preemption.swaps
        stats = memory.stats()
        assert stats.swap_outs - before.swap_outs >= 1 and stats.swap_ins - before.swap_ins >= 1
        assert stats.preemptions == before.preemptions  # nothing freed as preempted: no recompute
        assert stats.used_blocks == 0 and stats.host_used_blocks == 0 and stats.swapped_sequences == 0
    finally:
        memory.close()


def test_an_offloaded_prefix_is_reloaded_and_only_the_rest_is_computed(tier_stack):
    tok = load_tokenizer("smollm2")
    prompt = tok.encode("The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is")
    flush = tok.encode("Once upon a time, in a small village by the sea, there lived an old fisherman who")
    salt = uuid.uuid4().hex
    memory = MemoryClient(tier_stack.memory.address)
    try:
        cold = run(tier_stack, "recompute", [prompt], salt, SHORT)[1][0]
        before = memory.stats()
        run(tier_stack, "recompute", [flush], uuid.uuid4().hex,
            SHORT)  # takes the pool: the prompt's blocks go to the host
        mid = memory.stats()
        assert mid.offloads - before.offloads >= len(prompt) // 4 - 1, (before, mid)
        engine, (warm,) = run(tier_stack, "recompute", [prompt], salt, SHORT)
        after = memory.stats()
        reloaded = after.host_cache_hits - mid.host_cache_hits
        assert cold.error is None and warm.error is None and len(warm.seqs[0].generated) == SHORT.max_tokens
        # Every full block but the one holding the last prompt token was cached: the first on the
        # device still (the flush evicted leaves first), the others reloaded from the host tier...
        assert warm.num_cached_tokens == (len(prompt) - 1) // 4 * 4 == reloaded + 4
        assert after.reloads - mid.reloads == reloaded // 4 >= 2
        # ...so the first step computed only the rest of the prompt, and the output is the cold run's.
        assert engine.traces[0].num_tokens == len(prompt) - warm.num_cached_tokens
        assert warm.seqs[0].generated == cold.seqs[0].generated
        assert after.used_blocks == 0 and after.host_used_blocks == 0
    finally:
        memory.close()
    # The KV events name the medium: offloaded blocks were stored on the host.
    channel = grpc.insecure_channel(tier_stack.memory.address)
    try:
        stream = mpb_grpc.MemoryServiceStub(channel).StreamKvEvents(mpb.StreamKvEventsRequest(from_sequence_number=1),
                                                                    timeout=2.0)
        media = set()
        try:
            for e in stream:
                if e.HasField("block_stored"):
                    media.add(e.block_stored.medium)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e
        assert media == {grant_pb2.MEDIUM_DEVICE, grant_pb2.MEDIUM_HOST}
    finally:
        channel.close()
