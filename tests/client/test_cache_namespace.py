"""A Client's prefix-cache entries are its user's (pagedkv.runtime.cache_salt): another user's process
(here: another $PAGEDKV_HOME, so another secret) can neither hit nor confirm its prompts, through
a Client, LookupPrefix or the KV events, while a second Client of the same user shares them. On
loopback LookupPrefix needs the admin token."""

from __future__ import annotations

import os

import grpc
import pytest
from conftest import local_stack, private_home

from client import Client, SamplingParams
from client.services import MemoryClient, read_admin_token
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.runtime.block_hash import CacheKey, chain_hashes
from pagedkv.runtime.cache_salt import load_secret

PROMPT = [1, *range(3000, 3040)]  # 2 full blocks of 16 before the block holding the last token
GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def solo(tmp_path_factory, tiny_model):
    with local_stack(tmp_path_factory.mktemp("namespace"), ["--num-blocks", "64", "--block-size", "16"],
                     name="namespace", model=tiny_model[0]) as s:
        yield s


def _client(stack, home, monkeypatch) -> Client:
    monkeypatch.setenv("PAGEDKV_HOME", str(home))
    return Client(stack.memory_address, stack.worker_addresses)


def test_another_user_neither_hits_nor_confirms_a_clients_prompt(solo, tmp_path, monkeypatch):
    mine, theirs = private_home(tmp_path / "mine"), private_home(tmp_path / "theirs")
    admin = MemoryClient(solo.memory_address, admin_token=read_admin_token(solo.memory.info["admin_token_file"]))
    with _client(solo, mine, monkeypatch) as a:
        a.generate([PROMPT], GREEDY)
        model_id, ns = a.engine.model_id, a.cache_namespace
    assert oct((mine / "cache-salt-secret").stat().st_mode & 0o777) == "0o600" and len(ns) == 32
    hashes = lambda salt: chain_hashes(PROMPT, 16, CacheKey(model_id, salt), 2)  # noqa: E731
    with _client(solo, theirs, monkeypatch) as b:
        b.generate([PROMPT], GREEDY)
        assert b.cache_namespace != ns and b.engine.traces[0].num_tokens == len(PROMPT)  # no hit
    with _client(solo, mine, monkeypatch) as c:
        c.generate([PROMPT], GREEDY)
        assert c.engine.traces[0].num_tokens == len(PROMPT) - 32  # the same user's two blocks
    # Confirming a guessed prompt: LookupPrefix needs the admin token on loopback; the events carry
    # the hashes of the salted prompt only, which no other user can compute.
    anyone = MemoryClient(solo.memory_address)
    lookup = lambda m, salt: m.stub.LookupPrefix(mpb.LookupPrefixRequest(  # noqa: E731
        token_ids=PROMPT, model_id=model_id, cache_salt=salt), metadata=m._admin_md(), timeout=5)
    with pytest.raises(grpc.RpcError) as refused:
        lookup(anyone, "")
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "LookupPrefix needs the admin role" in refused.value.details()
    assert lookup(admin, "").cached_tokens == 0
    assert lookup(admin, ns).cached_tokens == 32
    seen = set()
    for e in anyone.stub.StreamKvEvents(mpb.StreamKvEventsRequest(from_sequence_number=1), timeout=2):
        if e.WhichOneof("event") == "block_stored":
            seen.add(e.block_stored.block_hash)
            assert not e.block_stored.token_ids  # token ids go to the admin only
        if set(hashes(ns)) <= seen:
            break
    assert not set(hashes("")) & seen
    anyone.close()
    admin.close()


def test_a_secret_other_users_may_read_is_refused(tmp_path):
    path = tmp_path / "secret"
    first = load_secret(path)
    assert load_secret(path) == first and len(first) == 32
    os.chmod(path, 0o640)
    with pytest.raises(ValueError, match="chmod 600"):
        load_secret(path)
    os.chmod(path, 0o600)
    path.write_text("not hex\n")
    with pytest.raises(ValueError, match="64 hex digits"):
        load_secret(path)


def test_an_explicit_namespace_is_shared_on_purpose(solo, tmp_path, monkeypatch):
    with _client(solo, private_home(tmp_path / "u1"), monkeypatch) as a:
        monkeypatch.setenv("PAGEDKV_HOME", str(private_home(tmp_path / "u2")))
        with Client(solo.memory_address, solo.worker_addresses, cache_namespace=a.cache_namespace) as b:
            a.generate([[1, *range(5000, 5040)]], GREEDY)
            b.generate([[1, *range(5000, 5040)]], GREEDY)
            assert b.engine.traces[0].num_tokens == 41 - 32
