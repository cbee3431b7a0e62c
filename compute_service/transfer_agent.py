"""A NIXL agent over a worker's mapped pool: read KV blocks of another node's pool into ours.

DESIGN.md, "Tiers and transfers" and the NIXL machine facts. Each node's workers map one pool,
the 6-D block-major tensor ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``
(:class:`compute_service.pool_map.MappedPool`), so block b's K and V for every layer are one byte
range ``[base + b * block_bytes, base + (b + 1) * block_bytes)``. A worker registers its pool's
whole range with NIXL once, publishes a :class:`TransferSource`, and a worker of another node
reads (one-sided, UCX backend) source blocks into blocks of its own pool.

NIXL Python API used (``nixl_cu12._api``, NIXL 1.5): ``nixl_agent(name, nixl_agent_config(
backends=[...]))``, ``register_memory`` / ``deregister_memory``, ``get_agent_metadata``,
``add_remote_agent`` / ``remove_remote_agent``, ``get_xfer_descs`` (Nx3 ``(address, bytes,
device id)``), ``initialize_xfer("READ", local, remote, peer)``, ``transfer``, ``check_xfer_state``
and ``nixl_xfer_handle.release``. Install it with ``pip install --no-deps nixl-cu12`` (its
declared dependencies pull a CUDA torch). NIXL's own Python log records go to our structlog
logger at WARNING and above (``NIXL_LOG_LEVEL`` still sets their level); its C++ and UCX layers
print their own warnings and errors on stderr.

NIXL's progress thread (which answers peers' requests on a source: connection set-up, and the
data itself over TCP) runs with a pause of :data:`PROGRESS_DELAY_US` between its rounds. NIXL's
Python wrapper hard-codes no pause (``pthrDelay = 0``), and that thread then keeps one core busy in
every worker for as long as the agent lives (measured: 0.94 CPU-seconds per second idle, worker
forwards 1.7-4x slower on 2 cores; with the pause, under 2% idle): :func:`_make_agent` builds the
agent through a config whose delay the wrapper cannot zero.

Fault injection, for tests of the callers: a test hook at ``transfer.read_blocks``
(:mod:`pagedkv.runtime.test_hooks`) that returns k makes a call given more than k pairs transfer only its
first k pairs and then raise ``TransferError(blocks_done=k)``; a call with at most k pairs runs
normally.
"""

from __future__ import annotations

import hashlib
import logging
import operator
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from pagedkv.config import env_is_set
from pagedkv.grant.v1 import grant_pb2
from pagedkv.runtime import test_hooks
from pagedkv.runtime.logs import get_logger
from pagedkv.runtime.transfer import source_digest

log = get_logger("transfer_agent")

#: Longest sleep between two polls of a transfer's state, seconds.
_MAX_POLL_S = 1e-3


class _ToStructlog(logging.Handler):
    """Hands NIXL's Python log records to our structlog logger."""

    def emit(self, record: logging.LogRecord) -> None:
        log.log(record.levelno, "nixl_log", message=record.getMessage(), source=record.name)


def _nixl_api():
    """``nixl_cu12._api``, imported on first use, its logger routed to structlog (ImportError names the fix)."""
    try:
        from nixl_cu12 import _api
    except ImportError as e:
        raise ImportError("NIXL is not installed: `pip install --no-deps nixl-cu12==1.5.1` (without --no-deps "
                          "its declared dependencies pull a CUDA torch; it needs none of them)") from e
    nixl_logger = logging.getLogger("nixl")
    if not any(isinstance(h, _ToStructlog) for h in nixl_logger.handlers):
        nixl_logger.handlers = [_ToStructlog()]  # not NIXL's own handler, which prints INFO to stdout
        if not env_is_set("NIXL_LOG_LEVEL"):
            nixl_logger.setLevel(logging.WARNING)
    return _api


@dataclass(frozen=True, slots=True)
class TransferSource:
    """What a reader needs to read blocks of a peer's pool (published by the peer's worker)."""

    #: The peer's NIXL agent name.
    agent_name: str
    #: ``nixl_agent.get_agent_metadata()`` of the peer (opaque bytes: connection info, registrations).
    agent_metadata: bytes
    #: Address of block 0 in the peer's process (bytes; a device pointer for VRAM).
    base_address: int
    #: Blocks in the peer's pool.
    num_blocks: int
    #: Bytes per block (all layers, K and V); must equal the reader's.
    block_bytes: int
    #: NIXL memory type of the peer's pool: "DRAM" (a cpu pool) or "VRAM" (a cuda pool).
    mem_type: str = "DRAM"
    #: The peer's device index for VRAM, 0 for DRAM.
    device_id: int = 0

    def __post_init__(self):
        if not self.agent_name or not isinstance(self.agent_metadata, bytes) or not self.agent_metadata:
            raise ValueError("a TransferSource needs a non-empty agent_name and agent_metadata (bytes)")
        if min(self.base_address, self.device_id) < 0 or min(self.num_blocks, self.block_bytes) <= 0:
            raise ValueError(f"TransferSource: base_address {self.base_address}, num_blocks {self.num_blocks}, "
                             f"block_bytes {self.block_bytes}, device_id {self.device_id}: need >= 0, > 0, > 0, >= 0")
        if self.mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"TransferSource: mem_type {self.mem_type!r} is not 'DRAM' or 'VRAM'")

    def digest(self) -> bytes:
        """SHA-256 (32 bytes) naming this source in grants: ``pagedkv.runtime.transfer.source_digest`` of
        :meth:`to_proto`."""
        return source_digest(self.to_proto())

    def to_proto(self) -> grant_pb2.TransferSource:
        """As published (``PublishTransferSource``) and carried in tickets and StepRequests."""
        return grant_pb2.TransferSource(agent_name=self.agent_name, agent_metadata=self.agent_metadata,
                                        base_address=self.base_address, num_blocks=self.num_blocks,
                                        block_bytes=self.block_bytes, mem_type=self.mem_type, device_id=self.device_id)

    @classmethod
    def from_proto(cls, s: grant_pb2.TransferSource) -> TransferSource:
        """From its message (``mem_type`` unset: DRAM). Raises ValueError as the constructor."""
        return cls(s.agent_name, bytes(s.agent_metadata), s.base_address, s.num_blocks, s.block_bytes,
                   s.mem_type or "DRAM", s.device_id)


class TransferError(Exception):
    """A transfer failed (peer gone, NIXL error, timeout, injected fault).

    ``blocks_done``: how many of the call's block pairs, in order, are known to be in. A failed
    NIXL request counts 0: its destination blocks may hold partial data and must not be used.
    """

    def __init__(self, message: str, blocks_done: int = 0):
        super().__init__(message)
        self.blocks_done = blocks_done


def merge_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(source block, local block) pairs as runs ``(source start, local start, blocks)``, sorted by
    source: pairs consecutive on both sides become one run, hence one NIXL descriptor."""
    runs: list[list[int]] = []
    for s, d in sorted(pairs):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [(s, d, n) for s, d, n in runs]


#: Microseconds NIXL's progress thread pauses between rounds (the module's docstring says why).
PROGRESS_DELAY_US = 100
_MAKE_LOCK = threading.Lock()


def _make_agent(api, name: str, backends: list[str]):
    """``api.nixl_agent(name, nixl_agent_config(backends=backends))`` whose progress thread pauses
    :data:`PROGRESS_DELAY_US` between rounds: the wrapper builds ``nixlBind.nixlAgentConfig()`` and
    sets ``pthrDelay = 0``; for the call, that name is a subclass whose ``pthrDelay`` keeps ours."""
    bind = api.nixlBind
    base = bind.nixlAgentConfig
    field = base.pthrDelay

    class _Paced(base):
        pthrDelay = property(field.__get__, lambda self, _: field.__set__(self, PROGRESS_DELAY_US))

    with _MAKE_LOCK:
        bind.nixlAgentConfig = _Paced
        try:
            return api.nixl_agent(name, api.nixl_agent_config(backends=backends))
        finally:
            bind.nixlAgentConfig = base


class TransferAgent:
    """One NIXL agent over this worker's pool; reads blocks of peers' pools into it.

    Args:
        name: this agent's NIXL name, unique among the agents that talk to each other.
        pool: the mapped pool, ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``,
            any dtype, cpu (registered as DRAM) or cuda (VRAM); ``pool[0]`` contiguous and blocks
            packed (``pool.stride(0) == pool[0].numel()``). The agent holds it until :meth:`close`.
        backends: NIXL backends to create (``nixl_agent_config(backends=...)``).

    Raises:
        ValueError: a pool of another rank or layout. ImportError: NIXL not installed.
        RuntimeError: a backend NIXL cannot create.

    Calls are serialized by a lock (NIXL's agent is made without thread sync).
    """

    def __init__(self, name: str, pool: torch.Tensor, *, backends=("UCX",)):
        if pool.dim() != 6 or pool.shape[2] != 2 or pool.shape[0] < 1:
            raise ValueError(f"the pool must be [num_blocks >= 1, num_layers, 2, block_size, num_kv_heads, "
                             f"head_dim]; got shape {list(pool.shape)}")
        if not pool[0].is_contiguous() or pool.stride(0) != pool[0].numel():
            raise ValueError(f"each block of the pool must be one contiguous byte range: pool[0] contiguous and "
                             f"pool.stride(0) == pool[0].numel() (got strides {list(pool.stride())})")
        api = _nixl_api()
        self.name = name
        self.pool = pool  # NOTE: registered with NIXL until close(): held here so it cannot be freed under it
        self.num_blocks = pool.shape[0]
        self.block_bytes = pool.stride(0) * pool.element_size()
        self.base_address = pool.data_ptr()
        self.mem_type, self.device_id = ("VRAM", pool.get_device()) if pool.is_cuda else ("DRAM", 0)
        #: NIXL's exception types (nixlBackendError, nixlRemoteDisconnectError, ...): all become TransferError.
        self._nixl_errors = tuple(v for k, v in vars(api.nixlBind).items()
                                  if k.startswith("nixl") and k.endswith("Error") and isinstance(v, type))
        self._agent = _make_agent(api, name, list(backends))
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise RuntimeError(f"NIXL could not create backend(s) {missing}; it has plugins {self._agent.plugin_list}")
        nbytes = self.num_blocks * self.block_bytes
        self._reg = self._agent.register_memory([(self.base_address, nbytes, self.device_id, "")], self.mem_type)
        #: NOTE: remote agents added, by name -> SHA-256 of the metadata they were added with.
        self._remotes: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._closed = False
        log.info("transfer_agent_started", agent=name, num_blocks=self.num_blocks, block_bytes=self.block_bytes,
                 mem_type=self.mem_type)

    def source(self) -> TransferSource:
        """This agent's own description, for publishing to readers."""
        return TransferSource(self.name, self._agent.get_agent_metadata(), self.base_address, self.num_blocks,
                              self.block_bytes, self.mem_type, self.device_id)

    def read_blocks(self, source: TransferSource, pairs: list[tuple[int, int]], timeout: float = 30.0) -> None:
        """Read source block s into local block d for each (s, d), all layers K and V; returns when
        every byte is in.

        All pairs go in one NIXL READ request (``initialize_xfer``), a descriptor per run of
        :func:`merge_runs`; ``check_xfer_state`` is polled until "DONE".

        Args:
            source: the peer's published description.
            pairs: (source block, local block) ids; a local block at most once.
            timeout: seconds for the whole call (NIXL's connect in ``add_remote_agent`` is one
                blocking call: a peer on this host that is gone refuses it at once).

        Raises:
            ValueError: (before any transfer) a block id out of range on either side, block_bytes
                differing between the two pools, a local block written twice, a closed agent, or
                metadata naming another agent than ``source.agent_name``.
            TransferError: the peer is gone, NIXL failed, the timeout passed, or the injected
                fault fired. The request's handle is released (NIXL cancels a request still in
                flight) and the peer's remote agent is removed (the next call adds it again).
        """
        checked = self._check(source, pairs)
        limit = test_hooks.call("transfer.read_blocks", agent=self.name, source=source.agent_name, pairs=checked)
        todo = checked[:limit] if limit is not None else checked
        with self._lock:
            if self._closed:
                raise ValueError(f"transfer agent {self.name!r} is closed")
            if todo:
                self._read(source, todo, timeout)
        if len(todo) < len(checked):
            raise TransferError(f"injected fault (test hook transfer.read_blocks) after {len(todo)} of {len(checked)} "
                                "block pairs", blocks_done=len(todo))

    def close(self) -> None:
        """Remove every remote agent and deregister the pool; later calls are no-ops."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for name in list(self._remotes):
                self._forget(name)
            self._agent.deregister_memory(self._reg)
            self._agent = self.pool = None  # the C++ agent goes with its last reference
            log.info("transfer_agent_closed", agent=self.name)

    def _check(self, source: TransferSource, pairs) -> list[tuple[int, int]]:
        if source.block_bytes != self.block_bytes:
            raise ValueError(f"the source's blocks are {source.block_bytes} bytes, this pool's {self.block_bytes}: "
                             "both pools need the same layers, block size, KV heads, head dim and dtype")
        if source.agent_name == self.name:
            raise ValueError(f"source {source.agent_name!r} is this agent: copy blocks within the pool instead")
        checked, seen = [], set()
        for s, d in pairs:
            s, d = operator.index(s), operator.index(d)
            if not (0 <= s < source.num_blocks and 0 <= d < self.num_blocks):
                raise ValueError(
                    f"block pair ({s}, {d}) is out of range: source blocks are 0..{source.num_blocks - 1}, "
                    f"local blocks 0..{self.num_blocks - 1}"
                )
            if d in seen:
                raise ValueError(f"local block {d} is written twice in one read_blocks call")
            seen.add(d)
            checked.append((s, d))
        return checked

    def _read(self, source: TransferSource, pairs: list[tuple[int, int]], timeout: float) -> None:
        start = time.monotonic()
        bb, handle, ok = self.block_bytes, None, False
        try:
            peer = self._remote(source)
            runs = np.array(merge_runs(pairs), dtype=np.uint64).reshape(-1, 3)
            local = np.stack(
                [self.base_address + runs[:, 1] * bb, runs[:, 2] * bb, np.full(len(runs), self.device_id, np.uint64)],
                axis=1,
            )
            remote = np.stack(
                [
                    source.base_address + runs[:, 0] * bb,
                    runs[:, 2] * bb,
                    np.full(len(runs), source.device_id, np.uint64),
                ],
                axis=1,
            )
            handle = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs(local, self.mem_type),
                self._agent.get_xfer_descs(remote, source.mem_type),
                peer,
            )
            state, pause = self._agent.transfer(handle), 0.0
            while state == "PROC":
                if time.monotonic() - start > timeout:
                    raise TransferError(f"reading {len(pairs)} blocks from {peer!r} took over {timeout} s")
                time.sleep(pause)
                pause = min(2 * pause or 1e-5, _MAX_POLL_S)
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"NIXL reported {state} reading {len(pairs)} blocks from {peer!r}")
            ok = True
        except self._nixl_errors as e:
            raise TransferError(f"NIXL failed reading {len(pairs)} blocks from {source.agent_name!r}: {e!r}") from e
        finally:
            if handle is not None:
                try:
                    handle.release()
                except self._nixl_errors as e:  # not cancellable; NIXL keeps it to release with the agent
                    log.error("transfer_handle_not_released", peer=source.agent_name, error=repr(e))
            if not ok:
                self._forget(source.agent_name)
                log.warning(
                    "blocks_read_failed", peer=source.agent_name, num_pairs=len(pairs), error=str(sys.exc_info()[1])
                )
        log.debug(
            "blocks_read",
            peer=source.agent_name,
            num_pairs=len(pairs),
            num_descs=len(runs),
            seconds=round(time.monotonic() - start, 6),
        )

    def _remote(self, source: TransferSource) -> str:
        """The peer's name, its agent added once per (name, metadata digest)."""
        digest = hashlib.sha256(source.agent_metadata).digest()
        known = self._remotes.get(source.agent_name)
        if known == digest:
            return source.agent_name
        if known is not None:
            self._forget(source.agent_name)  # the peer restarted: new metadata under the same name
        got = self._agent.add_remote_agent(source.agent_metadata)
        got = got.decode() if isinstance(got, bytes) else got
        if got != source.agent_name:
            if got not in self._remotes:
                self._agent.remove_remote_agent(got)
            raise ValueError(f"the source's metadata is agent {got!r}'s, not {source.agent_name!r}'s")
        self._remotes[got] = digest
        return got

    def _forget(self, name: str) -> None:
        if self._remotes.pop(name, None) is not None:
            try:
                self._agent.remove_remote_agent(name)
            except self._nixl_errors as e:
                log.warning("remote_agent_not_removed", peer=name, error=repr(e))
