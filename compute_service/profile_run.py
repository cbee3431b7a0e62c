"""A GPU worker's profile run: one forward at its largest step on dummy inputs, before it serves.

vLLM measures what a model needs besides its KV cache with a profile run
(``gpu_model_runner.profile_run``: a forward at ``max_num_batched_tokens`` on dummy inputs, then a
dummy sampler run, read with ``torch.cuda.max_memory_allocated``) and sizes the KV cache from it.
Here the pool exists before any worker (the memory service sized it, pagedkv.config.gpu_sizing),
so the run checks instead of sizing:

- it runs the step a worker's largest batch costs: ``--max-num-batched-tokens`` tokens of one
  sequence (a prefill, the attention's widest case) with a logits row for every token (a step of
  that many decode rows) and a softmax over them (the sampler's working copy), on a scratch pool of
  ``ceil(T / block_size)`` blocks of the mapped pool's layout (the mapped pool holds other
  sequences' KV and is never touched);
- a run that runs out of device memory refuses the start (:class:`WorkerMemoryError`, naming the
  device's memory, the weights, the pool's share and the flags that fix it), instead of a worker
  that fails its first large step;
- its peak, ``max_memory_allocated`` during the run less what was allocated before and the scratch
  pool, is logged beside the memory service's estimate (GetStats ``sizing``), with a warning when
  this worker needs more than the share the pool left it (:func:`budget_warning`);
- the allocator keeps the run's memory cached, so the room of the largest step stays this
  worker's: a worker that starts later on the same device cannot take it.

On a CPU the run is skipped (the pool lives in host memory, sized by bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch

import kernels
from pagedkv.config.gpu_sizing import gib
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.memory.v1 import memory_service_pb2_grpc as mpb_grpc
from pagedkv.runtime import tls
from pagedkv.runtime.logs import get_logger

log = get_logger("compute_service")


class WorkerMemoryError(RuntimeError):
    """The device has too little memory left for this worker's largest step."""


@dataclass(frozen=True, slots=True)
class ProfileResult:
    """What a profile run measured (bytes)."""

    #: Tokens of the step (``--max-num-batched-tokens``).
    num_tokens: int
    #: Peak activation memory of the step: max_memory_allocated less the allocation before and the scratch pool.
    peak_bytes: int
    #: The device's free memory after the run (the run's memory stays cached by this process).
    free_bytes: int
    #: The device's memory.
    total_bytes: int


def dummy_step(model, pool: torch.Tensor, num_tokens: int, kv_scales: Sequence | None = None) -> int:
    """Run ``model`` on a step of ``num_tokens`` tokens of one sequence, every row a logits row,
    then a softmax over the logits; returns the bytes of the scratch pool it wrote K/V into.

    Args:
        model: a ``compute_service.model.llama.LlamaForPagedLM``.
        pool: the mapped pool [num_blocks, num_layers, 2, block_size, Hkv, Dh], read for its layout,
            dtype and device only (the scratch pool has ``ceil(num_tokens / block_size)`` blocks of it).
        num_tokens: T >= 1.
        kv_scales: an fp8 pool's per-layer (k_scale, v_scale), as the worker's steps pass them.

    Raises:
        ValueError: ``num_tokens`` < 1.
        torch.cuda.OutOfMemoryError: the device ran out.
    """
    if num_tokens < 1:
        raise ValueError(f"--max-num-batched-tokens must be >= 1, got {num_tokens}")
    device, block_size = pool.device, pool.shape[3]
    num_blocks = -(-num_tokens // block_size)
    scratch = torch.zeros(num_blocks, *pool.shape[1:], dtype=pool.dtype, device=device)
    positions = torch.arange(num_tokens, dtype=torch.int64, device=device)  # [T]: also every row's logits index
    token_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    tables = torch.arange(num_blocks, dtype=torch.int32, device=device)[None]  # [1, num_blocks]
    query_start = torch.tensor([0, num_tokens], dtype=torch.int32)
    seq_lens = torch.tensor([num_tokens], dtype=torch.int32)
    plan = kernels.plan_attention(tables, query_start.to(device), seq_lens.to(device), block_size,
                                  host_query_start_loc=query_start, host_seq_lens=seq_lens, num_kv_heads=pool.shape[4])
    logits = model(token_ids, positions, scratch, positions, plan, positions, kv_scales)  # [T, vocab] float32
    torch.softmax(logits, dim=-1)  # the sampler's float32 working copy
    return scratch.nbytes


def profile_run(model, pool: torch.Tensor, num_tokens: int, kv_scales: Sequence | None = None) -> ProfileResult:
    """:func:`dummy_step` on the GPU ``pool`` lives on, measured (the module's steps).

    Raises:
        WorkerMemoryError: the device ran out of memory during the run.
    """
    device = pool.device
    torch.cuda.synchronize(device)
    free_before, total = torch.cuda.mem_get_info(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    try:
        scratch = dummy_step(model, pool, num_tokens, kv_scales)
        torch.cuda.synchronize(device)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        raise WorkerMemoryError(shortfall_message(num_tokens, free_before, total, model.nbytes(),
                                                  pool.nbytes)) from None
    peak = max(0, torch.cuda.max_memory_allocated(device) - before - scratch)
    free_after, _ = torch.cuda.mem_get_info(device)
    return ProfileResult(num_tokens, peak, free_after, total)


def shortfall_message(num_tokens: int, free: int, total: int, weight_bytes: int, pool_bytes: int) -> str:
    """Why a worker refuses to start: its largest step did not fit, with every term and the fixes."""
    return (f"this worker's largest step (--max-num-batched-tokens {num_tokens}) ran out of device memory: "
            f"{gib(free)} were free of the device's {gib(total)} after the pool ({gib(pool_bytes)}) and this "
            f"worker's weights ({gib(weight_bytes)}). Lower --max-num-batched-tokens (here and on the memory "
            "service), start the memory service with a lower --gpu-memory-utilization or --kv-cache-memory, or "
            "with --workers-per-device counting every worker on this device")


def budget_warning(result: ProfileResult, weight_bytes: int, sizing: mpb.PoolSizing | None) -> str | None:
    """A warning when this worker needs more than the memory service set aside for one worker
    (a pool sized by ``--gpu-memory-utilization``: its ``weight_bytes + reserve_bytes``), or was
    sized for a smaller step; None when it fits or the pool was sized otherwise."""
    if sizing is None or sizing.source != mpb.POOL_SIZING_SOURCE_GPU_MEMORY_UTILIZATION:
        return None
    share = sizing.weight_bytes + sizing.reserve_bytes
    need = weight_bytes + result.peak_bytes
    if need > share:
        return (f"this worker needs {gib(need)} (weights {gib(weight_bytes)} + peak {gib(result.peak_bytes)} at "
                f"{result.num_tokens} tokens), more than the {gib(share)} the memory service set aside per worker "
                f"(weights {gib(sizing.weight_bytes)} + reserve {gib(sizing.reserve_bytes)}): the device's "
                "last workers may run short; lower --gpu-memory-utilization on the memory service")
    if result.num_tokens > sizing.max_num_batched_tokens:
        return (f"this worker's --max-num-batched-tokens {result.num_tokens} is more than the memory service's "
                f"{sizing.max_num_batched_tokens}, which its reserve was estimated for: give both the same value")
    return None


def profile_worker(model, pool: torch.Tensor, num_tokens: int, kv_scales: Sequence | None, memory: str,
                   files: tls.TlsFiles | None = None) -> ProfileResult:
    """A GPU worker's start-up check: :func:`profile_run`, logged (``profile_run``) beside the memory
    service at ``memory``'s estimate, with a ``profile_over_budget`` warning from :func:`budget_warning`.

    Raises:
        WorkerMemoryError: the largest step does not fit on the device.
    """
    result = profile_run(model, pool, num_tokens, kv_scales)
    sizing = fetch_sizing(memory, files)
    weights = model.nbytes()
    log.info("profile_run", tokens=result.num_tokens, peak_bytes=result.peak_bytes, weight_bytes=weights,
             free_bytes=result.free_bytes, total_bytes=result.total_bytes,
             estimated_reserve_bytes=sizing.reserve_bytes if sizing is not None else None)
    if (warning := budget_warning(result, weights, sizing)) is not None:
        log.warning("profile_over_budget", message=warning)
    return result


def fetch_sizing(address: str, files: tls.TlsFiles | None = None) -> mpb.PoolSizing | None:
    """GetStats' ``sizing`` of the memory service at ``address`` (None: none, or no answer)."""
    try:
        with tls.channel(address, files) as ch:
            stats = mpb_grpc.MemoryServiceStub(ch).GetStats(mpb.GetStatsRequest(), timeout=5)
    except grpc.RpcError:
        return None
    return stats.sizing if stats.HasField("sizing") else None


__all__ = ["ProfileResult", "WorkerMemoryError", "budget_warning", "dummy_step", "fetch_sizing", "profile_run",
           "profile_worker", "shortfall_message"]
