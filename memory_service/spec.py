"""``pagedkv memory``'s flags, parsed and checked once into frozen values: the pool the service
makes (:class:`PoolSpec`) and the rest of the service (:class:`MemorySpec`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from memory_service.kv_events.endpoints import KvEventsSpec
from memory_service.quotas import BlockQuota
from pagedkv import config
from pagedkv.config import DEFAULT_CPU_KV_MEMORY, DType, host_cache_bytes, parse_bytes
from pagedkv.config.gpu_sizing import DEFAULT_GPU_MEMORY_UTILIZATION, check_utilization, refuse_on_cpu
from pagedkv.model.checkpoint_dtype import checkpoint_dtype
from pagedkv.runtime.service import Bind


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """The pool the flags ask for, parsed and checked once (:meth:`from_args`)."""

    #: "cpu", "cuda" or "cuda:N".
    device: str
    #: The pool's element type (``--kv-cache-dtype``); None: auto, decided once the model is read
    #: (:meth:`resolved_dtype`).
    dtype: DType | None
    #: Tokens per block.
    block_size: int
    #: Blocks in the pool (``--num-blocks``); None: sized by ``kv_cache_memory`` or ``gpu_memory_utilization``.
    num_blocks: int | None
    #: Bytes of the pool (``--kv-cache-memory``, or the CPU default); None with ``num_blocks`` or
    #: ``gpu_memory_utilization``.
    kv_cache_memory: int | None
    #: Bytes of the host tier (``--host-cache-memory``); 0: none.
    host_cache_memory: int
    #: An fp8 pool's scales file (``--kv-scales-file``).
    kv_scales_file: str | None
    #: The disk tier's directory (``--disk-cache-dir``) and bytes (``--disk-cache-size``); None: none.
    disk_cache_dir: str | None = None
    disk_cache_size: int | None = None
    #: What sizes the pool (:data:`pagedkv.config.gpu_sizing.SIZING_SOURCES`): "num_blocks",
    #: "kv_cache_memory", "gpu_memory_utilization" (a GPU pool by default) or "default" (a CPU pool's 1GiB).
    sizing: str = "kv_cache_memory"
    #: F of ``--gpu-memory-utilization`` when it sizes the pool (None otherwise: an absolute size won).
    gpu_memory_utilization: float | None = None
    #: W, workers that map the pool on its device (``--workers-per-device``); GPU sizing only.
    workers_per_device: int = 1
    #: Tokens of a step's largest batch (``--max-num-batched-tokens``): the workers' activation reserve.
    max_num_batched_tokens: int = 512
    #: The longest sequence the pool must hold once (``--max-model-len``); None: the model's context.
    max_model_len: int | None = None

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def device_index(self) -> int:
        """N of "cuda:N" (0 for "cuda" and "cpu")."""
        return int(self.device.split(":", 1)[1]) if ":" in self.device else 0

    def resolved_dtype(self, model_source: str) -> DType:
        """The pool's dtype: ``--kv-cache-dtype``, or :func:`pagedkv.config.pool_dtype`'s auto for the
        device and the checkpoint dtype of ``model_source`` (a resolved model's ``load_source``)."""
        return self.dtype or config.pool_dtype(None, self.cuda, checkpoint_dtype(model_source))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PoolSpec:
        """The pool's size, most explicit first: ``--num-blocks``, ``--kv-cache-memory``, then on a GPU
        ``--gpu-memory-utilization`` (default 0.9), on a CPU the 1GiB default.

        Raises ValueError: a device, dtype or size that is not valid, ``--gpu-memory-utilization``
        outside (0, 1] or on a cpu device, or scales for a pool that is not fp8."""
        cuda = args.device.startswith("cuda")
        if not cuda and args.device != "cpu":
            raise ValueError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
        utilization = getattr(args, "gpu_memory_utilization", None)
        if utilization is not None:
            utilization = check_utilization(utilization)
        refuse_on_cpu(args.device, utilization)
        sizing = _sizing_args(args)
        dtype = None if args.kv_cache_dtype in (None, "auto") else config.pool_dtype(args.kv_cache_dtype, cuda=cuda)
        if args.kv_scales_file and (dtype is None or not dtype.is_fp8):
            raise ValueError("--kv-scales-file is for an fp8 pool (--kv-cache-dtype fp8); this one holds "
                             f"{dtype or 'the auto dtype'}")
        disk_dir, disk_size = getattr(args, "disk_cache_dir", None), getattr(args, "disk_cache_size", None)
        if bool(disk_dir) != bool(disk_size):
            raise ValueError("--disk-cache-dir and --disk-cache-size go together: the disk tier needs both")
        if disk_dir and dtype is not None and dtype.is_fp8 and not args.kv_scales_file:
            raise ValueError("an fp8 pool's disk tier needs the scales fixed at start (--kv-scales-file): blocks on "
                             "disk are kept per set of scales, and calibrated scales are known only later")
        memory, source = None, "num_blocks"
        if args.num_blocks is not None:
            utilization = None
        elif args.kv_cache_memory:
            memory, source, utilization = parse_bytes(args.kv_cache_memory), "kv_cache_memory", None
        elif cuda:
            source, utilization = "gpu_memory_utilization", utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        else:
            memory, source = parse_bytes(DEFAULT_CPU_KV_MEMORY), "default"
        return cls(
            args.device,
            dtype,
            args.block_size,
            args.num_blocks,
            memory,
            host_cache_bytes(args.host_cache_memory),
            args.kv_scales_file,
            disk_dir or None,
            parse_bytes(disk_size) if disk_dir else None,
            source,
            utilization,
            **sizing,
        )


def _sizing_args(args: argparse.Namespace) -> dict:
    """``--workers-per-device``, ``--max-num-batched-tokens``, ``--max-model-len`` (defaults where a
    parser lacks them), checked.

    Raises:
        ValueError: a value < 1 (``--max-model-len`` < 2).
    """
    found = {"workers_per_device": getattr(args, "workers_per_device", 1),
             "max_num_batched_tokens": getattr(args, "max_num_batched_tokens", 512),
             "max_model_len": getattr(args, "max_model_len", None)}
    for name, value in found.items():
        if value is not None and value < (2 if name == "max_model_len" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be >= {2 if name == 'max_model_len' else 1}, "
                             f"got {value}")
    return found


@dataclass(frozen=True, slots=True)
class MemorySpec:
    """The memory service the flags ask for (:meth:`from_args`)."""

    #: Where the service listens.
    bind: Bind
    #: The pool.
    pool: PoolSpec
    #: Layout source (``--model``, config only) and its ``--revision``.
    model: str
    revision: str | None
    #: The pool's name; None: random.
    pool_id: str | None
    #: The Unix socket workers map the pool through; None: ``$PAGEDKV_HOME/run/memory-<pid>.sock``.
    worker_socket: str | None
    #: Where the admin token is written; None: ``$PAGEDKV_HOME/admin-token``.
    admin_token_file: str | None
    #: The shared secret of node transfers, and this node's name among a deployment's (None: the pool id).
    transfer_key_file: str | None
    node_name: str | None
    #: Seconds a lease lives without keep-alive.
    lease_ttl: float
    prefix_caching: bool
    #: KV events kept for replay.
    max_kv_events: int
    #: Quotas: block-table entries per lease (a count, a percent of the pool's or none; the admin's
    #: leases exempt), live sequences per lease, live leases, live leases per peer (None: no limit;
    #: the admin's leases do not count).
    max_blocks_per_lease: BlockQuota
    max_sequences_per_lease: int
    max_leases: int
    max_leases_per_peer: int | None
    #: Port of Prometheus /metrics (0: any free port); None: none.
    metrics_port: int | None
    #: Seconds between NOT_SERVING and releasing the pool.
    grace: float
    #: The KV events' ZMQ publisher in vLLM's format (``--kv-events-*``); None: off.
    kv_events: KvEventsSpec | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MemorySpec:
        """Raises ValueError: bad bind or TLS flags, a bad pool (:meth:`PoolSpec.from_args`), a TTL,
        event count or grace period out of range, or bad ``--kv-events-*`` flags (:meth:`KvEventsSpec.from_args`)."""
        if not args.lease_ttl > 0:
            raise ValueError(f"--lease-ttl must be > 0 seconds, got {args.lease_ttl}")
        if args.max_kv_events < 1:
            raise ValueError(f"--max-kv-events must be >= 1, got {args.max_kv_events}")
        if args.grace < 0:
            raise ValueError(f"--grace must be >= 0 seconds, got {args.grace}")
        return cls(
            Bind.from_args(args), PoolSpec.from_args(args), args.model, args.revision, args.pool_id,
            args.worker_socket, args.admin_token_file, args.transfer_key_file, args.node_name, args.lease_ttl,
            args.prefix_caching, args.max_kv_events, args.max_blocks_per_lease, args.max_sequences_per_lease,
            args.max_leases, args.max_leases_per_peer, args.metrics_port, args.grace, KvEventsSpec.from_args(args),
        )
