"""A Client that loses its lease recovers: a new lease, running requests recomputed, outputs unchanged.

Each test with processes pauses the engine thread mid-generation (a listener that blocks on the
first request's output), loses the lease while it waits (the memory service SIGKILLed and
restarted on the same port; or the keep-alives stopped until the lease expires), lets it go on,
and compares every output with an undisturbed run of the same requests.
"""

from __future__ import annotations

import socket
import threading
import time
import types

import grpc
import pytest
from conftest import ROOT, START_TIMEOUT, pagedkv_process

from client import Client, SamplingParams
from client.engine.recovery import LayoutChanged, Recovery, is_lost
from client.errors import FailedPrecondition, InvalidArgument, Unavailable
from client.ops.stack import LocalStack
from client.serve.metrics import ServeMetrics
from client.services import MemoryClient
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.runtime.errors import LEASE_EXPIRED

MEMORY_ARGS = ["--num-blocks", "128", "--block-size", "16", "--grace", "0.5"]

#: (prompt, params): greedy requests, beam search and parallel sampling (n=2, seeded).
REQUESTS = [
    ([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=8)),
    ([{"role": "user", "content": "List three prime numbers."}], SamplingParams(temperature=0, max_tokens=8)),
    ([{"role": "user", "content": "Write a haiku about memory."}], SamplingParams(temperature=0, max_tokens=8)),
    ([{"role": "user", "content": "Say hello."}], SamplingParams(n=2, num_beams=2, max_tokens=6)),
    ([{"role": "user", "content": "Name a colour."}], SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=8)),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def restartable(tmp_path_factory, tiny_model):
    """A memory service on a fixed port (so it can come back there) and one worker mapping its pool,
    on the tiny random Llama (every check compares runs of one model); a memory service started
    again comes back on it too ($PAGEDKV_MODEL while the module runs)."""
    env = pytest.MonkeyPatch()
    env.setenv("PAGEDKV_MODEL", str(tiny_model[0]))
    try:
        with LocalStack(MEMORY_ARGS, num_workers=1, run_dir=tmp_path_factory.mktemp("recovery"), name="recovery",
                        memory_port=free_port(), model=str(tiny_model[0]), cwd=ROOT, timeout=START_TIMEOUT) as s:
            yield s
    finally:
        env.undo()


def outputs(results) -> list[list[tuple[list[int], str | None]]]:
    """Per request, each output's (token ids, finish reason)."""
    return [[(o.token_ids, o.finish_reason) for o in r.outputs] for r in results]


@pytest.fixture(scope="module")
def undisturbed(restartable):
    with Client(restartable.memory_address, restartable.worker_addresses) as c:
        return outputs([c.submit(p, sp, cache_salt="undisturbed").result(120) for p, sp in REQUESTS])


def run_paused(client: Client, salt: str, pause_at: int, while_paused) -> list:
    """Run :data:`REQUESTS`, holding the engine thread (in the first request's listener) while
    ``while_paused()`` runs, after the first request's ``pause_at``-th output; returns the results.

    The first request runs one step alone; the others join in the next step, S, together. So at
    ``pause_at=2`` (the engine held after step S) the n=2 request has prefilled its prompt less
    the last token and the beam search has scored its first candidates: both fork in step S + 1.
    """
    alone, joined, paused, go = (threading.Event() for _ in range(4))
    seen = [0]

    def hold(out, error) -> None:  # engine thread
        seen[0] += 1
        if seen[0] == 1:
            alone.set()
            joined.wait(60)
        if seen[0] == pause_at:
            paused.set()
            go.wait(120)

    handles = [client.submit(*REQUESTS[0], cache_salt=salt, listener=hold)]
    assert alone.wait(120), "the first request produced no output"
    handles += [client.submit(p, sp, cache_salt=salt) for p, sp in REQUESTS[1:]]
    joined.set()
    assert paused.wait(120), f"the first request did not reach its output {pause_at}"
    try:
        running = client.engine.scheduler.running
        assert len(running) == len(REQUESTS) and all(r.seq_ids() for r in running), "not all mid-generation"
        while_paused()
    finally:
        go.set()
    return [h.result(180) for h in handles]


class Restart:
    """SIGKILL the stack's memory service (no NOT_SERVING, no grace: its lease table is gone), then
    start ``pagedkv memory <args>`` on the same port from another thread, so that the engine, let go
    meanwhile, meets UNAVAILABLE and waits for it."""

    def __init__(self, stack: LocalStack, run_dir, args: list[str]):
        port = int(stack.memory_address.rsplit(":", 1)[1])

        def start_again() -> None:
            stack.memory = pagedkv_process(["memory", *args], run_dir, "memory-restarted", port=port)

        self.stack, self.thread = stack, threading.Thread(target=start_again, daemon=True)

    def __call__(self) -> None:
        self.stack.memory.proc.kill()
        self.stack.memory.proc.wait()
        self.thread.start()


def test_memory_service_restart_mid_generation(restartable, undisturbed, tmp_path):
    with Client(restartable.memory_address, restartable.worker_addresses) as client:
        old_lease, old_generation = client.lease_id, client.engine.recovery.generation
        restart = Restart(restartable, tmp_path, MEMORY_ARGS)
        got = run_paused(client, "disturbed", 2, restart)  # the n=2 request and the beams mid-fork
        restart.thread.join()
        assert outputs(got) == undisturbed
        assert client.engine.lease_recoveries == 1
        assert client.lease_id != old_lease and client.engine.recovery.generation > old_generation
        assert client.engine.runner.pool_generation == client.engine.recovery.generation
        stats = client.stats()
        assert (stats.generation, stats.num_leases, stats.used_blocks) == (client.engine.recovery.generation, 1, 0)
        metrics = ServeMetrics("m", client)
        assert metrics.registry.get_sample_value("pagedkv:lease_recoveries_total", {"model_name": "m"}) == 1


def test_lease_expired_by_a_pause_is_recovered(restartable, undisturbed):
    # The whole client pauses longer than its lease's TTL: the engine thread is held in a listener,
    # and the keep-alives stop (as they would in a stopped process), so the memory service expires it.
    memory = MemoryClient(restartable.memory_address)
    with Client(restartable.memory_address, restartable.worker_addresses, lease_ttl=1.0) as client:
        old_lease = client.lease_id
        memory.add_lease(old_lease, client.engine.lease.secret)

        def expire() -> None:
            client.engine.lease.stop_renewing()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    memory.sequences(old_lease)  # a lookup: it does not renew the lease
                except FailedPrecondition as e:
                    assert e.reason == LEASE_EXPIRED and e.code == grpc.StatusCode.FAILED_PRECONDITION
                    return
                time.sleep(0.2)
            raise AssertionError("the lease did not expire")

        got = run_paused(client, "expired", 4, expire)  # every request decoding
        assert outputs(got) == undisturbed
        assert client.engine.lease_recoveries == 1
        assert client.lease_id != old_lease
        stats = memory.stats()
        assert (stats.num_leases, stats.used_blocks) == (1, 0)
    memory.close()


def test_memory_service_back_with_another_layout_fails_every_request(restartable, tmp_path):
    # Runs last in this module: it leaves the stack's memory service with another layout.
    with Client(restartable.memory_address, restartable.worker_addresses) as client:
        restart = Restart(restartable, tmp_path, ["--num-blocks", "64", *MEMORY_ARGS[2:]])
        with pytest.raises(LayoutChanged, match="came back with pool layout .*num_blocks=64.* but this client "
                                                "started with .*num_blocks=128"):
            run_paused(client, "layout", 2, restart)
        restart.thread.join()
        assert client.engine.lease_recoveries == 0 and not client.engine.has_work()


def test_recovery_raises_what_it_cannot_recover_from():
    # No service at all: a lost lease waits at most `timeout`, then fails with what it waited for;
    # an error that is not a lost lease or pool is raised as it is.
    memory = MemoryClient(f"127.0.0.1:{free_port()}", timeout=1)
    old = types.SimpleNamespace(lease_id="old", lost=None, close=lambda: None)
    engine = types.SimpleNamespace(memory=memory, workers=[], lease=old)
    recovery = Recovery(memory, engine.workers, lambda: engine.lease, mpb.PoolDescriptor(generation=1), timeout=0.3)
    try:
        with pytest.raises(Unavailable, match=r"could not get a new one \(not ready within 0.3 s\): the memory "
                                              f"service at {memory.address} to serve"):
            recovery.recover(Unavailable(grpc.StatusCode.UNAVAILABLE, "connection refused"), lambda: [])
        # The old lease is released: the next step recovers again, however long the outage was.
        with pytest.raises(Unavailable, match="connection refused") as pending:
            recovery.check_lease()
        assert is_lost(pending.value)
        bad = InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, "bad", "INVALID_ARGUMENT")
        with pytest.raises(InvalidArgument) as exc:
            recovery.recover(bad, lambda: [])
        assert exc.value is bad and engine.lease is old and recovery.recoveries == 0
        assert is_lost(FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION, "expired", LEASE_EXPIRED))
        assert not is_lost(FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION, "other", "FAILED_PRECONDITION"))
    finally:
        memory.close()
