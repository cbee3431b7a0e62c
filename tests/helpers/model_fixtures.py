"""Shared fixtures and helpers for the model tests: the SmolLM2 GGUF, the transformers reference,
our paged model, and a tiny paged-cache driver (block tables; its step inputs come from the
worker's own `build_step_inputs`) for tests.

tests/conftest.py registers the fixtures once for the whole session (one transformers model, one
loaded GGUF); test modules import only the helpers.
"""

from __future__ import annotations

import inspect
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from compute_service.model.llama import LlamaForPagedLM
from compute_service.step_inputs import build_step_inputs
from compute_service.weights.source import SMOLLM2_GGUF, load_model_source, smollm2_gguf_path
from pagedkv.compute.v1 import compute_service_pb2 as pb

PROMPT = "What is the capital of France?"


@pytest.fixture(scope="session")
def gguf_dir() -> Path:
    return smollm2_gguf_path().parent


def private_home(path: Path, shared: tuple[str, ...] = ("weights", "tokenizers", "kernels")) -> Path:
    """A fresh ``$PAGEDKV_HOME`` at ``path`` (its own state file and admin token) that shares the
    default home's ``shared`` caches (weights, tokenizers, compiled kernels), so the services it
    starts load in seconds and no kernel library is compiled twice."""
    path.mkdir(parents=True, exist_ok=True)
    default_home = Path(os.environ.get("PAGEDKV_HOME") or Path.home() / ".cache" / "pagedkv")
    for sub in shared:
        (default_home / sub).mkdir(parents=True, exist_ok=True)
        (path / sub).symlink_to(default_home / sub)
    return path


@pytest.fixture(scope="session")
def pagedkv_home(tmp_path_factory) -> Path:
    """A private $PAGEDKV_HOME for the session's dequantized-weights cache (services started after
    :func:`ours` use it too); tokenizers and compiled kernels are the default home's."""
    return private_home(tmp_path_factory.mktemp("pagedkv_home"), shared=("tokenizers", "kernels"))


@pytest.fixture(scope="session")
def ours(pagedkv_home):
    """(config, weights, model) from our GGUF loader, cached under `pagedkv_home`."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PAGEDKV_HOME", str(pagedkv_home))
    config, weights = load_model_source("smollm2")
    yield config, weights, LlamaForPagedLM(config, weights, "cpu", torch.float32)
    mp.undo()


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)


@pytest.fixture(scope="session")
def hf_model(gguf_dir):
    """transformers' own LlamaForCausalLM read from the GGUF (the correctness reference)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    return m.eval()


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )


@torch.inference_mode()
def hf_greedy(model, ids: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decode with a dense cache: (steps + 1 tokens, logits [steps + 1, vocab] fp32)."""
    # transformers 5 renamed past_key_values to cache
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=torch.tensor([ids]), use_cache=True)
    logits, tokens = [out.logits[0, -1].float()], []
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        out = model(input_ids=torch.tensor([[tokens[-1]]]), use_cache=True, **{key: out[key]})
        logits.append(out.logits[0, -1].float())
    tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


@dataclass
class PagedCache:
    """Test driver: an in-process pool tensor and scattered block tables, one step at a time."""

    model: LlamaForPagedLM
    num_blocks: int = 96
    block_size: int = 16
    seed: int = 0
    pool: torch.Tensor = field(init=False)
    free: list[int] = field(init=False)
    tables: dict[int, list[int]] = field(default_factory=dict)
    lens: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        c = self.model.config
        # NaN in every unused slot: attention must never read past a sequence's context.
        self.pool = torch.full(
            (self.num_blocks, c.num_layers, 2, self.block_size, c.num_kv_heads, c.head_dim),
            float("nan"),
        )
        self.free = list(range(self.num_blocks))
        random.Random(self.seed).shuffle(self.free)

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run one forward with `chunks[seq] = new token ids`; returns each seq's last logits."""
        request = pb.StepRequest()
        for seq, toks in chunks.items():
            start = self.lens.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < start + len(toks):
                table.append(self.free.pop())
            request.sequences.append(pb.StepSequence(
                seq_id=seq, token_ids=toks, positions=range(start, start + len(toks)), block_ids=table))
            self.lens[seq] = start + len(toks)
        inputs = build_step_inputs(request, block_size=self.block_size, num_blocks=self.num_blocks,
                                   vocab_size=self.model.config.vocab_size, device=self.model.device)
        logits = self.model(*inputs.model_args(self.pool))
        return {s: logits[r] for r, s in enumerate(chunks)}
