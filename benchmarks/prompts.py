"""Benchmark prompts: token windows of the project's own docs, with lengths drawn from a trace.

Prompts are real English text (README.md and docs/*.md, tokenized once) cut at random offsets to
the drawn length, so every request has different content and an exact prompt length.
"""

from __future__ import annotations

import random

from common import ROOT, lengths


def corpus_ids(tokenizer) -> list[int]:
    """Token ids of README.md followed by docs/*.md (sorted)."""
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    text = "\n\n".join(p.read_text() for p in paths if p.exists())
    return tokenizer.encode(text)


def trace_prompts(tokenizer, dataset: str, n: int, seed: int, scale: float = 1.0,
                  max_prompt: int = 512, max_output: int = 512) -> list[tuple[list[int], int]]:
    """``n`` (prompt token ids, output tokens) with the dataset's length shape, scaled by ``scale``.

    Lengths are log-normal with the dataset's means (``common.DATASETS``) times ``scale``, each
    capped (``max_prompt``, ``max_output``) and at least 4 prompt / 2 output tokens.
    """
    rng = random.Random(seed)
    ids = corpus_ids(tokenizer)
    out = []
    for p, o in lengths(dataset, n, rng):
        p = min(max_prompt, max(4, round(p * scale)))
        o = min(max_output, max(2, round(o * scale)))
        p = min(p, len(ids) - 1)
        start = rng.randrange(0, len(ids) - p)
        out.append((ids[start:start + p], o))
    return out
