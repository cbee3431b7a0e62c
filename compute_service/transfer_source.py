"""A worker's NIXL agent over its mapped pool, published through its memory service so that workers
of other nodes can read this pool's blocks (DESIGN.md, "Nodes").

PublishTransferSource carries an HMAC under the pool generation's plane key
(:func:`pagedkv.runtime.transfer.sign_source`), which only processes that map the pool hold: no
other process can put a source of its own into this node's tickets. The memory service keeps a
source live for :data:`memory_service.transfers.SOURCE_TTL` seconds; the worker publishes it
again every :data:`SOURCE_REFRESH` seconds and withdraws it when it stops, so a ticket names a
source whose worker is gone for at most that TTL.
"""

from __future__ import annotations

import asyncio
import os

import grpc

from compute_service.worker import Worker
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.memory.v1 import memory_service_pb2_grpc as mpb_grpc
from pagedkv.runtime import tls
from pagedkv.runtime.logs import get_logger
from pagedkv.runtime.transfer import sign_source

log = get_logger("compute")

#: Seconds between two publications of a live worker's source.
SOURCE_REFRESH = 10.0


def publish_source(worker: Worker, address: str, files: tls.TlsFiles | None, withdraw: bool = False) -> None:
    """Publish (or withdraw) ``worker``'s transfer source, signed with its pool's plane key.

    Raises:
        grpc.RpcError: the memory service refused it or did not answer.
    """
    pool, agent = worker.pool, worker.transfer_agent
    if pool is None or agent is None:
        return
    s = agent.source().to_proto()
    with tls.channel(address, files) as ch:
        mpb_grpc.MemoryServiceStub(ch).PublishTransferSource(mpb.PublishTransferSourceRequest(
            pool_generation=pool.generation, source=s, withdraw=withdraw,
            signature=sign_source(pool.plane_key, pool.generation, s, withdraw)), timeout=10)


def publish_transfer_agent(worker: Worker, address: str, files: tls.TlsFiles | None) -> None:
    """Give ``worker`` a NIXL agent over its mapped pool and publish it (:func:`publish_source`).

    Raises:
        ImportError: NIXL is not installed.
        RuntimeError: the memory service refused the source (the agent is closed again).
    """
    from compute_service.transfer_agent import TransferAgent

    pool = worker.pool
    agent = TransferAgent(f"{pool.descriptor.node_name or pool.descriptor.pool_id}/{os.getpid()}/g{pool.generation}",
                          pool.tensor)
    worker.transfer_agent = agent
    try:
        publish_source(worker, address, files)
    except grpc.RpcError as e:
        worker.transfer_agent = None
        agent.close()
        raise RuntimeError(f"the memory service at {address} refused this worker's transfer source: "
                           f"{e.code().name}: {e.details()}") from None
    s = agent.source()
    log.info("transfer_agent_published", agent=s.agent_name, num_blocks=s.num_blocks, block_bytes=s.block_bytes)


async def keep_source_live(worker: Worker, address: str, files: tls.TlsFiles | None) -> None:
    """Publish the worker's source again every :data:`SOURCE_REFRESH` seconds (a background task)."""
    while True:
        await asyncio.sleep(SOURCE_REFRESH)
        try:
            await asyncio.to_thread(publish_source, worker, address, files)
        except grpc.RpcError as e:  # the memory service restarting: the remap publishes anew
            log.info("transfer_source_refresh_failed", code=e.code().name, error=e.details())


async def withdraw_source(worker: Worker, address: str, files: tls.TlsFiles | None) -> None:
    """Withdraw the worker's source as it stops (best effort: it expires otherwise)."""
    try:
        await asyncio.to_thread(publish_source, worker, address, files, True)
    except grpc.RpcError as e:
        log.info("transfer_source_withdraw_failed", code=e.code().name, error=e.details())
