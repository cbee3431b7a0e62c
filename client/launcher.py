"""``pagedkv up`` / ``down``: run a memory service and a worker on this machine in the background.

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

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv.paths import pagedkv_home

DEFAULT_MEMORY = "127.0.0.1:50051"
DEFAULT_WORKER = "127.0.0.1:50052"


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
    memory = os.environ.get("PAGEDKV_MEMORY") or state.get("memory", {}).get("address") or DEFAULT_MEMORY
    env_workers = os.environ.get("PAGEDKV_WORKERS")
    if env_workers:
        workers = [w.strip() for w in env_workers.split(",") if w.strip()]
    else:
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


def wait_healthy(address: str, timeout: float) -> None:
    """Block until ``address`` answers SERVING on the standard health service.

    Raises:
        TimeoutError: not healthy within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} was not healthy within {timeout:.0f} s")


class ServiceProcess:
    """A pagedkv service run as its own process; its address comes from its ready file.

    Args:
        command: the full command line, without ``--ready-file`` (added here).
        ready_file: where the service writes {"address", "port", "pid", ...} once serving.
        log_path: stdout and stderr of the process.
        env: its environment (default: this process's).
        cwd: its working folder.
        timeout: seconds to wait for the ready file.
        detach: start it in a session of its own (it outlives this process).

    Raises:
        RuntimeError: it exited or did not get ready in time (with its log's tail).
    """

    def __init__(self, command: list[str], ready_file: Path, log_path: Path, *, env: dict | None = None,
                 cwd: Path | None = None, timeout: float = 180.0, detach: bool = False):
        self.ready_file, self.log_path = Path(ready_file), Path(log_path)
        self.ready_file.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([*command, "--ready-file", str(self.ready_file)], stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                                         start_new_session=detach)
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.log_path.stem} did not start (see {self.log_path}):\n{self.log()[-3000:]}")
            time.sleep(0.05)
        #: The ready file's contents.
        self.info: dict = json.loads(self.ready_file.read_text())
        #: host:port it serves on.
        self.address: str = self.info["address"]

    @classmethod
    def pagedkv(cls, args: list[str], run_dir: Path, name: str, *, port: int = 0, env: dict | None = None,
                **kwargs) -> ServiceProcess:
        """``pagedkv <args> --port <port>`` from this Python, logging to ``run_dir/<name>.log``."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        return cls([sys.executable, "-m", "client.cli", *args, "--port", str(port)], run_dir / f"{name}.ready.json",
                   run_dir / f"{name}.log", env={**os.environ, **(env or {})}, **kwargs)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        """Its output so far."""
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (graceful shutdown), SIGKILL after ``timeout`` seconds; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _spawn(args: list[str], name: str, run_dir: Path, timeout: float, port: int) -> dict:
    svc = ServiceProcess.pagedkv(args, run_dir, name, port=port, timeout=timeout, detach=True)
    wait_healthy(svc.address, timeout)
    return {"address": svc.address, "pid": svc.pid, "log": str(svc.log_path)}


def up(*, device: str | None = None, model: str = "smollm2", memory_port: int = 50051, worker_port: int = 50052,
       block_size: int = 16, kv_cache_memory: str | None = None, num_blocks: int | None = None,
       timeout: float = 300.0) -> dict:
    """Start a memory service and one worker, wait for both to be healthy, write the state file.

    Raises:
        RuntimeError: services from an earlier ``up`` still run, or one failed to start.
    """
    state = read_state()
    if state and any(_alive(p["pid"]) for p in [state["memory"], *state["workers"]]):
        raise RuntimeError(f"pagedkv is already up (memory {state['memory']['address']}); run `pagedkv down` first")
    device = device or default_device()
    run_dir = pagedkv_home() / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    mem_args = ["memory", "--host", "127.0.0.1", "--device", device, "--block-size", str(block_size), "--model", model]
    if num_blocks is not None:
        mem_args += ["--num-blocks", str(num_blocks)]
    elif kv_cache_memory:
        mem_args += ["--kv-cache-memory", kv_cache_memory]
    memory = _spawn(mem_args, "memory", run_dir, timeout, memory_port)
    try:
        worker = _spawn(["compute", "--memory", memory["address"], "--host", "127.0.0.1", "--device", device,
                         "--model", model], "worker", run_dir, timeout, worker_port)
    except Exception:
        _stop(memory["pid"])
        raise
    state = {"memory": memory, "workers": [worker], "device": device, "model": model, "started": time.time()}
    state_path().write_text(json.dumps(state, indent=2))
    return state


def _alive(pid: int) -> bool:
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
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)


def down() -> list[str]:
    """Stop what ``up`` started (workers first, then the memory service); returns what was stopped."""
    state = read_state()
    if not state:
        return []
    stopped = []
    for proc in [*state["workers"], state["memory"]]:
        if _alive(proc["pid"]):
            _stop(proc["pid"])
            stopped.append(proc["address"])
    state_path().unlink(missing_ok=True)
    return stopped
