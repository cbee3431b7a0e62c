"""A memory-service restart: the worker drops the old pool, refuses stale steps and maps the new one."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch
from conftest import pagedkv_process
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.credentials import new_lease

from client.ops.stack import ServiceProcess
from pagedkv.compute.v1 import compute_service_pb2 as cpb
from pagedkv.compute.v1 import compute_service_pb2_grpc as cpb_grpc
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.memory.v1 import memory_service_pb2_grpc as mpb_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memory_on(port: int, tmp_path, name: str) -> ServiceProcess:
    return pagedkv_process(["memory", "--num-blocks", "16", "--grace", "0.5"], tmp_path, name, port=port)


def step(stub, generation: int, memory) -> cpb.StepResponse:
    lease, md = new_lease(memory)
    resp = memory.AllocateSequences(mpb.AllocateSequencesRequest(
        lease_id=lease, sequences=[mpb.SequenceAllocation(num_tokens=3)]), metadata=md)
    (seq,), (grant,) = resp.sequences, resp.grants
    return stub.Step(cpb.StepRequest(pool_generation=generation, sequences=[cpb.StepSequence(
        seq_id=seq.seq_id, token_ids=[1, 2, 3], positions=[0, 1, 2], block_ids=seq.block_ids, grant=grant)]))


def wait_for(predicate, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("condition not reached")


def test_worker_follows_a_memory_service_restart(tmp_path):
    port = free_port()
    first = memory_on(port, tmp_path, "memory-a")
    worker = pagedkv_process(["compute", "--memory", first.address], tmp_path, "worker")
    try:
        with grpc.insecure_channel(first.address) as mch, grpc.insecure_channel(worker.address) as wch:
            memory, stub = mpb_grpc.MemoryServiceStub(mch), cpb_grpc.ComputeServiceStub(wch)
            health = health_pb2_grpc.HealthStub(wch)
            old = first.info["generation"]
            assert step(stub, old, memory).results[0].HasField("token_id")

            first.stop()  # NOT_SERVING, grace, pool released
            wait_for(
                lambda: health.Check(health_pb2.HealthCheckRequest()).status != health_pb2.HealthCheckResponse.SERVING
            )
            with pytest.raises(grpc.RpcError) as exc:
                stub.Step(
                    cpb.StepRequest(
                        pool_generation=old,
                        sequences=[cpb.StepSequence(seq_id=0, token_ids=[1], positions=[0], block_ids=[0])],
                    )
                )
            assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION

            second = memory_on(port, tmp_path, "memory-b")
            try:
                new = second.info["generation"]
                assert new > old
                wait_for(lambda: stub.GetModelInfo(cpb.GetModelInfoRequest()).pool_generation == new)
                with pytest.raises(grpc.RpcError) as exc:
                    step(stub, old, memory)  # a client still holding the old generation
                assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "generation" in exc.value.details()
                assert step(stub, new, memory).results[0].HasField("token_id")
                assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
            finally:
                second.stop()
    finally:
        worker.stop()
        first.stop()


class _SlowModel:
    """Stands in for the decoder: sleeps through its forward, returns fixed logits."""

    device = torch.device("cpu")

    def __init__(self, seconds: float, vocab: int):
        self.seconds, self.vocab, self.started = seconds, vocab, threading.Event()

    def __call__(self, input_ids, positions, pool, slots, plan, logits_indices, kv_scales=None):
        self.started.set()
        time.sleep(self.seconds)
        logits = torch.zeros(len(logits_indices), self.vocab)
        logits[:, 7] = 1.0
        return logits


async def test_pool_drop_voids_the_step_in_flight():
    # The memory service goes away while a step computes: the drop waits for the step (one compute
    # thread), and the step must not return tokens computed on the pool being dropped.
    from compute_service.main import swap_pool
    from compute_service.worker import Worker
    from pagedkv.grant.v1 import grant_pb2
    from pagedkv.runtime.errors import FailedPreconditionError
    from pagedkv.runtime.grants import sign_grant, token_digest

    layout = mpb.PoolLayout(block_size=4, num_blocks=8)
    key, epochs = b"k" * 32, np.ones(8, dtype=np.int64)
    pool = types.SimpleNamespace(
        descriptor=mpb.PoolDescriptor(layout=layout),
        generation=3,
        tensor=torch.zeros(8, 1, 2, 4, 1, 2),  # [blocks, layers, K/V, block_size, heads, dim]
        close=lambda: None,
        plane_key=key,
        epochs=epochs,
        kv_scales=None,
    )
    model = _SlowModel(1.0, vocab=32)
    worker = Worker(model, types.SimpleNamespace(vocab_size=32, sliding_window=None), pool)
    grant = sign_grant(
        key,
        grant_pb2.StepGrant(
            pool_generation=3,
            seq_id=0,
            block_ids=[5],
            block_epochs=[1],
            readable_tokens=0,
            write_end=2,
            token_digest=token_digest([1, 2]),
            expires_at=time.time() + 60,
        ),
    )
    request = cpb.StepRequest(
        pool_generation=3,
        sequences=[cpb.StepSequence(seq_id=0, token_ids=[1, 2], positions=[0, 1], block_ids=[5], grant=grant)],
    )
    with ThreadPoolExecutor(max_workers=1) as compute:
        loop = asyncio.get_running_loop()
        assert (await loop.run_in_executor(compute, worker.step, request)).results[0].token_id == 7
        model.started.clear()
        in_flight = loop.run_in_executor(compute, worker.step, request)
        await loop.run_in_executor(None, model.started.wait, 10)
        await swap_pool(worker, compute, worker.set_pool, None)
        with pytest.raises(FailedPreconditionError, match="went away during this step"):
            await in_flight
    assert worker.pool is None and not worker.pool_lost.is_set()
