"""``pagedkv memory``: start the memory service.

Example::

    pagedkv memory --host 127.0.0.1 --port 50051 --device cpu --block-size 16 \\
        --kv-cache-memory 1GiB --model smollm2 --lease-ttl 10 --ready-file /tmp/mem.json

``--model`` (with ``--revision``) is resolved as the workers resolve it (:mod:`pagedkv.model.source`),
fetching only the repo's config.json and generation_config.json: the pool's layout comes from
the config alone, no weights.
``--port 0`` binds a free port; the ready file (JSON: address, host, port, pid,
pool_id, generation, metrics_port, worker_socket, admin_token_file, revision) says which. Workers of the same uid
receive the pool's handle on the Unix socket ``--worker-socket`` (default
``$PAGEDKV_HOME/run/memory-<pid>.sock``; see :mod:`memory_service.worker_socket`). At start the service
writes a fresh admin token to ``--admin-token-file`` (mode 0600; default
``$PAGEDKV_HOME/admin-token``): ``authorization: Bearer <token>`` makes a caller the
admin (memory_service/authz.py). ``--max-blocks-per-lease`` and
``--max-sequences-per-lease`` set per-lease quotas (default: half the pool's blocks, 16,384 sequences,
so that dropping one lease stays bounded work on the event loop), ``--max-leases-per-peer`` the live
leases of one caller (default 64); the admin's leases are exempt from the first and the last
(:mod:`memory_service.quotas`). Automatic prefix caching is on
unless ``--no-prefix-caching``; ``--metrics-port`` serves Prometheus metrics. ``--kv-events-endpoint``
also publishes the KV event log in vLLM's ZMQ/msgpack format (:mod:`memory_service.kv_events`; the
ready file names the bound endpoints). SIGTERM marks the service NOT_SERVING
(workers
watching health drop their mapping), closes the worker socket, waits the grace
period, stops the server, then releases the pool.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
from pathlib import Path

from memory_service.authz import create_admin_token
from memory_service.kv_events.endpoints import add_kv_events_args
from memory_service.kv_events.publisher import open_publisher
from memory_service.manager.block_manager import BlockManager
from memory_service.pool import CpuPool, CudaPool, Pool
from memory_service.quotas import DEFAULT_BLOCKS_PER_LEASE, DEFAULT_MAX_LEASES_PER_PEER, parse_block_quota, parse_limit
from memory_service.server import SERVICE_NAME, MemoryServicer, expire_leases_forever
from memory_service.sizing import log_capacity, plan_pool
from memory_service.spec import MemorySpec, PoolSpec
from memory_service.step_grants import GrantSigner
from memory_service.tiers.disk_tier import DiskTier
from memory_service.transfers import NodeTransfers
from memory_service.worker_socket import WorkerSocketServer
from pagedkv import config
from pagedkv.config import (
    env,
    flags,
)
from pagedkv.memory.v1 import memory_service_pb2 as pb
from pagedkv.memory.v1 import memory_service_pb2_grpc as pb_grpc
from pagedkv.model.source import ResolvedModel, resolve_model
from pagedkv.runtime import test_hooks
from pagedkv.runtime.credentials import default_admin_token_file
from pagedkv.runtime.kv_scales import load_scales_file
from pagedkv.runtime.logs import configure_logging, get_logger
from pagedkv.runtime.service import ServerSpec, run_server, serve_main
from pagedkv.runtime.transfer import load_transfer_key

log = get_logger("memory_service")

#: Live sequences one lease may hold unless --max-sequences-per-lease says otherwise: an expired or
#: released lease's sequences leave the table in one turn of the event loop (65,536 took ~90 ms on
#: a quiet 2-core VM, 16,384 take ~22 ms), and a scheduler runs far fewer at once (vLLM: 256).
DEFAULT_MAX_SEQUENCES_PER_LEASE = 16_384
#: Live leases unless --max-leases says otherwise: every lookup's expiry check walks the table
#: (~55 ns a lease), and one caller could otherwise open leases without end.
DEFAULT_MAX_LEASES = 4096


def _quota(text: str) -> int:
    """A quota flag's value: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"a quota must be >= 1 (leave the flag out for none), got {value}")
    return value


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Flags of ``pagedkv memory`` (also used to check docker-compose.yml).

    ``--dtype`` is refused (exit 2): it is the model's dtype; the pool's is ``--kv-cache-dtype``.
    """
    p = parser or argparse.ArgumentParser(prog="pagedkv memory", description="Run the KV-cache memory service.")
    flags.add_bind_args(p, "memory", config.MEMORY_PORT)
    flags.add_device_arg(p, "memory", "cpu, cuda or cuda:N (default cpu)")
    flags.add_pool_args(p, num_blocks=True, kv_cache_dtype=True, kv_cache_dtype_help=(
        f"the pool's element type (default {flags.AUTO_DTYPE_HELP}); fp8 (= fp8_e4m3) stores KV in "
        "one byte with static scales per (layer, KV head), from a worker's calibration pass or --kv-scales-file: "
        "4x the tokens of float32 in the same memory"))
    flags.refuse_pool_dtype_flag(p)
    _add_gpu_sizing_args(p)
    flags.add_model_args(p, help="layout source: " + flags.MODEL_HELP + "; only its config is read")
    p.add_argument("--kv-scales-file", default=env("PAGEDKV_KV_SCALES_FILE"),
                   help="an fp8 pool's scales, JSON {\"k_scale\": [[...]], \"v_scale\": [[...]]} of [num_layers]"
                        "[num_kv_heads] (default: the first worker calibrates them)")
    p.add_argument("--lease-ttl", type=float, default=10.0, help="lease TTL in seconds without keep-alive (default 10)")
    p.add_argument(
        "--max-kv-events",
        type=int,
        default=10_000,
        help="KV events kept for StreamKvEvents replay; a subscriber further behind is told what it lost "
        "(default 10000)",
    )
    p.add_argument("--pool-id", default=None, help="pool name (default: random)")
    p.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="turn automatic prefix caching off (on by default)",
    )
    p.add_argument(
        "--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port (0 = any free port): "
        "pagedkv:* names, and for one release their older pagedkv_* names as deprecated aliases (same values)"
    )
    p.add_argument("--ready-file", default=None, help="write the bound address here as JSON once serving")
    p.add_argument(
        "--worker-socket",
        default=env("PAGEDKV_WORKER_SOCKET"),
        help="Unix socket where workers (same uid) receive the pool's handle "
        "(default $PAGEDKV_HOME/run/memory-<pid>.sock)",
    )
    p.add_argument(
        "--grace", type=float, default=2.0, help="seconds between NOT_SERVING and releasing the pool (default 2)"
    )
    flags.add_tls_args(p)
    flags.add_logging_args(p)
    _add_trust_args(p)
    add_kv_events_args(p)
    return p


def _add_gpu_sizing_args(p: argparse.ArgumentParser) -> None:
    """What a GPU pool sized by --gpu-memory-utilization leaves the workers (memory_service.sizing)."""
    p.add_argument("--workers-per-device", type=int, default=env("PAGEDKV_WORKERS_PER_DEVICE"), metavar="W",
                   help="workers that map the pool on its GPU, each with its own weights and activations: "
                        "--gpu-memory-utilization sets W of them aside (default 1)")
    flags.add_max_batched_tokens_arg(p, "tokens of the workers' largest step: --gpu-memory-utilization sets each "
                                        "worker's activations at it aside (default 512, as pagedkv serve's)")
    p.add_argument("--max-model-len", type=int, default=env("PAGEDKV_MAX_MODEL_LEN"),
                   help="the longest sequence, in tokens: a pool sized by --gpu-memory-utilization must hold one "
                        "(default: the model's context length)")


def _add_trust_args(p: argparse.ArgumentParser) -> None:
    """Who may do what: the admin token, per-lease quotas, node transfers."""
    p.add_argument(
        "--admin-token-file",
        default=None,
        help="write a fresh admin token here at start, mode 0600 (default $PAGEDKV_HOME/admin-token)",
    )
    p.add_argument(
        "--max-blocks-per-lease",
        type=parse_block_quota,
        default=env("PAGEDKV_MAX_BLOCKS_PER_LEASE"),
        metavar="N|P%|none",
        help=f"quota of block-table entries per lease, a shared block counting for each holder: N blocks, P%% of "
        f"the pool's, or 0 / none for no quota (default {DEFAULT_BLOCKS_PER_LEASE.replace('%', '%%')}); a lease "
        "the admin created (admin token or certificate, as pagedkv serve does) is exempt",
    )
    p.add_argument(
        "--max-leases-per-peer",
        type=parse_limit,
        default=env("PAGEDKV_MAX_LEASES_PER_PEER"),
        metavar="N|none",
        help=f"most live leases of one caller: a local uid on loopback, a client certificate under TLS "
        f"(default {DEFAULT_MAX_LEASES_PER_PEER}; 0 / none: no limit); the admin's leases do not count",
    )
    p.add_argument(
        "--max-leases",
        type=_quota,
        default=DEFAULT_MAX_LEASES,
        help=f"most live leases (default {DEFAULT_MAX_LEASES}); CreateLease past it is RESOURCE_EXHAUSTED "
        "with reason QUOTA_EXCEEDED, so per-lease quotas bound what leases can hold in all",
    )
    p.add_argument(
        "--max-sequences-per-lease",
        type=_quota,
        default=DEFAULT_MAX_SEQUENCES_PER_LEASE,
        help=f"quota of live sequences per lease (default {DEFAULT_MAX_SEQUENCES_PER_LEASE}: dropping a "
        "lease removes its sequences in one turn of the event loop)",
    )
    p.add_argument(
        "--node-name",
        default=env("PAGEDKV_NODE_NAME"),
        help="this node's name among a deployment's nodes (default: the pool id)",
    )
    p.add_argument(
        "--transfer-key-file",
        default=env("PAGEDKV_TRANSFER_KEY_FILE"),
        help="the 32-byte hex secret every memory service of a deployment shares, mode 0600 "
        "(openssl rand -hex 32): with it this node exports cached prefixes to other nodes and takes "
        "theirs (node transfers over NIXL, trusted network only: docs/security.md)",
    )


def create_pool(service: MemorySpec, model: ResolvedModel | None = None) -> Pool:
    """The pool ``service`` asks for (:class:`PoolSpec`), sized by :func:`memory_service.sizing.plan_pool`
    (``pool.sizing`` says how); its layout from ``model`` (default: ``service.model`` resolved, config only).

    Raises:
        ValueError: a pool that does not fit the layout or the device's budget, or an unreadable scales file.
        RuntimeError: cuda requested without CuPy.
    """
    spec = service.pool
    model = model or resolve_model(service.model, service.revision, files="config")
    plan = plan_pool(spec, model)
    layout = plan.layout
    host_blocks = spec.host_cache_memory // layout.block_nbytes
    if spec.host_cache_memory and not host_blocks:
        raise ValueError(
            f"--host-cache-memory {spec.host_cache_memory} bytes holds no block of {layout.block_nbytes} "
            "bytes; give at least one block's size, or 0 for no host tier"
        )
    if spec.disk_cache_dir and not host_blocks:  # every disk copy stages through a host block
        host_blocks = DISK_STAGING_BLOCKS
        log.info("disk_staging_host_tier", blocks=host_blocks, bytes=host_blocks * layout.block_nbytes,
                 message="a disk tier without --host-cache-memory stages through a small host tier")
    scales = None
    if spec.kv_scales_file:
        try:
            scales = load_scales_file(spec.kv_scales_file, layout.num_layers, layout.num_kv_heads)
        except OSError as e:
            raise ValueError(f"--kv-scales-file {spec.kv_scales_file}: cannot read it: {e.strerror or e}") from None
    if spec.cuda:
        pool = CudaPool(layout, device_index=spec.device_index, pool_id=service.pool_id, model=service.model,
                        host_num_blocks=host_blocks)
    else:
        pool = CpuPool(layout, pool_id=service.pool_id, model=service.model, host_num_blocks=host_blocks)
    pool.sizing = plan.sizing
    log_capacity(layout, plan.sizing)
    if scales is not None:
        pool.set_kv_scales(scales)
    return pool


#: Host blocks made to stage disk copies through when a disk tier has no --host-cache-memory.
DISK_STAGING_BLOCKS = 64


def model_identity(pool: Pool, model, scales: pb.KvScales | None) -> dict:
    """What a block's KV depends on besides its tokens (the disk tier keeps blocks apart by it):
    the model's name, source and revision, the pool's KV dtype, block size and layout, and an fp8
    pool's scales (their SHA-256)."""
    lay = pool.layout
    ident = {"model": pool.model, "source": str(model.load_source), "revision": model.revision,
             "kv_dtype": lay.dtype.name, "block_size": lay.block_size,
             "layout": [lay.num_layers, lay.num_kv_heads, lay.head_dim]}
    if lay.dtype.is_fp8:
        ident["kv_scales_sha256"] = hashlib.sha256(scales.SerializeToString(deterministic=True)).hexdigest()
    return ident


def open_disk_tier(spec: PoolSpec, pool: Pool, model) -> DiskTier | None:
    """The disk tier ``--disk-cache-dir`` asks for, its folder in the pool's descriptor; None without one.

    Raises:
        ValueError: a size that holds no block.
        PermissionError: a directory another uid owns.
    """
    if not spec.disk_cache_dir:
        return None
    ident = model_identity(pool, model, pool.kv_scales)
    disk = DiskTier(Path(spec.disk_cache_dir), ident, pool.layout.block_nbytes, spec.disk_cache_size)
    pool.disk_tier = pb.DiskTierInfo(folder=str(disk.folder), slot_bytes=disk.slot_bytes,
                                     slots_per_slab=disk.slots_per_slab, num_slots=disk.num_slots,
                                     identity=disk.identity)
    log.info("disk_tier", folder=str(disk.folder), slots=disk.num_slots, recovered=disk.recovered,
             torn_headers=disk.unreadable_at_start)
    return disk


async def serve(spec: MemorySpec) -> None:
    """Create the pool and serve until SIGTERM."""
    model = await asyncio.to_thread(resolve_model, spec.model, spec.revision, files="config")
    log.info("model_resolved", model=model.name, revision=model.revision, path=str(model.path))
    transfer_key = load_transfer_key(spec.transfer_key_file) if spec.transfer_key_file else None
    token_file = os.path.abspath(spec.admin_token_file or default_admin_token_file())
    admin_token = create_admin_token(token_file)
    pool = create_pool(spec, model)
    sock = WorkerSocketServer(pool, spec.worker_socket)
    try:
        await sock.start()
    except BaseException:
        pool.close()
        raise
    disk = open_disk_tier(spec.pool, pool, model)
    manager = BlockManager(
        pool.layout.num_blocks,
        pool.layout.block_size,
        lease_ttl=spec.lease_ttl,
        prefix_caching=spec.prefix_caching,
        epochs=pool.epochs,
        max_events=spec.max_kv_events,
        max_blocks_per_lease=spec.max_blocks_per_lease.resolve(pool.layout.num_blocks),
        max_sequences_per_lease=spec.max_sequences_per_lease,
        max_leases=spec.max_leases,
        max_leases_per_peer=spec.max_leases_per_peer,
        host_num_blocks=pool.host_num_blocks,
        host_epochs=pool.host_epochs,
        disk=disk,
    )
    ready_info = {
        "pool_id": pool.pool_id,
        "generation": pool.generation,
        "num_blocks": pool.layout.num_blocks,
        "worker_socket": pool.worker_socket,
        "admin_token_file": token_file,
        "revision": model.revision,
    }
    events = None
    if spec.kv_events is not None:
        events = open_publisher(spec.kv_events, manager.prefix_cache, pool.layout.block_size, spec.max_kv_events,
                                os.path.dirname(token_file))
        ready_info.update(events.ready_info())
    if spec.metrics_port is not None:
        from memory_service.metrics import start_metrics_server

        ready_info["metrics_port"] = start_metrics_server(manager, spec.bind.host, spec.metrics_port)
    signer = GrantSigner(
        pool.plane_key,
        pool.generation,
        manager.pool.epochs,
        host_epochs=manager.tiers.host.epochs if manager.tiers.host is not None else None,
    )
    transfers = NodeTransfers(spec.node_name or pool.pool_id, pool.descriptor(), transfer_key)
    servicer = MemoryServicer(
        manager, pool, signer, admin_token=admin_token, admin_token_file=token_file, transfers=transfers
    )

    async def grace() -> None:
        # Workers watching health see NOT_SERVING now; no new one gets the pool; give them time
        # to drop the mapping.
        await sock.close()
        await asyncio.sleep(spec.grace)

    async def release() -> None:
        if events is not None:
            events.close()
        pool.close()

    server = ServerSpec.bound(
        spec.bind,
        SERVICE_NAME,
        lambda server: pb_grpc.add_MemoryServiceServicer_to_server(servicer, server),
        ready_info=ready_info,
        on_shutdown=grace,
        on_stopped=release,
        background=[lambda: expire_leases_forever(manager, min(1.0, spec.lease_ttl / 4))],
    )
    try:
        await run_server(server)
    finally:
        if events is not None:
            events.close()
        await sock.close()
        pool.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``pagedkv memory``."""
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    test_hooks.install_from_env()
    return serve_main("memory", lambda: serve(MemorySpec.from_args(args)), (ValueError, RuntimeError, OSError))


if __name__ == "__main__":
    raise SystemExit(main())
