"""TransferAgent: real NIXL (UCX) reads between this process and a spawned source node.

One source process serves the whole module: it holds a float32 and a bfloat16 pool of 8 blocks
with random values, each behind its own TransferAgent, and ships copies of the pools and their
TransferSources over a pipe; a second one, started beside it, is stopped and killed by the
dead-peer test. The readers here hold 6-block pools filled with a sentinel before each test, so
every byte a read should not touch is checked to be untouched.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from compute_service.transfer_agent import TransferAgent, TransferError, TransferSource, merge_runs
from pagedkv.runtime import test_hooks

pytestmark = pytest.mark.timeout(120)

#: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] of the source's pools.
SOURCE_SHAPE = (8, 2, 2, 4, 2, 8)
#: The readers' pools: same blocks, fewer of them.
LOCAL_BLOCKS = 6
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SENTINEL = -7.0
#: Seconds the child may take to start (torch + NIXL import, two agents).
START_S = 60
#: The test hook module of the injected fault (tests/hooks), and its parameter.
FAIL_AFTER_HOOK = str(Path(__file__).resolve().parents[1] / "hooks" / "transfer_fail_after.py")
FAIL_AFTER_ENV = "PAGEDKV_TRANSFER_FAIL_AFTER"


def _source_node(conn, prefix: str) -> None:
    """The source node: a pool and a TransferAgent per dtype; answers "reopen" and "stop"."""
    gen = torch.Generator().manual_seed(0)
    pools = {k: (torch.randn(SOURCE_SHAPE, generator=gen) + torch.arange(8.0).view(-1, 1, 1, 1, 1, 1)).to(dt)
             for k, dt in DTYPES.items()}
    agents = {k: TransferAgent(f"{prefix}-{k}", pool) for k, pool in pools.items()}
    conn.send({k: (agents[k].source(), pools[k].clone()) for k in pools})
    while (cmd := conn.recv()) != "stop":
        assert cmd == "reopen"  # the float32 agent restarts under its name: new metadata, same pool
        agents["float32"].close()
        agents["float32"] = TransferAgent(f"{prefix}-float32", pools["float32"])
        conn.send(agents["float32"].source())
    for agent in agents.values():
        agent.close()


class Node:
    """A spawned source node and the pipe to it."""

    def __init__(self, prefix: str):
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=_source_node, args=(child, prefix), daemon=True)
        self.proc.start()
        child.close()

    def started(self) -> dict[str, tuple[TransferSource, torch.Tensor]]:
        assert self.conn.poll(START_S), "the source node did not start"
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send("stop")
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


@dataclasses.dataclass
class Pair:
    """The shared source node, its pools and sources, a reader per dtype, and a node to kill."""

    node: Node
    sources: dict[str, TransferSource]
    remote: dict[str, torch.Tensor]
    readers: dict[str, TransferAgent]
    local: dict[str, torch.Tensor]
    victim: Node
    victim_source: TransferSource


@pytest.fixture(scope="module")
def pair():
    node, victim = Node("src"), Node("victim")  # both start while the readers start here
    local = {k: torch.full((LOCAL_BLOCKS, *SOURCE_SHAPE[1:]), SENTINEL, dtype=dt) for k, dt in DTYPES.items()}
    readers = {k: TransferAgent(f"reader-{k}", pool) for k, pool in local.items()}
    try:
        got, victim_source = node.started(), victim.started()["float32"][0]
        yield Pair(node, {k: s for k, (s, _) in got.items()}, {k: p for k, (_, p) in got.items()}, readers, local,
                   victim, victim_source)
    finally:
        for reader in readers.values():
            reader.close()
        node.stop()
        victim.stop()


@pytest.fixture
def fresh(pair):
    for pool in pair.local.values():
        pool.fill_(SENTINEL)
    return pair


def assert_blocks(pair: Pair, dtype: str, copied: dict[int, int]) -> None:
    """Local block d holds source block copied[d] bit for bit; every other local block is untouched."""
    local, remote = pair.local[dtype], pair.remote[dtype]
    for d in range(LOCAL_BLOCKS):
        want = remote[copied[d]] if d in copied else torch.full_like(local[d], SENTINEL)
        assert torch.equal(local[d].view(torch.uint8), want.view(torch.uint8)), f"{dtype} local block {d}"


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_chosen_blocks_land_in_chosen_blocks(fresh, dtype):
    fresh.readers[dtype].read_blocks(fresh.sources[dtype], [(7, 0), (2, 3), (5, 5), (2, 1)])
    assert_blocks(fresh, dtype, {0: 7, 3: 2, 5: 5, 1: 2})


def test_contiguous_runs_merge_into_one_descriptor_each(fresh):
    pairs = [(3, 4), (6, 0), (1, 2), (0, 1), (2, 3)]
    assert merge_runs(pairs) == [(0, 1, 4), (6, 0, 1)]
    assert merge_runs([(0, 0), (1, 2), (1, 1)]) == [(0, 0, 2), (1, 2, 1)]
    fresh.readers["float32"].read_blocks(fresh.sources["float32"], pairs)
    assert_blocks(fresh, "float32", {4: 3, 0: 6, 2: 1, 1: 0, 3: 2})


@pytest.mark.parametrize("pairs, match", [
    ([(0, 0), (8, 1)], "out of range"),
    ([(0, 0), (-1, 1)], "out of range"),
    ([(0, 0), (1, LOCAL_BLOCKS)], "out of range"),
    ([(0, 1), (2, 1)], "written twice"),
])
def test_bad_pairs_are_refused_before_any_transfer(fresh, pairs, match):
    with pytest.raises(ValueError, match=match):
        fresh.readers["float32"].read_blocks(fresh.sources["float32"], pairs)
    assert_blocks(fresh, "float32", {})


def test_mismatched_block_bytes_are_refused(fresh):
    with pytest.raises(ValueError, match="bytes"):
        fresh.readers["float32"].read_blocks(fresh.sources["bfloat16"], [(0, 0)])
    assert_blocks(fresh, "float32", {})


def test_injected_fault_after_two_pairs(fresh, monkeypatch):
    monkeypatch.setenv(FAIL_AFTER_ENV, "2")
    reader, source = fresh.readers["float32"], fresh.sources["float32"]
    with test_hooks.installed(FAIL_AFTER_HOOK):
        with pytest.raises(TransferError) as err:
            reader.read_blocks(source, [(4, 1), (0, 3), (6, 0), (1, 5)])
        assert err.value.blocks_done == 2
        assert_blocks(fresh, "float32", {1: 4, 3: 0})
        reader.read_blocks(source, [(6, 0), (1, 5)])  # at most k pairs: no fault
        assert_blocks(fresh, "float32", {1: 4, 3: 0, 0: 6, 5: 1})


def test_metadata_is_reused_and_replaced_when_it_changes(fresh, monkeypatch):
    reader = fresh.readers["float32"]
    reader.read_blocks(fresh.sources["float32"], [(0, 0)])  # the peer is known from here on
    calls = {"add": 0, "remove": 0}
    for op in calls:
        real = getattr(reader._agent, f"{op}_remote_agent")
        monkeypatch.setattr(reader._agent, f"{op}_remote_agent",
                            lambda arg, real=real, op=op: (calls.__setitem__(op, calls[op] + 1), real(arg))[1])
    reader.read_blocks(fresh.sources["float32"], [(1, 1)])
    reader.read_blocks(fresh.sources["float32"], [(2, 2)])
    assert calls == {"add": 0, "remove": 0}

    old = fresh.sources["float32"]
    fresh.node.conn.send("reopen")  # the peer restarts under the same name
    assert fresh.node.conn.poll(START_S)
    new = fresh.sources["float32"] = fresh.node.conn.recv()
    assert new.agent_name == old.agent_name and new.agent_metadata != old.agent_metadata
    reader.read_blocks(new, [(3, 3)])
    reader.read_blocks(new, [(4, 4)])
    assert calls == {"add": 1, "remove": 1}
    assert_blocks(fresh, "float32", {0: 0, 1: 1, 2: 2, 3: 3, 4: 4})


def test_stalled_then_dead_peer_raises_transfer_error(fresh, monkeypatch):
    reader, source, victim = fresh.readers["float32"], fresh.victim_source, fresh.victim.proc
    # Over TCP a READ needs the peer's progress thread (over CMA, the default here, it does not).
    monkeypatch.setenv("UCX_TLS", "tcp")
    tcp_pool = torch.full_like(fresh.local["float32"], SENTINEL)
    tcp_reader = TransferAgent("reader-tcp", tcp_pool)
    try:
        for r in (reader, tcp_reader):
            r.read_blocks(source, [(0, 0)])  # connected
        os.kill(victim.pid, signal.SIGSTOP)
        while open(f"/proc/{victim.pid}/stat").read().rpartition(")")[2].split()[0] != "T":
            time.sleep(0.001)  # stopped for sure, not just signalled
        with pytest.raises(TransferError, match="took over") as err:
            tcp_reader.read_blocks(source, [(1, 1), (2, 2)], timeout=1.0)
        assert err.value.blocks_done == 0 and source.agent_name not in tcp_reader._remotes

        os.kill(victim.pid, signal.SIGKILL)
        victim.join()
        for r in (reader, reader, tcp_reader):  # to a connected peer, then adding the dead peer again
            with pytest.raises(TransferError) as err:
                r.read_blocks(source, [(1, 1), (2, 2)], timeout=3.0)
            assert err.value.blocks_done == 0 and source.agent_name not in r._remotes
        tcp_reader.read_blocks(fresh.sources["float32"], [(5, 5)])  # the readers still work with live peers
        assert torch.equal(tcp_pool[5], fresh.remote["float32"][5])
    finally:
        tcp_reader.close()
    reader.read_blocks(fresh.sources["float32"], [(5, 5)])
    assert torch.equal(fresh.local["float32"][5], fresh.remote["float32"][5])


def test_source_digest_covers_every_field():
    base = TransferSource("peer", b"metadata", 4096, 8, 1024)
    changed = {"agent_name": "peer2", "agent_metadata": b"metadata2", "base_address": 8192, "num_blocks": 9,
               "block_bytes": 2048, "mem_type": "VRAM", "device_id": 1}
    assert set(changed) == {f.name for f in dataclasses.fields(TransferSource)}
    digests = {base.digest()} | {dataclasses.replace(base, **{k: v}).digest() for k, v in changed.items()}
    assert len(digests) == 1 + len(changed)
    assert base.digest() == TransferSource("peer", b"metadata", 4096, 8, 1024).digest()
    assert TransferSource("ab", b"c", 0, 1, 1).digest() != TransferSource("a", b"bc", 0, 1, 1).digest()
    with pytest.raises(ValueError):
        TransferSource("peer", b"metadata", 0, 0, 1024)


def test_pool_blocks_must_be_contiguous():
    pool = torch.zeros(SOURCE_SHAPE).transpose(1, 3)
    with pytest.raises(ValueError, match="contiguous"):
        TransferAgent("bad", pool)


def test_an_idle_agent_does_not_spin_a_core():
    """NIXL's wrapper gives its progress thread no pause (it would take a whole core for the agent's
    life); ours pauses between rounds: an idle agent's process uses a small share of one core."""
    import resource
    import time

    from nixl_cu12 import _api

    before_config = _api.nixlBind.nixlAgentConfig
    agent = TransferAgent("idle", torch.zeros(SOURCE_SHAPE))
    try:
        assert _api.nixlBind.nixlAgentConfig is before_config  # the wrapper's name is restored
        time.sleep(0.2)
        r0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        time.sleep(1.5)
        r1, w1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        cpu = (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / (w1 - w0)
        assert cpu < 0.3, f"{cpu:.2f} CPU-seconds per second while idle"
    finally:
        agent.close()
