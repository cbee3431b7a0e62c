"""A memory service and N compute workers as processes on this machine.

DESIGN.md, "Defaults and discovery": each service binds ``--port`` (0: a free port) and writes
its bound address to ``--ready-file``; that is how a :class:`LocalStack` learns the memory
service's address before it starts the workers that map its pool. DESIGN.md, "The pool": the
owner must outlive its importers, so a stack stops its workers before its memory service.

:class:`LocalStack` is what ``pagedkv up`` (detached), the test fixtures, the benchmarks and the
GPU check start; :class:`ServiceProcess` is one service of it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv.runtime.lifetime import child_env
from pagedkv.runtime.tls import TlsFiles
from pagedkv.runtime.tls import channel as plane_channel

#: Characters of a service's log quoted in a start-up error.
LOG_TAIL = 3000


def serving(channel: grpc.Channel, timeout: float) -> bool:
    """Whether the server on ``channel`` answers SERVING on the standard health service within
    ``timeout`` seconds (an unreachable server is not serving)."""
    try:
        resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.RpcError:
        return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def wait_healthy(address: str, timeout: float, tls: TlsFiles | None = None) -> None:
    """Block until ``address`` answers SERVING on the standard health service (over mutual TLS
    with ``tls``).

    Raises:
        TimeoutError: not healthy within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    with plane_channel(address, tls) as ch:
        while time.monotonic() < deadline:
            if serving(ch, timeout=2):
                return
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
        detach: start it in a session of its own (it outlives this process); otherwise it stops
            when this process is gone, even after a SIGKILL (pagedkv.runtime.lifetime).

    Raises:
        RuntimeError: it exited or did not get ready in time (with its log's tail).
    """

    def __init__(self, command: list[str], ready_file: Path, log_path: Path, *, env: dict | None = None,
                 cwd: Path | None = None, timeout: float = 180.0, detach: bool = False):
        self.command, self.ready_file, self.log_path = list(command), Path(ready_file), Path(log_path)
        self._options = {"env": env, "cwd": cwd, "timeout": timeout, "detach": detach}
        self.ready_file.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([*command, "--ready-file", str(self.ready_file)], stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env if detach else child_env(env), cwd=cwd, start_new_session=detach)
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.log_path.stem} did not start (see {self.log_path}):\n{self.log_tail()}")
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
        return cls([sys.executable, "-m", "client.ops.cli", *args, "--port", str(port)], run_dir / f"{name}.ready.json",
                   run_dir / f"{name}.log", env={**os.environ, **(env or {})}, **kwargs)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def respawn(self) -> ServiceProcess:
        """The same service started again at the same address (its ``--port`` pinned to the one it
        bound), once this process has exited; its log goes on in the same file.

        Raises:
            RuntimeError: this one still runs, or the new one did not get ready (with its log's tail).
        """
        if self.proc.poll() is None:
            raise RuntimeError(f"{self.log_path.stem} (pid {self.pid}) still runs")
        command = list(self.command)
        if "--port" in command:
            command[command.index("--port") + 1] = str(self.info["port"])
        return ServiceProcess(command, self.ready_file, self.log_path, **self._options)

    def log(self) -> str:
        """Its output so far."""
        return self.log_path.read_text(errors="replace")

    def log_tail(self) -> str:
        """The last :data:`LOG_TAIL` characters of its output (for error messages)."""
        return self.log()[-LOG_TAIL:]

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


@dataclass(slots=True)
class LocalStack:
    """A memory service and ``num_workers`` compute workers mapping its pool, each its own process.

    ``start()`` starts the memory service, waits until it is healthy, then starts the workers
    (``pagedkv compute --memory <its address>``) and waits for each; ``stop()`` stops the workers,
    then the memory service. As a context manager it starts on entry and stops on exit.

    Raises:
        ValueError: a negative worker count, a port outside 0-65535 or a timeout <= 0.
    """

    #: Flags after ``pagedkv memory``, e.g. ``["--num-blocks", "64", "--block-size", "4"]``.
    memory_args: list[str] = field(default_factory=list)
    #: Flags after ``pagedkv compute --memory <address>``, the same for every worker.
    worker_args: list[str] = field(default_factory=list)
    #: Compute workers; 0 runs the memory service alone.
    num_workers: int = 1
    #: ``--device`` of both services ("cpu", "cuda", "cuda:N"); None: the services' default.
    device: str | None = None
    #: ``--model`` of both services ("smollm2", a .gguf file, a Hugging Face directory or repo id); None: default.
    model: str | None = None
    #: ``--revision`` of both services (branch, tag or commit of a repo id); None: main.
    revision: str | None = None
    #: ``--host`` of both services; None: the services' default (127.0.0.1).
    host: str | None = None
    #: Ready files and logs (``<name>-memory.log``; ``<name>-worker.log`` for one worker,
    #: ``<name>-worker<i>.log`` for several); None: a temporary folder removed by ``stop()``.
    run_dir: Path | None = None
    #: Prefix of the log and ready file names ("" gives ``memory.log``, ``worker.log``).
    name: str = ""
    #: Port of the memory service; 0: a free one.
    memory_port: int = 0
    #: Port of worker 0 (worker i gets ``worker_port + i``); 0: free ones.
    worker_port: int = 0
    #: Environment added to this process's for both services.
    env: dict[str, str] | None = None
    #: Mutual TLS: both services get these files as ``--tls-cert/--tls-key/--tls-ca`` (and the
    #: health checks here use them); None: plaintext, so ``host`` must be loopback.
    tls: TlsFiles | None = None
    #: Working folder of the services; None: this process's.
    cwd: Path | None = None
    #: Seconds each service may take to write its ready file, and then to turn healthy.
    timeout: float = 180.0
    #: Start the services in sessions of their own, so they outlive this process (``pagedkv up``).
    detach: bool = False
    #: The memory service once started.
    memory: ServiceProcess | None = field(default=None, init=False)
    #: The workers once started, in order.
    workers: list[ServiceProcess] = field(default_factory=list, init=False)
    #: The temporary run folder when ``run_dir`` is None.
    _tmp: tempfile.TemporaryDirectory | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")
        last_worker_port = self.worker_port + max(0, self.num_workers - 1) if self.worker_port else 0
        for port in (self.memory_port, self.worker_port, last_worker_port):
            if not 0 <= port <= 65535:
                raise ValueError(f"ports must lie in 0-65535 (0: a free port), got {port}")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")

    @property
    def memory_address(self) -> str:
        """host:port of the memory service (after ``start()``)."""
        if self.memory is None:
            raise RuntimeError("the stack is not started")
        return self.memory.address

    @property
    def worker_addresses(self) -> list[str]:
        """host:port of each worker, in order."""
        return [w.address for w in self.workers]

    def start(self) -> LocalStack:
        """Start the memory service, then the workers, each healthy before the next; returns self.

        Raises:
            RuntimeError: already started, or a service exited, did not write its ready file or
                did not turn healthy within ``timeout`` (with its log's tail); whatever had
                started is stopped first.
        """
        if self.memory is not None:
            raise RuntimeError("the stack is already started")
        run_dir = self.run_dir
        if run_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="pagedkv-stack-")
            run_dir = Path(self._tmp.name)
        both = [*(["--host", self.host] if self.host else []), *(["--device", self.device] if self.device else []),
                *(["--model", str(self.model)] if self.model else []),
                *(["--revision", self.revision] if self.revision else []), *(self.tls.flags() if self.tls else [])]
        prefix = f"{self.name}-" if self.name else ""
        try:
            self.memory = self._service(["memory", *both, *self.memory_args], run_dir, f"{prefix}memory",
                                        self.memory_port)
            for i in range(self.num_workers):
                port = self.worker_port + i if self.worker_port else 0
                suffix = str(i) if self.num_workers > 1 else ""
                self.workers.append(self._service(["compute", "--memory", self.memory.address, *both,
                                                   *self.worker_args],
                                                  run_dir, f"{prefix}worker{suffix}", port))
        except BaseException:
            self.stop()
            raise
        return self

    def _service(self, args: list[str], run_dir: Path, name: str, port: int) -> ServiceProcess:
        svc = ServiceProcess.pagedkv(args, run_dir, name, port=port, env=self.env, cwd=self.cwd, timeout=self.timeout,
                                     detach=self.detach)
        try:
            wait_healthy(svc.address, self.timeout, self.tls)
        except TimeoutError as e:
            svc.stop()
            raise RuntimeError(f"{name} did not turn healthy (see {svc.log_path}): {e}\n{svc.log_tail()}") from e
        return svc

    def stop(self) -> None:
        """Stop the workers (in order), then the memory service; remove a temporary run folder."""
        for w in self.workers:
            w.stop()
        if self.memory is not None:
            self.memory.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
