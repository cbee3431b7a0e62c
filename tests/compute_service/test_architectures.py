"""Every supported architecture against transformers (fp32), through our loader and the real services.

For each of Llama (Llama 3's RoPE scaling; `attention_bias` and `mlp_bias`, so q/k/v/o and MLP
biases), Mistral (a sliding window of `WINDOW` tokens, run to just inside it), Qwen2 with tied and
with untied embeddings (q/k/v biases), a tiny random model is made here with transformers
(`AutoModelForCausalLM.from_config` under a fixed seed, `save_pretrained`, SmolLM2's tokenizer
beside it). The weights are drawn with `initializer_range` `INIT` and random biases and norm
weights (transformers starts those at 0 and 1), so that the logits are decisive: every greedy step
compared has a top-2 margin of at least `MIN_MARGIN` (checked), far above the `ATOL` on logits.

- Our loader: logits within `ATOL` of transformers' at every position after the prompt, and the
  greedy tokens of transformers' `generate`.
- The services (one `LocalStack` per model, started together): the Client's greedy tokens equal
  `generate`'s; a Step that reaches the window is refused with INVALID_ARGUMENT and writes nothing.
- An unsupported architecture (Qwen3) is refused at start by the worker and the memory service,
  with its name.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers.model_fixtures import PagedCache
from test_worker_grpc import Driver

from client.ops.stack import LocalStack
from compute_service.model.llama import LlamaForPagedLM
from compute_service.weights.source import load_model_source
from pagedkv.compute.v1 import compute_service_pb2 as cpb
from pagedkv.memory.v1 import memory_service_pb2 as mpb

ROOT = Path(__file__).resolve().parents[2]
ATOL = 1e-4
MIN_MARGIN = 1e-2
INIT = 0.25
WINDOW = 24
PROMPT_LEN = 12
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
#: name -> (transformers config class, its arguments beyond the shared shape, expected biases of layer 0)
SPECS = {
    "llama": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False,
                              "rope_parameters": LLAMA3_ROPE},
              {"bq", "bk", "bv", "bo", "b_gate", "b_up", "b_down"}),
    "mistral": ("MistralConfig", {"sliding_window": WINDOW, "tie_word_embeddings": False}, set()),
    "qwen2_tied": ("Qwen2Config", {"tie_word_embeddings": True}, {"bq", "bk", "bv"}),
    "qwen2_untied": ("Qwen2Config", {"tie_word_embeddings": False}, {"bq", "bk", "bv"}),
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2_tied": "Qwen2ForCausalLM",
                 "qwen2_untied": "Qwen2ForCausalLM"}


@dataclass
class TinyModel:
    """A random model saved in `path`, with transformers' greedy run from `prompt` (fp32)."""

    path: Path
    hf: torch.nn.Module
    prompt: list[int]  # PROMPT_LEN token ids
    generated: list[int]  # generate()'s new tokens: prompt + generated fills WINDOW positions
    logits: torch.Tensor  # [len(generated), vocab]: after the prompt, then after each generated token


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from pagedkv.model.tokenizer import load_tokenizer

    path = tmp_path_factory.mktemp("smollm2_tokenizer")
    load_tokenizer("smollm2").save_pretrained(path)
    return path


def make_model(name: str, root: Path, tokenizer_dir: Path) -> TinyModel:
    import transformers
    from transformers import AutoModelForCausalLM

    cls, extra, _ = SPECS[name]
    vocab = len(transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    config = getattr(transformers, cls)(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=INIT, **extra)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in n:
                p.normal_(1.0, 0.2)
    path = root / name
    hf.save_pretrained(path)
    for f in tokenizer_dir.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    prompt = torch.randint(0, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=WINDOW - PROMPT_LEN, do_sample=False)[0].tolist()
        logits = hf(input_ids=torch.tensor([out])).logits[0, PROMPT_LEN - 1 :].float()
    return TinyModel(path, hf, prompt, out[PROMPT_LEN:], logits)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_dir) -> dict[str, TinyModel]:
    root = tmp_path_factory.mktemp("architectures")
    return {name: make_model(name, root, tokenizer_dir) for name in SPECS}


@pytest.fixture(scope="module")
def stacks(models, tmp_path_factory):
    """One started LocalStack per model (a memory service of 32 blocks of 4 tokens and a worker)."""
    run = tmp_path_factory.mktemp("stacks")

    def start(name: str) -> LocalStack:
        args = ["--num-blocks", "32", "--block-size", "4", "--admin-token-file", str(run / f"{name}.admin-token")]
        return LocalStack(args, model=str(models[name].path), run_dir=run, name=name, cwd=ROOT, timeout=120).start()

    with ThreadPoolExecutor(len(models)) as pool:
        futures = {name: pool.submit(start, name) for name in models}
        started = {}
        try:
            for name, f in futures.items():
                started[name] = f.result()
            yield started
        finally:
            for f in futures.values():
                if f.exception() is None:
                    pool.submit(f.result().stop)


@pytest.mark.parametrize("name", list(SPECS))
def test_loader_matches_transformers(models, name):
    m = models[name]
    config, weights = load_model_source(str(m.path))
    assert config.architecture == ARCHITECTURES[name]
    assert config.sliding_window == (WINDOW if name == "mistral" else None)
    assert config.tie_word_embeddings == (name == "qwen2_tied") and ("lm_head" in weights) == (name != "qwen2_tied")
    biases = {"bq", "bk", "bv", "bo", "b_gate", "b_up", "b_down"}
    assert {b for b in biases if f"layers.0.{b}" in weights} == SPECS[name][2]
    model = LlamaForPagedLM(config, weights)
    top2 = m.logits.topk(2, dim=-1).values
    margin = float((top2[:, 0] - top2[:, 1]).min())
    assert margin >= MIN_MARGIN, f"the reference's greedy steps are not decisive (margin {margin:.3g})"
    cache = PagedCache(model, num_blocks=16, block_size=4, seed=3)
    tokens = m.prompt + m.generated  # WINDOW tokens: positions 0 .. WINDOW - 1
    got = [cache.step({0: m.prompt})[0]] + [cache.step({0: [t]})[0] for t in m.generated]
    got = torch.stack(got)
    torch.testing.assert_close(got, m.logits, atol=ATOL, rtol=0, msg=lambda s: f"{name}: {s}")
    assert got[:-1].argmax(-1).tolist() == m.generated
    assert len(tokens) == WINDOW


@pytest.mark.parametrize("name", list(SPECS))
def test_services_generate_like_transformers(models, stacks, name):
    from client.api import Client
    from client.params import SamplingParams

    m, stack = models[name], stacks[name]
    with Client(stack.memory_address, stack.worker_addresses, max_model_len=WINDOW) as client:
        info = client.workers[0].model_info()
        assert info.architecture == ARCHITECTURES[name]
        assert info.sliding_window == (WINDOW if name == "mistral" else 0)
        params = SamplingParams(temperature=0.0, max_tokens=len(m.generated), ignore_eos=True)
        (out,) = client.generate([m.prompt], params)
    assert out.outputs[0].token_ids == m.generated, name


def test_window_limits_the_context_at_start(stacks):
    """A client of a windowed model serves within the window by default and refuses a longer
    --max-model-len at start, naming the window; leases stay untouched."""
    from client.api import Client

    stack = stacks["mistral"]
    with Client(stack.memory_address, stack.worker_addresses) as client:
        assert client.engine.max_context == WINDOW
    with pytest.raises(ValueError, match=f"exceeds the model's sliding window of {WINDOW} tokens"):
        Client(stack.memory_address, stack.worker_addresses, max_model_len=WINDOW + 1)
    driver = Driver(stack)
    try:
        assert driver.mem.GetStats(mpb.GetStatsRequest()).num_leases == 1  # the driver's own only
    finally:
        driver.close()


def test_a_sequence_past_the_window_is_refused_alone_and_writes_nothing(stacks):
    from google.rpc import code_pb2

    from compute_service.pool_map import map_pool

    stack = stacks["mistral"]
    driver = Driver(stack)
    pool = map_pool(driver.pool)
    try:
        seq, other = driver.allocate(WINDOW + 1), driver.allocate(3)
        before = pool.tensor.clone()

        def sequence(s, n):
            return cpb.StepSequence(seq_id=s, token_ids=[7] * n, positions=range(n), block_ids=driver.tables[s],
                                    grant=driver.grants[s])

        req = cpb.StepRequest(pool_generation=driver.pool.generation, sequences=[sequence(seq, WINDOW + 1),
                                                                                  sequence(other, 3)])
        refused, computed = driver.workers[0].Step(req).results
        assert refused.seq_id == seq and refused.error.code == code_pb2.INVALID_ARGUMENT
        assert f"sliding window of {WINDOW} tokens" in refused.error.message
        assert not refused.HasField("token_id") and not refused.HasField("receipt")
        assert computed.seq_id == other and computed.HasField("token_id") and not computed.HasField("error")
        assert computed.receipt.end == 3
        mine, theirs = driver.tables[seq], driver.tables[other]
        assert torch.equal(pool.tensor[mine], before[mine]), "a refused sequence was written"
        assert not torch.equal(pool.tensor[theirs], before[theirs])
        # The same sequence up to the last position inside the window is computed and written.
        req = cpb.StepRequest(pool_generation=driver.pool.generation, sequences=[sequence(seq, WINDOW)])
        assert driver.workers[0].Step(req).results[0].HasField("token_id")
        assert not torch.equal(pool.tensor[mine], before[mine])
    finally:
        pool.close()
        driver.close()


def test_unsupported_architecture_is_refused_at_start(tmp_path):
    """Qwen3 (not supported) is refused by the worker and by the memory service, named, exit code 2."""
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 256, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cli = [sys.executable, "-m", "client.ops.cli"]
    procs = {
        "compute": subprocess.Popen([*cli, "compute", "--model", str(tmp_path), "--memory", "127.0.0.1:9",
                                     "--memory-timeout", "60", "--port", "0"], cwd=ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True),
        "memory": subprocess.Popen([*cli, "memory", "--model", str(tmp_path), "--num-blocks", "8", "--port", "0",
                                    "--admin-token-file", str(tmp_path / "admin-token")], cwd=ROOT,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
    }
    for service, p in procs.items():
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 2, f"{service}: exit code {p.returncode}\n{out[-2000:]}"
        assert "Qwen3ForCausalLM" in out and "not supported" in out, f"{service}:\n{out[-2000:]}"
