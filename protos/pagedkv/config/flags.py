"""Flag groups every subcommand adds, each flag's default read from the registry (:mod:`.envs`).

- :func:`add_bind_args`: ``--host``, ``--port`` (``PAGEDKV_<SERVICE>_HOST/PORT``);
- :func:`add_device_arg`: ``--device`` (``PAGEDKV_<SERVICE>_DEVICE``);
- :func:`add_model_args`: ``--model`` and ``--revision``;
- :func:`add_pool_args`: ``--block-size``, ``--kv-cache-memory`` (``--num-blocks``),
  ``--gpu-memory-utilization``, ``--host-cache-memory``, ``--kv-cache-dtype``;
- :func:`add_max_batched_tokens_arg`: ``--max-num-batched-tokens`` (``PAGEDKV_MAX_NUM_BATCHED_TOKENS``);
- :func:`add_tls_args`: ``--tls-cert``, ``--tls-key``, ``--tls-ca`` (:mod:`pagedkv.runtime.tls`);
- :func:`add_logging_args`: ``--log-level`` (``PAGEDKV_LOG_LEVEL``; :mod:`pagedkv.runtime.logs`);
- :func:`refuse_pool_dtype_flag`: ``pagedkv memory --dtype``, refused (the pool's is ``--kv-cache-dtype``).
"""

from __future__ import annotations

import argparse

from pagedkv.config.dtypes import KV_CACHE_DTYPE_CHOICES, MODEL_DTYPE_CHOICES
from pagedkv.config.envs import env
from pagedkv.config.gpu_sizing import DEFAULT_GPU_MEMORY_UTILIZATION, check_utilization
from pagedkv.config.sizes import DEFAULT_CPU_KV_MEMORY

Parser = argparse.ArgumentParser | argparse._ArgumentGroup

#: --model's help: what it takes.
MODEL_HELP = ("'smollm2', a .gguf file, a Hugging Face directory, or a Hugging Face repo id such as "
              "Qwen/Qwen2.5-0.5B-Instruct (from the Hugging Face cache; downloaded when missing unless "
              "HF_HUB_OFFLINE=1)")


def _env(name: str, from_env: bool, default):
    return env(name, default) if from_env else default


def add_bind_args(p: Parser, service: str, port: int) -> None:
    """``--host`` and ``--port`` of ``service`` ("memory", "compute", "serve"), from
    ``PAGEDKV_<SERVICE>_HOST`` and ``PAGEDKV_<SERVICE>_PORT``."""
    s = service.upper()
    p.add_argument("--host", default=env(f"PAGEDKV_{s}_HOST"), help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=env(f"PAGEDKV_{s}_PORT"),
                   help=f"port; 0 = any free port (default {port})")


def add_device_arg(p: Parser, service: str, help: str) -> None:
    """``--device`` of ``service``, from ``PAGEDKV_<SERVICE>_DEVICE`` (alias ``PAGEDKV_DEVICE``)."""
    p.add_argument("--device", default=env(f"PAGEDKV_{service.upper()}_DEVICE"), help=help)


def add_model_args(p: Parser, *, default: str | None = "smollm2", help: str = MODEL_HELP, from_env: bool = True,
                   revision_help: str = "branch, tag or commit of a repo id (default main)") -> None:
    """``--model`` (default ``default``, or ``PAGEDKV_MODEL``) and ``--revision`` (``PAGEDKV_REVISION``)."""
    p.add_argument("--model", default=_env("PAGEDKV_MODEL", from_env, default), help=help)
    p.add_argument("--revision", default=_env("PAGEDKV_REVISION", from_env, None), help=revision_help)


#: What ``auto`` means for ``--dtype`` and ``--kv-cache-dtype`` (:func:`pagedkv.config.default_dtype`), for help texts.
AUTO_DTYPE_HELP = ("auto: the checkpoint's 16-bit dtype where the device computes it natively (CUDA; a CPU with "
                   "AVX-512 BF16 or AMX), else float32")


def add_dtype_arg(p: Parser, *, default: str | None = "auto", help: str) -> None:
    """``--dtype``, the model's dtype (``PAGEDKV_DTYPE``); choices :data:`MODEL_DTYPE_CHOICES`."""
    p.add_argument("--dtype", default=env("PAGEDKV_DTYPE", default), choices=MODEL_DTYPE_CHOICES, help=help)


def add_pool_args(p: Parser, *, num_blocks: bool, kv_cache_dtype: bool,
                  given_only: bool = False, from_env: bool = True, kv_cache_dtype_help: str = "") -> None:
    """The pool's flags: ``--block-size``, ``--kv-cache-memory`` (with ``num_blocks``: and
    ``--num-blocks``, one of the two), ``--gpu-memory-utilization`` (a GPU pool's size as a
    fraction of the device, :mod:`pagedkv.config.gpu_sizing`; the two before it win over it),
    ``--host-cache-memory``, ``--disk-cache-dir`` and ``--disk-cache-size``, with ``kv_cache_dtype``
    ``--kv-cache-dtype``. ``given_only``: every default None, so that a caller can tell a flag
    given from its default (``pagedkv serve`` attaching to running services checks given ones).
    ``from_env``: defaults from ``PAGEDKV_<FLAG>``."""
    block = None if given_only else 16
    p.add_argument("--block-size", type=int, default=_env("PAGEDKV_BLOCK_SIZE", from_env, block),
                   help="tokens per block (default 16)")
    size = p.add_mutually_exclusive_group() if num_blocks else p
    if num_blocks:
        size.add_argument("--num-blocks", type=int, default=None,
                          help="blocks in the pool (instead of --kv-cache-memory)")
    size.add_argument("--kv-cache-memory", default=_env("PAGEDKV_KV_CACHE_MEMORY", from_env, None),
                      help=f"pool size in bytes, e.g. 2GiB (default {DEFAULT_CPU_KV_MEMORY} on cpu; on cuda "
                           "--gpu-memory-utilization's)")
    p.add_argument("--gpu-memory-utilization", type=_utilization, metavar="F",
                   default=_env("PAGEDKV_GPU_MEMORY_UTILIZATION", from_env, None),
                   help=f"a GPU pool's size as vLLM's: F x the device's memory less each worker's weights and "
                        f"activation reserve at --max-num-batched-tokens (F in (0, 1]; default "
                        f"{DEFAULT_GPU_MEMORY_UTILIZATION} on cuda; refused on cpu). --kv-cache-memory"
                        f"{' and --num-blocks' if num_blocks else ''} win over it")
    host = None if given_only or not from_env else "0"
    p.add_argument("--host-cache-memory", default=_env("PAGEDKV_HOST_CACHE_MEMORY", from_env, host), metavar="SIZE",
                   help="host tier behind the pool, e.g. 4GiB (default 0 = none): evicted prefix-cache blocks are "
                        "offloaded there and reloaded on a hit, and swap preemption keeps sequences there")
    p.add_argument("--disk-cache-dir", default=_env("PAGEDKV_DISK_CACHE_DIR", from_env, None), metavar="DIR",
                   help="a disk tier behind the host tier (default: none): host-cached blocks are written here and "
                        "read back for a prefix hit, and survive a restart; the directory is the memory service's "
                        "(mode 0700) and its workers' (the same uid)")
    p.add_argument("--disk-cache-size", default=_env("PAGEDKV_DISK_CACHE_SIZE", from_env, None), metavar="SIZE",
                   help="bytes the disk tier may take under --disk-cache-dir, e.g. 100GiB (required with it)")
    if kv_cache_dtype:
        p.add_argument("--kv-cache-dtype", default=_env("PAGEDKV_KV_CACHE_DTYPE", from_env, None),
                       choices=KV_CACHE_DTYPE_CHOICES, help=kv_cache_dtype_help)


def _utilization(text: str) -> float:
    try:
        return check_utilization(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_max_batched_tokens_arg(p: Parser, help: str) -> None:
    """``--max-num-batched-tokens`` (``PAGEDKV_MAX_NUM_BATCHED_TOKENS``, default 512): the most tokens
    one step carries."""
    p.add_argument("--max-num-batched-tokens", type=int, default=env("PAGEDKV_MAX_NUM_BATCHED_TOKENS"),
                   metavar="T", help=help)


class _Refused(argparse.Action):
    """A flag that exists only to be refused with a message (argparse error, exit 2)."""

    def __init__(self, option_strings, dest, message: str = "", **kwargs):
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.message = message

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(self.message)


def refuse_pool_dtype_flag(p: argparse.ArgumentParser) -> None:
    """``--dtype`` on the memory service: refused, naming ``--kv-cache-dtype`` (``--dtype`` is the model's)."""
    p.add_argument("--dtype", action=_Refused, dest="refused_dtype",
                   message="--dtype is the model's dtype (pagedkv compute, pagedkv serve); the memory service "
                           "holds the pool, whose dtype is --kv-cache-dtype (e.g. --kv-cache-dtype bfloat16)")


def add_tls_args(p: Parser) -> None:
    """``--tls-cert``, ``--tls-key`` and ``--tls-ca`` (defaults from ``PAGEDKV_TLS_*``): mutual TLS on
    the internal plane (:mod:`pagedkv.runtime.tls`)."""
    helps = {
        "cert": "this member's certificate (PEM), for mutual TLS on the internal plane (env PAGEDKV_TLS_CERT)",
        "key": "its private key (PEM) (env PAGEDKV_TLS_KEY)",
        "ca": "the plane's CA certificate (PEM); peers must present a certificate it signed (env PAGEDKV_TLS_CA). "
              "Without the three flags a server binds loopback only",
    }
    for name in ("cert", "key", "ca"):
        p.add_argument(f"--tls-{name}", dest=f"tls_{name}", default=env(f"PAGEDKV_TLS_{name.upper()}"),
                       metavar="PEM", help=helps[name])


#: ``--log-level`` choices (:mod:`pagedkv.runtime.logs`).
LOG_LEVELS = ("debug", "info", "warning", "error")


def add_logging_args(p: Parser) -> None:
    """``--log-level`` (default ``PAGEDKV_LOG_LEVEL``, else info); the service's main applies it with
    :func:`pagedkv.runtime.logs.configure_logging` before anything logs."""
    p.add_argument("--log-level", default=env("PAGEDKV_LOG_LEVEL").lower(), type=str.lower, choices=LOG_LEVELS,
                   help="structlog level: debug, info, warning or error (default info; env PAGEDKV_LOG_LEVEL)")
