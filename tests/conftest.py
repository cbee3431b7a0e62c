"""Shared fixtures: real service processes on free ports."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

# The suite never downloads (a test that means to, against its own local hub, says so itself);
# set before huggingface_hub is imported, which reads it once.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc
import pytest

# Session fixtures shared by every module: one reference model and one loaded GGUF per run.
from helpers.model_fixtures import gguf_dir, hf_model, hf_tokenizer, ours, pagedkv_home, private_home  # noqa: F401

from client.ops.stack import LocalStack, ServiceProcess

ROOT = Path(__file__).resolve().parent.parent
#: Seconds a service may take to write its ready file (and again to turn healthy).
START_TIMEOUT = 120.0
#: The suite's services compute in float32 unless a test names a dtype: its references (transformers,
#: dense fp64 attention, byte-compared pools) are exact comparisons, and ``auto`` is bfloat16 on a
#: CPU with AVX-512 BF16 (pagedkv.config.default_dtype). A test of the default passes ``auto``.
REFERENCE_DTYPE = "float32"


def with_reference_dtype(args: list[str]) -> list[str]:
    """``pagedkv <args>`` with :data:`REFERENCE_DTYPE` made explicit where the args name no dtype:
    a memory service's ``--kv-cache-dtype`` (its workers' ``auto`` follows the pool) and ``serve``'s
    ``--dtype``; other subcommands as given."""
    if "--kv-cache-dtype" in args or "--dtype" in args:
        return args
    if args[:1] == ["memory"]:
        return [*args, "--kv-cache-dtype", REFERENCE_DTYPE]
    if args[:1] == ["serve"]:
        return [*args, "--dtype", REFERENCE_DTYPE]
    return args


def hook_env(*modules: str, **params: str) -> dict[str, str]:
    """The environment that installs test hook modules (``tests.hooks.<name>``, :mod:`pagedkv.runtime.test_hooks`)
    into a service process, with the hooks' own ``params`` (environment variables); the repository
    root goes first on the process's ``PYTHONPATH`` so ``tests.hooks`` imports there."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {"PAGEDKV_TEST_HOOKS": ",".join(modules), "PYTHONPATH": path, **params}


def pagedkv_process(args: list[str], tmp: Path, name: str, env: dict | None = None, timeout: float = START_TIMEOUT,
                    port: int = 0) -> ServiceProcess:
    """``pagedkv <args>`` on ``port`` (0: a free one) as its own process, logging under ``tmp``.

    A memory service writes its admin token beside its log (``<name>.admin-token``), not to
    the shared ``$PAGEDKV_HOME``, so services started at once do not overwrite each other's.
    """
    if args[:1] == ["memory"] and "--admin-token-file" not in args:
        args = [*args, "--admin-token-file", str(Path(tmp) / f"{name}.admin-token")]
    if args[:1] == ["memory"] and "--grace" not in args:  # a test stops its workers first: nothing to wait for
        args = [*args, "--grace", "0"]
    return ServiceProcess.pagedkv(with_reference_dtype(args), tmp, name, port=port, env=env, timeout=timeout, cwd=ROOT)


def local_stack(tmp: Path, memory_args: list[str], num_workers: int = 1, name: str = "stack",
                model: str | Path | None = None, env: dict[str, str] | None = None,
                worker_args: list[str] | None = None) -> LocalStack:
    """``pagedkv memory <memory_args>`` and ``num_workers`` workers (``pagedkv compute <worker_args>``)
    on free ports, logging under ``tmp``; both services on ``--model model`` (None: SmolLM2), with
    ``env`` added to their environment; the pool in :data:`REFERENCE_DTYPE` unless ``memory_args``
    names its ``--kv-cache-dtype``.

    Not started: use it as ``with local_stack(...) as s:``. Its memory service writes its admin
    token under ``tmp`` (the ready file's ``admin_token_file`` names it).
    """
    if "--admin-token-file" not in memory_args:
        memory_args = [*memory_args, "--admin-token-file", str(Path(tmp) / f"{name or 'stack'}.admin-token")]
    if "--grace" not in memory_args:  # the stack stops its workers first: nothing to wait for at the end
        memory_args = [*memory_args, "--grace", "0"]
    memory_args = with_reference_dtype(["memory", *memory_args])[1:]
    pool = memory_args[memory_args.index("--kv-cache-dtype") + 1]
    # Over an fp8 pool a worker's auto is the device's default, not the pool's: the reference dtype too.
    worker_args = [*(worker_args or []), *(["--dtype", REFERENCE_DTYPE] if pool in ("fp8", "fp8_e4m3") else [])]
    return LocalStack(memory_args, num_workers=num_workers, run_dir=tmp, name=name, cwd=ROOT, timeout=START_TIMEOUT,
                      model=None if model is None else str(model), worker_args=worker_args, env=env)


@pytest.fixture
def one_torch_thread():
    """Torch (and the native kernels on its OpenMP team) on one thread for the test, as before after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def start_service(tmp_path):
    """Factory: ``start_service(["memory", "--num-blocks", "64"], name="memory")``; stopped at teardown."""
    started: list[ServiceProcess] = []

    def start(args: list[str], name: str = "service", env: dict | None = None) -> ServiceProcess:
        svc = pagedkv_process(args, tmp_path, f"{name}{len(started)}", env)
        started.append(svc)
        return svc

    yield start
    for svc in started:
        svc.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """(directory, transformers model): the tiny random Llama of ``tiny_llama.make_tiny_llama``
    (seed 0), written once for the session. Read-only: a test that edits its files copies it."""
    from helpers.tiny_llama import make_tiny_llama

    path = tmp_path_factory.mktemp("tiny_llama") / "model"
    return path, make_tiny_llama(path)


@pytest.fixture(scope="module")
def memory_service(tmp_path_factory):
    """One memory service for a test module: 64 blocks of 4 tokens, SmolLM2 layout."""
    with local_stack(tmp_path_factory.mktemp("memory"),
                     ["--num-blocks", "64", "--block-size", "4", "--lease-ttl", "30"],
                     num_workers=0, name="") as s:
        yield s.memory


@pytest.fixture
def memory_stub(memory_service):
    from pagedkv.memory.v1 import memory_service_pb2_grpc as pb_grpc

    with grpc.insecure_channel(memory_service.address) as channel:
        yield pb_grpc.MemoryServiceStub(channel)


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    """Memory service (512 blocks of 16 tokens, SmolLM2 layout) + two workers mapping its pool; each
    serves Prometheus metrics on a free port (its ready file's ``metrics_port``)."""
    with local_stack(tmp_path_factory.mktemp("stack"),
                     ["--num-blocks", "512", "--block-size", "16", "--lease-ttl", "30", "--metrics-port", "0"],
                     num_workers=2, worker_args=["--metrics-port", "0"]) as s:
        yield s


#: The admin API key of :func:`dashboard_server`'s ``pagedkv serve``.
DASHBOARD_ADMIN_KEY = "key-operator"


@pytest.fixture(scope="session")
def dashboard_server(tmp_path_factory):
    """The dashboard's server, shared by its feed's and its page's tests: a small pool (96 blocks of
    16 tokens), one worker, and ``pagedkv serve`` over them with ``--admin-api-key``
    :data:`DASHBOARD_ADMIN_KEY`, the memory service's admin token, and a snapshot every 0.2 s.
    Yields ``(stack, url, serve process)``. Its own stack, so the KV events replay from event 1."""
    run = tmp_path_factory.mktemp("dashboard")
    with local_stack(run, ["--num-blocks", "96", "--block-size", "16", "--lease-ttl", "30"], num_workers=1,
                     name="dash") as s:
        svc = pagedkv_process(["serve", "--memory", s.memory.address, "--workers", s.worker_addresses[0],
                               "--admin-api-key", DASHBOARD_ADMIN_KEY, "--memory-admin-token-file",
                               s.memory.info["admin_token_file"], "--dashboard-interval", "0.2"], run, "serve")
        try:
            yield s, f"http://{svc.address}", svc
        finally:
            svc.stop()


@contextlib.contextmanager
def streamed_request(url: str, body: dict, path: str = "/v1/completions"):
    """POST ``body`` (a streamed request) to ``url + path`` from a thread while the ``with`` block
    runs; leaving the block closes the connection, so the server aborts the request, and waits for
    the thread."""
    import httpx

    stop = threading.Event()

    def run():
        with httpx.stream("POST", f"{url}{path}", json=body, timeout=300) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    client = threading.Thread(target=run, daemon=True)
    client.start()
    try:
        yield
    finally:
        stop.set()
        client.join(timeout=60)
