"""``pagedkv compute``: start a compute worker.

Example::

    pagedkv compute --memory 127.0.0.1:50051 --host 127.0.0.1 --port 50052 --device cpu --model smollm2
    pagedkv compute --memory 127.0.0.1:50051 --model Qwen/Qwen2.5-0.5B-Instruct --revision main

Start-up: resolve ``--model`` (a repo id through the Hugging Face cache, downloading only when it
is not cached and HF_HUB_OFFLINE is unset; :mod:`pagedkv.model.source`), wait for the memory
service, read its pool descriptor (the layout
and the path of its worker socket), load the model, receive the pool's handle,
epoch table and plane key on that socket (``--memory-socket`` overrides the
path, for a container that mounts it elsewhere), map the pool and check that
its layout fits the model (a mismatch is a start-up error naming both); over an fp8 pool without scales yet, calibrate
them (:mod:`compute_service.kv_calibration`) and set them on the memory service; on a GPU, warm the
kernels and run one forward at ``--max-num-batched-tokens`` (:mod:`compute_service.profile_run`: a
step that does not fit refuses the start); then serve. A background task watches the memory
service's health: on NOT_SERVING (shutdown) or a new pool generation it drops the mapping, fails steps with
FAILED_PRECONDITION until a pool is mapped again, and re-maps the new pool
through the socket; it never computes on stale memory. ``--metrics-port`` serves the worker's step
metrics (:mod:`compute_service.metrics`) as Prometheus ``/metrics``; the ready file then names its
``metrics_port``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, replace

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from compute_service.device_sync import bind_compute_thread
from compute_service.kv_calibration import fit_kv_scales
from compute_service.metrics import WorkerMetrics, start_metrics_server
from compute_service.model.fused_decode import cpu_path
from compute_service.model.llama import LlamaForPagedLM
from compute_service.pool_map import MappedPool, map_pool
from compute_service.profile_run import profile_worker
from compute_service.server import SERVICE_NAME, ComputeServicer
from compute_service.step_inputs import MAX_STEP_SEQUENCES
from compute_service.transfer_source import keep_source_live, publish_transfer_agent, withdraw_source
from compute_service.warmup import warm_kernels
from compute_service.weights.load_progress import load_progress
from compute_service.weights.source import ModelConfig, check_model_source, load_model_source
from compute_service.worker import Worker
from pagedkv import config
from pagedkv.compute.v1 import compute_service_pb2_grpc as pb_grpc
from pagedkv.config import env, flags
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.memory.v1 import memory_service_pb2_grpc as mpb_grpc
from pagedkv.model.source import resolve_model
from pagedkv.runtime import test_hooks, tls
from pagedkv.runtime.logs import configure_logging, get_logger
from pagedkv.runtime.service import Bind, ServerSpec, run_server, serve_main

log = get_logger("compute_service")

def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Flags of ``pagedkv compute`` (also used to check docker-compose.yml)."""
    p = parser or argparse.ArgumentParser(prog="pagedkv compute", description="Run a compute worker.")
    p.add_argument("--memory", default=env("PAGEDKV_MEMORY", config.DEFAULT_MEMORY),
                   help=f"memory service address (default {config.DEFAULT_MEMORY})")
    flags.add_bind_args(p, "compute", config.COMPUTE_PORT)
    flags.add_device_arg(p, "compute", "cpu, cuda or cuda:N; a cuda pool is mapped on the GPU with its UUID")
    flags.add_model_args(p)
    flags.add_dtype_arg(p, help="weight and activation dtype (default auto: the pool's dtype; over an fp8 pool "
                                "the pool's device's " + flags.AUTO_DTYPE_HELP.removeprefix("auto: ") + ")")
    p.add_argument("--memory-socket", default=env("PAGEDKV_MEMORY_SOCKET"),
                   help="the memory service's worker socket here (default: the path its pool descriptor names)")
    p.add_argument("--memory-timeout", type=float, default=60.0,
                   help="seconds to wait for the memory service at start (default 60)")
    p.add_argument("--ready-file", default=None, help="write the bound address here as JSON once serving")
    p.add_argument("--metrics-port", type=int, default=env("PAGEDKV_COMPUTE_METRICS_PORT"),
                   help="serve Prometheus /metrics on this port of --host (0: any free port; the ready file's "
                        "metrics_port): pagedkv:worker_* step histograms and copy counters (default: off)")
    p.add_argument("--node-transfers", action="store_true", default=env("PAGEDKV_NODE_TRANSFERS"),
                   help="register the mapped pool with a NIXL agent and publish it through the memory service, so "
                        "workers of other nodes can read its blocks and this one theirs (needs nixl-cu12; trusted "
                        "network only: docs/security.md)")
    p.add_argument("--enforce-eager", action="store_true", default=env("PAGEDKV_ENFORCE_EAGER"),
                   help="run every step eagerly: no CUDA graphs for decode (as vLLM's flag)")
    p.add_argument("--max-cudagraph-capture-size", type=int, default=env("PAGEDKV_MAX_CUDAGRAPH_CAPTURE_SIZE"),
                   help="decode steps of up to this many sequences run in CUDA graphs, captured per batch size (1, 2, "
                        "4, then multiples of 8) when a GPU pool is mapped (default 256)")
    flags.add_max_batched_tokens_arg(p, "tokens of this worker's largest step: on a GPU a forward of that many "
                                        "tokens runs at start and the worker refuses to start when it does not fit "
                                        "(default 512, as pagedkv serve's)")
    flags.add_tls_args(p)  # also this worker's credentials towards the memory service
    flags.add_logging_args(p)
    return p


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """``pagedkv compute``'s flags, parsed and checked once (:meth:`from_args`)."""

    #: Where this worker listens.
    bind: Bind
    #: The memory service's address, host:port.
    memory: str
    #: "cpu", "cuda" or "cuda:N".
    device: str
    #: ``--model`` (a name, a .gguf file, a Hugging Face directory or repo id; after resolving, its local path).
    model: str
    #: ``--revision`` of a repo id; None: main.
    revision: str | None
    #: ``--dtype``; None: auto (decided by the pool, :func:`pagedkv.config.worker_dtype`).
    dtype: config.DType | None
    #: ``--memory-socket``; None: the path the pool descriptor names.
    memory_socket: str | None
    #: Seconds to wait for the memory service at start.
    memory_timeout: float
    #: Publish the mapped pool to other nodes' workers over NIXL.
    node_transfers: bool
    #: Decode steps of up to this many sequences in CUDA graphs (on a GPU pool); 0: ``--enforce-eager``.
    max_capture_size: int = 0
    #: Port of Prometheus /metrics (0: any free port); None: no metrics.
    metrics_port: int | None = None
    #: Tokens of the largest step, profiled at start on a GPU (``--max-num-batched-tokens``).
    max_num_batched_tokens: int = 512

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkerSpec:
        """Raises ValueError: bad TLS or bind flags, a dtype no model computes in, or a timeout <= 0."""
        if not args.memory_timeout > 0:
            raise ValueError(f"--memory-timeout must be > 0 seconds, got {args.memory_timeout}")
        if not 1 <= args.max_cudagraph_capture_size <= MAX_STEP_SEQUENCES:
            raise ValueError(f"--max-cudagraph-capture-size must be in [1, {MAX_STEP_SEQUENCES}] (a step's most "
                             f"sequences), got {args.max_cudagraph_capture_size}; --enforce-eager turns graphs off")
        if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must lie in 0-65535 (0: any free port), got {args.metrics_port}")
        if args.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {args.max_num_batched_tokens}")
        return cls(Bind.from_args(args), args.memory, args.device, args.model, args.revision,
                   config.model_dtype(args.dtype), args.memory_socket, args.memory_timeout, bool(args.node_transfers),
                   0 if args.enforce_eager else args.max_cudagraph_capture_size, args.metrics_port,
                   args.max_num_batched_tokens)


def model_dtype(flag: config.DType | str | None, desc: mpb.PoolDescriptor,
                checkpoint: str | None = None) -> torch.dtype:
    """The model's dtype over the pool ``desc`` describes: :func:`pagedkv.config.worker_dtype` of
    ``--dtype`` (``flag``; ``auto``: the pool's, over an fp8 pool :func:`pagedkv.config.default_dtype`
    of the pool's device and the ``checkpoint`` dtype, ModelConfig.dtype).

    Raises:
        ValueError: a dtype no model computes in, or another than a non-fp8 pool's.
    """
    cuda = desc.backend == mpb.POOL_BACKEND_CUDA
    saved = None if checkpoint is None else config.dtype(checkpoint)
    return config.worker_dtype(flag, config.dtype(desc.layout.dtype), cuda=cuda, checkpoint=saved).torch


def check_layout(desc: mpb.PoolDescriptor, config: ModelConfig) -> None:
    """Raise ValueError when the pool cannot hold this model's KV cache, naming both layouts."""
    lay = desc.layout
    pool = (lay.num_layers, lay.num_kv_heads, lay.head_dim)
    model = (config.num_layers, config.num_kv_heads, config.head_dim)
    if pool != model:
        raise ValueError(
            f"the pool's layout (num_layers, num_kv_heads, head_dim) = {pool} (model {desc.model!r}) does not fit "
            f"this worker's model {config.name!r} {model}; start the memory service with --model matching the worker")


def fetch_descriptor(address: str, timeout: float, files: tls.TlsFiles | None = None) -> mpb.PoolDescriptor:
    """The memory service's pool descriptor, waiting up to ``timeout`` seconds for it to serve.

    Raises:
        RuntimeError: the memory service did not answer in time.
    """
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    with tls.channel(address, files) as ch:
        stub = mpb_grpc.MemoryServiceStub(ch)
        while time.monotonic() < deadline:
            try:
                return stub.GetPoolDescriptor(mpb.GetPoolDescriptorRequest(), timeout=5).pool
            except grpc.RpcError as e:
                last = e
                time.sleep(0.25)
    raise RuntimeError(f"memory service at {address} did not answer within {timeout:.0f} s: {last}")


def _torch_device(device: str, desc: mpb.PoolDescriptor) -> str:
    if desc.backend == mpb.POOL_BACKEND_CUDA:
        if not device.startswith("cuda"):
            raise ValueError("the memory service exports a cuda pool; start the worker with --device cuda")
        return device  # map_pool resolves the pool's GPU by UUID; the model must sit on that GPU
    if device != "cpu":
        raise ValueError(f"the memory service exports a cpu pool; --device {device} cannot map it (use --device cpu)")
    return "cpu"


async def watch_memory_service(address: str, worker: Worker, health, compute: Executor,
                               socket_path: str | None = None, files: tls.TlsFiles | None = None,
                               node_transfers: bool = False) -> None:
    """Follow the memory service: drop the pool when it stops, map the new one when it is back.

    Mapping (through the worker socket, `socket_path` overriding the descriptor's) and dropping
    run on `compute`, the worker's one compute thread (see `swap_pool`). A mapping that fails
    (socket unreachable, another generation behind it) is logged and retried.
    """
    channel = tls.aio_channel(address, files)
    stub = health_pb2_grpc.HealthStub(channel)
    memory = mpb_grpc.MemoryServiceStub(channel)
    while True:
        try:
            async for resp in stub.Watch(health_pb2.HealthCheckRequest(service="")):
                if resp.status != health_pb2.HealthCheckResponse.SERVING:
                    break
                desc = (await memory.GetPoolDescriptor(mpb.GetPoolDescriptorRequest(), timeout=5)).pool
                if worker.pool is None or desc.generation != worker.pool.generation:
                    await swap_pool(worker, compute, _remap, worker, desc, socket_path, (address, files),
                                    node_transfers)
                    await health.set("", health_pb2.HealthCheckResponse.SERVING)
                    await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        except grpc.aio.AioRpcError as e:
            log.info("memory_service_unreachable", memory=address, code=e.code().name, error=e.details())
        except (OSError, ValueError, RuntimeError) as e:
            log.warning("pool_map_failed", memory=address, error=str(e))
        if worker.pool is not None:
            log.warning("pool_lost", memory=address, generation=worker.pool.generation)
            await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
            await swap_pool(worker, compute, worker.set_pool, None)
        await asyncio.sleep(0.5)


async def swap_pool(worker: Worker, compute: Executor, fn, *args) -> None:
    """Run `fn(*args)`, a pool drop or remap, on the compute thread, after the step in flight there.

    `pool_lost` is set first, from the caller's thread: that step then returns no results computed
    on the pool being dropped (it fails with FAILED_PRECONDITION); `Worker.set_pool` clears it.
    """
    worker.pool_lost.set()
    await asyncio.get_running_loop().run_in_executor(compute, fn, *args)


def _remap(worker: Worker, desc: mpb.PoolDescriptor, socket_path: str | None, memory: tuple[str, tls.TlsFiles | None],
           node_transfers: bool = False) -> None:
    check_layout(desc, worker.config)
    worker.set_pool(_map_with_scales(desc, socket_path, worker.model, worker.model_source, memory))
    if node_transfers:
        publish_transfer_agent(worker, *memory)
    log.info("pool_mapped", generation=desc.generation, backend=mpb.PoolBackend.Name(desc.backend),
             num_blocks=desc.layout.num_blocks)


def _map_with_scales(desc: mpb.PoolDescriptor, socket_path: str | None, model: LlamaForPagedLM, model_source: str,
                     memory: tuple[str, tls.TlsFiles | None], pool: MappedPool | None = None) -> MappedPool:
    """Map the pool (unless given ``pool``) and give it its fp8 scales (`fit_kv_scales`: the descriptor's, or
    calibrated and set); a pool whose scales fail is closed again, never served."""
    pool = pool or map_pool(desc, socket_path)
    try:
        fit_kv_scales(pool, model, model_source, *memory)
    except BaseException:
        pool.close()
        raise
    return pool


def _load(spec: WorkerSpec, desc: mpb.PoolDescriptor, device: str) -> tuple[Worker, str]:
    """Load the model, map the pool and check that they fit; returns the worker and its device.

    The config is read and checked against the pool before any weight; the weights then stream
    from the checkpoint tensor by tensor into the model (`compute_service.weights.checkpoint`), with a
    progress bar (`compute_service.weights.load_progress`). An fp8 pool then gets its scales
    (`compute_service.kv_calibration`).
    """
    t = time.perf_counter()
    config, weights = load_model_source(spec.model)
    log.info("model_config", model=config.name, architecture=config.architecture, num_layers=config.num_layers,
             sliding_window=config.sliding_window, eos_token_ids=list(config.eos_token_ids))
    if config.ignored_generation_keys:
        log.warning("generation_config_ignored_keys", keys=list(config.ignored_generation_keys),
                    message="generation_config.json keys not honoured: " + ", ".join(config.ignored_generation_keys))
    check_layout(desc, config)
    dtype = model_dtype(spec.dtype, desc, config.dtype)
    pool: MappedPool = map_pool(desc, spec.memory_socket)
    model_device = str(pool.tensor.device) if desc.backend == mpb.POOL_BACKEND_CUDA else device
    try:
        with load_progress(weights, config.name):
            model = LlamaForPagedLM(config, weights, device=model_device, dtype=dtype)
        weights.close()
        del weights
    except BaseException:
        pool.close()
        raise
    pool = _map_with_scales(desc, spec.memory_socket, model, spec.model, (spec.memory, spec.bind.tls), pool)
    if pool.tensor.is_cuda:  # compiled now, not in the first requests' steps (compute_service.warmup)
        bind_compute_thread(pool.tensor.device)
        warmed = warm_kernels(config.num_q_heads, pool.tensor, pool.kv_scales)
        log.info("kernels_warmed", seconds={k: round(v, 2) for k, v in warmed.items()})
        profile_worker(model, pool.tensor, spec.max_num_batched_tokens, pool.kv_scales, spec.memory, spec.bind.tls)
    log.info("model_loaded", model=config.name, architecture=config.architecture,
             seconds=round(time.perf_counter() - t, 2), weight_bytes=model.nbytes(), device=model_device,
             dtype=str(dtype).removeprefix("torch."), checkpoint_dtype=config.dtype,
             threads=torch.get_num_threads(), cpu_path=cpu_path(model))
    return Worker(model, config, pool, spec.model, spec.max_capture_size), model_device


#: Exit status of a worker whose device failed (a sticky CUDA error): its supervisor starts a fresh process.
EXIT_DEVICE_FAILED = 70
#: Seconds between NOT_SERVING and the exit, for the failed step's UNAVAILABLE reply to go out.
DEVICE_FAILURE_GRACE = 0.5


async def exit_on_device_failure(health, error: BaseException) -> None:
    """A sticky device error (compute_service.device_sync.is_fatal_device_error): this process's CUDA
    context is unusable, so report NOT_SERVING and exit with EXIT_DEVICE_FAILED (no cleanup: the
    context cannot run any; the kernel releases the mappings), instead of a worker that says
    SERVING and fails every step. The engine fails its sequences over; the supervisor restarts it."""
    log.error("device_failed", error=str(error), exit_status=EXIT_DEVICE_FAILED)
    await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    await asyncio.sleep(DEVICE_FAILURE_GRACE)
    os._exit(EXIT_DEVICE_FAILED)


async def serve(spec: WorkerSpec) -> None:
    # Before waiting for the memory service: a model that is not there fails at once.
    model = await asyncio.to_thread(resolve_model, spec.model, spec.revision)
    log.info("model_resolved", model=model.name, revision=model.revision, path=str(model.path))
    files = spec.bind.tls  # also this worker's credentials towards the memory service
    check_model_source(model.load_source)  # an unsupported model fails here, not after the memory service answers
    desc = await asyncio.to_thread(fetch_descriptor, spec.memory, spec.memory_timeout, files)
    device = _torch_device(spec.device, desc)
    # Every torch call of this process runs on one thread: torch's OpenMP runtime then keeps one
    # team of worker threads, which hand work over quickly; a second calling thread would add a
    # second team, and with more threads than cores each parallel region goes through futex sleeps.
    compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
    loop = asyncio.get_running_loop()
    worker, model_device = await loop.run_in_executor(compute, _load, replace(spec, model=model.load_source), desc,
                                                      device)
    if spec.node_transfers:
        await loop.run_in_executor(compute, publish_transfer_agent, worker, spec.memory, files)
    pool = worker.pool
    ready_info = {"memory": spec.memory, "model": spec.model, "revision": model.revision, "device": model_device,
                  "generation": pool.generation}
    if spec.metrics_port is not None:
        worker.metrics = WorkerMetrics()
        ready_info["metrics_port"] = start_metrics_server(worker.metrics, spec.bind.host, spec.metrics_port)
    servicer = ComputeServicer(worker, model, model_device, compute)
    from grpc_health.v1 import health

    health_servicer = health.aio.HealthServicer()
    worker.on_fatal = lambda e: loop.call_soon_threadsafe(lambda: asyncio.ensure_future(
        exit_on_device_failure(health_servicer, e)))
    server = ServerSpec.bound(
        spec.bind, SERVICE_NAME, lambda server: pb_grpc.add_ComputeServiceServicer_to_server(servicer, server),
        ready_info=ready_info,
        background=[lambda: watch_memory_service(spec.memory, worker, health_servicer, compute, spec.memory_socket,
                                                 files, spec.node_transfers),
                    *([lambda: keep_source_live(worker, spec.memory, files)] if spec.node_transfers else [])],
        health=health_servicer,
        on_shutdown=(lambda: withdraw_source(worker, spec.memory, files)) if spec.node_transfers else None,
    )
    await run_server(server)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``pagedkv compute``."""
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    test_hooks.install_from_env()
    errors = (ValueError, RuntimeError, OSError, LookupError, ImportError)
    return serve_main("compute", lambda: serve(WorkerSpec.from_args(args)), errors)


if __name__ == "__main__":
    raise SystemExit(main())
