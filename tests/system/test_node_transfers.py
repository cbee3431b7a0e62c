"""Two nodes on one machine: a prefix computed on node A is read by node B over NIXL (UCX on loopback).

Each node is a memory service (its own pool, the same --transfer-key-file) and a worker started
with --node-transfers; node C's worker fails every transfer after one block (the test hook
tests/hooks/transfer_fail_after.py, PAGEDKV_TRANSFER_FAIL_AFTER=1). Checked against the engine's
own step traces, the memory services' counters and a cold run on the same node (another cache
salt, so nothing is shared).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import hook_env, local_stack, pagedkv_process

from client.api import Client
from client.cluster.core import Cluster, NodeSpec
from client.params import SamplingParams

BS = 16
#: A prompt of 150 tokens: 9 full blocks before the block holding its last token.
PROMPT = [int(t) for t in (list(range(1000, 1100)) + list(range(2000, 2050)))]
PULLED = (len(PROMPT) - 1) // BS * BS  # 144
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def node_args(tmp, name: str, key) -> list[str]:
    return ["--num-blocks", "96", "--block-size", str(BS), "--transfer-key-file", str(key), "--node-name", name,
            "--lease-ttl", "30"]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, tiny_model):
    """Nodes a, b and c over the tiny random Llama (the checks compare runs of one model)."""
    tmp = tmp_path_factory.mktemp("nodes")
    key = tmp / "transfer.key"
    key.write_text(os.urandom(32).hex())
    key.chmod(0o600)
    stacks = {}
    try:
        fail_after = hook_env("tests.hooks.transfer_fail_after", PAGEDKV_TRANSFER_FAIL_AFTER="1")
        for name, env in (("a", None), ("b", None), ("c", fail_after)):
            s = local_stack(tmp, node_args(tmp, name, key), name=name, model=tiny_model[0])
            s.worker_args, s.env = ["--node-transfers"], env
            stacks[name] = s.start()
        yield stacks
    finally:
        for s in stacks.values():
            s.stop()


def used_and_ok(address: str, token_file) -> tuple[int, bool]:
    from client.services import MemoryClient

    m = MemoryClient(address, admin_token=open(token_file).read().strip())
    try:
        check = m.check_invariants()
        return m.stats().used_blocks, check.ok
    finally:
        m.close()


def admin_token(stack) -> str:
    return stack.memory.info["admin_token_file"]


def computed_first_step(client: Client) -> int:
    """Tokens the worker computed in the engine's first step (the prompt's prefill)."""
    return client.engine.traces[0].num_tokens


def test_prefix_cached_on_a_is_read_by_b_and_the_output_equals_a_cold_run(nodes):
    a, b = nodes["a"], nodes["b"]
    with Client(a.memory_address, a.worker_addresses) as ca:
        (on_a,) = ca.generate([PROMPT], GREEDY)
        assert computed_first_step(ca) == len(PROMPT)  # computed there, now cached on A
    with Client(b.memory_address, b.worker_addresses, peers=[a.memory_address]) as cb:
        (pulled,) = cb.generate([PROMPT], GREEDY)
        assert cb.engine.pulls.tokens_pulled == PULLED
        assert pulled.num_cached_tokens == PULLED
        assert computed_first_step(cb) == len(PROMPT) - PULLED  # only the uncached tokens on B
        assert not cb.engine.pulls.pins  # the pin on A dropped once B proved its copy
        (cold,) = cb.generate([PROMPT], GREEDY, cache_salt="cold")  # nothing shared: computed on B
        assert cb.engine.traces[-1 - 7].num_tokens == len(PROMPT)
    assert pulled.outputs[0].token_ids == cold.outputs[0].token_ids == on_a.outputs[0].token_ids
    # The blocks B read are in B's own prefix cache now: a second request there pulls nothing.
    with Client(b.memory_address, b.worker_addresses, peers=[a.memory_address]) as cb:
        (again,) = cb.generate([PROMPT], GREEDY)
        assert cb.engine.pulls.tokens_pulled == 0 and again.num_cached_tokens == PULLED
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids
    for s in (a, b):
        assert used_and_ok(s.memory_address, admin_token(s)) == (0, True)


def test_a_ticket_the_node_refuses_is_dropped_and_only_that_request_computes_everything(nodes):
    """A node given its own ticket (a peer list naming itself) refuses it (TRANSFER_TICKET_REFUSED): the
    request is allocated again without it, and the requests beside it in the same call carry on."""
    b = nodes["b"]
    prompt = list(range(9000, 9150))
    with Client(b.memory_address, b.worker_addresses) as cb:
        cb.generate([prompt], GREEDY)  # cached on B
    with Client(b.memory_address, b.worker_addresses, peers=[b.memory_address]) as cb:
        outs = cb.generate([prompt, list(range(9500, 9540))], GREEDY)
        assert cb.engine.pulls.tokens_pulled == 0 and not cb.engine.pulls.pins
        assert outs[0].num_cached_tokens == PULLED  # B's own cache, after the refused ticket
    with Client(b.memory_address, b.worker_addresses) as cb:
        assert [o.outputs[0].token_ids for o in outs] == [
            o.outputs[0].token_ids for o in cb.generate([prompt, list(range(9500, 9540))], GREEDY, cache_salt="x")]
    assert used_and_ok(b.memory_address, admin_token(b)) == (0, True)


def test_a_transfer_that_fails_part_way_is_recomputed_and_leaks_nothing(nodes):
    a, c = nodes["a"], nodes["c"]
    with Client(a.memory_address, a.worker_addresses) as ca:
        (on_a,) = ca.generate([PROMPT], GREEDY)
    with Client(c.memory_address, c.worker_addresses, peers=[a.memory_address]) as cc:
        (out,) = cc.generate([PROMPT], GREEDY)
        assert cc.engine.pulls.transfers_failed == 1 and cc.engine.preemption.preemptions == 1
        assert not cc.engine.pulls.pins
        assert any(t.num_tokens == len(PROMPT) for t in cc.engine.traces)  # recomputed in full on C
    assert out.outputs[0].token_ids == on_a.outputs[0].token_ids
    for s in (a, c):
        assert used_and_ok(s.memory_address, admin_token(s)) == (0, True)


def wait_indexed(cluster: Cluster, node: str, prompt: list[int], blocks: int, timeout: float = 10.0) -> None:
    """Until the router's index knows that ``node`` holds ``blocks`` leading blocks of ``prompt``."""
    from pagedkv.runtime.block_hash import CacheKey, chain_hashes

    hashes = chain_hashes(prompt, BS, CacheKey(cluster.limits.model_id, cluster.cache_namespace), blocks)
    deadline = time.monotonic() + timeout
    while cluster.index.leading(hashes)[node] < blocks:
        assert time.monotonic() < deadline, f"node {node}'s KV events did not reach the router"
        time.sleep(0.05)


def test_routing_follows_the_prefix_and_spreads_the_rest_by_load(nodes):
    a, b = nodes["a"], nodes["b"]
    specs = [NodeSpec("a", a.memory_address, a.worker_addresses), NodeSpec("b", b.memory_address, b.worker_addresses)]
    system = list(range(5000, 5128))  # a 128-token shared system prompt
    with Cluster(specs) as cluster:
        first = cluster.submit(system + [7, 8, 9], GREEDY).result()
        (holder,) = [n for n, k in cluster.router.routed.items() if k]
        wait_indexed(cluster, holder, system, len(system) // BS)
        for i in range(3):  # each shares the system prompt: each goes where it is, whatever the tie order
            cluster.submit(system + [100 + i, 7], GREEDY).result()
        assert cluster.router.routed[holder] == 4 and cluster.router.prefix_hits[holder] == 3
        assert cluster.nodes[holder].client.engine.pulls.tokens_pulled == 0
        cluster.router.routed.clear()
        distinct = [list(range(6000 + 300 * i, 6000 + 300 * i + 64)) for i in range(4)]
        handles = [cluster.submit(p, GREEDY) for p in distinct]  # queued at once: load decides
        outs = [h.result() for h in handles]
        assert dict(cluster.router.routed) == {"a": 2, "b": 2}
        per_node = cluster.node_stats()  # the cluster reports every node, not its first
        assert list(per_node) == ["a", "b"] and all(s.step_count > 0 for s in per_node.values())
        assert cluster.engine_stats().step_count == sum(s.step_count for s in per_node.values())
        assert {n: log.step_count for n, log in cluster.step_logs().items()} == {
            n: s.step_count for n, s in per_node.items()}
        pools = [n.client.stats() for n in cluster.nodes.values()]
        assert cluster.stats().total_blocks == sum(p.total_blocks for p in pools)
        assert cluster.stats().prefix_cache_queries == sum(p.prefix_cache_queries for p in pools) > 0
    assert first.outputs[0].token_ids and all(o.outputs[0].token_ids for o in outs)


def test_prefill_on_one_node_decode_on_another_equals_one_node(nodes):
    a, b = nodes["a"], nodes["b"]
    prompt = list(range(7000, 7150))
    with Client(b.memory_address, b.worker_addresses) as one:
        (alone,) = one.generate([prompt], GREEDY, cache_salt="alone")
    specs = [NodeSpec("a", a.memory_address, a.worker_addresses, role="prefill"),
             NodeSpec("b", b.memory_address, b.worker_addresses, role="decode")]
    with Cluster(specs) as cluster:
        out = cluster.submit(prompt, GREEDY).result(timeout=120)
        prefill, decode = cluster.nodes["a"].client.engine, cluster.nodes["b"].client.engine
        assert [t.num_tokens for t in prefill.traces] == [len(prompt)]  # the prompt, once, on A
        assert decode.pulls.tokens_pulled == PULLED  # moved once; B computes the rest
        assert decode.traces[0].num_tokens == len(prompt) - PULLED
        assert cluster.node_stats()["b"].tokens_pulled == PULLED and cluster.node_stats()["a"].tokens_pulled == 0
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    for s in (a, b):
        assert used_and_ok(s.memory_address, admin_token(s)) == (0, True)


def test_serve_with_a_prefill_node_and_a_decode_node(nodes, tmp_path):
    """`pagedkv serve --node a=...,role=prefill --node b=...,role=decode` over HTTP: tokens equal one node's."""
    import httpx

    a, b = nodes["a"], nodes["b"]
    prompt = list(range(8000, 8150))
    with Client(b.memory_address, b.worker_addresses) as one:
        (alone,) = one.generate([prompt], GREEDY, cache_salt="alone")
    serve = pagedkv_process(["serve", "--node", f"a={a.memory_address},workers={a.worker_addresses[0]},role=prefill",
                             "--node", f"b={b.memory_address},workers={b.worker_addresses[0]},role=decode"],
                            tmp_path, "serve")
    try:
        r = httpx.post(f"http://{serve.address}/v1/completions", timeout=120, json={
            "model": "smollm2", "prompt": prompt, "max_tokens": GREEDY.max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == alone.outputs[0].token_ids
    finally:
        serve.stop()


@pytest.mark.slow
def test_a_node_that_stops_serving_gets_no_new_requests_and_rejoins(nodes, tiny_model, tmp_path):
    """Node B's worker killed: requests keep succeeding, all on A; B's worker back at its address:
    B is routed to again, and a prompt A cached is read by B from A's pool."""
    a, b = nodes["a"], nodes["b"]
    specs = [NodeSpec("a", a.memory_address, a.worker_addresses), NodeSpec("b", b.memory_address, b.worker_addresses)]
    distinct = [list(range(11000 + 300 * i, 11000 + 300 * i + 40)) for i in range(4)]  # in no other test
    with Cluster(specs, recovery_timeout=5, step_timeout=5) as cluster:
        port = int(b.workers[0].address.rsplit(":", 1)[1])
        b.workers[0].proc.kill()
        b.workers[0].proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while cluster.health.up["b"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cluster.health.up == {"a": True, "b": False}
        cluster.router.routed.clear()
        outs = [h.result(timeout=60) for h in [cluster.submit(p, GREEDY) for p in distinct]]
        assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
        assert dict(cluster.router.routed) == {"a": 4}
        b.workers[0] = pagedkv_process(["compute", "--memory", b.memory_address, "--model", str(tiny_model[0]),
                                        "--node-transfers"], tmp_path, "b-worker-again", port=port)
        while not cluster.health.up["b"] and time.monotonic() < deadline + 30:
            time.sleep(0.05)
        assert cluster.health.up == {"a": True, "b": True}
        cluster.router.routed.clear()
        again = [h.result(timeout=60) for h in [cluster.submit([9, *p], GREEDY) for p in distinct]]
        assert dict(cluster.router.routed) == {"a": 2, "b": 2}  # queued at once: load spreads them
        assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in again)
        on_b = cluster.nodes["b"].client
        before = on_b.engine.pulls.tokens_pulled
        # Cached on A while B was down, in the cluster's namespace (its node clients add none).
        (pulled,) = on_b.generate([distinct[0]], GREEDY, cache_salt=cluster.cache_namespace)
        assert pulled.outputs[0].token_ids == outs[0].outputs[0].token_ids
        assert on_b.engine.pulls.tokens_pulled - before == 32
    for s in (a, b):
        assert used_and_ok(s.memory_address, admin_token(s)) == (0, True)


def test_a_killed_source_worker_falls_back_to_recompute(nodes):
    """Last: it kills node A's worker."""
    a, b = nodes["a"], nodes["b"]
    prompt = [int(t) for t in range(3000, 3150)]
    with Client(a.memory_address, a.worker_addresses) as ca:
        (on_a,) = ca.generate([prompt], GREEDY)
    os.kill(a.workers[0].pid, signal.SIGKILL)
    a.workers[0].proc.wait(timeout=10)
    with Client(b.memory_address, b.worker_addresses, peers=[a.memory_address]) as cb:
        (out,) = cb.generate([prompt], GREEDY)
        assert cb.engine.pulls.transfers_failed == 1
    assert out.outputs[0].token_ids == on_a.outputs[0].token_ids
    for s in (a, b):
        assert used_and_ok(s.memory_address, admin_token(s)) == (0, True)


def test_a_cluster_reports_every_node_added_up():
    # Without services: what the front reads of a Cluster is every node's, added up (client.backend).
    import types

    from client.backend import Backend, total_pool_stats
    from client.engine.stats import EngineStats, WorkerInfo
    from pagedkv.memory.v1 import memory_service_pb2 as mpb

    a, b, c = (object(), object(), object())
    one = EngineStats(step_count=3, running=(a,), waiting=(b,), preemptions=2, swaps=1, lease_id="A", lease_secret="s",
                      workers_ready=1, workers_total=2, last_step_at=7.0,
                      worker_info=(WorkerInfo("h:1", "ready", requests=1, sequences=1), WorkerInfo("h:2", "draining")))
    two = EngineStats(step_count=5, waiting=(c,), preemptions=1, lease_recoveries=1, tokens_pulled=32, lease_id="B",
                      worker_failovers=1, workers_total=1, last_step_at=9.0,
                      worker_info=(WorkerInfo("h:3", "down", since=8.0, failures=1),))
    pools = [mpb.GetStatsResponse(total_blocks=10, used_blocks=4, tokens_stored=40, block_size=16, generation=7,
                                  prefix_cache_queries=5, prefix_cache_hits=1),
             mpb.GetStatsResponse(total_blocks=20, used_blocks=1, tokens_stored=8, block_size=16, generation=9,
                                  prefix_cache_queries=3)]

    def node(stats, pool):
        client = types.SimpleNamespace(engine_stats=lambda: stats, stats=lambda: pool, tokenizer=None, limits=None)
        return types.SimpleNamespace(client=client)

    cluster = Cluster.__new__(Cluster)
    cluster.nodes = {"a": node(one, pools[0]), "b": node(two, pools[1])}
    total = cluster.engine_stats()
    assert (total.step_count, total.running, total.waiting) == (8, (a,), (b, c))
    assert (total.preemptions, total.swaps, total.lease_recoveries, total.tokens_pulled) == (3, 1, 1, 32)
    assert total.lease_id == "" and cluster.node_stats() == {"a": one, "b": two}
    # Every node's workers, each with its node's name; the counts added, the latest step.
    assert [(w.node, w.address, w.state, w.requests, w.failures) for w in total.worker_info] == [
        ("a", "h:1", "ready", 1, 0), ("a", "h:2", "draining", 0, 0), ("b", "h:3", "down", 0, 1)]
    assert total.workers == (("h:1", "ready"), ("h:2", "draining"), ("h:3", "down"))
    assert (total.workers_ready, total.workers_total, total.worker_failovers, total.last_step_at) == (1, 3, 1, 9.0)
    assert total.worker_info[2].since == 8.0 and one.worker_info[0].node == ""  # the node's own stats stay
    pool = cluster.stats()
    assert (pool.total_blocks, pool.used_blocks, pool.prefix_cache_queries, pool.prefix_cache_hits) == (30, 5, 8, 1)
    assert (pool.block_size, pool.generation) == (16, 7) and pool.utilization == pytest.approx(48 / (5 * 16))
    assert EngineStats.total([one]) is one and total_pool_stats([pools[1]]) is pools[1]
    assert isinstance(cluster, Backend)  # as a Client is (tests/client/test_client.py)
