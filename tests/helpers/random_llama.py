"""A small seeded random Llama built in memory (no files): GQA 4:2, head_dim 16, two layers.

For tests that compare two paths of our own model on the same weights (native vs torch ops, a
CUDA graph's padded decode vs an eager step); comparisons with transformers use
``helpers.tiny_llama`` instead.
"""

from __future__ import annotations

import torch

from compute_service.model.llama import LlamaForPagedLM
from compute_service.weights.source import ModelConfig


def random_llama(dtype: torch.dtype = torch.float32, seed: int = 0, vocab: int = 128,
                 max_positions: int = 256) -> LlamaForPagedLM:
    """The model on the CPU in ``dtype``: hidden 64, SwiGLU 96, 4 query and 2 KV heads of 16, tied
    embeddings, weights N(0, 0.2) (norms N(0, 1)) from generator seed ``seed``."""
    c = ModelConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_layers=2, num_q_heads=4, num_kv_heads=2,
        head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=max_positions,
        tie_word_embeddings=True, bos_token_id=None, eos_token_ids=(), name="tiny", source="test",
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    shapes = {"embed": (vocab, 64), "norm": (64,)}
    for i in range(2):
        shapes |= {f"layers.{i}.{k}": s for k, s in {
            "attn_norm": (64,), "wq": (64, 64), "wk": (32, 64), "wv": (32, 64), "wo": (64, 64),
            "mlp_norm": (64,), "w_gate": (96, 64), "w_up": (96, 64), "w_down": (64, 96)}.items()}  # fmt: skip
    weights = {k: torch.randn(s, generator=g) * (1.0 if len(s) == 1 else 0.2) for k, s in shapes.items()}
    return LlamaForPagedLM(c, weights, dtype=dtype)
