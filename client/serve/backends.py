"""Where ``pagedkv serve`` finds its memory service and workers: attach, or start them itself.

In order (the first that names a memory service wins):

1. ``--memory`` / ``--workers`` (or ``PAGEDKV_MEMORY`` / ``PAGEDKV_WORKERS``, which are their
   flags' defaults);
2. the state file of ``pagedkv up`` whose processes are all alive;
3. embedded: a :class:`~client.ops.stack.LocalStack` of one memory service and one worker as child
   processes on loopback free ports, stopped when the server stops. A :class:`~client.ops.supervisor.Supervisor`
   restarts one that dies at its address (bounded, with backoff), and they stop by themselves when
   the server is gone, even after a SIGKILL (pagedkv.runtime.lifetime).

Every channel (health checks, the pool check, the engine's) uses ``Backends.tls``, the scheduler's
mutual-TLS files (``--tls-cert/--tls-key/--tls-ca``), and embedded services get the same files;
without them everything is plaintext on loopback.

Attaching, the pool flags given (``--block-size``, ``--kv-cache-memory``, ``--gpu-memory-utilization``,
``--host-cache-memory``, ``--kv-cache-dtype``, ``--dtype``, ``--model``, ``--revision``) are checked against the
running pool's descriptor, its sizing (GetStats) and the worker's model, and refused when they differ: a server must
never believe in a pool it does not have.
``--no-prefix-caching`` configures embedded services only, and is refused when attaching.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from client.ops.launcher import alive, check_tls, default_device, forget_stale, read_state
from client.ops.stack import LocalStack, serving
from client.ops.supervisor import Supervisor
from client.serve.config import ServeConfig
from client.services import MemoryClient, WorkerClient, admin_token_path
from pagedkv import config
from pagedkv.config import host_cache_bytes, parse_bytes
from pagedkv.config.gpu_sizing import refuse_on_cpu
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.model.checkpoint_dtype import checkpoint_dtype
from pagedkv.model.source import resolve_model
from pagedkv.runtime.tls import TlsFiles, from_args
from pagedkv.runtime.tls import channel as plane_channel


@dataclass
class Backends:
    """The addresses the server uses, and the stack it started (None when attached)."""

    memory: str
    workers: list[str]
    #: "flags", "state file" or "embedded".
    source: str
    stack: LocalStack | None = None
    #: Restarts the embedded services that die (None when attached).
    supervisor: Supervisor | None = None
    #: The scheduler's mutual-TLS files for every channel to the backends; None: plaintext.
    tls: TlsFiles | None = None
    #: The other nodes' (memory, workers) with ``--node``: the server serves while one node does.
    others: list[tuple[str, list[str]]] = field(default_factory=list)
    #: Where the memory service's admin token is (the dashboard lists every lease with it): an
    #: embedded service's own file, else ``--memory-admin-token-file``, else the default
    #: (client.services.admin_token_path); None: none.
    admin_token_file: str | None = None
    _channels: dict[str, grpc.Channel] = field(default_factory=dict, repr=False)

    def health(self, timeout: float = 1.0) -> tuple[bool, int, int]:
        """(a node's memory service and at least one of its workers answer SERVING (standard health
        service), workers that answer SERVING, workers in all), over every node: with ``--node``
        the server serves while one node does (a down node's workers count as not ready)."""
        up, ready, total = False, 0, 0
        for m, ws in [(self.memory, self.workers), *self.others]:
            serving_here = sum(self._serving(w, timeout) for w in ws)
            up = up or (serving_here > 0 and self._serving(m, timeout))
            ready, total = ready + serving_here, total + len(ws)
        return up, ready, total

    def _serving(self, address: str, timeout: float) -> bool:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = plane_channel(address, self.tls)
        return serving(ch, timeout)

    def close(self) -> None:
        """Close the health channels and stop an embedded stack (workers, then the memory service)."""
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()
        if self.supervisor is not None:
            self.supervisor.stop()
            self.supervisor = None
        if self.stack is not None:
            self.stack.stop()
            self.stack = None


def resolve(args: ServeConfig) -> Backends:
    """Attach to running services or start embedded ones (the module's order).

    Raises:
        ValueError: workers given without a memory service, pool flags that differ from the
            running pool's, or incomplete or unreadable TLS files.
        RuntimeError: embedded services failed to start (with their log's tail).
        client.errors.ServiceError: an attached service refused the descriptor calls.
    """
    # The scheduler's files, read here (not at parsing) so a missing file is a start-up error.
    tls = from_args(args)
    if args.nodes:
        first = args.nodes[0]
        found = Backends(first.memory, first.workers, "nodes", tls=tls,
                         others=[(n.memory, n.workers) for n in args.nodes[1:]])
    elif args.memory:
        found = Backends(args.memory, list(args.workers) or [config.DEFAULT_WORKER], "flags", tls=tls)
    elif args.workers:
        raise ValueError("--workers needs --memory (the memory service whose pool they map)")
    else:
        state = read_state()
        procs = [state["memory"], *state.get("workers", [])] if state else []
        if procs and all(alive(p["pid"]) for p in procs) and state.get("workers"):
            check_tls(tls)
            found = Backends(state["memory"]["address"], [w["address"] for w in state["workers"]], "state file",
                             tls=tls)
        else:
            forget_stale()  # none of its processes runs: reported and removed
            return _embedded(args, tls)
    check_pool(args, found)
    found.admin_token_file = str(args.memory_admin_token_file or admin_token_path())
    return found


def embedded_args(args: ServeConfig, device: str = "cpu") -> tuple[list[str], list[str]]:
    """The flags of the embedded memory service and of its workers, from ``pagedkv serve``'s.

    Every pool flag is explicit (the children inherit this process's environment, whose
    variables must not configure them behind the server's back); :class:`~client.ops.stack.LocalStack`
    adds ``--host``, ``--port``, ``--device``, ``--model``, ``--revision`` and TLS, and :func:`_embedded`
    ``--log-level``. Workers get ``--dtype`` (the model's), the memory service the pool's flags; both
    resolved here (:func:`resolved_dtypes` on ``device``), so that the children run what the server reports;
    workers also ``--enforce-eager`` when given. Both get ``--max-num-batched-tokens`` (a GPU pool's
    activation reserve, a GPU worker's profile run); the memory service ``--gpu-memory-utilization``
    and ``--max-model-len`` when given (one worker: ``--workers-per-device 1``).

    Raises:
        ValueError: ``--gpu-memory-utilization`` for a cpu ``device``.
    """
    refuse_on_cpu(device, args.gpu_memory_utilization)
    model_dtype, pool_dtype = resolved_dtypes(args, device)
    batch = ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    memory_args = ["--block-size", str(args.block_size or 16),
                   "--kv-cache-dtype", pool_dtype.name,
                   "--host-cache-memory", args.host_cache_memory or "0", *batch]
    if args.kv_cache_memory:
        memory_args += ["--kv-cache-memory", args.kv_cache_memory]
    if args.gpu_memory_utilization is not None:
        memory_args += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.max_model_len is not None:
        memory_args += ["--max-model-len", str(args.max_model_len)]
    if args.kv_scales_file:
        memory_args += ["--kv-scales-file", args.kv_scales_file]
    if args.disk_cache_dir:
        memory_args += ["--disk-cache-dir", args.disk_cache_dir, "--disk-cache-size", args.disk_cache_size or ""]
    if not args.prefix_caching:
        memory_args.append("--no-prefix-caching")
    return memory_args, ["--dtype", model_dtype.name, *(["--enforce-eager"] if args.enforce_eager else []), *batch]


def resolved_dtypes(args: ServeConfig, device: str) -> tuple[config.DType, config.DType]:
    """(model dtype, pool dtype) of embedded services on ``device``, by the services' own rules:
    the pool's is ``--kv-cache-dtype`` (``--dtype``'s when only that is given) or
    :func:`pagedkv.config.pool_dtype`'s auto, the model's :func:`pagedkv.config.worker_dtype` over it.
    Where auto decides, the model's checkpoint dtype is read from its config alone."""
    cuda = device.startswith("cuda")
    pool, checkpoint = args.pool_dtype, None
    if args.model_dtype is None and (pool is None or pool.is_fp8):  # auto decides: the checkpoint's dtype
        try:
            source = resolve_model(args.model or "smollm2", args.revision, files="config", download=False).load_source
            checkpoint = checkpoint_dtype(source)
        except (OSError, ValueError):  # the children report a model that is not there
            pass
    pool = pool or config.pool_dtype(None, cuda, checkpoint)
    return config.worker_dtype(args.model_dtype, pool, cuda, checkpoint), pool


def _embedded(args: ServeConfig, tls: TlsFiles | None) -> Backends:
    device = args.device or default_device()
    memory_args, worker_args = embedded_args(args, device)
    log_level = ["--log-level", args.log_level]
    memory_args, worker_args = [*log_level, *memory_args], [*log_level, *worker_args]
    stack = LocalStack(memory_args, worker_args=worker_args, device=device,
                       model=args.model or "smollm2",
                       revision=args.revision, host="127.0.0.1", name="serve", tls=tls).start()
    return Backends(stack.memory_address, stack.worker_addresses, "embedded", stack, Supervisor(stack).start(),
                    tls=tls, admin_token_file=stack.memory.info.get("admin_token_file"))


def check_pool(args: ServeConfig, backends: Backends) -> None:
    """Refuse pool flags that the running pool does not match.

    Raises:
        ValueError: naming each flag, the value given and the pool's.
    """
    memory = MemoryClient(backends.memory, timeout=10, tls=backends.tls)
    try:
        pool = memory.pool()
        layout = pool.layout
        sizing = memory.stats().sizing if args.gpu_memory_utilization is not None else None
    finally:
        memory.close()
    wrong = []
    if sizing is not None and (sizing.source != mpb.POOL_SIZING_SOURCE_GPU_MEMORY_UTILIZATION
                               or abs(sizing.utilization - args.gpu_memory_utilization) > 1e-9):
        how = mpb.PoolSizingSource.Name(sizing.source).removeprefix("POOL_SIZING_SOURCE_").lower()
        wrong.append(f"--gpu-memory-utilization {args.gpu_memory_utilization} (the pool was sized by {how}"
                     + (f" {sizing.utilization}" if sizing.utilization else "") + ")")
    if not args.prefix_caching:
        wrong.append("--no-prefix-caching (it configures embedded services; start the memory service with it)")
    if args.kv_scales_file:
        wrong.append("--kv-scales-file (it configures embedded services; start the memory service with it)")
    if args.block_size is not None and args.block_size != layout.block_size:
        wrong.append(f"--block-size {args.block_size} (the pool's is {layout.block_size})")
    pool_dtype = config.dtype(layout.dtype)
    if args.kv_cache_dtype not in (None, "auto"):  # names the pool's dtype
        dtype_differs = args.pool_dtype != pool_dtype
    else:  # --dtype alone: the model's, which must pair with the pool's (an fp8 pool takes any)
        dtype_differs = args.model_dtype is not None and not config.pairs(args.model_dtype, pool_dtype)
    if dtype_differs:
        wrong.append(f"--kv-cache-dtype/--dtype {args.pool_dtype} (the pool's is {layout.dtype})")
    if args.kv_cache_memory:
        want = parse_bytes(args.kv_cache_memory) // pool.block_nbytes if pool.block_nbytes else 0  # the pool's block
        if want != layout.num_blocks:
            wrong.append(f"--kv-cache-memory {args.kv_cache_memory} ({want} blocks; the pool has {layout.num_blocks})")
    if args.host_cache_memory:
        want = host_cache_bytes(args.host_cache_memory) // pool.block_nbytes if pool.block_nbytes else 0
        if want != pool.host_num_blocks:
            wrong.append(f"--host-cache-memory {args.host_cache_memory} ({want} blocks; the host tier has "
                         f"{pool.host_num_blocks})")
    if args.model or args.revision:
        worker = WorkerClient(backends.workers[0], tls=backends.tls)
        try:
            info = worker.model_info()
        finally:
            worker.close()
        if args.model and args.model not in (info.model_source, info.weights_path, info.model_name):
            wrong.append(f"--model {args.model} (the workers run {info.model_source})")
        if args.revision and args.revision != info.revision and _revision(args.model or info.model_source,
                                                                          args.revision) != info.revision:
            wrong.append(f"--revision {args.revision} (the workers run revision {info.revision})")
    if wrong:
        raise ValueError("attached to a running pool that differs from the flags: " + "; ".join(wrong))


def _revision(model: str, revision: str) -> str | None:
    """The commit ``revision`` of ``model`` names in this host's Hugging Face cache (None: unknown here)."""
    try:
        return resolve_model(model, revision, files="config", download=False).revision
    except (OSError, ValueError):
        return None
