"""Prefix caching end to end: real services, the real model, two client processes, events, metrics."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
import uuid

import grpc
from helpers.credentials import admin_md, computed, new_lease

from client import Client, SamplingParams
from client.engine.core import Engine
from client.engine.scheduler import SchedulerConfig
from client.request import Request
from client.services import MemoryClient, WorkerClient
from client.tokenizer import encode_prompt
from pagedkv.memory.v1 import memory_service_pb2 as pb
from pagedkv.memory.v1 import memory_service_pb2_grpc as pb_grpc
from pagedkv.model.tokenizer import load_tokenizer

SYSTEM = ("You are a meticulous assistant for a library that lends books, maps and musical instruments. "
          "Always answer in one short sentence. Opening hours are nine to five on weekdays and ten to two on "
          "Saturdays; the library is closed on Sundays. Members may borrow up to five items for three weeks. "
          "Late returns cost ten cents a day. Maps may not leave the reading room.")
QUESTIONS = ["When does the library open on Saturday?", "How many items can a member borrow?"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def computed_tokens(engine: Engine, req: Request) -> tuple[int, list[int]]:
    """Run ``req`` alone to the end; (tokens the worker computed for it, its output)."""
    start = len(engine.traces)
    engine.add(req)
    while engine.has_work():
        engine.step()
    return sum(t.num_tokens for t in list(engine.traces)[start:]), req.seqs[0].generated


def test_second_request_computes_only_uncached_tokens(stack):
    memory = MemoryClient(stack.memory.address)
    engine = Engine(memory, [WorkerClient(stack.worker_addresses[0])], load_tokenizer("smollm2"),
                    config=SchedulerConfig(max_num_batched_tokens=1024))
    try:
        salt = uuid.uuid4().hex  # isolates this test from what earlier runs left in the cache
        ids = [encode_prompt(engine.tokenizer, messages(q)) for q in QUESTIONS]
        shared = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)  # common prefix length
        assert shared > 64
        first, _ = computed_tokens(engine, Request("q0", ids[0], GREEDY, cache_salt=salt))
        assert first == len(ids[0]) + 7  # prefill + 7 decode steps
        hits_before = memory.stats().prefix_cache_hits
        second, out = computed_tokens(engine, Request("q1", ids[1], GREEDY, cache_salt=salt))
        cached = (shared // 16) * 16
        assert second == len(ids[1]) - cached + 7
        assert memory.stats().prefix_cache_hits - hits_before == cached
        # Same output as a run that shares nothing (another salt: nothing cached under it).
        uncached, ref = computed_tokens(engine, Request("q1-fresh", ids[1], GREEDY, cache_salt=salt + "-other"))
        assert uncached == len(ids[1]) + 7 and out == ref
        assert memory.stats().used_blocks == 0
    finally:
        engine.close()
        memory.close()


OTHER_CLIENT = r"""
import json, sys
from client import Client, SamplingParams
with Client(sys.argv[1], [sys.argv[2]]) as llm:
    (out,) = llm.generate([json.loads(sys.argv[3])], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                          cache_salt=sys.argv[4])
    print(json.dumps(out.outputs[0].token_ids))
"""


def test_two_client_processes_share_cached_blocks(stack):
    salt = uuid.uuid4().hex
    other = subprocess.run([sys.executable, "-c", OTHER_CLIENT, stack.memory.address, stack.worker_addresses[1],
                            json.dumps(messages(QUESTIONS[0])), salt], capture_output=True, text=True, check=True)
    theirs = json.loads(other.stdout.strip().splitlines()[-1])
    with Client(stack.memory.address, stack.worker_addresses[:1]) as llm:
        hits = llm.stats().prefix_cache_hits
        (out,) = llm.generate([messages(QUESTIONS[0])], GREEDY, cache_salt=salt)
        gained = llm.stats().prefix_cache_hits - hits
        prompt_len = len(out.prompt_token_ids)
        assert gained == ((prompt_len - 1) // 16) * 16  # every full block but the last token's
        assert out.outputs[0].token_ids == theirs
        prefill = llm.engine.traces[0].num_tokens
        assert prefill == prompt_len - gained


def test_kv_events_stream(stack):
    with grpc.insecure_channel(stack.memory.address) as ch:
        stub = pb_grpc.MemoryServiceStub(ch)
        start = stub.GetStats(pb.GetStatsRequest())
        lease, md = new_lease(stub)
        # 2 full blocks of 16 + 8, of ids no other test of the session stack stores (a hit stores nothing)
        tokens = list(range(40000, 40040))
        seq = computed(stack, stub, lease, md, tokens, uuid.uuid4().hex)  # a worker's step and its receipt
        stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease), metadata=md)
        del start
        # Token ids in events go to the admin only (tests/memory_service/test_authz.py: others get none).
        events = stub.StreamKvEvents(pb.StreamKvEventsRequest(from_sequence_number=1), timeout=10,
                                     metadata=admin_md(stack.memory))
        seen = []
        for e in events:
            seen.append(e)
            if e.WhichOneof("event") == "block_stored" and list(e.block_stored.token_ids) == tokens[16:32]:
                break
        events.cancel()
        numbers = [e.sequence_number for e in seen]
        assert numbers == list(range(1, len(seen) + 1))
        first, second = seen[-2].block_stored, seen[-1].block_stored
        assert list(first.token_ids) == tokens[:16] and first.block_id == seq.block_ids[0]
        assert second.parent_block_hash == first.block_hash and second.block_id == seq.block_ids[1]


def test_prometheus_metrics(start_service):
    svc = start_service(["memory", "--num-blocks", "32", "--metrics-port", "0"], name="metrics")
    port = svc.info["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for name in ("kv_cache_usage_perc", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "num_preemptions_total", "num_blocks_total 32.0"):
        for prefix in ("pagedkv:", "pagedkv_"):  # the older names stay one release, as aliases
            assert f"\n{prefix}{name}" in text, prefix + name
    assert "# HELP pagedkv_num_blocks_total Deprecated alias of pagedkv:num_blocks_total" in text


def test_no_prefix_caching_flag(start_service):
    svc = start_service(["memory", "--num-blocks", "32", "--block-size", "4", "--no-prefix-caching"], name="nocache")
    m = MemoryClient(svc.address)
    lease = m.create_lease().lease_id
    m.allocate(lease, [pb.SequenceAllocation(num_tokens=9, token_ids=list(range(9)))])
    (b,) = m.allocate(lease, [pb.SequenceAllocation(num_tokens=9, token_ids=list(range(9)))]).sequences
    assert b.num_cached_tokens == 0 and not m.stats().prefix_caching
    m.close()
