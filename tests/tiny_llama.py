"""A tiny random Llama written by transformers (``save_pretrained``) with SmolLM2's tokenizer, and
a step-by-step greedy reference over it, for the tests that run generation through the services.

Hidden 64, 2 layers, SmolLM2's 49152-token vocabulary, an untied head. The weights are drawn
wide (embedding and head std 1, linear layers std 0.1) so that the logits are decisive (the
top two differ by far more than float32 rounding) and greedy text neither repeats one token nor
is flat: transformers' and our model agree on every greedy token.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

#: The tiny model's shape (transformers' LlamaConfig arguments).
CONFIG = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
              bos_token_id=1)
#: A prompt the tiny model (seed 0) continues by repeating its last two tokens (381, 34907), unpenalised:
#: six tokens and the model's own greedy continuation of them.
CYCLE_PROMPT = [1, 504, 3458, 282, 4649, 314, 26940, 9688, 32519, 8849, 35754, 41631, 6047, 4599, 21497, 34176,
                13795, 31934, 29912, 30714, 381, 34907]


def make_tiny_llama(path: Path, seed: int = 0):
    """Write the tiny Llama (config.json, generation_config.json, model.safetensors, tokenizer) to
    ``path``; returns the transformers model (fp32, eval)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from client.tokenizer import load_tokenizer

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 1.0 if ("embed" in name or "lm_head" in name) else 0.1)
    model.save_pretrained(path)
    load_tokenizer("smollm2").save_pretrained(path)
    return model


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
