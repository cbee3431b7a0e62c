"""Which nodes of a :class:`~client.cluster.core.Cluster` serve, so new requests go only to those.

A node serves while its memory service and at least one of its workers answer SERVING on the
standard gRPC health service. A thread looks at every node each ``interval`` seconds (a down
service answers at once: connection refused; a hung one within ``timeout``). A node that stops
serving keeps its own requests (its engine fails them over, or fails them after its recovery
timeout); new requests go to the nodes that serve. A node that serves again is routed to again,
and its engine recovers its lease there at its first request (client.engine.recovery).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import grpc

from client.ops.stack import serving
from pagedkv.runtime.logs import get_logger
from pagedkv.runtime.tls import TlsFiles
from pagedkv.runtime.tls import channel as plane_channel

log = get_logger("cluster")


class NodeHealth:
    """Watches nodes (the module's rule).

    Args:
        nodes: node name -> (memory service address, worker addresses).
        tls: the mutual-TLS files of the channels; None: plaintext.
        interval: seconds between two looks at every node.
        timeout: seconds one health check may take.
    """

    def __init__(self, nodes: dict[str, tuple[str, Sequence[str]]], tls: TlsFiles | None = None,
                 interval: float = 1.0, timeout: float = 0.5):
        self.nodes, self.interval, self.timeout = dict(nodes), interval, timeout
        self._channels: dict[str, grpc.Channel] = {a: plane_channel(a, tls) for m, ws in self.nodes.values()
                                                   for a in (m, *ws)}
        #: Node name -> whether it served at the last look (every node serves until looked at).
        self.up: dict[str, bool] = dict.fromkeys(self.nodes, True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="pagedkv-node-health", daemon=True)
        self._thread.start()

    def live(self, names: Sequence[str]) -> list[str]:
        """The nodes of ``names`` that serve, in order; all of ``names`` when none does (a request
        then fails where it is sent, with that node's error)."""
        up = [n for n in names if self.up.get(n, True)]
        return up or list(names)

    def check(self) -> dict[str, bool]:
        """Look at every node now; returns and keeps whether each serves, and logs each change."""
        for name, (memory, workers) in self.nodes.items():
            now = serving(self._channels[memory], self.timeout) and any(
                serving(self._channels[w], self.timeout) for w in workers)
            if now != self.up[name]:
                log.warning("node_back" if now else "node_down", node=name, memory=memory)
            self.up[name] = now
        return dict(self.up)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            self.check()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for ch in self._channels.values():
            ch.close()


__all__ = ["NodeHealth"]
