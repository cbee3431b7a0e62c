"""Shared fixtures and helpers for the model tests: the SmolLM2 GGUF, the transformers reference,
our paged model, and a tiny paged-cache driver (block tables; its step inputs come from the
worker's own `build_step_inputs`) for tests.

tests/conftest.py registers the fixtures once for the whole session (one transformers model, one
loaded GGUF); test modules import only the helpers.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import shutil
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


#: The home the suite started with (read at import: :func:`ours` points PAGEDKV_HOME elsewhere later).
DEFAULT_HOME = Path(os.environ.get("PAGEDKV_HOME") or Path.home() / ".cache" / "pagedkv")


def private_home(path: Path, shared: tuple[str, ...] = ("weights", "tokenizers", "kernels")) -> Path:
    """A fresh ``$PAGEDKV_HOME`` at ``path`` (its own state file and admin token) that shares the
    default home's ``shared`` caches (weights, tokenizers, compiled kernels), so the services it
    starts load in seconds and no kernel library is compiled twice."""
    path.mkdir(parents=True, exist_ok=True)
    for sub in shared:
        (DEFAULT_HOME / sub).mkdir(parents=True, exist_ok=True)
        (path / sub).symlink_to(DEFAULT_HOME / sub)
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


def _save_unquantized(model, path: Path) -> None:
    """Save ``model`` (read from a GGUF, its weights already dequantized) as a plain transformers
    checkpoint: its config without the GGUF quantization entry, and its tensors (tied ones once)."""
    from safetensors.torch import save_model

    path.mkdir(parents=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (path / "config.json").write_text(json.dumps(config))
    save_model(model, str(path / "model.safetensors"))


@pytest.fixture(scope="session")
def hf_model(gguf_dir):
    """transformers' own LlamaForCausalLM read from the GGUF (the correctness reference).

    transformers' GGUF reader takes about 20 s on a small CPU (it parses the file twice), so its
    result is kept as transformers saves it, under the default home's ``reference/`` folder keyed by
    the GGUF's digest and transformers' version, and read back from there by later runs."""
    import hashlib

    import transformers
    from transformers import AutoModelForCausalLM

    gguf = gguf_dir / SMOLLM2_GGUF
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()[:16]
    saved = DEFAULT_HOME / "reference" / f"{gguf.stem}-{digest}-transformers-{transformers.__version__}"
    if not (saved / "config.json").exists():
        m = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
        tmp = saved.with_name(f"{saved.name}.{os.getpid()}.tmp")
        _save_unquantized(m, tmp)
        if saved.exists():  # another run saved it meanwhile
            shutil.rmtree(tmp)
        else:
            tmp.replace(saved)
        return m.eval()
    return AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()


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


#: Chats the client and serve tests generate from (greedy, compared with :func:`hf_greedy_tokens`).
CHATS = [
    "What is the capital of France?",
    "Write a haiku about memory.",
    "List three prime numbers.",
    "Explain in one sentence what a block table is in an operating system's paging.",
]
#: (model, prompt, tokens) -> transformers' greedy continuation: the session's references, made once.
_GREEDY_TOKENS: dict[tuple[int, tuple[int, ...], int], list[int]] = {}


@torch.inference_mode()
def hf_greedy_tokens(model, ids: list[int], max_new: int) -> list[int]:
    """transformers' own greedy ``generate`` of up to ``max_new`` tokens after ``ids`` (stopping at
    EOS), the reference. Memoized for the session: a shorter request is the front of a longer one
    made before (greedy does not look ahead)."""
    prompt = tuple(ids)
    for (m, p, n), tokens in _GREEDY_TOKENS.items():
        if m == id(model) and p == prompt and n >= max_new:
            return tokens[:max_new]
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, pad_token_id=2)
    _GREEDY_TOKENS[(id(model), prompt, max_new)] = tokens = out[0, len(ids):].tolist()
    return list(tokens)


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
