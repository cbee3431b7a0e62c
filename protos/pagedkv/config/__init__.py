"""Configuration has one home: dtypes and their rules, byte sizes and default addresses, the flag
groups every subcommand adds, and the registry of every environment variable pagedkv reads.

- :mod:`.dtypes`: the dtype table (:class:`DType`: name, bytes per element, torch dtype), the
  ``auto`` rule and the model/pool pairing rule;
- :mod:`.sizes`: :func:`parse_bytes`, :func:`host_cache_bytes`, default ports and addresses;
- :mod:`.gpu_sizing`: a GPU pool's size from ``--gpu-memory-utilization`` (vLLM's budget);
- :mod:`.envs`: :data:`ENV_VARS` and :func:`env`, the only reader of the environment;
- :mod:`.flags`: argparse flag groups (model + revision, pool, TLS, bind address, device).

Importing this package imports neither torch nor grpc. ``python -m pagedkv.config --markdown``
prints docs/configuration.md.
"""

from pagedkv.config.dtypes import (
    BFLOAT16,
    DTYPES,
    FLOAT16,
    FLOAT32,
    FP8,
    FP8_FLAGS,
    KV_CACHE_DTYPE_CHOICES,
    MODEL_DTYPE_CHOICES,
    DType,
    check_pair,
    default_dtype,
    dtype,
    model_dtype,
    pairs,
    pool_dtype,
    serve_dtypes,
    worker_dtype,
)
from pagedkv.config.envs import ENV_VARS, EnvVar, env, env_is_set, env_text, markdown
from pagedkv.config.gpu_sizing import DEFAULT_GPU_MEMORY_UTILIZATION
from pagedkv.config.sizes import (
    COMPUTE_PORT,
    DEFAULT_CPU_KV_MEMORY,
    DEFAULT_HOST,
    DEFAULT_MEMORY,
    DEFAULT_SERVE_URL,
    DEFAULT_WORKER,
    MEMORY_PORT,
    SERVE_PORT,
    host_cache_bytes,
    parse_bytes,
)

__all__ = [
    "BFLOAT16", "COMPUTE_PORT", "DEFAULT_CPU_KV_MEMORY", "DEFAULT_GPU_MEMORY_UTILIZATION", "DEFAULT_HOST",
    "DEFAULT_MEMORY", "DEFAULT_SERVE_URL", "DEFAULT_WORKER", "DTYPES", "ENV_VARS", "FLOAT16", "FLOAT32", "FP8",
    "FP8_FLAGS", "KV_CACHE_DTYPE_CHOICES", "MEMORY_PORT", "MODEL_DTYPE_CHOICES", "SERVE_PORT", "DType", "EnvVar",
    "check_pair", "default_dtype", "dtype", "env", "env_is_set", "env_text", "host_cache_bytes", "markdown",
    "model_dtype", "pairs", "parse_bytes", "pool_dtype", "serve_dtypes", "worker_dtype",
]
