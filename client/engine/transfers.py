"""Cross-node prefix reuse for one engine: pull a prompt's cached blocks from another node, not recompute them.

DESIGN.md, "Nodes"; the flow is in :mod:`memory_service.transfers`. Before this node allocates a
new sequence, :meth:`PrefixPull.ticket` asks each peer node (its memory service, through a lease
of this engine's on it) to pin the prompt's cached prefix (ExportPrefix). The peer holding the
most full blocks wins when the blocks it holds past what this node would reuse anyway pay off
(:attr:`PrefixPull.min_blocks`, a simple cost model: reading a block over NIXL costs less than
computing its tokens from a few blocks on; ``benchmarks/bench_nodes.py`` measures the crossover);
its ticket goes in this node's AllocateSequences, which grants the worker node transfers for the
blocks it does not hold itself. The pin on the peer is dropped as soon as the step that read the
blocks is proven (:meth:`PrefixPull.release_done`), or at once when this node took none of them.

A step whose transfer fails (the peer died, a NIXL error) is refused by the worker before any
write (ABORTED, reason TRANSFER_FAILED): the engine preempts that step's requests by recompute and
marks the ones that pulled ``no_pull``, so their next allocation computes every token here.

A peer that does not answer is left out for :data:`PEER_RETRY` seconds (its prefixes are computed
here meanwhile); a peer whose lease was lost (it restarted) gets a new one at the next ticket.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from client.errors import ServiceError
from client.lease import Lease
from client.services import MemoryClient
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.runtime.errors import LEASE_EXPIRED, LEASE_NOT_FOUND
from pagedkv.runtime.logs import get_logger

log = get_logger("transfers")

#: Default fewest blocks worth pulling from another node (below, this node recomputes them).
DEFAULT_MIN_BLOCKS = 2
#: Seconds a call to a peer's memory service may take (a hung peer stalls this engine at most that long).
PEER_TIMEOUT = 5.0
#: Seconds a peer that did not answer is left out of the tickets (its prefixes are computed here).
PEER_RETRY = 2.0


@dataclass
class Peer:
    """Another node's memory service, and this engine's lease on it (which holds the pins)."""

    name: str
    memory: MemoryClient
    lease: Lease
    #: The TTL of each lease taken on it, seconds (None: the service's default).
    lease_ttl: float | None = None
    #: Until when (time.monotonic()) it is not asked: it did not answer (:data:`PEER_RETRY`).
    down_until: float = 0.0

    def renew_lease(self) -> None:
        """A new lease on the peer after the old one was lost (the peer restarted, or the lease
        expired): its pins went with it.

        Raises:
            client.errors.ServiceError: the peer refused, or does not answer.
        """
        self.lease.close()
        self.lease = Lease(self.memory, self.lease_ttl)
        log.warning("peer_lease_renewed", peer=self.name, lease_id=self.lease.lease_id)


@dataclass
class Pin:
    """One export pinned on a peer for one of this node's sequences."""

    peer: Peer
    seq_id: int  # the pinning sequence on the peer
    source: object  # the ticket's TransferSource, for the worker's StepRequest


@dataclass
class PrefixPull:
    """The pulls of one engine.

    Args:
        peers: the other nodes.
        min_blocks: fewest blocks a peer must hold past this node's own cached prefix to be read.
    """

    peers: list[Peer]
    min_blocks: int = DEFAULT_MIN_BLOCKS
    #: Pins by this node's sequence (the client's Seq object id).
    pins: dict[int, Pin] = field(default_factory=dict)
    #: Tokens granted as node transfers, and steps whose transfer failed.
    tokens_pulled: int = 0
    transfers_failed: int = 0

    def ticket(self, seq, tokens: list[int], model_id: str, cache_salt: str, block_size: int
               ) -> mpb.TransferTicket | None:
        """The best peer's ticket for ``tokens`` (pinned there for ``seq``), or None (no peer holds
        enough, or every peer failed to answer: the sequence is computed here)."""
        if len(tokens) <= self.min_blocks * block_size:
            return None
        best: tuple[Peer, mpb.ExportPrefixResponse] | None = None
        for peer in self.peers:
            if peer.down_until > time.monotonic():
                continue
            try:
                if peer.lease.lost is not None:
                    peer.renew_lease()
                resp = peer.memory.export_prefix(peer.lease.lease_id, tokens, model_id, cache_salt)
            except ServiceError as e:
                log.info("export_refused", peer=peer.name, error=str(e))
                if e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    peer.down_until = time.monotonic() + PEER_RETRY  # not asked again for a while
                elif e.reason in (LEASE_NOT_FOUND, LEASE_EXPIRED):
                    peer.lease.lost = e  # a new lease at the next ticket
                continue
            if resp.num_tokens < self.min_blocks * block_size:
                self._drop(peer, resp.seq_id if resp.num_tokens else None)
            elif best is None or resp.num_tokens > best[1].num_tokens:
                if best is not None:
                    self._drop(best[0], best[1].seq_id)
                best = (peer, resp)
            else:
                self._drop(peer, resp.seq_id)
        if best is None:
            return None
        peer, resp = best
        self.pins[id(seq)] = Pin(peer, resp.seq_id, resp.ticket.source)
        return resp.ticket

    def allocated(self, seq, table: mpb.SequenceBlockTable) -> None:
        """This node allocated ``seq``: keep its pin while node transfers read from it, else drop it."""
        pin = self.pins.get(id(seq))
        if pin is None:
            return
        if table.num_transferred_tokens:
            seq.transfer_source = pin.source
            self.tokens_pulled += table.num_transferred_tokens
            log.info("prefix_pull", peer=pin.peer.name, seq_id=table.seq_id, tokens=table.num_transferred_tokens)
        else:
            self.release(seq)

    def transfer_failed(self, requests) -> list:
        """A worker refused a step because a node transfer failed (nothing of it was written): count
        it and mark ``no_pull`` those of ``requests`` that read from a peer (they compute everything
        from now on). Returns ``requests`` (each once, in order), which the engine preempts by recompute."""
        self.transfers_failed += 1
        reqs = list({id(r): r for r in requests}.values())
        for req in reqs:
            if any(self.reading(s) for s in req.seqs):
                req.no_pull = True
        return reqs

    def reading(self, seq) -> bool:
        """Whether ``seq``'s next step reads blocks from a peer (its receipt must be taken at once)."""
        return id(seq) in self.pins

    def release(self, seq) -> None:
        """Drop ``seq``'s pin on its peer (best effort: the peer's lease frees it in the end)."""
        pin = self.pins.pop(id(seq), None)
        seq.transfer_source = None
        if pin is not None:
            self._drop(pin.peer, pin.seq_id)

    def release_done(self, seqs) -> None:
        """The steps of ``seqs`` ran and their receipts are taken: their pins go."""
        for s in seqs:
            if id(s) in self.pins:
                self.release(s)

    def clear(self) -> None:
        """Drop every pin (recovery, close)."""
        for pin in list(self.pins.values()):
            self._drop(pin.peer, pin.seq_id)
        self.pins.clear()

    def close(self) -> None:
        """Drop every pin and this engine's leases on the peers."""
        self.clear()
        for peer in self.peers:
            peer.lease.close()
            peer.memory.close()

    def _drop(self, peer: Peer, seq_id: int | None) -> None:
        if seq_id is None:
            return
        try:
            peer.memory.free(peer.lease.lease_id, [seq_id], mpb.FREE_REASON_FINISHED)
        except ServiceError as e:
            log.info("pin_release_failed", peer=peer.name, seq_id=seq_id, error=str(e))


def connect_peers(addresses: list[str], tls=None, lease_ttl: float | None = None) -> list[Peer]:
    """A :class:`Peer` (memory client and lease) per memory-service address; named by their pools' node names."""
    peers = []
    for address in addresses:
        memory = MemoryClient(address, timeout=PEER_TIMEOUT, tls=tls)
        peers.append(Peer(memory.pool().node_name or address, memory, Lease(memory, lease_ttl), lease_ttl))
    return peers


__all__ = ["DEFAULT_MIN_BLOCKS", "Peer", "Pin", "PrefixPull", "connect_peers"]
