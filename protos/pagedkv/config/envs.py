"""Every environment variable pagedkv reads, in one registry (the shape of vLLM's ``envs.py``).

Production code reads the environment through :func:`env` and nowhere else (a test greps for
other reads); ``docs/configuration.md`` is generated from :data:`ENV_VARS`
(``python -m pagedkv.config --markdown``) and a test fails when it is stale.

Names follow one convention: a flag that differs per process (host, port, device) reads
``PAGEDKV_<SERVICE>_<FLAG>`` (``PAGEDKV_MEMORY_PORT``, ``PAGEDKV_COMPUTE_PORT``,
``PAGEDKV_SERVE_PORT``), so the child processes of ``pagedkv serve``, which inherit its
environment, never take its port; a flag every process shares reads ``PAGEDKV_<FLAG>``. Older
names stay as aliases: either works, and the canonical name wins when both are set.

A variable is read each time :func:`env` is called (tests and kernel switches change them at run
time). An empty value counts as unset.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: :func:`env`'s marker for "the registered default".
_REGISTERED = object()
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True, slots=True)
class EnvVar:
    """One environment variable: its name, how its text parses, its default and its meaning."""

    #: The canonical name.
    name: str
    #: "str", "int", "float", "bool" (1/true/yes/on, 0/false/no/off; other text: the default) or "list"
    #: (comma-separated).
    type: str
    #: The value when unset or empty.
    default: Any
    #: One line: what it sets, and who reads it.
    doc: str
    #: Older names, read when the canonical one is unset.
    aliases: tuple[str, ...] = ()
    #: Read only when a test sets it (fault injection, test hooks); never set it in production.
    test_only: bool = False

    def parse(self, text: str) -> Any:
        """The typed value of ``text`` (non-empty).

        Raises:
            ValueError: text that is not an ``int`` or ``float`` of those types, naming the variable.
        """
        kind = _PARSERS[self.type]
        try:
            return kind(self, text)
        except ValueError:
            raise ValueError(f"{self.name}={text!r} is not {'an' if self.type == 'int' else 'a'} "
                             f"{'integer' if self.type == 'int' else 'number'}") from None


def _bool(var: EnvVar, text: str) -> bool:
    low = text.strip().lower()
    return True if low in _TRUE else False if low in _FALSE else var.default


_PARSERS: dict[str, Callable[[EnvVar, str], Any]] = {
    "str": lambda var, text: text,
    "int": lambda var, text: int(text),
    "float": lambda var, text: float(text),
    "bool": _bool,
    "list": lambda var, text: [v.strip() for v in text.split(",") if v.strip()],
}


def _vars(*entries: EnvVar) -> dict[str, EnvVar]:
    return {v.name: v for v in entries}


E = EnvVar
#: The registry, in the order of docs/configuration.md.
ENV_VARS: dict[str, EnvVar] = _vars(
    # --- every process
    E("PAGEDKV_HOME", "str", None,
      "folder of the state file, admin token, sockets and caches (default ~/.cache/pagedkv)"),
    E("PAGEDKV_LOG_LEVEL", "str", "info", "--log-level of memory, compute and serve: debug, info, warning, error"),
    E("PAGEDKV_TLS_CERT", "str", None,
      "--tls-cert: this member's certificate (PEM) for mutual TLS on the internal plane"),
    E("PAGEDKV_TLS_KEY", "str", None, "--tls-key: its private key (PEM)"),
    E("PAGEDKV_TLS_CA", "str", None, "--tls-ca: the plane's CA certificate (PEM)"),
    E("PAGEDKV_PARENT_PID", "int", None, "set by pagedkv serve and pagedkv up's supervisor on the services they "
      "start: a service stops when that process is gone"),
    # --- model and pool (memory, compute, serve)
    E("PAGEDKV_MODEL", "str", "smollm2", "--model: 'smollm2', a .gguf file, a Hugging Face directory or repo id"),
    E("PAGEDKV_REVISION", "str", None, "--revision: branch, tag or commit of a repo id (default main)"),
    E("PAGEDKV_DTYPE", "str", "auto", "--dtype of compute and serve: the model's weights and activations"),
    E("PAGEDKV_KV_CACHE_DTYPE", "str", "auto", "--kv-cache-dtype of memory and serve: the pool's element type"),
    E("PAGEDKV_BLOCK_SIZE", "int", 16, "--block-size of memory and serve: tokens per block"),
    E("PAGEDKV_KV_CACHE_MEMORY", "str", None, "--kv-cache-memory of memory and serve: pool size, e.g. 1GiB"),
    E("PAGEDKV_GPU_MEMORY_UTILIZATION", "float", None, "--gpu-memory-utilization of memory, up and serve: the "
      "fraction of a GPU the pool and its workers take (default 0.9 on a GPU; refused on cpu)"),
    E("PAGEDKV_HOST_CACHE_MEMORY", "str", "0", "--host-cache-memory of memory and serve: the host tier, e.g. 4GiB"),
    E("PAGEDKV_DISK_CACHE_DIR", "str", None, "--disk-cache-dir of memory, up and serve: the disk tier's directory"),
    E("PAGEDKV_DISK_CACHE_SIZE", "str", None, "--disk-cache-size of memory, up and serve: the disk tier's bytes"),
    E("PAGEDKV_KV_SCALES_FILE", "str", None, "--kv-scales-file of memory and serve: an fp8 pool's scales (JSON)"),
    # --- pagedkv memory
    E("PAGEDKV_MEMORY_HOST", "str", "127.0.0.1", "--host of pagedkv memory: the address it binds"),
    E("PAGEDKV_MEMORY_PORT", "int", 50051, "--port of pagedkv memory (0: any free port)"),
    E("PAGEDKV_MEMORY_DEVICE", "str", "cpu", "--device of pagedkv memory: cpu, cuda or cuda:N",
      aliases=("PAGEDKV_DEVICE",)),
    E("PAGEDKV_WORKER_SOCKET", "str", None,
      "--worker-socket of pagedkv memory: where workers receive the pool's handle"),
    E("PAGEDKV_NODE_NAME", "str", None, "--node-name of pagedkv memory: this node's name (default: the pool id)"),
    E("PAGEDKV_TRANSFER_KEY_FILE", "str", None, "--transfer-key-file of pagedkv memory: the secret of node transfers"),
    E("PAGEDKV_MAX_BLOCKS_PER_LEASE", "str", "50%", "--max-blocks-per-lease of pagedkv memory: N blocks, P% of the "
      "pool's, or none (the admin's leases are exempt)"),
    E("PAGEDKV_WORKERS_PER_DEVICE", "int", 1, "--workers-per-device of pagedkv memory: workers that map a GPU "
      "pool on its device, each with its weights and activations (--gpu-memory-utilization sizing)"),
    E("PAGEDKV_MAX_LEASES_PER_PEER", "str", "64", "--max-leases-per-peer of pagedkv memory: live leases of one uid "
      "or certificate, or none"),
    # --- pagedkv compute
    E("PAGEDKV_COMPUTE_HOST", "str", "127.0.0.1", "--host of pagedkv compute: the address it binds"),
    E("PAGEDKV_COMPUTE_PORT", "int", 50052, "--port of pagedkv compute (0: any free port)"),
    E("PAGEDKV_COMPUTE_DEVICE", "str", "cpu", "--device of pagedkv compute: cpu, cuda or cuda:N",
      aliases=("PAGEDKV_DEVICE",)),
    E("PAGEDKV_MEMORY_SOCKET", "str", None, "--memory-socket of pagedkv compute: the worker socket's path here"),
    E("PAGEDKV_COMPUTE_METRICS_PORT", "int", None, "--metrics-port of pagedkv compute: its Prometheus /metrics "
      "(0: any free port; default off)"),
    E("PAGEDKV_NODE_TRANSFERS", "bool", False, "--node-transfers of pagedkv compute: publish the pool over NIXL"),
    E("PAGEDKV_ENFORCE_EAGER", "bool", False, "--enforce-eager of pagedkv compute and serve: no CUDA graphs"),
    E("PAGEDKV_MAX_CUDAGRAPH_CAPTURE_SIZE", "int", 256,
      "--max-cudagraph-capture-size of pagedkv compute: the largest decode batch run in a CUDA graph"),
    # --- clients: pagedkv compute/serve/generate/stats
    E("PAGEDKV_MEMORY", "str", None, "--memory: the memory service's address host:port (default 127.0.0.1:50051)"),
    E("PAGEDKV_WORKERS", "list", None, "--workers: worker addresses, comma-separated (default 127.0.0.1:50052)"),
    E("PAGEDKV_ADMIN_TOKEN_FILE", "str", None, "the memory service's admin token that stats and the dashboard read"),
    # --- pagedkv serve
    E("PAGEDKV_SERVE_HOST", "str", "127.0.0.1", "--host of pagedkv serve: the HTTP address it binds",
      aliases=("PAGEDKV_HOST",)),
    E("PAGEDKV_SERVE_PORT", "int", 8000, "--port of pagedkv serve: the HTTP port (0: any free port)",
      aliases=("PAGEDKV_PORT",)),
    E("PAGEDKV_SERVE_DEVICE", "str", None, "--device of pagedkv serve's embedded services (default: cuda when present)",
      aliases=("PAGEDKV_DEVICE",)),
    E("PAGEDKV_NODE", "str", None, "--node of pagedkv serve: nodes separated by ';'"),
    E("PAGEDKV_ROUTER_TLS_CERT", "str", None, "--router-tls-cert of pagedkv serve: the router's certificate"),
    E("PAGEDKV_ROUTER_TLS_KEY", "str", None, "--router-tls-key of pagedkv serve: its private key"),
    E("PAGEDKV_MEMORY_ADMIN_TOKEN_FILE", "str", None, "--memory-admin-token-file of pagedkv serve: the dashboard's, "
      "and its lease's"),
    E("PAGEDKV_API_KEY", "list", None, "--api-key of pagedkv serve: keys of tenant 'default', comma-separated"),
    E("PAGEDKV_API_KEYS_FILE", "str", None, "--api-keys-file of pagedkv serve: keys and their tenants"),
    E("PAGEDKV_ADMIN_API_KEY", "str", None, "--admin-api-key of pagedkv serve; --key of pagedkv top; "
      "--api-key of pagedkv drain"),
    E("PAGEDKV_METRICS_API_KEY", "str", None, "--metrics-api-key of pagedkv serve: a key that may read /metrics only"),
    E("PAGEDKV_METRICS_COMPAT", "str", "none", "--metrics-compat of pagedkv serve: none, or vllm (also export "
      "vLLM's metric names)"),
    E("PAGEDKV_CACHE_SHARING_GROUP", "str", None, "--cache-sharing-group of pagedkv serve: groups separated by ';'"),
    E("PAGEDKV_CACHE_SALT_SECRET_FILE", "str", None, "--cache-salt-secret-file of pagedkv serve: the secret of "
      "its tenants' cache namespaces (default $PAGEDKV_HOME/cache-salt-secret)"),
    E("PAGEDKV_MAX_QUEUED_REQUESTS", "int", 1024, "--max-queued-requests of pagedkv serve"),
    E("PAGEDKV_MAX_REQUESTS_PER_TENANT", "int", None, "--max-requests-per-tenant of pagedkv serve"),
    E("PAGEDKV_DASHBOARD_INTERVAL", "str", "1.0", "--dashboard-interval of pagedkv serve: seconds between snapshots"),
    E("PAGEDKV_HTTP_HEADER_TIMEOUT", "float", 10.0, "--http-header-timeout of pagedkv serve: seconds for a "
      "request's whole head"),
    E("PAGEDKV_HTTP_BODY_TIMEOUT", "float", 30.0, "--http-body-timeout of pagedkv serve: seconds from a request's "
      "head to the end of its body"),
    E("PAGEDKV_MAX_CONNECTIONS", "int", 1024, "--max-connections of pagedkv serve: HTTP connections open at once"),
    E("PAGEDKV_FORWARDED_ALLOW_IPS", "list", None, "--forwarded-allow-ips of pagedkv serve: proxies whose "
      "X-Forwarded-For/-Proto count, comma-separated (default none)"),
    E("PAGEDKV_SERVED_MODEL_NAME", "str", None, "--served-model-name of pagedkv serve"),
    E("PAGEDKV_CHAT_TEMPLATE", "str", None, "--chat-template of pagedkv serve: a Jinja file, the template itself, or "
      "a shipped template's name"),
    E("PAGEDKV_ENABLE_AUTO_TOOL_CHOICE", "bool", False, "--enable-auto-tool-choice of pagedkv serve: tool_choice "
      "auto, read by --tool-call-parser"),
    E("PAGEDKV_TOOL_CALL_PARSER", "str", None, "--tool-call-parser of pagedkv serve: hermes or llama3_json"),
    E("PAGEDKV_PREEMPTION_MODE", "str", "recompute", "--preemption-mode of pagedkv serve: recompute or swap"),
    E("PAGEDKV_SCHEDULING_POLICY", "str", "fcfs", "--scheduling-policy of pagedkv serve: fcfs or priority"),
    E("PAGEDKV_MAX_NUM_SEQS", "int", 64, "--max-num-seqs of pagedkv serve"),
    E("PAGEDKV_MAX_NUM_BATCHED_TOKENS", "int", 512, "--max-num-batched-tokens of serve, memory and compute: a "
      "step's token budget (the GPU pool's activation reserve, a GPU worker's profile run)"),
    E("PAGEDKV_MAX_MODEL_LEN", "int", None, "--max-model-len of serve and memory: the longest context (a GPU pool "
      "sized by --gpu-memory-utilization holds at least one)"),
    E("PAGEDKV_STEP_TIMEOUT", "float", 600.0, "--step-timeout of pagedkv serve: seconds before a worker's step "
      "counts as hung"),
    E("PAGEDKV_RECOVERY_TIMEOUT", "float", 60.0, "--recovery-timeout of pagedkv serve: seconds to wait for the "
      "services after a lost lease, or for a worker when every worker is down"),
    # --- pagedkv top
    E("PAGEDKV_URL", "str", "http://127.0.0.1:8000", "--url of pagedkv top and pagedkv drain: "
      "the pagedkv serve to watch or ask"),
    # --- compute paths of a worker (0: off, for comparisons and ablations)
    E("PAGEDKV_NATIVE_CPU", "bool", True, "the native CPU kernels (C, built at first use); 0: torch's ops"),
    E("PAGEDKV_PACKED_LINEAR", "bool", True, "oneDNN-packed CPU projections; 0: F.linear"),
    E("PAGEDKV_ROW_BUCKETS", "bool", True,
      "oneDNN projections run at a bounded set of row counts, so its primitive caches stay bounded; "
      "0: at every count (a worker's memory then grows with each new step size)"),
    E("PAGEDKV_CPU_LINEAR", "str", "auto",
      "the native projection kernel over oneDNN's packed weights: auto (from the CPU's flags), amx, avx512_bf16 "
      "(bf16), avx2 (fp32), or off (oneDNN's matmul)"),
    E("PAGEDKV_FUSED_DECODE", "bool", True,
      "a decode-only step on a native projection kernel in one native call per step; 0: off"),
    # --- read from other projects' names
    E("HF_HUB_OFFLINE", "bool", False, "huggingface_hub's: 1 never downloads a model that is not cached"),
    E("TRITON_INTERPRET", "bool", False, "Triton's: 1 runs the Triton kernels on CPU tensors (interpreter)"),
    E("CC", "str", None, "the C compiler of the native CPU kernels (default: cc, gcc or clang on PATH)"),
    E("NIXL_LOG_LEVEL", "str", None, "NIXL's: when unset, NIXL's log is cut to warnings"),
    # --- tests only
    E("PAGEDKV_TEST_CPU_FLAGS", "str", None,
      "CPU flags the processes see, as a list: only those the CPU has count (the kernels then built and "
      "chosen for them: a test runs another CPU's path)", test_only=True),
    E("PAGEDKV_TEST_HOOKS", "str", None, "a module the processes import at start to install test hooks",
      test_only=True),
)
del E


def _lookup(name: str) -> EnvVar:
    try:
        return ENV_VARS[name]
    except KeyError:
        raise KeyError(f"{name} is not in pagedkv's environment registry (pagedkv.config.envs.ENV_VARS)") from None


def env_text(name: str) -> str | None:
    """The raw text of ``name`` (canonical name, else the first alias set), None when unset or empty.

    Raises:
        KeyError: ``name`` is not registered.
    """
    var = _lookup(name)
    for n in (var.name, *var.aliases):
        text = os.environ.get(n)
        if text:
            return text
    return None


def env(name: str, default: Any = _REGISTERED) -> Any:
    """The value of the registered variable ``name``, parsed by its type; unset or empty: ``default``
    (the registered default unless given). Read anew each call.

    Raises:
        KeyError: ``name`` is not registered.
        ValueError: text that does not parse as an int or float variable, naming it.
    """
    var = _lookup(name)
    text = env_text(name)
    if text is None:
        return var.default if default is _REGISTERED else default
    return var.parse(text)


def env_is_set(name: str) -> bool:
    """Whether ``name`` (or an alias) is set to a non-empty value."""
    return env_text(name) is not None


def markdown() -> str:
    """docs/configuration.md: the registry as a table, generated (never edit the file by hand)."""
    lines = [
        "# Configuration: environment variables",
        "",
        "Generated from `protos/pagedkv/config/envs.py` by `python -m pagedkv.config --markdown`;",
        "`tests/pagedkv/test_config.py` fails when this file is stale. A flag given on the command line wins",
        "over its variable, which wins over the default. A flag that differs per process reads",
        "`PAGEDKV_<SERVICE>_<FLAG>`, one all processes share `PAGEDKV_<FLAG>`; an alias (an older",
        "name) is read when the canonical name is unset. An empty value counts as unset.",
        "",
        "| variable | type | default | meaning | aliases |",
        "|---|---|---|---|---|",
    ]
    for v in ENV_VARS.values():
        default = "" if v.default is None else f"`{v.default}`"
        meaning = ("**test only:** " if v.test_only else "") + v.doc.replace("|", "\\|")
        aliases = ", ".join(f"`{a}`" for a in v.aliases)
        lines.append(f"| `{v.name}` | {v.type} | {default} | {meaning} | {aliases} |")
    return "\n".join(lines) + "\n"
