"""Shared fixtures: real service processes on free ports."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

# Session fixtures shared by every module: one reference model and one loaded GGUF per run.
from model_fixtures import gguf_dir, hf_model, hf_tokenizer, ours, pagedkv_home  # noqa: F401

from client import launcher

ROOT = Path(__file__).resolve().parent.parent


def pagedkv_process(args: list[str], tmp: Path, name: str, env: dict | None = None, timeout: float = 120.0,
                    port: int = 0) -> launcher.ServiceProcess:
    """``pagedkv <args>`` on ``port`` (0: a free one) as its own process, logging under ``tmp``."""
    return launcher.ServiceProcess.pagedkv(args, tmp, name, port=port, env=env, timeout=timeout, cwd=ROOT)


@pytest.fixture
def start_service(tmp_path):
    """Factory: ``start_service(["memory", "--num-blocks", "64"], name="memory")``; stopped at teardown."""
    started: list[launcher.ServiceProcess] = []

    def start(args: list[str], name: str = "service", env: dict | None = None) -> launcher.ServiceProcess:
        svc = pagedkv_process(args, tmp_path, f"{name}{len(started)}", env)
        started.append(svc)
        return svc

    yield start
    for svc in started:
        svc.stop()


@pytest.fixture(scope="module")
def memory_service(tmp_path_factory):
    """One memory service for a test module: 64 blocks of 4 tokens, SmolLM2 layout."""
    svc = pagedkv_process(
        ["memory", "--num-blocks", "64", "--block-size", "4", "--lease-ttl", "30"],
        tmp_path_factory.mktemp("memory"), "memory",
    )
    yield svc
    svc.stop()


@pytest.fixture
def memory_stub(memory_service):
    from pagedkv.memory.v1 import memory_service_pb2_grpc as pb_grpc

    with grpc.insecure_channel(memory_service.address) as channel:
        yield pb_grpc.MemoryServiceStub(channel)


class Stack:
    """A memory service and one or more workers as separate processes."""

    def __init__(self, tmp: Path, memory_args: list[str], num_workers: int = 1, name: str = "stack"):
        self.memory = pagedkv_process(["memory", *memory_args], tmp, f"{name}-memory")
        self.workers: list[launcher.ServiceProcess] = []
        try:
            for i in range(num_workers):
                self.workers.append(pagedkv_process(["compute", "--memory", self.memory.address], tmp, f"{name}-worker{i}"))
        except Exception:
            self.stop()
            raise

    @property
    def worker_addresses(self) -> list[str]:
        return [w.address for w in self.workers]

    def stop(self) -> None:
        for w in self.workers:
            w.stop()
        self.memory.stop()


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    """Memory service (512 blocks of 16 tokens, SmolLM2 layout) + two workers mapping its pool."""
    s = Stack(tmp_path_factory.mktemp("stack"), ["--num-blocks", "512", "--block-size", "16", "--lease-ttl", "30"], num_workers=2)
    yield s
    s.stop()
