"""The dtype table and the two dtype rules, shared by every process.

A dtype crosses the plane as its name (``PoolLayout.dtype`` in the protos: ``float32``,
``float16``, ``bfloat16``, ``fp8_e4m3``); past the command line and the proto edge every process
holds it as a :class:`DType` from :data:`DTYPES` (or its ``torch.dtype``, :attr:`DType.torch`).
torch is imported only when a ``torch.dtype`` is asked for: the memory service never needs it.

The rules, each written once here:

- ``auto`` (:func:`default_dtype`, vLLM's rule): the checkpoint's 16-bit dtype where the device
  computes it natively (CUDA; a CPU with AVX-512 BF16 or AMX computes bfloat16), float32
  otherwise. The memory service's pool takes it when ``--kv-cache-dtype`` is auto, and a
  worker's model over an fp8 pool.
- pairing (:func:`check_pair`): the model runs in the pool's dtype, except over an fp8 pool,
  whose keys and values the kernels widen to the model's dtype (vLLM's ``--kv-cache-dtype fp8``).
  A worker's ``--dtype auto`` follows the pool (:func:`worker_dtype`); ``pagedkv serve``'s
  ``--kv-cache-dtype auto`` follows ``--dtype`` (:func:`serve_dtypes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedkv.runtime.cpu_flags import computes_bf16

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class DType:
    """One element type of the KV cache or the model."""

    #: The name on the wire and in flags: "float32", "float16", "bfloat16" or "fp8_e4m3".
    name: str
    #: Bytes per element.
    itemsize: int
    #: The ``torch`` attribute of its torch dtype ("float8_e4m3fn" for fp8).
    torch_name: str
    #: Whether a model computes in it (fp8 is a storage format of the KV cache only).
    computes: bool = True

    @property
    def torch(self) -> torch.dtype:
        """The torch dtype (imports torch)."""
        import torch

        return getattr(torch, self.torch_name)

    @property
    def is_fp8(self) -> bool:
        """Whether this is fp8 e4m3 with static scales (:mod:`pagedkv.runtime.kv_scales`)."""
        return self.name == FP8.name

    def __str__(self) -> str:
        return self.name


FLOAT32 = DType("float32", 4, "float32")
FLOAT16 = DType("float16", 2, "float16")
BFLOAT16 = DType("bfloat16", 2, "bfloat16")
#: OCP float8 e4m3fn (saturating at +-448), stored with one static scale per (layer, KV head).
FP8 = DType("fp8_e4m3", 1, "float8_e4m3fn", computes=False)

#: Every dtype this build runs, by wire name.
DTYPES: dict[str, DType] = {d.name: d for d in (FLOAT32, FLOAT16, BFLOAT16, FP8)}
#: ``--kv-cache-dtype`` spellings of fp8 (vLLM's ``fp8`` means e4m3).
FP8_FLAGS = ("fp8", FP8.name)
#: ``--dtype`` choices: the model's dtype.
MODEL_DTYPE_CHOICES = ("auto", *(d.name for d in DTYPES.values() if d.computes))
#: ``--kv-cache-dtype`` choices: the pool's dtype.
KV_CACHE_DTYPE_CHOICES = (*MODEL_DTYPE_CHOICES, *FP8_FLAGS)


def dtype(value: str | DType | torch.dtype) -> DType:
    """The table's entry for a wire name, a flag spelling (``fp8``), a torch dtype or a DType.

    Raises:
        ValueError: a dtype the table does not hold.
    """
    if isinstance(value, DType):
        return value
    if isinstance(value, str):
        found = FP8 if value in FP8_FLAGS else DTYPES.get(value)
    else:
        found = next((d for d in DTYPES.values() if d.torch_name == str(value).removeprefix("torch.")), None)
    if found is None:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {value!r}")
    return found


def default_dtype(cuda: bool, checkpoint: DType | None = None, native_bf16: bool | None = None) -> DType:
    """The ``auto`` rule, as vLLM decides it (``ModelConfig.dtype`` "auto" and its CPU platform's check).

    - CUDA: the checkpoint's dtype when it is bfloat16 or float16, else bfloat16 (a float32
      checkpoint, or one that states none).
    - CPU: bfloat16 when the checkpoint is 16-bit (bfloat16, or float16, which a CPU computes as
      bfloat16) and the CPU computes bfloat16 natively (``native_bf16``; default
      :func:`pagedkv.runtime.cpu_flags.computes_bf16`: AVX-512 BF16 or AMX); float32 otherwise.

    ``checkpoint``: the dtype the model was saved in (:func:`pagedkv.model.checkpoint_dtype.checkpoint_dtype`),
    None when it states none.
    """
    if cuda:
        return checkpoint if checkpoint in (BFLOAT16, FLOAT16) else BFLOAT16
    if checkpoint not in (BFLOAT16, FLOAT16):
        return FLOAT32
    return BFLOAT16 if (computes_bf16() if native_bf16 is None else native_bf16) else FLOAT32


def pool_dtype(flag: str | None, cuda: bool, checkpoint: DType | None = None) -> DType:
    """The memory service's pool dtype from ``--kv-cache-dtype`` (None or ``auto``:
    :func:`default_dtype` of the device and the model's ``checkpoint`` dtype).

    Raises:
        ValueError: a value not in :data:`KV_CACHE_DTYPE_CHOICES` (e.g. from the environment).
    """
    if flag in (None, "auto"):
        return default_dtype(cuda, checkpoint)
    if flag not in KV_CACHE_DTYPE_CHOICES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, got {flag!r}")
    return dtype(flag)


def pairs(model: DType, pool: DType) -> bool:
    """The pairing rule: a model runs over a pool of its own dtype, or over any fp8 pool."""
    return pool.is_fp8 or model == pool


def check_pair(model: DType, pool: DType) -> None:
    """Raise ValueError unless :func:`pairs` (``model``, ``pool``), naming the flags that fix it."""
    if not pairs(model, pool):
        raise ValueError(f"--dtype {model} over a {pool} pool: the model runs in the pool's dtype (only an fp8 pool "
                         f"takes another); start the memory service with --kv-cache-dtype {model}, or drop --dtype")


def model_dtype(flag: str | None) -> DType | None:
    """The model's dtype from ``--dtype`` (``flag``); None for ``auto`` or not given (decided once the
    pool is known: :func:`worker_dtype`).

    Raises:
        ValueError: a value not in :data:`MODEL_DTYPE_CHOICES` (e.g. from the environment).
    """
    if flag in (None, "auto"):
        return None
    if flag not in MODEL_DTYPE_CHOICES:
        raise ValueError(f"--dtype must be one of {', '.join(MODEL_DTYPE_CHOICES)}, got {flag!r}")
    return DTYPES[flag]


def worker_dtype(model: DType | str | None, pool: DType, cuda: bool, checkpoint: DType | None = None) -> DType:
    """A worker's model dtype: ``--dtype`` (``model``: parsed by :func:`model_dtype`, or its flag
    text), or with ``auto`` (None) the pool's (over an fp8 pool :func:`default_dtype` of the pool's
    device, ``cuda``, and the model's ``checkpoint`` dtype).

    Raises:
        ValueError: a dtype no model computes in, or one that does not pair with the pool.
    """
    if not isinstance(model, DType):
        model = model_dtype(model)
    elif not model.computes:
        raise ValueError(f"--dtype must be one of {', '.join(MODEL_DTYPE_CHOICES)}, got {model.name!r}")
    if model is None:
        model = default_dtype(cuda, checkpoint) if pool.is_fp8 else pool
    check_pair(model, pool)
    return model


def serve_dtypes(dtype_flag: str | None, kv_flag: str | None) -> tuple[DType | None, DType | None]:
    """``pagedkv serve``'s (model dtype, pool dtype) from ``--dtype`` and ``--kv-cache-dtype``; None:
    not given (the services' ``auto``). The pool's ``auto`` is the model's dtype.

    Raises:
        ValueError: a value outside the choices, or a pair that breaks :func:`pairs`.
    """
    model = model_dtype(dtype_flag)
    if kv_flag not in (None, *KV_CACHE_DTYPE_CHOICES):
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, got {kv_flag!r}")
    pool = None if kv_flag in (None, "auto") else dtype(kv_flag)
    if model is not None and pool is not None and not pairs(model, pool):
        raise ValueError(f"--dtype {model} with --kv-cache-dtype {pool}: workers run the model in the pool's dtype "
                         "(fp8 pools aside), so the two must match")
    return model, pool or model
