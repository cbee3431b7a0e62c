"""``pagedkv up`` / ``down``: run a memory service and a worker on this machine in the background.

``up`` starts a detached supervisor (:mod:`client.ops.supervisor`) that runs a
:class:`~client.ops.stack.LocalStack` as its children and restarts a service that dies (the services
outlive the command); ``down`` stops the supervisor, and so the services, by pid.

DESIGN.md, "Defaults and discovery": addresses and pids go to a state file
``$PAGEDKV_HOME/state.json`` (default ``~/.cache/pagedkv/``) that ``generate``,
``stats`` and ``down`` read; ``PAGEDKV_MEMORY`` and ``PAGEDKV_WORKERS``
(comma-separated) override it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from client.ops.stack import LocalStack
from pagedkv.config import COMPUTE_PORT, DEFAULT_MEMORY, DEFAULT_WORKER, MEMORY_PORT, env
from pagedkv.config.gpu_sizing import refuse_on_cpu
from pagedkv.runtime.paths import pagedkv_home
from pagedkv.runtime.tls import TlsFiles


def state_path() -> Path:
    return pagedkv_home() / "state.json"


def read_state() -> dict | None:
    """The state file written by ``pagedkv up``, or None."""
    try:
        return json.loads(state_path().read_text())
    except (OSError, json.JSONDecodeError):
        return None


def addresses() -> tuple[str, list[str]]:
    """(memory address, worker addresses): environment, then state file, then defaults."""
    state = read_state() or {}
    memory = env("PAGEDKV_MEMORY") or state.get("memory", {}).get("address") or DEFAULT_MEMORY
    workers = env("PAGEDKV_WORKERS")  # None: unset; "," gives no worker
    if workers is None:
        workers = [w["address"] for w in state.get("workers", [])] or [DEFAULT_WORKER]
    return memory, workers


def default_device() -> str:
    """``cuda`` when a GPU and CuPy are present, else ``cpu``."""
    try:
        import torch

        if torch.cuda.is_available():
            import cupy  # noqa: F401

            return "cuda"
    except ImportError:
        pass
    return "cpu"


def check_tls(tls: TlsFiles | None) -> None:
    """Refuse plaintext towards services that ``pagedkv up`` started with mutual TLS (the state
    file says so), rather than fail later with an opaque handshake error.

    Raises:
        ValueError: the state file says TLS and ``tls`` is None.
    """
    state = read_state() or {}
    if tls is None and state.get("tls") and not env("PAGEDKV_MEMORY"):
        raise ValueError("the services of `pagedkv up` run with mutual TLS: give --tls-cert, --tls-key and --tls-ca "
                         "(e.g. the scheduler or admin files of `pagedkv certs`), or the PAGEDKV_TLS_* variables")


def up(*, device: str | None = None, model: str = "smollm2", memory_port: int = MEMORY_PORT,
       worker_port: int = COMPUTE_PORT,
       block_size: int = 16, kv_cache_memory: str | None = None, num_blocks: int | None = None,
       host_cache_memory: str | None = None, timeout: float = 300.0, tls: TlsFiles | None = None,
       revision: str | None = None, kv_cache_dtype: str | None = None, disk_cache_dir: str | None = None,
       disk_cache_size: str | None = None, gpu_memory_utilization: float | None = None) -> dict:
    """Start a supervisor (:mod:`client.ops.supervisor`, detached) that starts a memory service and
    one worker as its children, restarts either when it dies, and writes the state file once both
    are healthy; returns the state.

    ``model`` is "smollm2", a local directory or .gguf file, or a Hugging Face repo id at
    ``revision`` (branch, tag or commit; None: main), resolved by both services through the
    Hugging Face cache (pagedkv.model.source).

    ``host_cache_memory`` (e.g. "4GiB"; None or "0": none) sizes the memory service's host tier
    (``--host-cache-memory``): offloaded prefix-cache blocks and swapped-out requests.
    ``kv_cache_dtype`` (None: auto, pagedkv.config.default_dtype) is the pool's ``--kv-cache-dtype``,
    which the worker's model follows. ``disk_cache_dir`` and ``disk_cache_size`` give it a disk tier
    (``--disk-cache-dir``, ``--disk-cache-size``). ``gpu_memory_utilization`` (``--gpu-memory-utilization``;
    None: 0.9 on a GPU) sizes a GPU pool unless ``num_blocks`` or ``kv_cache_memory`` does; the one
    worker ``up`` starts is the device's only one (``--workers-per-device 1``).

    With ``tls`` both services get these files (``--tls-cert/--tls-key/--tls-ca``) and serve
    mutual TLS; without, plaintext on loopback.

    Raises:
        RuntimeError: services from an earlier ``up`` still run, or one failed to start (with the
            supervisor's log).
        ValueError: ``gpu_memory_utilization`` on a cpu device.
    """
    device = device or default_device()
    refuse_on_cpu(device, gpu_memory_utilization)
    state = read_state()
    if state and any(alive(p) for p in _pids(state)):
        raise RuntimeError(f"pagedkv is already up (memory {state['memory']['address']}); run `pagedkv down` first")
    forget_stale()
    mem_args = ["--block-size", str(block_size)]
    if num_blocks is not None:
        mem_args += ["--num-blocks", str(num_blocks)]
    elif kv_cache_memory:
        mem_args += ["--kv-cache-memory", kv_cache_memory]
    if gpu_memory_utilization is not None:
        mem_args += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if host_cache_memory:
        mem_args += ["--host-cache-memory", host_cache_memory]
    if kv_cache_dtype:  # the worker's --dtype auto follows the pool
        mem_args += ["--kv-cache-dtype", kv_cache_dtype]
    if disk_cache_dir:
        mem_args += ["--disk-cache-dir", disk_cache_dir, "--disk-cache-size", disk_cache_size or ""]
    run_dir = pagedkv_home() / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    LocalStack(memory_port=memory_port, worker_port=worker_port, timeout=timeout)  # checks the ports here
    conf = {"memory_args": mem_args, "device": device, "model": model, "revision": revision, "host": "127.0.0.1",
            "run_dir": str(run_dir), "memory_port": memory_port, "worker_port": worker_port, "timeout": timeout,
            "tls": {k: str(getattr(tls, k)) for k in ("cert", "key", "ca")} if tls else None,
            "state": str(state_path()), "log_level": env("PAGEDKV_LOG_LEVEL"),
            "extra": {"device": device, "model": model, "tls": tls is not None, "started": time.time()}}
    conf_path = run_dir / "supervisor.json"
    conf_path.write_text(json.dumps(conf))
    log_path = run_dir / "supervisor.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "client.ops.supervisor", "--config", str(conf_path)],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    deadline = time.monotonic() + 2 * timeout
    while True:
        state = read_state()
        if state and state.get("supervisor", {}).get("pid") == proc.pid:
            return state
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                _stop(proc.pid)
            raise RuntimeError(f"pagedkv up: the services did not start (see {log_path}):\n"
                               + log_path.read_text(errors="replace")[-3000:])
        time.sleep(0.1)


def _pids(state: dict) -> list[int]:
    """Every pid a state file names: the supervisor (when there is one), the workers, the memory service."""
    sup = state.get("supervisor")
    return [*([sup["pid"]] if sup else []), *(w["pid"] for w in state.get("workers", [])), state["memory"]["pid"]]


def forget_stale() -> bool:
    """Remove a state file none of whose processes runs (the machine rebooted, or they were killed),
    and say so on stderr; returns whether it did."""
    state = read_state()
    if not state or any(alive(p) for p in _pids(state)):
        return False
    state_path().unlink(missing_ok=True)
    print(f"pagedkv: removed {state_path()}: none of its processes runs (memory {state['memory']['address']}, "
          f"pids {', '.join(map(str, _pids(state)))})", file=sys.stderr)
    return True


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours counts as gone
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


def _stop(pid: int, timeout: float = 30.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(pid):
        os.kill(pid, signal.SIGKILL)


def down() -> list[str]:
    """Stop what ``up`` started: the supervisor, which stops the workers, then the memory service;
    then whatever still runs by pid. Returns the addresses stopped."""
    state = read_state()
    if not state:
        return []
    if forget_stale():
        return []
    services = [*state["workers"], state["memory"]]
    running = [p["address"] for p in services if alive(p["pid"])]
    if state.get("supervisor"):
        _stop(state["supervisor"]["pid"], timeout=60.0)
    for proc in services:
        if alive(proc["pid"]):
            _stop(proc["pid"])
    state_path().unlink(missing_ok=True)
    return running
