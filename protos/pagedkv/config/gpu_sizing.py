"""Sizing a GPU pool as vLLM does: a fraction of the device's memory, less what the workers need.

vLLM gives one engine ``--gpu-memory-utilization`` F of the device's memory (``torch.cuda.mem_get_info``'s
total) and, after a profile run at its largest batch (``gpu_worker.determine_available_memory``),
hands the KV cache what the weights and the peak activations leave of it. Here the pool is made
before any worker exists, by the memory service, which never loads the model, so the same budget
is taken with the workers' needs read and estimated instead of measured::

    pool bytes = floor(F * total) - W * (weights + reserve)

- ``total``: the device's memory, bytes (:func:`memory_service.sizing.device_memory`);
- ``F``: ``--gpu-memory-utilization`` in (0, 1], default :data:`DEFAULT_GPU_MEMORY_UTILIZATION` on a GPU;
- ``W``: ``--workers-per-device``, the workers that map the pool on this device, each with its own
  copy of the weights and its own activations;
- ``weights``: one worker's weights at the dtype it runs, from the checkpoint's tensor sizes
  (:mod:`pagedkv.model.weight_bytes`: safetensors headers, GGUF tensor infos, no weight loaded);
- ``reserve``: one worker's activations at ``--max-num-batched-tokens`` (:func:`activation_reserve`).

What F leaves, ``(1 - F) * total``, holds what neither term counts: each process's CUDA context
(~0.5 GiB), cuBLAS workspaces, the CUDA-graph pool of decode steps and the allocator's
fragmentation (vLLM counts some of these inside F by measuring; lower F when a device is shared
with other programs). Each worker checks the estimate at start with a real forward at its largest
batch (``compute_service.profile_run``) and refuses to start when the device is short.

Pure arithmetic: no torch, no device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedkv.config.dtypes import DType

if TYPE_CHECKING:
    from pagedkv.model.config import ModelConfig

#: F when a GPU pool is sized by neither ``--num-blocks`` nor ``--kv-cache-memory`` (vLLM's default).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
#: ``--workers-per-device`` default.
DEFAULT_WORKERS_PER_DEVICE = 1
#: What sized a pool (GetStats ``sizing.source``), most explicit first.
SIZING_SOURCES = ("num_blocks", "kv_cache_memory", "gpu_memory_utilization", "default")
#: Bytes of a float32 element: the logits and the split-KV partials are float32 whatever the model's dtype.
_FP32 = 4


def check_utilization(value: float) -> float:
    """``value`` as a ``--gpu-memory-utilization``.

    Raises:
        ValueError: not a number in (0, 1].
    """
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"--gpu-memory-utilization must be a fraction in (0, 1], got {value!r}") from None
    if not 0 < f <= 1:
        raise ValueError(f"--gpu-memory-utilization must be a fraction in (0, 1] of the device's memory (vLLM's "
                         f"default 0.9), got {value!r}")
    return f


def refuse_on_cpu(device: str, utilization: float | None) -> None:
    """``--gpu-memory-utilization`` sizes a GPU pool only; on ``--device cpu`` it is refused.

    Raises:
        ValueError: ``utilization`` given for a cpu device, naming the flags that size a CPU pool.
    """
    if utilization is not None and not device.startswith("cuda"):
        raise ValueError(f"--gpu-memory-utilization {utilization} sizes a GPU pool (a fraction of the device's "
                         f"memory); on --device {device} size the pool with --kv-cache-memory (default 1GiB) or "
                         "--num-blocks, and leave --gpu-memory-utilization (and PAGEDKV_GPU_MEMORY_UTILIZATION) out")


def gib(n: float) -> str:
    """``n`` bytes for a message: GiB with two decimals, MiB below 1 GiB, bytes below 1 MiB."""
    if abs(n) >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if abs(n) >= 2**20 else f"{int(n)} bytes"


@dataclass(frozen=True, slots=True)
class ActivationReserve:
    """One worker's activation memory at its largest step, by term (bytes each; :func:`activation_reserve`)."""

    #: Tokens of the step (``--max-num-batched-tokens``).
    num_tokens: int
    #: The residual stream, a layer's input, its normed input and a sublayer's output: 4 [T, D].
    hidden_bytes: int
    #: The fused q/k/v projection [T, (Hq + 2 Hkv) Dh], the rotated q and k [T, (Hq + Hkv) Dh], the
    #: attention output [T, Hq Dh], at the model's dtype; split-KV partials [T, Hq Dh] float32.
    attention_bytes: int
    #: The fused gate/up projection [T, 2 I] and silu(gate) * up [T, I].
    mlp_bytes: int
    #: The LM head's output [T, V] at the model's dtype, its float32 copy, one float32 working copy
    #: in the sampler (softmax, top-p sort).
    logits_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.hidden_bytes + self.attention_bytes + self.mlp_bytes + self.logits_bytes


def activation_reserve(config: ModelConfig, max_num_batched_tokens: int, dtype: DType) -> ActivationReserve:
    """Estimate one worker's activation peak at a step of ``max_num_batched_tokens`` tokens (bytes).

    vLLM measures this with a profile run, a forward at its largest batch on dummy inputs; the
    memory service cannot run the model, so it adds up what that forward holds at once, with T
    tokens, model width D, MLP width I, vocabulary V, Hq query and Hkv KV heads of Dh channels,
    ``b`` = ``dtype.itemsize`` bytes (4 for float32 terms)::

        hidden    = 4 T D b                                      residual stream, layer input, normed input, output
        attention = T Dh (3 Hq + 3 Hkv) b + T Hq Dh 4            qkv, rotated q/k, attention output; split-KV partials
        mlp       = 3 T I b                                      gate/up [T, 2I], silu(gate) * up [T, I]
        logits    = T V (b + 4 + 4)                              LM head output, float32 logits, sampler copy

    Every row of the step is counted as a logits row (a step of T decode sequences; a prefill
    chunk needs one row per sequence), so the estimate bounds the step. A layer's intermediates and
    the logits never live at once, so the sum is an upper bound of the peak by the smaller of the
    two; weights are not counted (:mod:`pagedkv.model.weight_bytes`), nor the KV the step writes
    (it goes into the pool).

    Raises:
        ValueError: ``max_num_batched_tokens`` < 1, or a dtype no model computes in (fp8).
    """
    if max_num_batched_tokens < 1:
        raise ValueError(f"--max-num-batched-tokens must be >= 1, got {max_num_batched_tokens}")
    if not dtype.computes:
        raise ValueError(f"activations are never {dtype}: give the model's dtype (bfloat16, float16 or float32)")
    t, b = max_num_batched_tokens, dtype.itemsize
    c = config
    return ActivationReserve(
        num_tokens=t,
        hidden_bytes=4 * t * c.hidden_size * b,
        attention_bytes=t * c.head_dim * (3 * c.num_q_heads + 3 * c.num_kv_heads) * b
        + t * c.num_q_heads * c.head_dim * _FP32,
        mlp_bytes=3 * t * c.intermediate_size * b,
        logits_bytes=t * c.vocab_size * (b + 2 * _FP32),
    )


@dataclass(frozen=True, slots=True)
class GpuBudget:
    """The terms of ``pool bytes = floor(F * total) - W * (weights + reserve)`` (the module's formula)."""

    #: The device's memory, bytes.
    device_total_bytes: int
    #: F, ``--gpu-memory-utilization``, in (0, 1].
    utilization: float
    #: W, ``--workers-per-device``.
    workers_per_device: int
    #: One worker's weights at the dtype it runs, bytes.
    weight_bytes: int
    #: One worker's activation reserve, bytes.
    reserve_bytes: int

    def __post_init__(self) -> None:
        check_utilization(self.utilization)
        if self.workers_per_device < 1:
            raise ValueError(f"--workers-per-device must be >= 1, got {self.workers_per_device}")
        for name in ("device_total_bytes", "weight_bytes", "reserve_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def budget_bytes(self) -> int:
        """floor(F * total): what the pool and the workers may take together."""
        return int(self.utilization * self.device_total_bytes)

    @property
    def workers_bytes(self) -> int:
        """W * (weights + reserve)."""
        return self.workers_per_device * (self.weight_bytes + self.reserve_bytes)

    @property
    def pool_bytes(self) -> int:
        """The pool's bytes (may be <= 0: :func:`gpu_pool_bytes` refuses that)."""
        return self.budget_bytes - self.workers_bytes

    def terms(self) -> str:
        """The formula with every term's value, for messages."""
        return (f"{self.utilization} x {gib(self.device_total_bytes)} device = {gib(self.budget_bytes)}, minus "
                f"{self.workers_per_device} worker(s) per device x (weights {gib(self.weight_bytes)} + activation "
                f"reserve {gib(self.reserve_bytes)}) = {gib(self.workers_bytes)}, leaves {gib(self.pool_bytes)} "
                f"({self.pool_bytes} bytes) for the pool")


def gpu_pool_bytes(total_bytes: int, utilization: float, workers_per_device: int, weight_bytes: int,
                   reserve_bytes: int, *, min_pool_bytes: int = 1, min_pool_what: str = "one block") -> int:
    """``floor(F * total) - W * (weights + reserve)`` bytes (the module's formula).

    Args:
        total_bytes: the device's memory.
        utilization: F in (0, 1].
        workers_per_device: W >= 1.
        weight_bytes: one worker's weights at the dtype it runs.
        reserve_bytes: one worker's activation reserve (:func:`activation_reserve`).
        min_pool_bytes: the least the pool may hold (e.g. one sequence of the longest length).
        min_pool_what: what ``min_pool_bytes`` is, for the message.

    Raises:
        ValueError: a term out of range, or a pool of less than ``min_pool_bytes`` (or <= 0),
            naming every term and what to change.
    """
    budget = GpuBudget(total_bytes, utilization, workers_per_device, weight_bytes, reserve_bytes)
    pool = budget.pool_bytes
    if pool <= 0 or pool < min_pool_bytes:
        short = "no room for the pool" if pool <= 0 else (
            f"less than {min_pool_what} needs ({gib(min_pool_bytes)}, {min_pool_bytes} bytes)")
        raise ValueError(
            f"--gpu-memory-utilization leaves {short}: {budget.terms()}. Raise --gpu-memory-utilization, lower "
            "--max-num-batched-tokens (the reserve) or --workers-per-device"
            + (", or --max-model-len" if pool > 0 else "")
            + ", use a device with more memory, or size the pool with --kv-cache-memory or --num-blocks")
    return pool


__all__ = ["DEFAULT_GPU_MEMORY_UTILIZATION", "DEFAULT_WORKERS_PER_DEVICE", "SIZING_SOURCES", "ActivationReserve",
           "GpuBudget", "activation_reserve", "check_utilization", "gib", "gpu_pool_bytes", "refuse_on_cpu"]
