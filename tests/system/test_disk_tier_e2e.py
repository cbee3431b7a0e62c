"""The disk tier end to end: real services, the real model, a device pool and host tier too small to
keep a prompt, and a disk tier behind them. A prefix evicted through the host to disk comes back
(read, checked and reloaded: only the rest is computed) with the cold run's output; after the
memory service restarts over the same directory, the prompt still hits; a corrupted block file is
never served; another model identity over the same directory finds nothing; a full disk (ENOSPC)
and a tier of 3 slots drop and evict, and serve on; a worker SIGKILLed in the middle of a slot
write loses that block only."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest
from conftest import ROOT, local_stack, pagedkv_process

from client.engine.core import Engine
from client.engine.scheduler import SchedulerConfig
from client.params import SamplingParams
from client.request import Request
from client.services import MemoryClient, WorkerClient
from pagedkv.model.tokenizer import load_tokenizer

SHORT = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
FLUSH = ["Once upon a time, in a small village by the sea, there lived an old fisherman who",
         "A long list of fruits: apples, pears, plums, cherries, peaches, grapes and figs, all"]


HOOKS = str(ROOT / "tests" / "hooks" / "disk_fault.py")


def stack(tmp, disk_dir, name="disk", size="64MiB", fault: str | None = None, kill_file: Path | None = None):
    """8 device blocks of 4 tokens, a host tier of 4 blocks (SmolLM2's fp32 layout: 180 KiB each),
    and a disk tier of ``size`` under ``disk_dir``; ``fault``: the workers' disk writes fail so, and
    ``kill_file``: while it exists, the next write SIGKILLs its worker mid-slot (tests/hooks/disk_fault.py)."""
    env = None
    if fault or kill_file:
        env = {"PAGEDKV_TEST_HOOKS": HOOKS, "PAGEDKV_TEST_DISK_FAULT": fault or "",
               "PAGEDKV_TEST_DISK_KILL_FILE": str(kill_file or "")}
    return local_stack(tmp, ["--num-blocks", "8", "--block-size", "4", "--host-cache-memory", "720KiB",
                             "--max-blocks-per-lease", "none", "--disk-cache-dir", str(disk_dir),
                             "--disk-cache-size", size], name=name, env=env)


def run(s, prompt: list[int], salt: str, timeout: float = 60.0) -> tuple[Engine, Request]:
    """Run one prompt to the end on a fresh engine (closed after); returns it and the request."""
    memory = MemoryClient(s.memory.address)
    engine = Engine(memory, [WorkerClient(a) for a in s.worker_addresses], load_tokenizer("smollm2"),
                    config=SchedulerConfig(max_num_batched_tokens=64))
    req = Request(prompt, prompt, SHORT, request_id=uuid.uuid4().hex[:8], cache_salt=salt)
    try:
        engine.add(req)
        deadline = time.monotonic() + timeout
        while engine.has_work() and time.monotonic() < deadline:
            engine.step()
        assert not engine.has_work() and req.error is None, req.error
        wait_for_disk_work(memory)
    finally:
        engine.close()
        memory.close()
    return engine, req


def wait_for_disk_work(memory: MemoryClient, timeout: float = 20.0) -> None:
    """Until the write-through the run caused is done: no pending disk write, nothing pinned for it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = memory.stats()
        if st.host_used_blocks == 0 and st.used_blocks == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"disk work still pending: {memory.stats()}")


def evict(s, tok) -> None:
    """Fill the device pool and the host tier with other prompts (other salts)."""
    for text in FLUSH:
        run(s, tok.encode(text), uuid.uuid4().hex)


def disk_stats(s):
    memory = MemoryClient(s.memory.address)
    try:
        return memory.stats()
    finally:
        memory.close()


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("disk") / "kv"


def test_a_prefix_evicted_to_disk_comes_back_and_a_corrupted_one_is_never_served(tmp_path_factory, disk_dir):
    tok = load_tokenizer("smollm2")
    prompt = tok.encode(PROMPT)
    salt, other_salt = uuid.uuid4().hex, uuid.uuid4().hex
    full = (len(prompt) - 1) // 4 * 4  # every full block but the one holding the last token
    with stack(tmp_path_factory.mktemp("disk-stack"), disk_dir) as s:
        _, cold = run(s, prompt, salt)
        _, other_cold = run(s, prompt, other_salt)  # the same prompt under another salt: blocks of its own
        evict(s, tok)
        mid = disk_stats(s)
        assert mid.disk.writes >= full // 4 and mid.disk.blocks >= full // 4, mid.disk
        engine, warm = run(s, prompt, salt)
        after = disk_stats(s)
        read = after.disk.hits - mid.disk.hits
        assert read >= 4 and after.disk.reads - mid.disk.reads == read // 4, (mid.disk, after.disk)
        # Whatever was not on the device or the host came back from disk: only the rest is computed.
        assert warm.num_cached_tokens == full
        assert engine.traces[0].num_tokens == len(prompt) - full
        assert warm.seqs[0].generated == cold.seqs[0].generated
        assert after.disk.checksum_failures == 0 and after.used_blocks == 0
        # Flip a byte in every slot's payload: the other salt's blocks, read back, fail their checksum,
        # are dropped and counted, never served: that prompt is computed, with its cold output.
        corrupt_every_slot(disk_dir, after.disk.slots)
        _, other_warm = run(s, prompt, other_salt)
        final = disk_stats(s)
        assert final.disk.checksum_failures >= 1 and other_warm.num_cached_tokens < full, final.disk
        assert other_warm.seqs[0].generated == other_cold.seqs[0].generated
    # Another block size over the same directory: a folder of its own, nothing recovered.
    with local_stack(tmp_path_factory.mktemp("disk-other"), ["--num-blocks", "8", "--block-size", "8",
                                                             "--host-cache-memory", "720KiB",
                                                             "--max-blocks-per-lease", "none", "--disk-cache-dir",
                                                             str(disk_dir), "--disk-cache-size", "64MiB"],
                     num_workers=0, name="other") as other:
        assert disk_stats(other).disk.recovered == 0


def corrupt_every_slot(disk_dir: Path, slots: int) -> None:
    """Flip one byte of every slot's payload, in every slab of the directory."""
    folder = next(p for p in disk_dir.iterdir() if p.is_dir())
    for slab in folder.glob("slab-*.bin"):
        size = os.path.getsize(slab)
        slot = size // slots if slots else size
        with open(slab, "r+b") as f:
            for off in range(4096 + 100, size, max(slot, 1)):
                f.seek(off)
                b = f.read(1)
                f.seek(off)
                f.write(bytes([b[0] ^ 0xFF]) if b else b"")


def test_a_restarted_memory_service_and_front_serve_a_tenants_prompt_from_disk(tmp_path_factory):
    """``pagedkv serve`` over a stack with a disk tier: a tenant's prompt, pushed to disk by others, is
    served from disk after the front stops, the memory service restarts (SIGTERM) and a new front
    starts with the same home (its tenants' salt secret): the same text, and every full block but the
    last prompt token's reported as cached (usage.prompt_tokens_details.cached_tokens)."""
    import httpx
    from helpers.model_fixtures import private_home

    tok = load_tokenizer("smollm2")
    prompt = tok.encode(PROMPT)
    tmp = tmp_path_factory.mktemp("disk-front")
    home = private_home(tmp / "home")
    key = "key-disk"
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}

    def front(name: str):
        return pagedkv_process(["serve", "--memory", s.memory.address, "--workers", s.worker_addresses[0],
                                "--api-key", key], tmp, name, env={"PAGEDKV_HOME": str(home)})

    def complete(svc, payload) -> dict:
        r = httpx.post(f"http://{svc.address}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                       json=payload, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    with stack(tmp, tmp / "kv", name="front") as s:
        first = front("serve-first")
        try:
            cold = complete(first, body)
            for text in FLUSH:
                complete(first, {**body, "prompt": tok.encode(text)})
            memory = MemoryClient(s.memory.address)
            try:
                wait_for_disk_work(memory)
                assert memory.stats().disk.writes >= 4
            finally:
                memory.close()
        finally:
            first.stop()
        s.memory.stop()
        s.memory = s.memory.respawn()
        wait_for_worker(s)
        recovered = disk_stats(s).disk
        assert recovered.recovered >= 4 and recovered.blocks == recovered.recovered, recovered
        second = front("serve-again")
        try:
            warm = complete(second, body)
        finally:
            second.stop()
        token = open(s.memory.info["admin_token_file"]).read().strip()
        check = MemoryClient(s.memory.address, admin_token=token)
        try:
            assert check.check_invariants().ok and check.stats().disk.hits >= 4
        finally:
            check.close()
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(prompt) - 1) // 4 * 4


def wait_for_worker(s, timeout: float = 60.0) -> None:
    """Until the worker has mapped the restarted memory service's pool."""
    memory = MemoryClient(s.memory.address)
    try:
        generation = memory.pool().generation
    finally:
        memory.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        w = WorkerClient(s.worker_addresses[0])
        try:
            if w.model_info().pool_generation == generation:
                return
        except Exception:  # noqa: BLE001 - restarting
            pass
        finally:
            w.close()
        time.sleep(0.2)
    raise AssertionError("the worker did not map the restarted pool")


def test_a_full_disk_drops_offloads_and_keeps_serving(tmp_path_factory):
    """ENOSPC on every write (a hook on the workers' write path): every offload to disk is dropped and
    counted, nothing is on disk, every request is answered."""
    tok = load_tokenizer("smollm2")
    prompt = tok.encode(PROMPT)
    with stack(tmp_path_factory.mktemp("disk-full"), tmp_path_factory.mktemp("full") / "kv", name="full",
               fault="enospc") as s:
        _, cold = run(s, prompt, "x")
        evict(s, tok)
        _, again = run(s, prompt, "x")
        st = disk_stats(s)
        assert st.disk.dropped >= 3 and st.disk.writes == 0 and st.disk.blocks == 0, st.disk
        assert again.seqs[0].generated == cold.seqs[0].generated and st.used_blocks == 0


def test_a_worker_killed_in_the_middle_of_a_write_loses_that_block_only(tmp_path_factory):
    """SIGKILL between a slot's payload and its header (a tier of 6 slots, full by then: the slot is
    reused, so its old header stays over new bytes), then both services restarted: every prompt gets
    its cold output again, the torn block is dropped and counted (the old header's checksum fails
    when its block is read), the rest is found, and CheckInvariants holds on all three tiers."""
    tok = load_tokenizer("smollm2")
    texts = [PROMPT, *FLUSH]
    prompts = [tok.encode(t) for t in texts]
    slot = -(-(4096 + 184_320) // 4096) * 4096
    tmp = tmp_path_factory.mktemp("disk-torn")
    kill = tmp / "kill-next-write"
    with stack(tmp, tmp / "kv", name="torn", size=str(6 * slot), kill_file=kill) as s:
        cold = [run(s, p, "t")[1].seqs[0].generated for p in prompts]
        full = disk_stats(s).disk
        assert full.slots == 6 and full.blocks <= 6 and full.evictions >= 1, full  # bounded: slots are reused
        kill.touch()
        late = tok.encode("Colours of the rainbow: red, orange, yellow, green, blue, indigo and violet, so")
        deadline = time.monotonic() + 60
        while s.workers[0].proc.poll() is None and time.monotonic() < deadline:
            try:  # new blocks pass through the host tier to disk: the first write kills the worker
                run(s, late, uuid.uuid4().hex, timeout=10)
            except Exception:  # noqa: BLE001 - the worker died under this run
                break
        deadline = time.monotonic() + 30
        while s.workers[0].proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert s.workers[0].proc.poll() is not None and not kill.exists(), "the hook killed the worker mid-write"
        s.memory.stop()
        s.memory = s.memory.respawn()
        s.workers[0] = s.workers[0].respawn()
        wait_for_worker(s)
        found = disk_stats(s).disk.recovered
        again = [run(s, p, "t")[1] for p in prompts]
        st = disk_stats(s)
        assert found >= 1 and st.disk.checksum_failures == 1, st.disk
        assert [r.seqs[0].generated for r in again] == cold
        assert sum(r.num_cached_tokens for r in again) > 0, "blocks written before the kill are hits"
        token = open(s.memory.info["admin_token_file"]).read().strip()
        check = MemoryClient(s.memory.address, admin_token=token)
        try:
            assert check.check_invariants().ok
        finally:
            check.close()
