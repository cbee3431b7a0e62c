"""A tiny random Llama written by transformers (``save_pretrained``) with SmolLM2's tokenizer, and
a step-by-step greedy reference over it, for the tests that run generation through the services.

Hidden 64, 2 layers, SmolLM2's 49152-token vocabulary, an untied head. The weights are drawn
from their own generator (embedding std 1, every other matrix std 0.1, norms 1): the top two
logits differ by far more than float32 rounding (> 0.01 on these prompts), so transformers' and
our model agree on every greedy token, and greedy text does not repeat itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

#: The tiny model's shape (transformers' LlamaConfig arguments).
CONFIG = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
              bos_token_id=1)
#: Six token ids to start from (beginning-of-sequence, then five arbitrary ones).
BASE_PROMPT = [1, 25077, 4047, 22741, 42711, 40640]


def make_tiny_llama(path: Path, seed: int = 0):
    """Write the tiny Llama (config.json, generation_config.json, model.safetensors, tokenizer) to
    ``path``; returns the transformers model (fp32, eval)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedkv.model.tokenizer import load_tokenizer

    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    g = torch.Generator().manual_seed(seed)  # the weights do not depend on transformers' own init
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 1.0 if "embed" in name else 0.1, generator=g)
    model.save_pretrained(path)
    load_tokenizer("smollm2").save_pretrained(path)
    return model


def echo_prompt(model) -> list[int]:
    """A prompt that holds the model's own greedy continuation of BASE_PROMPT at its front, then
    BASE_PROMPT again: unpenalised, greedy repeats tokens of the prompt (so a repetition penalty
    changes what it picks)."""
    return [BASE_PROMPT[0], *reference_greedy(model, BASE_PROMPT, 8), *BASE_PROMPT[1:]]


def set_json(path: Path, name: str, **values) -> None:
    """Set keys of ``path/name`` (a JSON object; created when absent)."""
    f = path / name
    d = json.loads(f.read_text()) if f.exists() else {}
    d.update(values)
    f.write_text(json.dumps(d, indent=2))


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], steps: int, *, repetition_penalty: float = 1.0,
                     presence_penalty: float = 0.0, frequency_penalty: float = 0.0) -> list[int]:
    """Greedy tokens of the transformers ``model`` with vLLM's penalties applied by hand, in
    float64, one vocabulary entry at a time over the tokens seen so far (no cache: the whole
    sequence is run again at every step)."""
    tokens = list(prompt)
    out: list[int] = []
    for _ in range(steps):
        logits = model(input_ids=torch.tensor([tokens])).logits[0, -1].double().tolist()
        counts: dict[int, int] = {}
        for t in out:
            counts[t] = counts.get(t, 0) + 1
        seen = set(prompt) | set(out)
        for v in seen:
            x = logits[v]
            logits[v] = x / repetition_penalty if x > 0 else x * repetition_penalty
        for v, c in counts.items():
            logits[v] -= frequency_penalty * c + presence_penalty
        best = max(range(len(logits)), key=logits.__getitem__)
        tokens.append(best)
        out.append(best)
    return out
