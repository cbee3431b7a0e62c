"""Keep the services of a :class:`~client.ops.stack.LocalStack` running: one that dies is reaped and
started again at its address, bounded and with backoff.

``pagedkv serve`` with no backends supervises its embedded memory service and worker from a thread;
``pagedkv up`` starts :func:`main` as a detached process of its own (its pid is in the state file)
that starts the stack as its children, supervises it, rewrites the state file when a service comes
back with a new pid, and stops the stack on SIGTERM (``pagedkv down``). The children watch their
parent (pagedkv.runtime.lifetime), so a SIGKILLed supervisor or server leaves nothing running.

A restarted worker binds the same address, so an engine's ``--workers`` list finds it again
(client.engine.failover: a new ``instance_id`` ends its drain and frees its quarantine). A restarted
memory service is a new pool generation: the workers map it again and the engine's lease is
recovered by recompute (DESIGN.md, "Failure modes").

The restart policy is the one Kubernetes and systemd apply: wait ``backoff`` seconds, doubling with
each restart in the last ``window`` seconds up to ``max_backoff``; after ``max_restarts`` in the
window the service is left down and the supervisor logs that it gave up.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from client.ops.stack import LocalStack, ServiceProcess
from pagedkv.runtime.logs import configure_logging, get_logger
from pagedkv.runtime.tls import TlsFiles

log = get_logger("supervisor")


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How often a dead service is started again."""

    #: Restarts allowed within ``window`` seconds; past them the service stays down.
    max_restarts: int = 5
    #: Seconds over which restarts are counted.
    window: float = 300.0
    #: Seconds before the first restart; doubled for each restart in the window.
    backoff: float = 0.5
    #: The longest wait before a restart, in seconds.
    max_backoff: float = 30.0


@dataclass(slots=True)
class _Record:
    restarts: list[float] = field(default_factory=list)
    died_at: float | None = None
    gave_up: bool = False


class Supervisor:
    """Restarts the services of ``stack`` that exit (the module's policy).

    Args:
        stack: a started stack whose services are this process's children.
        policy: the restart policy.
        on_restart: called with the stack after a service came back (e.g. to rewrite a state file).
    """

    def __init__(self, stack: LocalStack, policy: RestartPolicy = RestartPolicy(),
                 on_restart: Callable[[LocalStack], None] | None = None):
        self.stack, self.policy, self.on_restart = stack, policy, on_restart
        self._records: dict[str, _Record] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _services(self) -> list[tuple[str, ServiceProcess, Callable[[ServiceProcess], None]]]:
        """(name, service, put back) for the memory service, then each worker."""
        stack = self.stack
        found = [("memory", stack.memory, lambda s: setattr(stack, "memory", s))] if stack.memory else []
        for i, w in enumerate(stack.workers):
            found.append((f"worker{i}", w, lambda s, i=i: stack.workers.__setitem__(i, s)))
        return found

    def check(self) -> list[str]:
        """One look at every service: reap the ones that exited and restart those whose backoff has
        passed; returns the names restarted (``memory``, ``worker<i>``)."""
        restarted = []
        with self._lock:
            for name, svc, put in self._services():
                if self._stop.is_set():
                    break
                code = svc.proc.poll()  # reaps it
                if code is None:
                    continue
                rec = self._records.setdefault(name, _Record())
                now = time.monotonic()
                if rec.died_at is None:
                    rec.died_at = now
                    log.warning("service_exited", service=name, address=svc.address, pid=svc.pid, code=code)
                rec.restarts = [t for t in rec.restarts if now - t < self.policy.window]
                if len(rec.restarts) >= self.policy.max_restarts:
                    if not rec.gave_up:
                        rec.gave_up = True
                        log.error("restart_gave_up", service=name, address=svc.address,
                                  restarts=len(rec.restarts), window_s=self.policy.window)
                    continue
                delay = min(self.policy.max_backoff, self.policy.backoff * 2 ** len(rec.restarts))
                if now - rec.died_at < delay:
                    continue
                rec.restarts.append(now)
                try:
                    new = svc.respawn()
                except RuntimeError as e:
                    rec.died_at = time.monotonic()  # the next try waits a longer backoff
                    log.error("restart_failed", service=name, address=svc.address, error=str(e)[-500:])
                    continue
                put(new)
                rec.died_at, rec.gave_up = None, False
                restarted.append(name)
                log.warning("service_restarted", service=name, address=new.address, pid=new.pid,
                            attempt=len(rec.restarts))
        if restarted and self.on_restart is not None:
            self.on_restart(self.stack)
        return restarted

    def start(self, interval: float = 0.5) -> Supervisor:
        """Run :meth:`check` every ``interval`` seconds on a daemon thread; returns self."""
        def loop() -> None:
            while not self._stop.wait(interval):
                self.check()

        self._thread = threading.Thread(target=loop, name="supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop supervising (a restart under way finishes first); the services keep running."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


# ------------------------------------------------------------------ pagedkv up's supervisor process
def main(argv: list[str] | None = None) -> int:
    """The supervisor process of ``pagedkv up``: ``--config`` names a JSON file of the
    :class:`LocalStack` fields and ``state`` (the state file to write), written by
    :func:`client.ops.launcher.up`. Starts the stack, writes the state file, supervises the stack
    until SIGTERM or SIGINT, then stops it. Returns 0, or 1 when the stack did not start."""
    parser = argparse.ArgumentParser(prog="python -m client.ops.supervisor")
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    conf = json.loads(Path(args.config).read_text())
    configure_logging(conf.pop("log_level", "info"))
    state_file, extra = Path(conf.pop("state")), conf.pop("extra", {})
    tls = TlsFiles(**conf.pop("tls")) if conf.get("tls") else None
    conf.pop("tls", None)
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        stack = LocalStack(**{**conf, "run_dir": Path(conf["run_dir"]), "tls": tls}).start()
    except RuntimeError as e:
        print(f"pagedkv up: {e}", file=sys.stderr)
        return 1

    def write_state(stack: LocalStack) -> None:
        state = {"memory": _entry(stack.memory), "workers": [_entry(w) for w in stack.workers],
                 "supervisor": {"pid": os.getpid()}, **extra,
                 "revision": stack.workers[0].info.get("revision") if stack.workers else None}
        tmp = state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, state_file)

    write_state(stack)
    supervisor = Supervisor(stack, on_restart=write_state)
    try:
        while not stopping.wait(0.5):
            supervisor.check()
    finally:
        stack.stop()
    return 0


def _entry(svc: ServiceProcess) -> dict:
    """One service's record in the state file."""
    return {"address": svc.address, "pid": svc.pid, "log": str(svc.log_path)}


if __name__ == "__main__":
    raise SystemExit(main())
