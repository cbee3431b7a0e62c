"""Repetition, presence and frequency penalties on the logits, batched (vLLM's semantics).

Follows ``apply_penalties`` of vLLM (vllm/model_executor/layers/utils.py), per row r and vocabulary
entry v, with ``in_prompt``/``in_output`` whether v occurs in the row's prompt / generated tokens
and ``count`` how often it occurs among the generated ones::

    if in_prompt or in_output:                                    (repetition, CTRL, Keskar et al. 2019)
        logit = logit / repetition_penalty   if logit > 0
                logit * repetition_penalty   otherwise
    logit -= frequency_penalty * count                            (OpenAI's definition)
    logit -= presence_penalty * (count > 0)

The worker keeps no history between steps (DESIGN.md): each step carries, for every sequence whose
sampling sets a penalty, its prompt and generated tokens (``StepSequence.prompt_token_ids`` /
``output_token_ids``), checked by ``compute_service.step_inputs`` and held here as a
:class:`TokenHistory`. Counts come from one ``scatter_add_`` over the padded ids of the rows that
have penalties (no loop over tokens in Python).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class TokenHistory:
    """Prompt and generated token ids of the sampled rows that set a penalty.

    ``rows[i]`` is a row of the sampler's logits (an index among the step's sampled sequences);
    ``prompt[i]`` / ``output[i]`` are its token ids, int64, each in [0, vocab). ``prompt[i]`` is
    empty unless the row sets a repetition penalty (only that penalty reads the prompt).
    """

    rows: list[int]  # [P] sampler row of each penalised sequence, ascending
    prompt: list[np.ndarray]  # [P] int64 arrays, the prompt's token ids
    output: list[np.ndarray]  # [P] int64 arrays, the generated token ids so far

    def __post_init__(self) -> None:
        assert len(self.rows) == len(self.prompt) == len(self.output), "one history per penalised row"


def _padded(ids: Sequence[np.ndarray], pad: int, device: torch.device) -> torch.Tensor:
    """[P, max(len)] int64 on ``device``: each row's ids, then ``pad`` (at least one column)."""
    width = max(1, max((len(a) for a in ids), default=0))
    out = np.full((len(ids), width), pad, dtype=np.int64)
    for r, a in enumerate(ids):
        out[r, : len(a)] = a
    return torch.from_numpy(out).to(device)


def bin_counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Occurrences of each vocabulary entry per row: ids [P, L] int64 in [0, vocab_size], where
    ``vocab_size`` is padding; returns [P, vocab_size] int32 (vLLM's ``get_token_bin_counts_and_mask``,
    in int32: half the memory of its int64 counts, which a sequence never fills)."""
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.int32, device=ids.device))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: torch.Tensor,
    output_ids: torch.Tensor,
    repetition_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
) -> torch.Tensor:
    """The penalised logits (the module's formula); ``logits`` is not changed.

    Args:
        logits: [P, V] float32.
        prompt_ids: [P, Lp] int64 in [0, V]; V pads a row.
        output_ids: [P, Lo] int64 in [0, V]; V pads a row.
        repetition_penalty: [P] float32 > 0 (1 = off).
        presence_penalty: [P] float32 (0 = off).
        frequency_penalty: [P] float32 (0 = off).

    Returns [P, V] float32 on ``logits``' device: -inf where ``logits`` is -inf (a token the
    bitmask or min_tokens forbids: `compute_service.logits_processors`), finite elsewhere (an
    overflow is clamped to float32's largest magnitude).
    """
    vocab = logits.shape[1]
    out_counts = bin_counts(output_ids, vocab)  # [P, V]
    seen = out_counts > 0
    seen_any = seen | (bin_counts(prompt_ids, vocab) > 0)
    rep = repetition_penalty[:, None].expand_as(logits)
    x = torch.where(seen_any, torch.where(logits > 0, logits / rep, logits * rep), logits)
    x = x - frequency_penalty[:, None] * out_counts.to(x.dtype)
    x = x - presence_penalty[:, None] * seen.to(x.dtype)
    # A tiny repetition penalty overflows float32 (logit / penalty): keep the row finite, its order
    # kept up to ties among the overflowed entries, so the sampler never sees inf - inf.
    big = torch.finfo(x.dtype).max
    return x.clamp_(min=-big, max=big).masked_fill_(torch.isneginf(logits), float("-inf"))


def penalised(logits: torch.Tensor, params: Sequence, history: TokenHistory) -> torch.Tensor:
    """``logits`` [S, V] float32 with each penalised row of ``history`` penalised by its
    ``params[row]`` (``compute_service.sampling.SamplingParams``); a new tensor, the others' rows
    unchanged."""
    if not history.rows:
        return logits
    dev, vocab = logits.device, logits.shape[1]
    idx = torch.tensor(history.rows, dtype=torch.int64, device=dev)
    ps = [params[r] for r in history.rows]

    def col(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in ps], dtype=torch.float32, device=dev)

    rows = apply_penalties(
        logits.index_select(0, idx), _padded(history.prompt, vocab, dev), _padded(history.output, vocab, dev),
        col("repetition_penalty"), col("presence_penalty"), col("frequency_penalty"),
    )  # fmt: skip
    return logits.index_copy(0, idx, rows)
