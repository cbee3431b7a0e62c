"""A restarted ``pagedkv serve`` keeps its tenants' prefix cache: the secret of their cache
namespaces persists in ``$PAGEDKV_HOME/cache-salt-secret`` (pagedkv.runtime.cache_salt), so the same
tenant's prompt hits the blocks the previous process cached; a server with another secret file
shares nothing with it."""

from __future__ import annotations

import httpx
from conftest import pagedkv_process, private_home

from client.services import MemoryClient

KEY = "key-restart"
PROMPT = [1, *range(7000, 7040)]  # 2 full blocks of 16 before the block holding the last token


def _hits_of_one_request(stack, tmp, home, name: str, *extra: str) -> int:
    """Start a server in ``home``, send PROMPT as tenant ``restart``, stop it: the prefix-cache hits."""
    memory = MemoryClient(stack.memory.address)
    svc = pagedkv_process(["serve", "--memory", stack.memory.address, "--workers", stack.worker_addresses[0],
                           "--api-key", KEY, *extra], tmp, name, env={"PAGEDKV_HOME": str(home)})
    try:
        before = memory.stats().prefix_cache_hits
        r = httpx.post(f"http://{svc.address}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"prompt": PROMPT, "max_tokens": 1, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        return memory.stats().prefix_cache_hits - before
    finally:
        svc.stop()
        memory.close()


def test_a_restarted_server_keeps_its_tenants_cache(stack, tmp_path):
    home = private_home(tmp_path / "home")
    assert _hits_of_one_request(stack, tmp_path, home, "serve-first") == 0
    assert (home / "cache-salt-secret").exists()
    assert _hits_of_one_request(stack, tmp_path, home, "serve-again") == 32
    other = tmp_path / "other-secret"
    assert _hits_of_one_request(stack, tmp_path, home, "serve-other", "--cache-salt-secret-file", str(other)) == 0
