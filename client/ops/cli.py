"""The ``pagedkv`` command.

    pagedkv memory ...        run the KV-cache memory service (memory_service.main)
    pagedkv compute ...       run a compute worker (compute_service.main)
    pagedkv serve ...         the OpenAI-compatible HTTP server (client.serve.main)
    pagedkv up                start both on this machine in the background
    pagedkv down              stop them
    pagedkv generate PROMPT   stream a generation  [--chat] [--n 3] [--max-tokens 64] [--temperature 0]
    pagedkv stats             pool, leases and every lease's sequences (block ids, refcounts, shared blocks);
                              reads the memory service's admin token ($PAGEDKV_HOME/admin-token)
    pagedkv certs --out DIR   a CA and one certificate per member of the plane  [--hosts a,b] [--days N] [--force]
    pagedkv top               a `pagedkv serve`'s pool, block tables and rates, live  [--url URL] [--key KEY] [--once]

``up``, ``generate``, ``stats`` (and every service) take ``--tls-cert/--tls-key/--tls-ca`` for
mutual TLS on the internal plane (pagedkv.runtime.tls); without them the services listen on loopback only.

Service subcommands are imported lazily, so ``pagedkv memory`` never loads model code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pagedkv import config
from pagedkv.config import flags
from pagedkv.runtime import tls as plane_tls

_SERVICES = {"memory": "memory_service.main", "compute": "compute_service.main", "serve": "client.serve.main",
             "top": "client.ops.top"}


def build_parser() -> argparse.ArgumentParser:
    """The client subcommands' parser (services parse their own flags)."""
    p = argparse.ArgumentParser(prog="pagedkv", description="PagedAttention as services: a shared paged KV-cache pool.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("memory", help="run the KV-cache memory service", add_help=False)
    sub.add_parser("compute", help="run a compute worker", add_help=False)
    sub.add_parser("serve", help="run the OpenAI-compatible HTTP server", add_help=False)
    sub.add_parser("top", help="watch a `pagedkv serve`'s pool and requests live in the terminal", add_help=False)
    up = sub.add_parser("up", help="start a memory service and a worker on this machine")
    up.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    flags.add_model_args(up, from_env=False, help=flags.MODEL_HELP + " (default smollm2)")
    up.add_argument("--memory-port", type=int, default=config.MEMORY_PORT,
                    help=f"memory service port; 0 = a free one (default {config.MEMORY_PORT})")
    up.add_argument("--worker-port", type=int, default=config.COMPUTE_PORT,
                    help=f"worker port; 0 = a free one (default {config.COMPUTE_PORT})")
    flags.add_pool_args(up, num_blocks=True, kv_cache_dtype=True, from_env=False, kv_cache_dtype_help=(
        f"the pool's element type, which the worker's model follows (default {flags.AUTO_DTYPE_HELP}); "
        "float32 for outputs that match a float32 reference token for token"))
    flags.add_tls_args(up)
    sub.add_parser("down", help="stop what `pagedkv up` started")
    gen = sub.add_parser("generate", help="stream a generation")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--n", type=int, default=1, help="parallel samples (prefilled once, forked)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=None, help="default: the model's (generation_config.json), else 1")
    gen.add_argument("--top-k", type=int, default=None, help="0 = off; default: the model's, else 0")
    gen.add_argument("--repetition-penalty", type=float, default=None, help="1 = off; default: the model's, else 1")
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2] (default 0)")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2] (default 0)")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--num-beams", type=int, default=1)
    flags.add_tls_args(gen)
    drain = sub.add_parser("drain", help="move a worker's requests to the others and stop sending it work")
    drain.add_argument("address", help="the worker's address, host:port, as pagedkv serve knows it")
    drain.add_argument("--url", default=config.env("PAGEDKV_URL"), help="the pagedkv serve (default $PAGEDKV_URL, else "
                       "http://127.0.0.1:8000)")
    drain.add_argument("--api-key", default=config.env("PAGEDKV_ADMIN_API_KEY"),
                       help="its --admin-api-key (default $PAGEDKV_ADMIN_API_KEY)")
    drain.add_argument("--undrain", action="store_true", help="end the drain: the worker takes work again")
    stats = sub.add_parser("stats", help="show the pool, leases and sequences")
    stats.add_argument("--admin-token-file", default=None,
                       help="the memory service's admin token (default $PAGEDKV_ADMIN_TOKEN_FILE, else "
                            "$PAGEDKV_HOME/admin-token); under TLS an admin certificate serves instead")
    flags.add_tls_args(stats)
    from pagedkv.runtime.certs import build_parser as certs_parser

    certs_parser(sub.add_parser("certs", help="make a CA and one certificate per member of the plane (mutual TLS)"))
    return p


def _generate(args: argparse.Namespace) -> int:
    from client.api import Client
    from client.ops.launcher import addresses, check_tls
    from client.params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, repetition_penalty=args.repetition_penalty,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            seed=args.seed, n=args.n, num_beams=args.num_beams)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    memory, workers = addresses()
    tls = plane_tls.from_args(args)
    check_tls(tls)
    with Client(memory, workers, tls=tls) as llm:
        if args.n == 1 and args.num_beams == 1:
            printed = 0
            for out in llm.stream(prompt, params):
                text = out.outputs[0].text
                sys.stdout.write(text[printed:])
                sys.stdout.flush()
                printed = len(text)
            sys.stdout.write("\n")
        else:
            (out,) = llm.generate([prompt], params)
            for o in out.outputs:
                print(f"--- [{o.index}] ({o.finish_reason})\n{o.text}")
    return 0


def _stats(args: argparse.Namespace) -> int:
    from client.ops.launcher import addresses, check_tls
    from client.ops.report import print_stats, sizing_table, stats_table
    from client.services import MemoryClient, admin_token_path, read_admin_token

    memory, _ = addresses()
    tls = plane_tls.from_args(args)
    check_tls(tls)
    path = args.admin_token_file or admin_token_path()
    m = MemoryClient(memory, tls=tls, admin_token=read_admin_token(path))
    try:
        if m.admin_token is None and tls is None:  # counters are open to all; block tables only to the admin
            from rich.console import Console

            stats = m.stats()
            Console(width=140).print(stats_table(stats), *([sizing_table(stats)] if stats.HasField("sizing") else []))
            print(f"no admin token at {path}, so no block tables: run this as the user of the memory service, "
                  "or pass --admin-token-file", file=sys.stderr)
            return 1
        stats = m.stats()
        print_stats(stats, m.sequences(), pins=m.list_pins() if stats.pins.num_pins else ())
    finally:
        m.close()
    return 0


def _drain(args) -> int:
    """``pagedkv drain ADDRESS``: POST /admin/workers/{address}/drain (or undrain); prints the reply."""
    import json
    import urllib.error
    import urllib.parse
    import urllib.request

    action = "undrain" if args.undrain else "drain"
    url = f"{args.url.rstrip('/')}/admin/workers/{urllib.parse.quote(args.address, safe='')}/{action}"
    req = urllib.request.Request(url, method="POST", headers={"Authorization": f"Bearer {args.api_key or ''}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            print(json.dumps(json.loads(r.read())))
    except urllib.error.HTTPError as e:
        print(f"pagedkv drain: error: {e.code}: {e.read().decode(errors='replace')}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``pagedkv``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _SERVICES:
        return importlib.import_module(_SERVICES[argv[0]]).main(argv[1:])
    args = build_parser().parse_args(argv)
    from client.errors import ServiceError

    try:
        if args.command == "up":
            from client.ops.launcher import up

            state = up(device=args.device, model=args.model, memory_port=args.memory_port, worker_port=args.worker_port,
                       block_size=args.block_size, kv_cache_memory=args.kv_cache_memory, num_blocks=args.num_blocks,
                       host_cache_memory=args.host_cache_memory, tls=plane_tls.from_args(args),
                       revision=args.revision, kv_cache_dtype=args.kv_cache_dtype,
                       disk_cache_dir=args.disk_cache_dir, disk_cache_size=args.disk_cache_size,
                       gpu_memory_utilization=args.gpu_memory_utilization)
            print(f"memory service  {state['memory']['address']}  (pid {state['memory']['pid']})")
            for w in state["workers"]:
                print(f"worker          {w['address']}  (pid {w['pid']}, {state['device']})")
            print(f"model           {state['model']}  (revision {state['revision']})")
            return 0
        if args.command == "down":
            from client.ops.launcher import down

            stopped = down()
            print("stopped " + ", ".join(stopped) if stopped else "nothing to stop")
            return 0
        if args.command == "generate":
            return _generate(args)
        if args.command == "stats":
            return _stats(args)
        if args.command == "drain":
            return _drain(args)
        if args.command == "certs":
            from pagedkv.runtime.certs import run

            return run(args)
    except (ServiceError, RuntimeError, TimeoutError, ValueError, OSError) as e:
        print(f"pagedkv {args.command}: error: {e}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
