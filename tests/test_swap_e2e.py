"""Preemption by swap end to end: real services with a host tier, the real model, a pool too small for two requests."""

from __future__ import annotations

import uuid

import pytest

from client.engine import Engine
from client.params import SamplingParams
from client.request import Request
from client.scheduler import SchedulerConfig
from client.services import MemoryClient, WorkerClient
from client.tokenizer import load_tokenizer

PROMPTS = ["The capital of France is", "Three prime numbers are"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def tier_stack(tmp_path_factory):
    """8 device blocks of 4 tokens (two requests of ~20 tokens cannot both finish) and a host tier of
    4 MiB (22 blocks of SmolLM2's fp32 layout)."""
    from conftest import local_stack

    with local_stack(tmp_path_factory.mktemp("tier"), ["--num-blocks", "8", "--block-size", "4",
                                                       "--host-cache-memory", "4MiB"], name="tier") as s:
        yield s


def run(stack, mode: str, prompts: list[list[int]], salt: str) -> tuple[Engine, list[Request]]:
    """Run ``prompts`` together on one engine to the end; returns the engine (closed) and the requests."""
    memory = MemoryClient(stack.memory.address)
    engine = Engine(memory, [WorkerClient(stack.worker_addresses[0])], load_tokenizer("smollm2"),
                    config=SchedulerConfig(max_num_batched_tokens=64, preemption_mode=mode))
    reqs = [Request(p, p, GREEDY, request_id=f"{mode}-{i}", cache_salt=salt) for i, p in enumerate(prompts)]
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
        assert engine.swaps >= 1 and engine.swap_fallbacks == 0 and engine.preemptions == engine.swaps
        assert sum(r.metrics.swaps for r in reqs) == engine.swaps
        stats = memory.stats()
        assert stats.swap_outs - before.swap_outs >= 1 and stats.swap_ins - before.swap_ins >= 1
        assert stats.preemptions == before.preemptions  # nothing freed as preempted: no recompute
        assert stats.used_blocks == 0 and stats.host_used_blocks == 0 and stats.swapped_sequences == 0
    finally:
        memory.close()
