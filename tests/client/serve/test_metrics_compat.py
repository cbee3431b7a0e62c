"""Metrics of every process under one prefix, and `pagedkv serve --metrics-compat vllm`.

- The compat export against a capture of a real `vllm serve` 0.32 (tests/client/serve/data/
  vllm_0.32_metrics.txt, scripts/capture_vllm_metrics.py): every family it exports, and every one
  the dashboards need, has vLLM's type, label names and buckets. No vLLM needed.
- A known workload through a real `pagedkv serve --metrics-compat vllm` over the session's stack
  (its memory service and worker 0 with --metrics-port): the front's counters move by exactly the
  prompt and output tokens sent, under `pagedkv:` and `vllm:`; the memory service's `pagedkv:`
  names and their `pagedkv_` aliases agree; the worker's step histograms count exactly the steps
  and tokens of the engine's step trace; /metrics keeps its key rule for the vllm: names.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from conftest import pagedkv_process
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from client.engine.stats import EngineStats
from client.serve.metrics import ServeMetrics
from client.serve.metrics_vllm import one_two_five_buckets

CAPTURE = Path(__file__).parent / "data" / "vllm_0.32_metrics.txt"
#: The families a dashboard for vLLM reads, that the compat export must carry.
REQUIRED = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens",
            "vllm:generation_tokens", "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
            "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_success",
            "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"}
#: The capture's --max-model-len: its per-request token histograms' buckets come from it.
CAPTURE_MAX_MODEL_LEN = 2048
METRICS_KEY, ADMIN = "key-scraper", "key-admin"


def read_capture() -> dict[str, tuple[str, list[str], list[float]]]:
    """The capture: family name -> (type, label names, finite bucket bounds)."""
    out = {}
    for line in CAPTURE.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, kind, labels, *buckets = line.split()
        out[name] = (kind, [] if labels == "-" else labels.split(","),
                     [float(b) for b in buckets[0].split(",")] if buckets else [])
    return out


def families(text: str, prefix: str) -> dict[str, tuple[str, list[str], list[float]]]:
    """The families of a /metrics text whose names start with ``prefix`` (as :func:`read_capture`;
    prometheus_client's ``_created`` gauges left out, as in the capture)."""
    parsed = list(text_string_to_metric_families(text))
    names = {f.name for f in parsed}
    out = {}
    for f in parsed:
        if not f.name.startswith(prefix) or f.name.removesuffix("_created") in names - {f.name}:
            continue
        labels = sorted({k for s in f.samples for k in s.labels if k != "le"})
        buckets = sorted({float(s.labels["le"]) for s in f.samples if s.name.endswith("_bucket")} - {float("inf")})
        out[f.name] = (f.type, labels, buckets)
    return out


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics text: {(name, sorted labels without model_name/engine): value}."""
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


class _Backend:
    """A backend of fixed engine and pool stats (no services)."""

    def engine_stats(self):
        return EngineStats(preemptions=3)

    def stats(self):
        return SimpleNamespace(used_blocks=4, total_blocks=16, prefix_cache_queries=40, prefix_cache_hits=8)


def test_compat_families_are_vllm_s():
    capture = read_capture()
    assert REQUIRED <= set(capture)
    assert capture["vllm:request_success"][1] == ["engine", "finished_reason", "model_name"]
    text = generate_latest(ServeMetrics("smollm2", _Backend(), compat="vllm",
                                        max_model_len=CAPTURE_MAX_MODEL_LEN).registry).decode()
    ours = families(text, "vllm:")
    assert REQUIRED <= set(ours), sorted(REQUIRED - set(ours))
    for name, (kind, labels, buckets) in ours.items():
        assert name in capture, f"{name} is not a family of vllm serve"
        assert (kind, labels, buckets) == capture[name], name
    # The per-request token histograms' bounds follow vLLM's rule from the longest context.
    assert capture["vllm:request_prompt_tokens"][2] == one_two_five_buckets(CAPTURE_MAX_MODEL_LEN)
    m = samples(text)
    assert m[("vllm:kv_cache_usage_perc", ())] == m[("pagedkv:kv_cache_usage_perc", ())] == 0.25
    assert m[("vllm:num_preemptions_total", ())] == m[("pagedkv:num_preemptions_total", ())] == 3
    assert m[("vllm:prefix_cache_hits_total", ())] == 8
    assert {labels for name, labels in m if name == "vllm:request_success_total"} == {
        (("finished_reason", r),) for r in ("stop", "length", "abort", "error", "repetition")}
    # Off by default.
    plain = generate_latest(ServeMetrics("smollm2", _Backend()).registry).decode()
    assert "vllm:" not in plain and "pagedkv:prompt_tokens_total" in plain
    with pytest.raises(ValueError, match="metrics compat"):
        ServeMetrics("smollm2", _Backend(), compat="sglang")


def test_metrics_flags(monkeypatch, capsys):
    from client.serve.config import parse_args
    from compute_service.main import WorkerSpec, build_parser

    assert parse_args([]).metrics_compat == "none"
    assert parse_args(["--metrics-compat", "vllm"]).metrics_compat == "vllm"
    monkeypatch.setenv("PAGEDKV_METRICS_COMPAT", "vllm")
    assert parse_args([]).metrics_compat == "vllm"
    with pytest.raises(SystemExit):
        parse_args(["--metrics-compat", "sglang"])
    assert "--metrics-compat must be one of none, vllm" in capsys.readouterr().err
    # The worker's: off by default, from its flag or PAGEDKV_COMPUTE_METRICS_PORT, a port or 0.
    assert WorkerSpec.from_args(build_parser().parse_args([])).metrics_port is None
    monkeypatch.setenv("PAGEDKV_COMPUTE_METRICS_PORT", "9401")
    assert WorkerSpec.from_args(build_parser().parse_args([])).metrics_port == 9401
    with pytest.raises(ValueError, match="--metrics-port must lie in 0-65535"):
        WorkerSpec.from_args(build_parser().parse_args(["--metrics-port", "70000"]))


# ------------------------------------------------------------------------------------------------
# A known workload through the real processes


@pytest.fixture(scope="module")
def serve(stack, tmp_path_factory):
    """`pagedkv serve --metrics-compat vllm` over the session's memory service and worker 0, with a
    metrics key and an admin key (no tenant keys: the API is open, /metrics is not)."""
    tmp = tmp_path_factory.mktemp("serve-compat")
    svc = pagedkv_process(["serve", "--memory", stack.memory.address, "--workers", stack.worker_addresses[0],
                           "--metrics-compat", "vllm", "--metrics-api-key", METRICS_KEY, "--admin-api-key", ADMIN],
                          tmp, "serve-compat")
    yield f"http://{svc.address}"
    svc.stop()


class Scrapes:
    """The front's, the memory service's and worker 0's /metrics, and the engine's step count."""

    def __init__(self, url: str, stack):
        self.url, self.stack = url, stack

    def take(self) -> dict:
        auth = {"Authorization": f"Bearer {METRICS_KEY}"}
        mem = f"http://127.0.0.1:{self.stack.memory.info['metrics_port']}/metrics"
        worker = f"http://127.0.0.1:{self.stack.workers[0].info['metrics_port']}/metrics"
        steps = httpx.get(f"{self.url}/debug/steps", params={"since": 1 << 62},
                          headers={"Authorization": f"Bearer {ADMIN}"}).json()["step_count"]
        return {"front": httpx.get(f"{self.url}/metrics", headers=auth).text, "memory": httpx.get(mem).text,
                "worker": httpx.get(worker).text, "step": steps}

    def trace(self, since: int) -> list[dict]:
        r = httpx.get(f"{self.url}/debug/steps", params={"since": since}, headers={"Authorization": f"Bearer {ADMIN}"})
        return r.json()["steps"]


def moved(before: str, after: str):
    """``delta(name, **labels)``: how far a sample moved between two scrapes."""
    b, a = samples(before), samples(after)

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        assert key in a, f"no sample {key}"
        return a[key] - b.get(key, 0.0)

    return delta


def complete(url: str, prompt: list[int], max_tokens: int, n: int = 1) -> None:
    r = httpx.post(f"{url}/v1/completions", timeout=300, json={
        "model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "n": n, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text


def test_metrics_need_a_key_for_the_vllm_names_too(serve):
    r = httpx.get(f"{serve}/metrics")
    assert r.status_code == 401 and "vllm:" not in r.text
    r = httpx.get(f"{serve}/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"})
    assert r.status_code == 200 and REQUIRED <= set(families(r.text, "vllm:"))


def test_counters_move_by_the_workload_under_every_name(serve, stack):
    scrapes = Scrapes(serve, stack)
    # Prompts shorter than a block (16 tokens): no full block, so no prefix-cache hit, and every
    # prompt token is computed once. Two requests at once, so steps batch them.
    prompts = [[504, 3458, 282, 4649, 314, 11, 284], [1830, 253, 727, 28, 1848, 30, 339, 3000, 28]]
    outputs = [6, 4]
    before = scrapes.take()
    threads = [threading.Thread(target=complete, args=(serve, p, k)) for p, k in zip(prompts, outputs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    after = scrapes.take()
    front = moved(before["front"], after["front"])
    n, prompt_tokens, output_tokens = len(prompts), sum(map(len, prompts)), sum(outputs)
    for prefix in ("pagedkv:", "vllm:"):
        assert front(f"{prefix}prompt_tokens_total") == prompt_tokens, prefix
        assert front(f"{prefix}generation_tokens_total") == output_tokens, prefix
        assert front(f"{prefix}request_success_total", finished_reason="length") == n, prefix
        assert front(f"{prefix}time_to_first_token_seconds_count") == n, prefix
        assert front(f"{prefix}e2e_request_latency_seconds_count") == n, prefix
    assert front("pagedkv:time_per_output_token_seconds_count") == output_tokens - n
    assert front("vllm:inter_token_latency_seconds_count") == output_tokens - n
    assert front("vllm:request_time_per_output_token_seconds_count") == n
    assert front("vllm:request_success_total", finished_reason="stop") == 0
    assert front("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert front("vllm:request_generation_tokens_sum") == output_tokens
    assert front("vllm:request_num_preemptions_count") == n
    # Read at scrape from the same engine and pool: equal under both names.
    last = samples(after["front"])
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total"):
        assert last[(f"vllm:{name}", ())] == last[(f"pagedkv:{name}", ())], name

    # The memory service: every pagedkv_ alias equals its pagedkv: name; the pool's prefix-cache
    # counters moved as the front read them.
    mem = samples(after["memory"])
    aliases = {k: v for k, v in mem.items() if k[0].startswith("pagedkv_")}
    assert len(aliases) > 20 and all(mem[("pagedkv:" + k[0].removeprefix("pagedkv_"), k[1])] == v
                                     for k, v in aliases.items())
    memory = moved(before["memory"], after["memory"])
    queried = front("pagedkv:prefix_cache_queries_total")
    assert memory("pagedkv:prefix_cache_queries_total") == memory("pagedkv_prefix_cache_queries_total") == queried
    assert memory("pagedkv:prefix_cache_hits_total") == 0

    # Worker 0 ran every step of the engine: one Step each, with the trace's tokens and batch.
    trace = scrapes.trace(before["step"])
    assert len(trace) == after["step"] - before["step"] > 0
    worker = moved(before["worker"], after["worker"])
    assert worker("pagedkv:worker_step_seconds_count") == len(trace)
    assert worker("pagedkv:worker_model_seconds_count") == worker("pagedkv:worker_attention_seconds_count") \
        == len(trace)  # every step ran a forward on a CPU pool
    assert worker("pagedkv:worker_step_tokens_sum") == sum(t["num_tokens"] for t in trace) \
        == prompt_tokens + output_tokens - n  # each prompt once, each output token but the last fed back
    assert worker("pagedkv:worker_batch_size_sum") == sum(len(t["request_ids"]) for t in trace)
    assert max(len(t["request_ids"]) for t in trace) == 2  # they were batched
    assert worker("pagedkv:worker_copies_total", kind="cow") == 0


def test_forked_samples_copy_on_write_on_the_worker(serve, stack):
    """n = 2 over a prompt that ends inside a block: the two samples share that block after the
    fork, so the first append into it copies it once on the worker (copy-on-write)."""
    scrapes = Scrapes(serve, stack)
    before = scrapes.take()
    complete(serve, [504, 3458, 282, 4649, 314], 3, n=2)
    after = scrapes.take()
    worker = moved(before["worker"], after["worker"])
    assert worker("pagedkv:worker_copies_total", kind="cow") == 1
    assert worker("pagedkv:worker_step_seconds_count") == after["step"] - before["step"]
    front = moved(before["front"], after["front"])
    for prefix in ("pagedkv:", "vllm:"):  # one request: its prompt once, both samples' tokens
        assert front(f"{prefix}prompt_tokens_total") == 5 and front(f"{prefix}generation_tokens_total") == 6
        assert front(f"{prefix}request_success_total", finished_reason="length") == 1
