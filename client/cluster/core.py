"""Several nodes behind one front: each request routed by prefix and load, prefilled and decoded where each is cheapest.

DESIGN.md, "Nodes". A :class:`Cluster` holds one :class:`~client.api.Client` (engine) per node,
each with the other nodes as peers (cross-node prefix reuse, client.engine.transfers), a
:class:`~client.cluster.router.KvIndex` over the nodes' KV events and a :class:`~client.cluster.router.Router`.
It offers what ``pagedkv serve`` uses of a Client (client.backend.Backend), and reports every node.

Roles (``--node NAME=MEMORY,workers=A,B,role=prefill|decode|both``):

- ``both`` nodes take whole requests, routed by the router's cost;
- with ``prefill`` and ``decode`` nodes, a request is prefilled on a prefill node (the router's
  pick: where its prefix is), then decoded on a decode node (the least loaded), which reads the
  prompt's blocks from the prefill node's pool over NIXL (one move; only the block holding the
  prompt's last token is computed again there, as every allocation does) and samples every
  output token itself, so the output is the one a single node gives;
- inside a node, workers may have roles too (``workers=A@prefill,B@decode``): a request moves from
  the prefill worker to the decode worker with no copy (client.engine.scheduler.Scheduler.hand_off).

A node whose memory service or every worker is down keeps its own requests (they fail over or
fail there) and gets no new ones until it serves again (client.cluster.health).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field

from client.api import Client, RequestHandle
from client.backend import total_pool_stats
from client.cluster.health import NodeHealth
from client.cluster.router import POLICIES, KvIndex, Router
from client.engine.scheduler import ROLES
from client.engine.stats import EngineLimits, EngineStats, StepLog
from client.params import SamplingParams
from client.services import MemoryClient
from client.tokenizer import encode_prompt
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.runtime.cache_salt import load_secret, namespace, salted
from pagedkv.runtime.logs import get_logger
from pagedkv.runtime.tls import TlsFiles

log = get_logger("cluster")

#: Requests whose node the cluster remembers for abort() (older ones have long finished).
MAX_TRACKED = 100_000


@dataclass
class NodeSpec:
    """One node as ``--node`` names it."""

    name: str
    memory: str
    workers: list[str]
    #: "prefill", "decode" or "both": what this node does for requests of the cluster.
    role: str = "both"
    #: Each worker's role inside the node (default all "both").
    worker_roles: list[str] = field(default_factory=list)


def parse_node(text: str) -> NodeSpec:
    """``NAME=MEMORY_ADDR,workers=A,B,role=prefill|decode|both`` (``pagedkv serve --node``); a worker may
    carry its own role inside the node as ``ADDR@prefill`` / ``ADDR@decode``.

    Raises:
        ValueError: naming what is wrong.
    """
    head, *rest = [p.strip() for p in text.split(",")]
    name, sep, memory = head.partition("=")
    if not sep or not name or not memory:
        raise ValueError(f"--node {text!r}: start with NAME=MEMORY_ADDR")
    fields: dict[str, list[str]] = {"workers": [], "role": []}
    key = None
    for part in rest:
        k, sep, v = part.partition("=")
        if sep:
            if k not in fields:
                raise ValueError(f"--node {text!r}: unknown key {k!r} (workers, role)")
            key, part = k, v
        if key is None:
            raise ValueError(f"--node {text!r}: {part!r} follows no key")
        fields[key].append(part)
    role = fields["role"][0] if fields["role"] else "both"
    if len(fields["role"]) > 1 or role not in ROLES:
        raise ValueError(f"--node {text!r}: role must be one of {ROLES}")
    if not fields["workers"]:
        raise ValueError(f"--node {text!r}: name its workers (workers=HOST:PORT,...)")
    workers, roles = [], []
    for w in fields["workers"]:
        addr, _, wrole = w.partition("@")
        if not addr:
            raise ValueError(f"--node {text!r}: an empty worker address")
        if wrole and wrole not in ROLES:
            raise ValueError(f"--node {text!r}: worker {w!r}: role must be one of {ROLES}")
        workers.append(addr)
        roles.append(wrole or "both")
    return NodeSpec(name, memory, workers, role, roles if any(r != "both" for r in roles) else [])


@dataclass
class Node:
    spec: NodeSpec
    client: Client


class Cluster:
    """The nodes of ``specs`` behind one API.

    Args:
        specs: the nodes (names unique; at least one decodes and one prefills).
        router_tls: under mutual TLS (``client_kwargs["tls"]``), the router's certificate for the
            nodes' KV event streams (StreamKvEvents needs the router role).
        routing: the router's policy, "kv" or "round-robin" (:class:`~client.cluster.router.Router`).
        pulls: whether a node reads prefixes other nodes cache (client.engine.transfers); without, each
            node computes what it lacks (a request split across prefill and decode nodes needs them).
        cache_namespace: as :class:`Client`'s (None: this user's).
        client_kwargs: passed to every node's :class:`Client` (batch limits, TLS, the admin token file its
            lease is created with: a node whose memory service refuses that token gets a plain lease, ...).

    Raises:
        ValueError: no node, duplicate names, a role missing, nodes of different layouts, or mutual
            TLS without ``router_tls``.
    """

    def __init__(self, specs: list[NodeSpec], router_tls: TlsFiles | None = None, routing: str = "kv",
                 pulls: bool = True, cache_namespace: str | None = None, **client_kwargs):
        if not specs or len({s.name for s in specs}) != len(specs) or len({s.memory for s in specs}) != len(specs):
            raise ValueError(f"nodes {[(s.name, s.memory) for s in specs]}: give at least one, each name and memory "
                             "service once")
        if not pulls and {s.role for s in specs} != {"both"}:
            raise ValueError("prefill and decode nodes move each request's blocks between them: keep pulls on")
        if routing not in POLICIES:
            raise ValueError(f"routing policy {routing!r}: one of {POLICIES}")
        if not any(s.role != "decode" for s in specs) or not any(s.role != "prefill" for s in specs):
            raise ValueError("the nodes need at least one that prefills and one that decodes (role both, or one "
                             "prefill and one decode)")
        if client_kwargs.get("tls") is not None and router_tls is None:
            raise ValueError("routing under mutual TLS follows the nodes' KV events, which needs a router certificate: "
                             "give --router-tls-cert and --router-tls-key (pagedkv certs makes router.pem)")
        self._router_tls = router_tls
        #: The namespace of every request's cache salt (client.api.Client's ``cache_namespace``),
        #: applied here, before routing, so the router hashes what the nodes cache.
        self.cache_namespace = namespace(load_secret(), "user") if cache_namespace is None else cache_namespace
        self._streams: list[MemoryClient] = []
        self.nodes: dict[str, Node] = {}
        try:
            for s in specs:
                peers = [o.memory for o in specs if o is not s] if pulls else []
                self.nodes[s.name] = Node(s, Client(s.memory, s.workers, peers=peers, cache_namespace="",
                                                    worker_roles=s.worker_roles or None, **client_kwargs))
        except BaseException:
            self.close()
            raise
        first = self._first.limits
        kv = lambda c: (c.limits.block_size, c.limits.model_id, c.memory.pool().layout.dtype)  # noqa: E731
        for n in self.nodes.values():
            mine, theirs = kv(n.client), kv(self._first)
            if mine != theirs:
                self.close()
                raise ValueError(f"node {n.spec.name} holds (block size, model, dtype) {mine}, another {theirs}: "
                                 "every node must hold the same KV")
        self.index = KvIndex({name: self._stream(n) for name, n in self.nodes.items()})
        #: Which nodes serve: new requests go only to those (client.cluster.health).
        self.health = NodeHealth({s.name: (s.memory, s.workers) for s in specs}, client_kwargs.get("tls"))
        self.router = Router(self.index, first.block_size, first.model_id, self._load, routing)
        #: Request id -> (node, its id there), the newest MAX_TRACKED (what abort() can reach).
        self._where: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()
        self._lock = threading.Lock()

    # What pagedkv serve uses (client.backend.Backend): every node's, or the first's where all are alike.
    @property
    def tokenizer(self):
        """The first node's tokenizer (every node runs one model)."""
        return self._first.tokenizer

    @property
    def limits(self) -> EngineLimits:
        """The first node's limits (every node holds the same KV)."""
        return self._first.limits

    def engine_stats(self) -> EngineStats:
        """Every node's engine stats added up (queues and workers joined, node order; each worker
        carries its node's name)."""
        return EngineStats.total([n.client.engine_stats().on_node(name) for name, n in self.nodes.items()])

    def node_stats(self) -> dict[str, EngineStats]:
        """Each node's engine stats, by node name."""
        return {name: n.client.engine_stats() for name, n in self.nodes.items()}

    def drain(self, address: str, timeout: float = 30.0) -> dict:
        """:meth:`client.api.Client.drain` on the node whose worker is at ``address``.

        Raises:
            KeyError: no node has a worker at ``address``.
        """
        return self._node_of(address).drain(address, timeout)

    def undrain(self, address: str, timeout: float = 30.0) -> dict:
        """:meth:`client.api.Client.undrain` on the node whose worker is at ``address``."""
        return self._node_of(address).undrain(address, timeout)

    def _node_of(self, address: str):
        for n in self.nodes.values():
            if any(w.address == address for w in n.client.workers):
                return n.client
        raise KeyError(f"no node has a worker at {address}")

    def step_logs(self, since: int = 0) -> dict[str, StepLog]:
        """Each node's step trace from step ``since`` on, by node name."""
        return {name: n.client.step_logs(since)[n.client.memory.address] for name, n in self.nodes.items()}

    @property
    def _first(self) -> Client:
        return next(iter(self.nodes.values())).client

    def _stream(self, node: Node):
        memory = MemoryClient(node.spec.memory, tls=self._router_tls)  # the router's own channel
        self._streams.append(memory)
        return lambda: memory.stub.StreamKvEvents(mpb.StreamKvEventsRequest())

    def _load(self, name: str) -> int:
        """Blocks node ``name`` is busy with: its running and waiting requests' tokens."""
        s = self.nodes[name].client.engine_stats()
        bs = self.limits.block_size
        return sum(-(-len(q.seqs[0].tokens) // bs) for q in [*s.running, *s.waiting] if q.seqs)

    def submit(self, prompt, sampling_params: SamplingParams | None = None, *, cache_salt: str | None = None,
               request_id: str | None = None, listener=None, priority: int = 0):
        """Route one prompt (the module's roles); returns its handle (:class:`RequestHandle`, or a
        :class:`TwoPhaseHandle` when it prefills on one node and decodes on another).

        Raises:
            ValueError: as :meth:`Client.submit`.
        """
        ids = encode_prompt(self.tokenizer, prompt)
        salt = cache_salt = salted(self.cache_namespace, cache_salt)
        prefill = self.health.live([n for n, x in self.nodes.items() if x.spec.role != "decode"])
        p = self.router.choose(prefill, ids, salt)
        if self.nodes[p].spec.role == "both":
            handle = self.nodes[p].client.submit(ids, sampling_params, cache_salt=cache_salt, request_id=request_id,
                                                 listener=listener, priority=priority)
            self._track(handle.request_id, p, handle.request_id)
            return handle
        decode = self.health.live([n for n, x in self.nodes.items() if x.spec.role != "prefill"])
        d = min(decode, key=self._load)
        return TwoPhaseHandle(self, p, d, ids, sampling_params or SamplingParams(), cache_salt, request_id, listener,
                              priority)

    def _track(self, rid: str, node: str, there: str) -> None:
        with self._lock:
            self._where[rid] = (node, there)
            if len(self._where) > MAX_TRACKED:
                self._where.popitem(last=False)

    def abort(self, request_id: str) -> None:
        """Abort a request wherever it runs (thread-safe)."""
        with self._lock:
            where = self._where.pop(request_id, None)
        if where is not None:
            self.nodes[where[0]].client.abort(where[1])

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self):
        """Every node's GetStats added up (client.backend.total_pool_stats).

        Raises:
            client.errors.ServiceError: a node's memory service did not answer.
        """
        return total_pool_stats([n.client.stats() for n in self.nodes.values()])

    def close(self) -> None:
        if getattr(self, "health", None) is not None:
            self.health.close()
        if getattr(self, "index", None) is not None:
            self.index.close()
        for m in getattr(self, "_streams", ()):
            m.close()
        for n in self.nodes.values():
            n.client.close()


class TwoPhaseHandle:
    """A request prefilled on node ``p`` (one greedy token, discarded) and then run whole on node
    ``d``, which reads the prompt's blocks from ``p``. ``result()``, iteration and ``cancel()`` as a
    :class:`RequestHandle`'s; the listener sees only the decode node's outputs."""

    def __init__(self, cluster: Cluster, p: str, d: str, ids: list[int], params: SamplingParams,
                 cache_salt: str | None, request_id: str | None, listener, priority: int = 0):
        self.cluster, self.decode_node, self.ids, self.params = cluster, d, ids, params
        self.cache_salt, self.listener, self.priority = cache_salt, listener, priority
        self.decode: RequestHandle | None = None
        #: Why the request ended before its decode (the decode node refused it), else None.
        self.error: Exception | None = None
        self._started = threading.Event()
        self._cancelled = False
        prefill = cluster.nodes[p].client.submit(ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                                                 cache_salt=cache_salt, listener=self._prefilled, priority=priority)
        self.request_id = request_id or f"{prefill.request_id}-decode"
        cluster._track(self.request_id, p, prefill.request_id)

    def _prefilled(self, out, error) -> None:  # the prefill node's engine thread: never raises
        if error is None and (out is None or not out.finished):
            return
        aborted = out is not None and any(o.finish_reason == "abort" for o in out.outputs)
        try:
            if error is None and not (self._cancelled or aborted):
                self.decode = self.cluster.nodes[self.decode_node].client.submit(
                    self.ids, self.params, cache_salt=self.cache_salt, request_id=self.request_id,
                    listener=self.listener, priority=self.priority)
                self.cluster._track(self.request_id, self.decode_node, self.request_id)
            elif error is not None and self.listener is not None:
                self.listener(None, error)
        except Exception as e:  # noqa: BLE001 - e.g. the decode node's pool cannot hold the prompt
            log.warning("decode_submit_failed", request_id=self.request_id, node=self.decode_node, error=str(e))
            self.error = e
            if self.listener is not None:
                self.listener(None, e)
        finally:
            self._started.set()

    def result(self, timeout: float | None = None):
        if not self._started.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish its prefill within {timeout} s")
        if self.decode is None:
            if self.error is not None:
                raise self.error
            raise RuntimeError(f"request {self.request_id} ended in its prefill (cancelled or failed)")
        return self.decode.result(timeout)

    def __iter__(self):
        self._started.wait()
        if self.decode is not None:
            yield from self.decode

    def cancel(self) -> None:
        self._cancelled = True
        self.cluster.abort(self.request_id)


__all__ = ["Cluster", "Node", "NodeSpec", "TwoPhaseHandle"]
