"""Naming a model by its Hugging Face repo id (pagedkv.model.source), with no network.

A tiny random Llama (transformers `save_pretrained`, SmolLM2's tokenizer beside it) in two
revisions is served by a stand-in for the Hub's HTTP API on loopback; huggingface_hub itself
downloads it once into a cache folder of the test (the only step with downloads allowed). Every
other step runs with HF_HUB_OFFLINE=1 against that cache: resolution, the real memory service and
workers started from the repo id (one of them at `--revision v2`), the client's tokenizer, the
start-up failures of `pagedkv memory` / `pagedkv compute`, and the prefix cache's model identity
(no block shared between two revisions).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
import torch
from conftest import ROOT, pagedkv_process

from client import Client, SamplingParams
from client.ops.stack import LocalStack
from client.services import MemoryClient, WorkerClient
from client.tokenizer import tokenizer_source
from pagedkv.compute.v1 import compute_service_pb2 as cpb
from pagedkv.model.source import ModelNotCachedError, fingerprint, model_identity, resolve_model
from pagedkv.model.tokenizer import load_tokenizer
from pagedkv.runtime.block_hash import CacheKey, chain_hashes

REPO = "pagedkv-test/tiny-llama"
#: Commits of the two revisions on the stand-in Hub: `main` and the tag `v2`.
COMMITS = {"main": hashlib.sha1(b"revision one").hexdigest(), "v2": hashlib.sha1(b"revision two").hexdigest()}
#: Files of the repo that no pagedkv process needs (never downloaded).
EXTRA_FILES = {"README.md": b"# tiny\n", "original/consolidated.00.pth": b"\0" * 64}
BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def write_tiny_llama(path: Path, seed: int) -> None:
    """A random Llama (hidden 64, 2 layers, GQA 4/2) with SmolLM2's vocabulary and tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_theta=10000.0, tie_word_embeddings=True, initializer_range=0.2,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    load_tokenizer("smollm2").save_pretrained(path)


class StandInHub:
    """The Hub's HTTP API for one model repo, as huggingface_hub calls it: revision info, the
    recursive tree of a commit, and HEAD/GET of `/{repo}/resolve/{commit}/{file}`."""

    def __init__(self, repo: str, commits: dict[str, dict[str, bytes]], refs: dict[str, str]):
        hub = self
        self.repo, self.commits, self.refs = repo, commits, refs

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, code: int, body: bytes, headers: dict[str, str], head: bool) -> None:
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def route(self, head: bool) -> None:
                parts = unquote(urlparse(self.path).path).strip("/").split("/")
                api = parts[:2] == ["api", "models"]
                repo = "/".join(parts[2:4] if api else parts[:2])
                rev = parts[5] if api else parts[3]
                sha = hub.refs.get(rev, rev)
                if repo != hub.repo:
                    return self.reply(404, b'{"error":"Repository not found"}', {"X-Error-Code": "RepoNotFound"}, head)
                if sha not in hub.commits:
                    return self.reply(404, b'{"error":"Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"}, head)
                files = hub.commits[sha]
                if api and parts[4] == "revision":
                    body = {"id": repo, "sha": sha, "siblings": [{"rfilename": f} for f in files]}
                    return self.reply(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head)
                if api:  # tree
                    body = [{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                            for f, b in files.items()]
                    return self.reply(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head)
                data = files.get("/".join(parts[4:]))
                if data is None:
                    return self.reply(404, b"", {"X-Error-Code": "EntryNotFound"}, head)
                return self.reply(200, data, {"X-Repo-Commit": sha, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'},
                                  head)

            def do_GET(self):
                self.route(head=False)

            def do_HEAD(self):
                self.route(head=True)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


DOWNLOAD = r"""
import json, sys
from pagedkv.model.source import ModelNotCachedError, resolve_model
out = {}
for name, rev in (("pagedkv-test/tiny-llama", None), ("pagedkv-test/tiny-llama", "v2")):
    m = resolve_model(name, rev)
    out[rev or "main"] = [str(m.path), m.revision]
for name, rev in (("pagedkv-test/missing", None), ("pagedkv-test/tiny-llama", "v3")):
    try:
        resolve_model(name, rev)
    except ModelNotCachedError as e:
        out[name + "@" + str(rev)] = str(e)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(cache folder, {revision: model directory}, what the one online run printed)."""
    tmp = tmp_path_factory.mktemp("hub")
    dirs, commits = {}, {}
    for seed, rev in enumerate(COMMITS):
        dirs[rev] = tmp / "src" / rev
        write_tiny_llama(dirs[rev], seed)
        commits[COMMITS[rev]] = {p.name: p.read_bytes() for p in dirs[rev].iterdir()}
    commits[COMMITS["main"]].update(EXTRA_FILES)
    server = StandInHub(REPO, commits, dict(COMMITS))
    cache = tmp / "hf" / "hub"
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": server.url, "HF_HUB_CACHE": str(cache),
           "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONPATH": f"{ROOT}:{ROOT / 'protos'}"}
    env.pop("HF_TOKEN", None)
    try:
        r = subprocess.run([sys.executable, "-c", DOWNLOAD], env=env, capture_output=True, text=True, timeout=120)
    finally:
        server.close()
    assert r.returncode == 0, r.stdout + r.stderr
    return cache, dirs, json.loads(r.stdout.splitlines()[-1])


@pytest.fixture
def offline(hub, monkeypatch):
    """This process reads the test's cache with downloads off (huggingface_hub read both at import)."""
    from huggingface_hub import constants

    cache = hub[0]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    load_tokenizer.cache_clear()
    yield cache
    load_tokenizer.cache_clear()


def services_env(cache: Path) -> dict[str, str]:
    return {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_ENDPOINT": "http://127.0.0.1:9"}


def test_huggingface_hub_downloads_only_the_model_files(hub):
    from huggingface_hub import scan_cache_dir

    cache, dirs, printed = hub
    (repo,) = scan_cache_dir(cache).repos
    assert repo.repo_id == REPO and repo.repo_type == "model"
    by_commit = {r.commit_hash: r for r in repo.revisions}
    assert set(by_commit) == set(COMMITS.values())
    for rev, commit in COMMITS.items():
        r = by_commit[commit]
        assert r.refs == {rev}
        assert printed[rev] == [str(r.snapshot_path), commit]
        # Every file of the model directory (config, weights, tokenizer) and nothing else.
        assert {f.file_name for f in r.files} == {p.name for p in dirs[rev].iterdir()}
        for f in r.files:
            assert f.file_path.read_bytes() == (dirs[rev] / f.file_name).read_bytes()
    assert not any((cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMITS["main"] / f).exists()
                   for f in EXTRA_FILES)


def test_the_hub_refusing_a_repo_or_revision_is_named(hub):
    printed = hub[2]
    assert "no model 'pagedkv-test/missing' on the Hub" in printed["pagedkv-test/missing@None"]
    assert f"model {REPO!r} has no revision 'v3' on the Hub" in printed[f"{REPO}@v3"]


def test_repo_id_resolves_offline_from_the_cache(offline):
    snapshots = offline / f"models--{REPO.replace('/', '--')}" / "snapshots"
    for revision, want in ((None, "main"), ("main", "main"), ("v2", "v2"), (COMMITS["v2"], "v2")):
        for files in ("model", "config", "tokenizer"):
            m = resolve_model(REPO, revision, files=files)
            assert (m.name, m.repo_id, m.revision) == (REPO, REPO, COMMITS[want])
            assert m.path == snapshots / COMMITS[want] and m.load_source == str(m.path)


@pytest.mark.parametrize("name, revision, reason", [
    ("pagedkv-test/missing", None, "no folder models--pagedkv-test--missing there"),
    (REPO, "v3", "has no ref 'v3'"),
    (REPO, "0" * 40, f"no snapshot {'0' * 40}"),
    (REPO, "stale", f"its ref 'stale' names commit {'2' * 40}, which has no snapshot there"),
])
def test_missing_repo_or_revision_fails_with_how_to_fetch_it(offline, name, revision, reason):
    ref = offline / f"models--{REPO.replace('/', '--')}" / "refs" / "stale"  # a ref left by a deleted snapshot
    ref.write_text("2" * 40)
    try:
        with pytest.raises(ModelNotCachedError) as e:
            resolve_model(name, revision)
    finally:
        ref.unlink()
    msg = str(e.value)
    rev = revision or "main"
    for part in (f"model {name!r} at revision {rev!r}", f"Hugging Face cache {offline}", reason,
                 f"`hf download {name} --revision {rev}`", "unset HF_HUB_OFFLINE"):
        assert part in msg, msg


@pytest.mark.parametrize("name, error, text", [
    ("not a model", ValueError, "neither 'smollm2', an existing directory or .gguf file, nor a Hugging Face repo id"),
    ("a/b/c", FileNotFoundError, "no such file or directory"),
    ("./missing-dir", FileNotFoundError, "no such file or directory"),
    ("", ValueError, "no model named"),
    ("x" * 600, ValueError, "not a usable path"),
])
def test_a_name_that_is_neither_path_nor_repo_id_fails(offline, name, error, text):
    with pytest.raises(error, match=text):
        resolve_model(name)


def test_local_models_are_fingerprinted_by_their_files(hub, tmp_path):
    src = hub[1]["main"]
    m = resolve_model(str(src))
    assert (m.path, m.repo_id, m.load_source) == (src, None, str(src))
    assert m.revision.startswith("local-") and len(m.revision) == len("local-") + 16
    assert resolve_model(str(src)).revision == m.revision == fingerprint(src)
    # The other revision's files (other sizes or times) fingerprint otherwise; a rewritten config too.
    assert resolve_model(str(hub[1]["v2"])).revision != m.revision
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in ("config.json", "model.safetensors"):
        (copy / f).write_bytes((src / f).read_bytes())
    before = fingerprint(copy)
    (copy / "tokenizer.json").write_text("{}")  # not part of what the KV depends on
    assert fingerprint(copy) == before
    st = (copy / "config.json").stat()
    os.utime(copy / "config.json", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert fingerprint(copy) != before
    smol = resolve_model("smollm2")
    assert smol.load_source == "smollm2" and smol.path.suffix == ".gguf" and smol.revision.startswith("local-")
    gguf = resolve_model(str(smol.path))
    assert gguf.path == smol.path and gguf.revision == fingerprint(smol.path)
    with pytest.raises(ValueError, match="--revision v2 names a revision of a Hugging Face repo"):
        resolve_model(str(src), "v2")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(str(src / "config.json"))


def test_tokenizer_source_uses_the_cache_when_the_weights_path_is_elsewhere(offline, hub):
    for rev in COMMITS:
        info = cpb.GetModelInfoResponse(model_source=REPO, revision=COMMITS[rev],
                                        weights_path="/elsewhere/on/the/worker/host")
        path = tokenizer_source(info)
        assert Path(path).name == COMMITS[rev]
        tok = load_tokenizer(path)
        assert tok("What is the capital of France?")["input_ids"] == load_tokenizer("smollm2")(
            "What is the capital of France?")["input_ids"]
    info = cpb.GetModelInfoResponse(model_source=REPO, revision="1" * 40, weights_path="/elsewhere")
    with pytest.raises(ModelNotCachedError, match=f"no snapshot {'1' * 40}"):
        tokenizer_source(info)
    info = cpb.GetModelInfoResponse(model_source="/models/on/the/worker", revision="local-0123456789abcdef",
                                    weights_path="/models/on/the/worker")
    with pytest.raises(FileNotFoundError, match="which is not on this host"):
        tokenizer_source(info)
    # load_tokenizer takes a repo id itself (cache first, like the services).
    assert load_tokenizer(REPO, revision="v2").name_or_path == str(
        offline / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMITS["v2"])


def test_services_refuse_a_missing_model_at_once(hub, tmp_path):
    env = {**os.environ, **services_env(hub[0]), "PAGEDKV_LOG_LEVEL": "warning"}
    token = ["--admin-token-file", str(tmp_path / "token")]
    runs = [  # (argv, the message's lines)
        (["compute", "--memory", "127.0.0.1:9", "--memory-timeout", "600", "--model", "pagedkv-test/missing"],
         ["model 'pagedkv-test/missing' at revision 'main' is not in the Hugging Face cache",
          "`hf download pagedkv-test/missing --revision main`", "unset HF_HUB_OFFLINE"]),
        (["memory", "--port", "0", "--model", REPO, "--revision", "v3", *token],
         [f"model {REPO!r} at revision 'v3' is not in the Hugging Face cache", f"`hf download {REPO} --revision v3`"]),
        (["compute", "--memory", "127.0.0.1:9", "--memory-timeout", "600", "--model", REPO, "--revision", "v3"],
         [f"model {REPO!r} at revision 'v3' is not in the Hugging Face cache", "has no ref 'v3'"]),
        (["memory", "--port", "0", "--model", "not a model", *token], ["nor a Hugging Face repo id"]),
    ]
    procs = [subprocess.Popen([sys.executable, "-m", "client.ops.cli", *args], env=env, cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for args, _ in runs]
    for (args, lines), p in zip(runs, procs):
        out, _ = p.communicate(timeout=120)  # a worker would wait 600 s for its memory service
        assert p.returncode == 2, out
        assert f"pagedkv {args[0]}: error: " in out, out
        for line in lines:
            assert line in out, out


@pytest.fixture(scope="module")
def hub_stack(hub, tmp_path_factory):
    """A memory service and a worker from the repo id (main), and a second worker at --revision v2."""
    cache = hub[0]
    tmp = tmp_path_factory.mktemp("hub_stack")
    stack = LocalStack(["--num-blocks", "64", "--block-size", str(BLOCK_SIZE), "--lease-ttl", "30",
                        "--admin-token-file", str(tmp / "admin-token")], model=REPO, run_dir=tmp, name="hub",
                       cwd=ROOT, env=services_env(cache), timeout=120)
    with stack:
        v2 = pagedkv_process(["compute", "--memory", stack.memory_address, "--model", REPO, "--revision", "v2"], tmp,
                             "worker-v2", env=services_env(cache))
        try:
            yield stack, v2
        finally:
            v2.stop()


@torch.inference_mode()
def hf_greedy(path: Path, ids: list[int], steps: int) -> list[int]:
    """transformers' greedy tokens for ``ids`` from the model directory (a full forward per token)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = list(ids)
    for _ in range(steps):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-steps:]


def test_services_run_the_repo_at_each_revision(hub_stack, hub, offline):
    stack, v2 = hub_stack
    dirs = hub[1]
    snapshots = offline / f"models--{REPO.replace('/', '--')}" / "snapshots"
    assert stack.memory.info["revision"] == COMMITS["main"]
    workers = {"main": stack.worker_addresses[0], "v2": v2.address}
    assert stack.workers[0].info["revision"] == COMMITS["main"] and v2.info["revision"] == COMMITS["v2"]
    prompt = "The paged KV cache keeps every block"
    outputs = {}
    for rev, address in workers.items():
        w = WorkerClient(address)
        try:
            info = w.model_info()
        finally:
            w.close()
        assert (info.model_name, info.model_source, info.revision) == (REPO, REPO, COMMITS[rev])
        assert info.weights_path == str(snapshots / COMMITS[rev]) and info.dtype == "float32"
        with Client(stack.memory_address, [address]) as llm:
            assert llm.tokenizer.name_or_path == str(snapshots / COMMITS[rev])
            ids = llm.tokenizer.encode(prompt)
            assert ids == load_tokenizer("smollm2").encode(prompt)
            (out,) = llm.generate([ids], GREEDY)
            outputs[rev] = out.outputs[0].token_ids
            assert llm.engine.model_id == model_identity(REPO, REPO, COMMITS[rev], "float32")
        assert outputs[rev] == hf_greedy(dirs[rev], ids, GREEDY.max_tokens), rev
    assert outputs["main"] != outputs["v2"], "both revisions gave the same tokens: --revision picked nothing"


def test_prefix_cache_never_shares_blocks_between_revisions(hub_stack, offline):
    stack, v2 = hub_stack
    ids = list(range(1000, 1000 + 3 * BLOCK_SIZE + 1))  # three full blocks and one token
    memory = MemoryClient(stack.memory_address)
    try:
        with Client(stack.memory_address, [stack.worker_addresses[0]]) as main, \
                Client(stack.memory_address, [v2.address]) as other:
            (first,) = main.generate([ids], GREEDY)
            hits = memory.stats().prefix_cache_hits
            (again,) = main.generate([ids], GREEDY)
            assert again.num_cached_tokens == 3 * BLOCK_SIZE  # the same revision hits its blocks
            assert memory.stats().prefix_cache_hits - hits == 3 * BLOCK_SIZE
            hits = memory.stats().prefix_cache_hits
            (v2_out,) = other.generate([ids], GREEDY)
            assert v2_out.num_cached_tokens == 0  # the other revision: nothing reused
            assert memory.stats().prefix_cache_hits == hits
            (v2_again,) = other.generate([ids], GREEDY)
            assert v2_again.num_cached_tokens == 3 * BLOCK_SIZE and v2_again.outputs[0].token_ids == \
                v2_out.outputs[0].token_ids
            assert first.outputs[0].token_ids == again.outputs[0].token_ids
            assert main.engine.model_id != other.engine.model_id
    finally:
        memory.close()


def test_serve_attaching_checks_the_revision(hub_stack, hub):
    """`pagedkv serve --model REPO --revision R` refuses workers that run another commit than R
    names in its own cache; the pool size is checked in the pool's blocks, whatever the model."""
    stack, _ = hub_stack
    env = {**os.environ, **services_env(hub[0]), "PAGEDKV_HOME": str(hub[0].parent)}
    attach = ["serve", "--memory", stack.memory_address, "--workers", stack.worker_addresses[0], "--model", REPO,
              "--port", "0"]
    runs = [[*attach, "--revision", "v2"], [*attach, "--revision", "main", "--kv-cache-memory", "1MiB"]]
    procs = [subprocess.Popen([sys.executable, "-m", "client.ops.cli", *args], env=env, cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for args in runs]
    (_, v2), (_, size) = (p.communicate(timeout=120) for p in procs)
    assert [p.returncode for p in procs] == [1, 1], v2 + size
    assert f"--revision v2 (the workers run revision {COMMITS['main']})" in v2, v2
    block_nbytes = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4  # layers, K and V, tokens, KV heads, head dim, fp32
    assert f"--kv-cache-memory 1MiB ({2**20 // block_nbytes} blocks; the pool has 64)" in size, size
    assert "--revision" not in size, size


def test_model_identity_includes_the_revision_and_the_kv_dtype():
    ids = list(range(2 * BLOCK_SIZE))

    def hashes(revision: str, dtype: str) -> list[bytes]:
        return chain_hashes(ids, BLOCK_SIZE, CacheKey(model_identity(REPO, REPO, revision, dtype)), 2)

    base = hashes(COMMITS["main"], "float32")
    assert base == hashes(COMMITS["main"], "float32")
    assert not set(base) & set(hashes(COMMITS["v2"], "float32"))
    assert not set(base) & set(hashes(COMMITS["main"], "bfloat16"))
