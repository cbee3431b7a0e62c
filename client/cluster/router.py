"""KV-aware routing across nodes: follow every node's KV events, send each request where its prefix is.

DESIGN.md, "Nodes" ("the front routes by the nodes' KV events"). :class:`KvIndex` follows each
node's ``StreamKvEvents`` (the router role under TLS: block hashes, never token ids) into one
prefix index, block hash -> the nodes holding it (device or host tier). :class:`Router` hashes a
prompt's full blocks as the memory services do (``pagedkv.runtime.block_hash.chain_hashes``, with
the model identity and the tenant's cache salt), counts each node's leading run of them, and picks
the node of least cost, Dynamo's KV router cost with weight 1::

    cost(node) = blocks of the prompt the node must prefill  (prompt blocks - its cached run)
               + blocks the node is busy with                 (its running and waiting requests)

so a long shared prefix draws a request to the node that holds it, unless that node is loaded by
more than the prefill it saves; requests that share nothing spread by load. Ties go round-robin.
A stream that breaks (a node restarting, a subscriber too far behind) drops that node's entries
and subscribes again from the oldest event the node keeps.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable, Sequence

import grpc

from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.runtime.block_hash import CacheKey, chain_hashes
from pagedkv.runtime.logs import get_logger

log = get_logger("router")

#: Routing policies: by cached prefix and load, or each node in turn.
POLICIES = ("kv", "round-robin")


class KvIndex:
    """Block hash -> nodes holding it, kept from the nodes' KV event streams (one thread per node).

    Args:
        streams: node name -> a function opening that node's ``StreamKvEvents`` iterator (the
            call and its credentials are the caller's).
        retry: seconds between a broken stream and the next subscription.
    """

    def __init__(self, streams: dict[str, Callable[[], object]], retry: float = 0.5):
        self._streams = streams
        self._retry = retry
        self._lock = threading.Lock()
        #: hash -> node -> media holding it (0 device, 1 host).
        self._where: dict[bytes, dict[str, set[int]]] = {}
        #: Events applied per node (tests wait on it).
        self.applied: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._calls: dict[str, object] = {}
        self._threads = [threading.Thread(target=self._follow, args=(n,), name=f"pagedkv-kv-{n}", daemon=True)
                         for n in streams]
        for t in self._threads:
            t.start()

    def leading(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """Per node, how many of ``hashes`` (a prompt's chain, in order) it holds from the first on."""
        out = dict.fromkeys(self._streams, 0)
        with self._lock:
            alive = set(out)
            for h in hashes:
                alive &= set(self._where.get(h, ()))
                if not alive:
                    break
                for n in alive:
                    out[n] += 1
        return out

    def close(self) -> None:
        self._stop.set()
        for call in list(self._calls.values()):
            call.cancel()
        for t in self._threads:
            t.join(timeout=2)

    def _follow(self, node: str) -> None:
        while not self._stop.is_set():
            try:
                call = self._calls[node] = self._streams[node]()
                for e in call:
                    self._apply(node, e)
            except grpc.RpcError as e:
                if not self._stop.is_set():
                    log.info("kv_stream_broken", node=node, code=e.code().name if hasattr(e, "code") else "")
            self._forget(node)
            self._stop.wait(self._retry)

    def _apply(self, node: str, e: mpb.KvEvent) -> None:
        kind = e.WhichOneof("event")
        with self._lock:
            if kind == "block_stored":
                self._where.setdefault(e.block_stored.block_hash, {}).setdefault(node, set()).add(e.block_stored.medium)
            elif kind == "block_removed":
                nodes = self._where.get(e.block_removed.block_hash, {})
                media = nodes.get(node)
                if media is not None:
                    media.discard(e.block_removed.medium)
                    if not media:
                        del nodes[node]
                if not nodes:
                    self._where.pop(e.block_removed.block_hash, None)
            elif kind == "all_cleared":
                self._forget_locked(node)
            self.applied[node] += 1

    def _forget(self, node: str) -> None:
        with self._lock:
            self._forget_locked(node)

    def _forget_locked(self, node: str) -> None:
        for h in [h for h, nodes in self._where.items() if node in nodes]:
            del self._where[h][node]
            if not self._where[h]:
                del self._where[h]


class Router:
    """Picks a node for each request (the module's cost).

    Args:
        index: the nodes' prefix index.
        block_size: tokens per block (every node's pool has the same layout).
        model_id: the prefix-cache identity of the model (the engines' ``model_id``).
        load: node name -> blocks it is busy with now.
        policy: "kv" (the module's cost) or "round-robin" (each node in turn, blind to prefixes and
            load: the baseline benchmarks/bench_nodes.py compares with).

    Raises:
        ValueError: an unknown policy.
    """

    def __init__(self, index: KvIndex, block_size: int, model_id: str, load: Callable[[str], int],
                 policy: str = "kv"):
        if policy not in POLICIES:
            raise ValueError(f"routing policy {policy!r}: one of {POLICIES}")
        self.index, self.block_size, self.model_id, self.load = index, block_size, model_id, load
        self.policy = policy
        self._turn = itertools.count()
        #: Requests routed per node, and of them those routed to a node holding part of their prefix.
        self.routed: collections.Counter[str] = collections.Counter()
        self.prefix_hits: collections.Counter[str] = collections.Counter()

    def choose(self, nodes: Sequence[str], token_ids: Sequence[int], cache_salt: str) -> str:
        """The node of least cost for a prompt among ``nodes`` (each able to take it)."""
        n = (len(token_ids) - 1) // self.block_size  # never the block holding the last token
        cached = self.index.leading(chain_hashes(token_ids, self.block_size, CacheKey(self.model_id, cache_salt), n)) \
            if n else {}
        turn = next(self._turn)
        if self.policy == "round-robin":
            best = nodes[turn % len(nodes)]
        else:
            loads = {name: self.load(name) for name in nodes}  # once per node: each walks its queues
            order = {name: (i - turn) % len(nodes) for i, name in enumerate(nodes)}
            best = min(nodes, key=lambda x: (n - cached.get(x, 0) + loads[x], loads[x], order[x]))
            log.debug("routed", node=best, prompt_blocks=n, cached=cached, loads=loads)
        self.routed[best] += 1
        self.prefix_hits[best] += bool(cached.get(best))
        return best


__all__ = ["POLICIES", "KvIndex", "Router"]
