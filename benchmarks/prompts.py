"""Benchmark prompts: token windows of a fixed English text, with lengths drawn from a trace.

Prompts are cut from ``benchmarks/corpus.txt`` (a frozen copy of the project's README and docs,
so that editing the docs does not change the benchmarks' prompts) at random offsets to the drawn
length: every request has different content and an exact prompt length.
"""

from __future__ import annotations

import random

from common import ROOT, lengths

CORPUS = ROOT / "benchmarks" / "corpus.txt"


def corpus_ids(tokenizer) -> list[int]:
    """Token ids of ``benchmarks/corpus.txt``."""
    return tokenizer.encode(CORPUS.read_text())


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
