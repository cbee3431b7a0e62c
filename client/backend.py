"""What ``pagedkv serve`` uses of the generation side: one :class:`~client.api.Client`, or a
:class:`~client.cluster.core.Cluster` of nodes (one Client each), behind one protocol.

The front submits and aborts requests, reads the engines' published stats
(client.engine.stats) and the pools' GetStats, and never reaches into an engine. A Cluster
reports every node: its :meth:`Backend.engine_stats` and :meth:`Backend.stats` add up its nodes',
and :meth:`Backend.node_stats` / :meth:`Backend.step_logs` name each node's.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from client.engine.stats import EngineLimits, EngineStats, StepLog
from pagedkv.memory.v1 import memory_service_pb2 as mpb

#: GetStats fields that describe a pool rather than count in it: a sum over nodes takes the first
#: node's (every node holds the same KV layout), and ``utilization`` is computed again.
_NOT_ADDED = frozenset({"block_size", "generation", "utilization", "prefix_caching", "kv_cache_dtype",
                        "kv_bytes_per_token"})


@runtime_checkable
class Backend(Protocol):
    """A Client or a Cluster, as the front uses it (thread-safe, every method)."""

    #: The model's tokenizer (every node runs one model).
    tokenizer: object

    @property
    def limits(self) -> EngineLimits:
        """The model served and the limits a request must fit (a Cluster: its first node's; every
        node holds the same KV)."""

    def submit(self, prompt, sampling_params=None, *, cache_salt: str | None = None, request_id: str | None = None,
               listener=None):
        """Queue one prompt; returns its handle (``result()``, iteration, ``cancel()``).

        Raises:
            ValueError: a prompt that cannot run (empty, out of vocabulary, longer than the context).
        """

    def abort(self, request_id: str) -> None:
        """Abort a request by id; its blocks are freed at its engine's next step."""

    def stats(self) -> mpb.GetStatsResponse:
        """The pool's GetStats (a Cluster: its nodes' added up, :func:`total_pool_stats`).

        Raises:
            client.errors.ServiceError: a memory service did not answer.
        """

    def engine_stats(self) -> EngineStats:
        """The engine's stats after its last step (a Cluster: its nodes' added up)."""

    def node_stats(self) -> dict[str, EngineStats]:
        """Each node's engine stats, by node name, first node first (a Client: one entry)."""

    def step_logs(self, since: int = 0) -> dict[str, StepLog]:
        """Each node's step trace from step ``since`` on, by node name, first node first."""

    def drain(self, address: str, timeout: float = 30.0) -> dict:
        """Move the requests of the worker at ``address`` to the others between two steps and give it
        no more work (client.engine.failover). Raises KeyError for an unknown worker."""

    def undrain(self, address: str, timeout: float = 30.0) -> dict:
        """End a drain."""

    def close(self) -> None:
        """Stop the engines and release their leases."""


def total_pool_stats(parts: list[mpb.GetStatsResponse]) -> mpb.GetStatsResponse:
    """Several pools' GetStats as one: every count added up, the layout fields the first's, and
    ``utilization`` (tokens stored per used token slot) computed over all of them; no ``sizing`` (each
    pool's own). One part is returned as it is."""
    if len(parts) == 1:
        return parts[0]
    out = mpb.GetStatsResponse()
    out.CopyFrom(parts[0])
    for f in out.DESCRIPTOR.fields:
        if f.name == "sizing":  # how each pool was sized: one pool's, not a sum
            out.ClearField(f.name)
        elif f.message_type is not None:  # the disk tier's and the pins' counters: added up where a node has them
            disks = [getattr(p, f.name) for p in parts if p.HasField(f.name)]
            if disks:
                total = getattr(out, f.name)
                for g in total.DESCRIPTOR.fields:
                    setattr(total, g.name, sum(getattr(d, g.name) for d in disks))
        elif f.name not in _NOT_ADDED:
            setattr(out, f.name, sum(getattr(p, f.name) for p in parts))
    slots = out.used_blocks * out.block_size
    out.utilization = out.tokens_stored / slots if slots else 0.0
    return out


__all__ = ["Backend", "total_pool_stats"]
