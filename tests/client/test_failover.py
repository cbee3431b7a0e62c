"""Worker failover (client.engine.failover) through real processes: a memory service and two
workers on the tiny random Llama. A worker SIGKILLed mid-stream costs the step it had in flight:
its sequences go on on the other worker from their KV in the pool, the lease stays, and the
outputs equal an undisturbed run's. The killed worker, started again at its address, is found
again and takes new requests; the sequences held for its lost step are freed then. A worker that
hangs past the step timeout after its grant check is failed over from the same way, and what it
writes when it wakes up is never read or cached."""

from __future__ import annotations

import os
import time

import pytest
from conftest import hook_env, local_stack, pagedkv_process
from helpers.tiny_llama import BASE_PROMPT

from client import Client, SamplingParams
from client.engine.failover import WorkersDown
from client.errors import PermissionDenied
from client.services import MemoryClient, read_admin_token

PROMPTS = [[*BASE_PROMPT, 100 + i, 200 + i] for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_model):
    """(stack, run folder): a memory service (blocks of 4 tokens: most steps leave a partly filled
    block) and two workers, on the tiny Llama."""
    tmp = tmp_path_factory.mktemp("failover")
    stack = local_stack(tmp, ["--num-blocks", "256", "--block-size", "4"], num_workers=2, name="failover",
                        model=tiny_model[0])
    with stack:
        yield stack, tmp


def _admin(stack) -> MemoryClient:
    return MemoryClient(stack.memory_address, admin_token=read_admin_token(stack.memory.info["admin_token_file"]))


def test_a_killed_worker_costs_its_step_in_flight_and_comes_back(pair, tiny_model):
    stack, tmp = pair
    admin = _admin(stack)
    with Client(stack.memory_address, stack.worker_addresses, step_timeout=5, recovery_timeout=20) as client:
        undisturbed = [o.outputs[0].token_ids for o in client.generate(PROMPTS, GREEDY)]
        lease = client.engine.lease.lease_id
        handles = [client.submit(p, GREEDY) for p in PROMPTS]
        while min(len(h.request.seqs[0].generated) for h in handles) < 6:
            time.sleep(0.005)
        on_killed = [h.request.request_id for h in handles if h.request.worker == 0]
        assert on_killed, "the least-loaded pinning puts requests on both workers"
        stack.workers[0].proc.kill()
        got = [h.result(timeout=120).outputs[0].token_ids for h in handles]
        assert got == undisturbed
        engine, stats = client.engine, client.engine.stats()
        assert engine.lease.lease_id == lease and engine.lease_recoveries == 0
        assert (stats.worker_failovers, stats.workers_ready, stats.workers_total) == (1, 1, 2)
        killed, kept = stats.worker_info
        assert killed.address == stack.worker_addresses[0] and (killed.state, killed.failures, killed.restarts) == (
            "down", 1, 0)
        assert 0 < killed.since <= time.monotonic() and (kept.state, kept.failures, kept.since) == ("ready", 0, 0.0)
        # Each moved sequence computes its lost decode step again (1 token), nothing more.
        assert 0 < stats.recomputed_worker_failure <= len(on_killed)
        assert stats.recomputed_preemption == stats.recomputed_lease_lost == 0
        assert admin.stats().num_leases == 1
        assert admin.check_invariants().ok
        # The killed worker's lost step may still write what it was granted: those blocks are held.
        held = admin.stats().used_blocks
        assert held > 0

        # Started again at its address: found again, takes new work, and the held blocks go.
        port = int(stack.workers[0].address.rsplit(":", 1)[1])
        stack.workers[0] = pagedkv_process(["compute", "--memory", stack.memory_address, "--model",
                                            str(tiny_model[0])], tmp, "failover-worker0-again", port=port)
        again = [client.submit(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)) for p in PROMPTS]
        assert [h.result(timeout=60).outputs[0].token_ids for h in again] == [u[:4] for u in undisturbed]
        deadline = time.monotonic() + 30
        while client.engine.stats().workers_ready < 2 and time.monotonic() < deadline:
            client.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        assert client.engine.stats().workers_ready == 2
        back = client.engine.stats().worker_info[0]  # another process at the same address
        assert (back.state, back.failures, back.restarts) == ("ready", 1, 1) and back.instance_id != killed.instance_id
        later = [client.submit(p, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)) for p in PROMPTS]
        [h.result(timeout=60) for h in later]
        assert {h.request.worker for h in later} == {0, 1}
        assert admin.stats().used_blocks == 0  # the quarantine was freed: that process is gone
        assert admin.check_invariants().ok
    admin.close()


def test_with_every_worker_down_requests_fail_after_the_timeout_and_the_lease_stays(pair, tiny_model):
    stack, tmp = pair
    with Client(stack.memory_address, [stack.worker_addresses[1]], step_timeout=5, recovery_timeout=2) as client:
        lease = client.engine.lease.lease_id
        port = int(stack.workers[1].address.rsplit(":", 1)[1])
        stack.workers[1].proc.kill()
        stack.workers[1].proc.wait()
        handle = client.submit(PROMPTS[0], GREEDY)
        with pytest.raises(WorkersDown, match="the lease is kept"):
            handle.result(timeout=60)
        stack.workers[1] = pagedkv_process(["compute", "--memory", stack.memory_address, "--model",
                                            str(tiny_model[0])], tmp, "failover-worker1-again", port=port)
        (out,) = client.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 4 and client.engine.lease.lease_id == lease


def test_a_worker_that_wakes_up_mid_step_writes_only_blocks_nobody_reads(pair, tiny_model):
    """The hooked worker stops after its grant check (tests/hooks/gate_step.py) past the step timeout:
    its requests go on on the other worker. Woken up, it writes the step it had: the blocks it was
    granted are held by the moved sequences' parents, so the outputs, and the same prompts again
    through the prefix cache the survivor filled, equal an undisturbed run's."""
    stack, tmp = pair
    gate = tmp / "gate"
    hooked = pagedkv_process(["compute", "--memory", stack.memory_address, "--model", str(tiny_model[0])], tmp,
                             "failover-hooked", env=hook_env("tests.hooks.gate_step",
                                                             PAGEDKV_TEST_GATE_FILE=str(gate)))
    admin = _admin(stack)
    try:
        with Client(stack.memory_address, [hooked.address, stack.worker_addresses[1]], step_timeout=2,
                    recovery_timeout=20) as client:
            undisturbed = [o.outputs[0].token_ids for o in client.generate(PROMPTS, GREEDY)]
            admin.reset_prefix_cache()
            gate.touch()
            handles = [client.submit(p, GREEDY) for p in PROMPTS]
            got = [h.result(timeout=120).outputs[0].token_ids for h in handles]
            assert got == undisturbed
            stats = client.engine.stats()
            assert stats.worker_failovers >= 1 and client.engine.lease_recoveries == 0
            assert "paused" in (tmp / "gate.log").read_text()
            gate.unlink()  # it wakes up and writes its step into the held blocks
            deadline = time.monotonic() + 30
            while "resumed" not in (tmp / "gate.log").read_text() and time.monotonic() < deadline:
                time.sleep(0.05)
            again = [o.outputs[0].token_ids for o in client.generate(PROMPTS, GREEDY)]
            assert again == undisturbed
            assert admin.stats().prefix_cache_hits > 0
            assert admin.check_invariants().ok
            # Once the woken worker has completed a step, nothing of it can write: the held blocks go.
            while client.engine.stats().workers_ready < 2 and time.monotonic() < deadline:
                client.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
            client.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
            assert admin.stats().used_blocks == 0
    finally:
        gate.unlink(missing_ok=True)
        hooked.stop()
        admin.close()


def test_a_drain_moves_requests_between_steps_with_no_copy_and_no_recompute(pair):
    stack, _ = pair
    with Client(stack.memory_address, stack.worker_addresses, step_timeout=5, recovery_timeout=20) as client:
        undisturbed = [o.outputs[0].token_ids for o in client.generate(PROMPTS, GREEDY)]
        with pytest.raises(KeyError, match="not one of this engine's workers"):
            client.drain("127.0.0.1:1")
        handles = [client.submit(p, GREEDY) for p in PROMPTS]
        while min(len(h.request.seqs[0].generated) for h in handles) < 4:
            time.sleep(0.005)
        on_first = sum(h.request.worker == 0 for h in handles)
        reply = client.drain(stack.worker_addresses[0])
        assert reply == {"worker": stack.worker_addresses[0], "state": "draining", "moved_sequences": on_first}
        assert {h.request.worker for h in handles} == {1}
        assert [h.result(timeout=120).outputs[0].token_ids for h in handles] == undisturbed
        stats = client.engine.stats()
        assert (stats.recomputed_worker_failure, stats.recomputed_preemption, stats.worker_failovers) == (0, 0, 0)
        assert dict(stats.workers)[stack.worker_addresses[0]] == "draining" and stats.workers_ready == 1
        later = [client.submit(p, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)) for p in PROMPTS]
        [h.result(timeout=60) for h in later]
        assert {h.request.worker for h in later} == {1}  # no new work for the drained worker
        assert client.undrain(stack.worker_addresses[0])["state"] == "ready"
        again = [client.submit(p, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)) for p in PROMPTS]
        [h.result(timeout=60) for h in again]
        assert {h.request.worker for h in again} == {0, 1}


def test_a_sequence_its_worker_refuses_fails_its_request_alone(pair, tiny_model):
    """The hooked worker gets a forged grant for the request that carries a marker token
    (tests/hooks/spoil_grant.py): it refuses that sequence alone (StepResult.error), computes the
    others of the step, and the engine fails that request only and frees its blocks."""
    stack, tmp = pair
    hooked = pagedkv_process(["compute", "--memory", stack.memory_address, "--model", str(tiny_model[0])], tmp,
                             "failover-spoiled", env=hook_env("tests.hooks.spoil_grant",
                                                              PAGEDKV_TEST_SPOIL_TOKEN="777"))
    admin = _admin(stack)
    try:
        with Client(stack.memory_address, [hooked.address]) as client:
            undisturbed = [o.outputs[0].token_ids for o in client.generate(PROMPTS, GREEDY)]
            handles = [client.submit(p, GREEDY) for p in [*PROMPTS[:2], [*BASE_PROMPT, 777], *PROMPTS[2:]]]
            with pytest.raises(PermissionDenied, match="is not the memory service's grant for it"):
                handles[2].result(timeout=120)
            got = [h.result(timeout=120).outputs[0].token_ids for h in [*handles[:2], *handles[3:]]]
            assert got == undisturbed
            (refused_in,) = [t for t in client.engine.traces if handles[2].request.request_id in t.request_ids]
            assert len(refused_in.request_ids) > 1  # the step that refused it computed others
            assert client.engine.stats().worker_failovers == 0
        assert admin.stats().used_blocks == 0 and admin.check_invariants().ok
    finally:
        hooked.stop()
        admin.close()


def _wave(k: int) -> list[list[int]]:
    """Wave ``k`` of the rolling-restart trace: six prompts, each a prefix of two full blocks of its
    own (the same in every wave: cached by wave 0, a hit from wave 1 on) and a token of the wave."""
    return [[1000 + 10 * i + j for j in range(8)] + [50 + k] for i in range(6)]


@pytest.mark.slow
def test_a_rolling_restart_under_load_fails_nothing_recomputes_nothing_and_keeps_the_cache(pair, tiny_model):
    """Each worker in turn is drained while a wave of requests runs, stopped, and started again at
    its address; the next wave waits for it. The trace's outputs, its prefix-cache hits and its
    recomputed tokens equal those of the same trace with no restart."""
    stack, tmp = pair
    admin = _admin(stack)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    waves = 5 if not os.environ.get("PAGEDKV_TEST_FULL") else 9

    def run(client, restart) -> tuple[list, int]:
        admin.reset_prefix_cache()
        hits, out = admin.stats().prefix_cache_hits, []
        for k in range(waves):
            handles = [client.submit(p, params) for p in _wave(k)]
            if restart(k):
                w = (k // 2) % 2
                while min(len(h.request.seqs[0].generated) for h in handles) < 2:
                    time.sleep(0.005)
                reply = client.drain(stack.worker_addresses[w])
                assert reply["state"] == "draining" and reply["moved_sequences"] > 0  # it ran some of the wave
                port = int(stack.workers[w].address.rsplit(":", 1)[1])
                assert stack.workers[w].stop() == 0  # no step of it is in flight: it stops at once
                stack.workers[w] = pagedkv_process(["compute", "--memory", stack.memory_address, "--model",
                                                    str(tiny_model[0])], tmp, f"rolling-worker{w}-{k}", port=port)
            out += [h.result(timeout=120).outputs[0].token_ids for h in handles]
            deadline = time.monotonic() + 30
            while client.engine.stats().workers_ready < 2 and time.monotonic() < deadline:  # probed between steps
                client.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=1))
            assert client.engine.stats().workers_ready == 2
        return out, admin.stats().prefix_cache_hits - hits

    try:
        with Client(stack.memory_address, stack.worker_addresses, step_timeout=5, recovery_timeout=20) as client:
            base_out, base_hits = run(client, lambda k: False)
            got_out, got_hits = run(client, lambda k: k % 2 == 1 and k < 4 * (waves // 4))
            stats = client.engine.stats()
            assert got_out == base_out
            assert got_hits >= base_hits == 48 * (waves - 1)  # two blocks of 4 per request from wave 1 on
            assert (stats.worker_failovers, stats.recomputed_worker_failure, stats.recomputed_preemption) == (0, 0, 0)
            assert client.engine.lease_recoveries == 0 and admin.stats().num_leases == 1
        assert admin.check_invariants().ok
    finally:
        admin.close()


def test_the_re_prefill_baseline_computes_again_what_a_fork_keeps(pair, tiny_model):
    """``Failover.migrate = "recompute"`` (benchmarks/bench_failover.py's baseline): the killed worker's
    requests are prefilled again, prompt and generated tokens, where a fork computes one step again."""
    stack, tmp = pair
    with Client(stack.memory_address, stack.worker_addresses, step_timeout=5, recovery_timeout=20) as client:
        client.engine.failover.migrate = "recompute"
        undisturbed = [o.outputs[0].token_ids for o in client.generate(PROMPTS, GREEDY)]
        handles = [client.submit(p, GREEDY) for p in PROMPTS]
        while min(len(h.request.seqs[0].generated) for h in handles) < 6:
            time.sleep(0.005)
        on_killed = [h for h in handles if h.request.worker == 0]
        assert on_killed, "the least-loaded pinning puts requests on both workers"
        stack.workers[0].proc.kill()
        assert [h.result(timeout=120).outputs[0].token_ids for h in handles] == undisturbed
        stats = client.engine.stats()
        assert stats.worker_failovers == 1 and client.engine.lease_recoveries == 0
        assert stats.recomputed_worker_failure >= sum(len(h.request.prompt_token_ids) + 6 for h in on_killed)
    port = int(stack.workers[0].address.rsplit(":", 1)[1])
    stack.workers[0] = pagedkv_process(["compute", "--memory", stack.memory_address, "--model", str(tiny_model[0])],
                                       tmp, "failover-worker0-baseline", port=port)
