"""``pagedkv serve``'s flags: vLLM's names where vLLM has one, each also read from its environment
variable (:mod:`pagedkv.config.envs`: ``PAGEDKV_SERVE_HOST``/``PORT``/``DEVICE`` for this
process's own, ``PAGEDKV_<FLAG>`` for the shared ones).

A flag given on the command line wins over its environment variable, which wins over the
default. The model is ``pagedkv serve MODEL`` (as ``vllm serve MODEL``) or ``--model``. Pool flags
(``--block-size``, ``--kv-cache-memory``, ``--kv-cache-dtype``, ``--dtype``, ``--model``) default
to None here so that attaching to running services can tell "given" from "default"
(:mod:`client.serve.backends` checks given ones against the pool). Keys and tenants are
:mod:`client.serve.tenants`'s; the HTTP server's timeouts, connection limit and trusted proxies
:mod:`client.serve.http_limits`'s.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from client.cluster.core import NodeSpec, parse_node
from client.engine.scheduler_types import SCHEDULING_POLICIES
from client.serve.chat_template import load_chat_template
from client.serve.http_limits import HttpLimits, add_http_limit_args, parse_http_limits
from client.serve.metrics_vllm import COMPAT_CHOICES
from client.serve.tenants import Tenants
from client.serve.tools.parser import parser_names
from pagedkv import config
from pagedkv.config import flags
from pagedkv.config.gpu_sizing import check_utilization


def _env(name: str, *default):
    """``PAGEDKV_<name>`` from the registry (``default``: instead of the registered default); an
    unparsable value exits with a usage error."""
    try:
        return config.env(f"PAGEDKV_{name}", *default)
    except ValueError as e:
        raise SystemExit(f"pagedkv serve: error: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``pagedkv serve`` (defaults from the environment, read when it is built)."""
    p = argparse.ArgumentParser(prog="pagedkv serve", description="An OpenAI-compatible HTTP server that owns the "
                                "scheduler: every caller's requests join one continuous batch.")
    _add_backend_args(p)
    plane = p.add_argument_group("internal plane (mutual TLS; the scheduler's certificate, also given to embedded "
                                 "services; none: plaintext, loopback only)")
    flags.add_tls_args(plane)
    flags.add_logging_args(p)
    _add_http_args(p)
    add_http_limit_args(p)
    _add_model_args(p)
    _add_chat_args(p)
    _add_scheduler_args(p)
    return p


def _add_backend_args(p: argparse.ArgumentParser) -> None:
    """Where the memory service and workers are (none: embedded children)."""
    where = p.add_argument_group("backends (none given: start a memory service and a worker as child processes)")
    where.add_argument("--memory", default=_env("MEMORY"), help="memory service address host:port (env PAGEDKV_MEMORY)")
    where.add_argument("--workers", default=config.env_text("PAGEDKV_WORKERS"),
                       help="worker addresses, comma-separated (env PAGEDKV_WORKERS)")
    where.add_argument("--node", action="append", default=None, metavar="NAME=MEMORY,workers=A,B,role=ROLE",
                       help="a node of several (repeatable; env PAGEDKV_NODE, nodes separated by ';'): its memory "
                       "service, its workers (a worker may take a role inside the node: ADDR@prefill, ADDR@decode) and "
                       "its role, prefill, decode or both (default). Requests go to the node of least cost by cached "
                       "prefix and load; with prefill and decode nodes each request prefills on one and decodes on "
                       "another, its blocks read once over NIXL (memory services with one --transfer-key-file, workers "
                       "with --node-transfers). Replaces --memory/--workers")
    where.add_argument("--router-tls-cert", default=_env("ROUTER_TLS_CERT"), metavar="PEM",
                       help="with --node under mutual TLS: the router's certificate (role router) for the nodes' KV "
                       "event streams (env PAGEDKV_ROUTER_TLS_CERT)")
    where.add_argument("--router-tls-key", default=_env("ROUTER_TLS_KEY"), metavar="PEM",
                       help="its private key (env PAGEDKV_ROUTER_TLS_KEY)")
    where.add_argument("--memory-admin-token-file", default=_env("MEMORY_ADMIN_TOKEN_FILE"), metavar="PATH",
                       help="the memory service's admin token: this server's lease is created with it (exempt from "
                       "--max-blocks-per-lease: the whole pool), and the dashboard shows every lease's sequences "
                       "(default: an embedded service's own, else $PAGEDKV_ADMIN_TOKEN_FILE, else $PAGEDKV_HOME/admin-"
                       "token; unreadable: a lease under the quota, and the dashboard shows this server's lease only)")
    where.add_argument("--device", default=_env("SERVE_DEVICE"),
                       help="embedded services: cpu or cuda (default: cuda when present)")


def _add_http_args(p: argparse.ArgumentParser) -> None:
    """The HTTP front: address, API keys and tenants, queue limits, the dashboard."""
    http = p.add_argument_group("HTTP")
    http.add_argument("--host", default=_env("SERVE_HOST"), help="address to bind (default 127.0.0.1)")
    http.add_argument("--port", type=int, default=_env("SERVE_PORT", config.SERVE_PORT),
                      help="port; 0 = any free port (default 8000)")
    http.add_argument("--api-key", action="append", default=None,
                      help="a key callers must send as 'Authorization: Bearer KEY' (repeatable; env PAGEDKV_API_KEY, "
                      "comma-separated); its tenant is 'default'")
    http.add_argument("--api-keys-file", default=_env("API_KEYS_FILE"),
                      help="keys and their tenants: a JSON object {key: tenant} or lines 'KEY TENANT'")
    http.add_argument("--admin-api-key", default=_env("ADMIN_API_KEY"),
                      help="the key that may read every tenant's state and the debug routes")
    http.add_argument("--metrics-api-key", default=_env("METRICS_API_KEY"),
                      help="a key that may read /metrics and nothing else (a Prometheus scraper's). With API keys "
                      "or this key given, /metrics needs it or the admin key; otherwise it is open")
    http.add_argument("--metrics-compat", default=_env("METRICS_COMPAT"), metavar="{none,vllm}",
                      help="vllm: /metrics also exports the same values under the names, labels and buckets of "
                      "vllm serve 0.32 (vllm:num_requests_running, vllm:time_to_first_token_seconds, ...), for "
                      "dashboards written for vLLM; the same key rule as /metrics (default none: pagedkv: only)")
    http.add_argument("--cache-sharing-group", action="append", default=None, metavar="NAME=TENANT,TENANT",
                      help="tenants that share one prefix cache (each tenant's is its own otherwise); repeatable, a "
                      "tenant in one group at most (env PAGEDKV_CACHE_SHARING_GROUP, groups separated by ';')")
    http.add_argument("--cache-salt-secret-file", default=_env("CACHE_SALT_SECRET_FILE"), help="the secret of the "
                      "tenants' cache namespaces, kept across restarts (default $PAGEDKV_HOME/cache-salt-secret)")
    http.add_argument("--max-queued-requests", type=int, default=_env("MAX_QUEUED_REQUESTS", 1024),
                      help="requests that may wait for admission; more get 429 (default 1024)")
    http.add_argument("--max-requests-per-tenant", type=int, default=_env("MAX_REQUESTS_PER_TENANT", None),
                      help="sequences (queued and running; each prompt counts its n samples or beams) one tenant "
                      "may have in flight; more get 429, so one tenant cannot fill the server for all (default: no "
                      "per-tenant limit; needs API keys)")
    http.add_argument("--dashboard-interval", type=float, default=_env("DASHBOARD_INTERVAL", 1.0),
                      help="seconds between the dashboard's snapshots while someone watches (default 1)")
    http.add_argument("--ready-file", default=None, help="write the bound address here as JSON once serving")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """The model and, for embedded services, the pool."""
    model = p.add_argument_group("model and pool")
    model.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                       help="the model, as --model (pagedkv serve MODEL, as vllm serve MODEL)")
    # From the environment after parsing: MODEL on the command line beats PAGEDKV_MODEL, as --model does.
    flags.add_model_args(model, default=None, from_env=False, help=flags.MODEL_HELP + " (default smollm2)",
                         revision_help="branch, tag or commit of a repo id (default main); attaching, the workers "
                                       "must run it")
    model.add_argument("--served-model-name", default=_env("SERVED_MODEL_NAME"),
                       help="the name in the API's 'model' field (default: --model)")
    flags.add_dtype_arg(model, default=None,
                        help=f"model weights and activations (default {flags.AUTO_DTYPE_HELP})")
    model.add_argument(
        "--kv-scales-file",
        default=_env("KV_SCALES_FILE"),
        help='with --kv-cache-dtype fp8: the pool\'s scales, JSON {"k_scale": [[...]], "v_scale": [[...]]} '
        "of [num_layers][num_kv_heads] (default: the first worker calibrates them); embedded "
        "services only",
    )
    flags.add_pool_args(
        model,
        num_blocks=False,
        kv_cache_dtype=True,
        given_only=True,
        kv_cache_dtype_help=(
            "the pool's dtype (default auto: the model's); fp8 stores keys and values in one byte (e4m3) with static "
            "scales per (layer, KV head) that the first worker calibrates: 4x the tokens of float32, 2x of bfloat16, "
            "in the same memory. Embedded services get the pool flags; attaching, they must match"
        ),
    )
    model.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="embedded memory service without automatic prefix caching (on by default)",
    )
    model.add_argument("--enforce-eager", action="store_true", default=config.env("PAGEDKV_ENFORCE_EAGER"),
                       help="embedded GPU workers run every step eagerly: no CUDA graphs for decode")


def _add_chat_args(p: argparse.ArgumentParser) -> None:
    """The chat template and tool calling (vLLM's flags; client.serve.chat_template, client.serve.tools)."""
    chat = p.add_argument_group("chat template and tool calling")
    chat.add_argument("--chat-template", default=_env("CHAT_TEMPLATE"), metavar="FILE|TEMPLATE",
                      help="the chat template for every chat prompt: a Jinja file, the template itself (a value "
                      "with '{', '}' or a newline), or a template shipped with pagedkv by name "
                      "(tool_chat_template_hermes.jinja); default: the model's, or the shipped Hermes tool "
                      "template for requests with tools when the model's renders none")
    chat.add_argument("--enable-auto-tool-choice", action="store_true", default=_env("ENABLE_AUTO_TOOL_CHOICE"),
                      help='tool_choice "auto" (the default when a request has tools): the model decides, and '
                      "--tool-call-parser reads its calls out of the text")
    chat.add_argument("--tool-call-parser", default=_env("TOOL_CALL_PARSER"), metavar="{hermes,llama3_json}",
                      help="how calls are written in the model's text: hermes (<tool_call>{...}</tool_call>, "
                      "the shipped template's) or llama3_json")


def _add_scheduler_args(p: argparse.ArgumentParser) -> None:
    """The engine's scheduler: batch, token budget, preemption, context."""
    sched = p.add_argument_group("scheduler")
    sched.add_argument(
        "--max-num-seqs", type=int, default=_env("MAX_NUM_SEQS", 64), help="most requests running at once (default 64)"
    )
    sched.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=_env("MAX_NUM_BATCHED_TOKENS", 512),
        help="token budget of one step, chunked prefill (default 512)",
    )
    sched.add_argument(
        "--preemption-mode",
        choices=("recompute", "swap"),
        default=_env("PREEMPTION_MODE", "recompute"),
        help="when the pool runs out, preempt a running request by 'recompute' (free its blocks, "
        "compute its tokens again later; the default) or by 'swap' (move its KV to the host tier "
        "and back, nothing recomputed; needs --host-cache-memory, else it recomputes)",
    )
    sched.add_argument(
        "--scheduling-policy", choices=SCHEDULING_POLICIES, default=_env("SCHEDULING_POLICY", "fcfs"),
        help="the order of waiting requests (vLLM's): 'fcfs' by arrival (the default), or 'priority' by each "
        "request's `priority` field, lower first, then arrival; preemption then takes the least urgent, "
        "latest request first. Under 'fcfs' a request's priority must be 0")
    sched.add_argument(
        "--step-timeout", type=float, default=_env("STEP_TIMEOUT", 600.0),
        help="seconds a worker's step may take before the worker counts as hung: its sequences go on on "
        "another worker from their KV, only the lost step recomputed (default 600)")
    sched.add_argument(
        "--recovery-timeout", type=float, default=_env("RECOVERY_TIMEOUT", 60.0),
        help="seconds to wait for the services after a lost lease, or for a worker when every worker is "
        "down, before the requests held fail (default 60)")
    sched.add_argument(
        "--max-model-len",
        type=int,
        default=_env("MAX_MODEL_LEN", None),
        help="longest context, prompt + output tokens (default: the model's, capped by the pool)",
    )


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """``pagedkv serve``'s flags, parsed and checked once (:func:`parse_args`). Pool flags left out
    are None, so attaching can tell "given" from "default" (:mod:`client.serve.backends`)."""

    # -- backends
    memory: str | None
    workers: tuple[str, ...]
    nodes: tuple[NodeSpec, ...]
    router_tls_cert: str | None
    router_tls_key: str | None
    memory_admin_token_file: str | None
    device: str | None
    #: The internal plane's mutual-TLS files, as given (read when the backends are resolved).
    tls_cert: str | None
    tls_key: str | None
    tls_ca: str | None
    log_level: str
    # -- HTTP
    host: str
    port: int
    tenants: Tenants
    cache_salt_secret_file: str | None
    max_queued_requests: int
    max_requests_per_tenant: int | None
    #: "vllm": /metrics also exports vLLM's names (client.serve.metrics_vllm); "none": pagedkv: only.
    metrics_compat: str
    #: Seconds between dashboard snapshots.
    dashboard_interval: float
    ready_file: str | None
    #: Header and body timeouts, connections, trusted proxies (client.serve.http_limits).
    http_limits: HttpLimits
    # -- model and pool
    model: str | None
    revision: str | None
    served_model_name: str | None
    #: ``--dtype`` and the pool's dtype (``--kv-cache-dtype``, else the model's); None: auto.
    model_dtype: config.DType | None
    pool_dtype: config.DType | None
    #: ``--kv-cache-dtype`` as given (None: not given).
    kv_cache_dtype: str | None
    kv_scales_file: str | None
    block_size: int | None
    kv_cache_memory: str | None
    #: ``--gpu-memory-utilization`` as given (None: not given; embedded GPU services default to 0.9).
    gpu_memory_utilization: float | None
    host_cache_memory: str | None
    disk_cache_dir: str | None
    disk_cache_size: str | None
    prefix_caching: bool
    enforce_eager: bool
    # -- chat template and tools
    #: ``--chat-template``'s template text (loaded and compiled at start); None: the model's.
    chat_template: str | None
    enable_auto_tool_choice: bool
    tool_call_parser: str | None
    # -- scheduler
    max_num_seqs: int
    max_num_batched_tokens: int
    preemption_mode: str
    scheduling_policy: str
    max_model_len: int | None
    #: Seconds before a worker's step counts as hung; to wait for the services after a failure.
    step_timeout: float
    recovery_timeout: float

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> ServeConfig:
        """The fields of parsed and checked ``args`` (lists become tuples)."""
        value = lambda v: tuple(v) if isinstance(v, list) else v  # noqa: E731
        return cls(**{f.name: value(getattr(args, f.name)) for f in fields(cls)})


def parse_args(argv: list[str]) -> ServeConfig:
    """Parse ``argv`` (after ``serve``); exits with a usage error on bad values."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.model_positional is not None:
        if args.model is not None and args.model != args.model_positional:
            p.error(f"the model is given twice, {args.model_positional} and --model {args.model}: give one")
        args.model = args.model_positional
    del args.model_positional
    args.model = args.model or _env("MODEL", None)
    args.revision = args.revision or _env("REVISION")
    if args.api_key is None:
        args.api_key = _env("API_KEY") or []
    if args.cache_sharing_group is None:  # the values hold commas: groups are separated by ';'
        args.cache_sharing_group = [g.strip() for g in (_env("CACHE_SHARING_GROUP") or "").split(";") if g.strip()]
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_queued_requests"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_requests_per_tenant is not None and args.max_requests_per_tenant < 1:
        p.error("--max-requests-per-tenant must be >= 1")
    try:
        args.dashboard_interval = float(args.dashboard_interval)
    except ValueError:
        p.error(f"--dashboard-interval {args.dashboard_interval!r} is not a number of seconds")
    if not 0.05 <= args.dashboard_interval <= 3600:
        p.error("--dashboard-interval must lie in 0.05-3600 seconds")
    for name in ("step_timeout", "recovery_timeout"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0 seconds")
    if args.max_model_len is not None and args.max_model_len < 2:
        p.error("--max-model-len must be >= 2")
    if args.metrics_compat not in COMPAT_CHOICES:  # checked here: also from PAGEDKV_METRICS_COMPAT
        p.error(f"--metrics-compat must be one of {', '.join(COMPAT_CHOICES)}, got {args.metrics_compat!r}")
    if args.preemption_mode not in ("recompute", "swap"):  # from PAGEDKV_PREEMPTION_MODE
        p.error(f"--preemption-mode must be recompute or swap, got {args.preemption_mode!r}")
    if args.scheduling_policy not in SCHEDULING_POLICIES:  # from PAGEDKV_SCHEDULING_POLICY
        p.error(f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {args.scheduling_policy!r}")
    if args.block_size is not None and args.block_size < 1:
        p.error("--block-size must be >= 1")
    if args.gpu_memory_utilization is not None:  # from PAGEDKV_GPU_MEMORY_UTILIZATION, unchecked by argparse
        try:
            args.gpu_memory_utilization = check_utilization(args.gpu_memory_utilization)
        except ValueError as e:
            p.error(str(e))
    if not 0 <= args.port <= 65535:
        p.error("--port must lie in 0-65535")
    try:  # values from PAGEDKV_DTYPE / PAGEDKV_KV_CACHE_DTYPE are checked here
        args.model_dtype, args.pool_dtype = config.serve_dtypes(args.dtype, args.kv_cache_dtype)
    except ValueError as e:
        p.error(str(e))
    if args.kv_scales_file and not (args.pool_dtype and args.pool_dtype.is_fp8):
        p.error("--kv-scales-file gives an fp8 pool's scales: add --kv-cache-dtype fp8")
    args.workers = [w.strip() for w in args.workers.split(",") if w.strip()] if args.workers else []
    if args.node is None:
        args.node = [n.strip() for n in (_env("NODE") or "").split(";") if n.strip()]
    try:
        args.nodes = [parse_node(n) for n in args.node]
    except ValueError as e:
        p.error(str(e))
    if args.nodes and (args.memory or args.workers):
        p.error("--node replaces --memory/--workers: name every node's memory service and workers with --node")
    if len({n.name for n in args.nodes}) != len(args.nodes):
        p.error("--node: each node name once")
    try:
        args.tenants = Tenants.load(args.api_key, args.api_keys_file, args.admin_api_key, args.cache_sharing_group,
                                    args.metrics_api_key)
    except (OSError, ValueError) as e:
        p.error(str(e))
    args.http_limits = parse_http_limits(args, p.error)
    _check_chat_args(args, p)
    return ServeConfig.from_namespace(args)


def _check_chat_args(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """Load ``--chat-template`` (a bad path or template fails the start, not the first request) and
    check the tool flags as vLLM does."""
    try:
        args.chat_template = load_chat_template(args.chat_template)
    except ValueError as e:
        p.error(f"--chat-template: {e}")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        p.error("--enable-auto-tool-choice requires --tool-call-parser")
    if args.tool_call_parser is not None and args.tool_call_parser not in parser_names():
        p.error(f"invalid tool call parser: {args.tool_call_parser} (choose from {{ {', '.join(parser_names())} }})")
