"""How many blocks the pool gets, and why: the layout the memory service allocates and the
``PoolSizing`` that GetStats reports.

Most explicit first (:meth:`memory_service.spec.PoolSpec.from_args` decides which):

- ``--num-blocks N``: N blocks;
- ``--kv-cache-memory BYTES``: as many blocks as fit;
- on a GPU, ``--gpu-memory-utilization F`` (default 0.9): vLLM's budget,
  ``floor(F * total) - W * (weights + reserve)`` bytes (:mod:`pagedkv.config.gpu_sizing`), with the
  device's total from cudaMemGetInfo (:func:`device_memory`), the weights counted from the
  checkpoint (:mod:`pagedkv.model.weight_bytes`) at the dtype the workers will run, the reserve
  estimated from the model's shape at ``--max-num-batched-tokens``, and W = ``--workers-per-device``;
  it must hold one sequence of ``--max-model-len`` tokens (default: the model's context) and fit
  the device's free memory now;
- on a CPU, 1GiB.

Each worker measures its own peak at start (``compute_service.profile_run``) and refuses to start
on a device that is short.
"""

from __future__ import annotations

from dataclasses import dataclass

from memory_service.layout import PoolLayout, make_layout
from memory_service.spec import PoolSpec
from pagedkv import config
from pagedkv.config.gpu_sizing import activation_reserve, gib, gpu_pool_bytes
from pagedkv.memory.v1 import memory_service_pb2 as pb
from pagedkv.model.checkpoint_dtype import checkpoint_dtype
from pagedkv.model.source import ResolvedModel
from pagedkv.model.weight_bytes import count_weights, read_model_config
from pagedkv.runtime.logs import get_logger

log = get_logger("memory_service")


def device_memory(index: int) -> tuple[int, int]:
    """(free, total) bytes of CUDA device ``index``: cudaMemGetInfo through CuPy (the memory
    service never imports torch; torch.cuda.mem_get_info reads the same call).

    Raises:
        RuntimeError: CuPy is not installed.
    """
    try:
        import cupy
    except ImportError as e:
        raise RuntimeError("a cuda pool needs CuPy: pip install 'pagedkv[cuda12]' or '[cuda13]'") from e
    with cupy.cuda.Device(index):
        free, total = cupy.cuda.runtime.memGetInfo()
    return int(free), int(total)


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """The pool to allocate and how its size was decided."""

    #: Shape and dtype, with the number of blocks.
    layout: PoolLayout
    #: What GetStats reports as ``sizing``.
    sizing: pb.PoolSizing


def plan_pool(spec: PoolSpec, model: ResolvedModel) -> PoolPlan:
    """The layout and sizing ``spec`` asks for, for ``model`` (config and checkpoint headers only).

    Raises:
        ValueError: a size that holds no block; with ``--gpu-memory-utilization``, a pool that
            leaves no room, holds less than one sequence of the longest length, or does not fit the
            device's free memory (every term named).
        RuntimeError: a GPU budget without CuPy.
    """
    source = model.load_source
    dtype = spec.resolved_dtype(source)
    if spec.sizing != "gpu_memory_utilization":
        layout = make_layout(source, block_size=spec.block_size, dtype=dtype, num_blocks=spec.num_blocks,
                             kv_cache_memory=spec.kv_cache_memory)
        return PoolPlan(layout, pb.PoolSizing(source=_source(spec.sizing),
                                              requested_bytes=spec.kv_cache_memory or layout.nbytes))
    cfg = read_model_config(source)
    # The dtype the workers will run (their --dtype auto): the pool's, over fp8 the GPU's default.
    run = config.worker_dtype(None, dtype, cuda=True, checkpoint=checkpoint_dtype(source))
    count = count_weights(source, cfg)
    weights = count.nbytes(run.itemsize)
    reserve = activation_reserve(cfg, spec.max_num_batched_tokens, run).total_bytes
    free, total = device_memory(spec.device_index)
    one_block = make_layout(source, block_size=spec.block_size, dtype=dtype, num_blocks=1).block_nbytes
    max_len = spec.max_model_len or cfg.max_position_embeddings
    longest = -(-max_len // spec.block_size) * one_block
    pool_bytes = gpu_pool_bytes(total, spec.gpu_memory_utilization, spec.workers_per_device, weights, reserve,
                                min_pool_bytes=longest,
                                min_pool_what=f"one sequence of {max_len} tokens (--max-model-len)")
    if pool_bytes > free:
        raise ValueError(
            f"the pool of {gib(pool_bytes)} ({spec.gpu_memory_utilization} x {gib(total)} less the workers' "
            f"{gib(total * spec.gpu_memory_utilization - pool_bytes)}) does not fit the {gib(free)} free on "
            f"cuda:{spec.device_index} now: other processes hold {gib(total - free)}. Stop them, lower "
            "--gpu-memory-utilization, or size the pool with --kv-cache-memory")
    layout = make_layout(source, block_size=spec.block_size, dtype=dtype, kv_cache_memory=pool_bytes)
    sizing = pb.PoolSizing(
        source=_source(spec.sizing), requested_bytes=pool_bytes, device_total_bytes=total,
        utilization=spec.gpu_memory_utilization, weight_bytes=weights, reserve_bytes=reserve,
        workers_per_device=spec.workers_per_device, max_num_batched_tokens=spec.max_num_batched_tokens,
        weights_from=count.source)
    log.info("gpu_pool_budget", device_total_bytes=total, device_free_bytes=free,
             utilization=spec.gpu_memory_utilization, workers_per_device=spec.workers_per_device,
             weight_bytes=weights, weights_from=count.source, weight_dtype=run.name, reserve_bytes=reserve,
             max_num_batched_tokens=spec.max_num_batched_tokens, pool_bytes=pool_bytes)
    return PoolPlan(layout, sizing)


def _source(name: str) -> int:
    return pb.PoolSizingSource.Value(f"POOL_SIZING_SOURCE_{name.upper()}")


def log_capacity(layout: PoolLayout, sizing: pb.PoolSizing) -> None:
    """The pool's capacity at start, one structlog line: blocks, tokens, bytes and what sized it."""
    log.info("pool_capacity", num_blocks=layout.num_blocks, block_size=layout.block_size,
             token_capacity=layout.num_blocks * layout.block_size, pool_bytes=layout.nbytes,
             kv_cache_dtype=layout.dtype.name,
             sizing=pb.PoolSizingSource.Name(sizing.source).removeprefix("POOL_SIZING_SOURCE_").lower())
