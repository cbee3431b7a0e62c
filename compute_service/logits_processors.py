"""What the worker does to a sampled row's logits before the penalties, and min-p after temperature.

Order as vLLM v1 (the model runner's structured-output bitmask, then vllm/v1/sample/sampler.py and
its built-in logits processors in vllm/v1/sample/logits_processor/builtin.py), per row::

    token bitmask     a token the sequence's grammar does not allow: -inf      (structured output)
    min_tokens        while output position t < min_tokens: min_tokens_stop_ids -inf
                      (unless that leaves no token allowed: then they stay)
    logit_bias        logit += bias, per listed token                              (OpenAI's logit_bias)
    -> penalties (compute_service.penalties) -> greedy's argmax, or temperature ->
    min_p             drop p < min_p * max(p), p = softmax(logits / temperature)  (argmax-invariant)
    -> top-k -> top-p (compute_service.sampling.filtered_probs)

The worker keeps no state between steps (DESIGN.md): the bitmask comes with each step
(``StepSequence.token_bitmask``, read by `compute_service.step_sampling` into a :class:`TokenMasks`),
min_tokens compares the step's ``output_index`` with the request's min_tokens, and the ids it
suppresses (``min_tokens_stop_ids``: the model's EOS and the request's stop ids, vLLM's
``all_stop_token_ids``) are sent by the client. Where vLLM would leave a row with every token at
-inf (a grammar that allows only EOS before min_tokens), min_tokens yields to the grammar.

Every step is batched over the rows that use a feature (one ``index_put_`` or ``masked_fill`` per
feature); a batch where no row uses one returns the logits unchanged, without a copy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

_NEG_INF = float("-inf")


@dataclass(slots=True)
class TokenMasks:
    """The token bitmasks of the sampled rows that carry one (structured output).

    ``packed[i]`` is row ``rows[i]``'s ``StepSequence.token_bitmask`` as bytes: ceil(V / 32) little-endian
    int32 words, i.e. a little-endian bit array: bit b of byte m is token 8 m + b, 1 = allowed.
    """

    rows: list[int]  # [R] sampler row of each masked sequence, ascending
    packed: np.ndarray  # [R, 4 * ceil(V / 32)] uint8

    def __post_init__(self) -> None:
        assert self.packed.dtype == np.uint8 and self.packed.shape[0] == len(self.rows), "one mask per row"


def unpack_bitmask(packed: torch.Tensor, vocab: int) -> torch.Tensor:
    """packed: [R, B] uint8, bit b of byte m = token 8 m + b (8 B >= vocab); returns [R, vocab] bool on
    packed's device, True = allowed (bits past ``vocab`` dropped)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed[:, :, None] >> shifts) & 1  # [R, B, 8]
    return bits.reshape(packed.shape[0], -1)[:, :vocab].bool()


def check_logits_controls(p) -> None:
    """Check the min_p, logit_bias and min_tokens fields of ``p`` (a
    `compute_service.sampling.SamplingParams`) on their own (the vocabulary: :func:`check_in_vocab`).

    Raises:
        ValueError: min_p outside [0, 1]; a bias that is not finite or a token id < 0 or listed twice;
            min_tokens < 0; a min_tokens_stop_ids id < 0.
    """
    if not 0.0 <= p.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1] (0 = off), got {p.min_p}")
    ids = [t for t, _ in p.logit_bias]
    if any(t < 0 for t in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"logit_bias token ids must be >= 0, each at most once, got {ids[:16]}")
    if not all(math.isfinite(b) for _, b in p.logit_bias):
        raise ValueError("logit_bias values must be finite")
    if isinstance(p.min_tokens, bool) or not isinstance(p.min_tokens, int) or p.min_tokens < 0:
        raise ValueError(f"min_tokens must be an int >= 0 (0 = off), got {p.min_tokens!r}")
    if any(t < 0 for t in p.min_tokens_stop_ids):
        raise ValueError(f"min_tokens_stop_ids must be >= 0, got {list(p.min_tokens_stop_ids)[:16]}")


def check_in_vocab(p, vocab: int) -> None:
    """Raise ValueError (naming the field) when a token id of ``p``'s logit_bias or
    min_tokens_stop_ids is not below ``vocab`` (the logits' width)."""
    for name, ids in (("logit_bias", [t for t, _ in p.logit_bias]), ("min_tokens_stop_ids", p.min_tokens_stop_ids)):
        if ids and max(ids) >= vocab:
            raise ValueError(f"{name} token id {max(ids)} is outside the vocabulary [0, {vocab})")


def constrain(logits: torch.Tensor, params: Sequence, output_positions: Sequence[int],
              masks: TokenMasks | None = None) -> torch.Tensor:
    """The logits after the token bitmask, min_tokens and logit_bias (the module's order).

    Args:
        logits: [S, V] float32; not changed.
        params: S `compute_service.sampling.SamplingParams`, checked (their ids below V).
        output_positions: S ints, the output position t each row samples (min_tokens compares it).
        masks: the rows' token bitmasks (each allowing some token below V), or None.

    Returns [S, V] float32: ``logits`` itself when no row uses a feature, else a new tensor where
    the masked and suppressed entries are -inf.
    """
    banned = [i for i, p in enumerate(params) if p.min_tokens_stop_ids and output_positions[i] < p.min_tokens]
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    if masks is None and not banned and not biased:
        return logits
    x = logits.clone()
    dev, vocab = x.device, x.shape[1]
    if masks is not None:
        idx = torch.tensor(masks.rows, dtype=torch.int64, device=dev)
        allowed = unpack_bitmask(torch.tensor(masks.packed, device=dev), vocab)  # [R, V]
        x.index_copy_(0, idx, x.index_select(0, idx).masked_fill_(~allowed, _NEG_INF))
    if banned:
        idx = torch.tensor(banned, dtype=torch.int64, device=dev)
        local = [r for r, i in enumerate(banned) for _ in params[i].min_tokens_stop_ids]
        cols = [t for i in banned for t in params[i].min_tokens_stop_ids]
        rows = x.index_select(0, idx)  # [B, V]
        cut = rows.index_put((torch.tensor(local, device=dev), torch.tensor(cols, device=dev)),
                             torch.tensor(_NEG_INF, dtype=x.dtype, device=dev))
        left = (cut > _NEG_INF).any(dim=-1, keepdim=True)  # [B, 1] some token still allowed
        x.index_copy_(0, idx, torch.where(left, cut, rows))
    if biased:
        rows = torch.tensor([i for i in biased for _ in params[i].logit_bias], device=dev)
        cols = torch.tensor([t for i in biased for t, _ in params[i].logit_bias], device=dev)
        vals = torch.tensor([b for i in biased for _, b in params[i].logit_bias], dtype=x.dtype, device=dev)
        x.index_put_((rows, cols), vals, accumulate=True)
    return x


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """x: [S, V] float, logits after temperature (-inf = dropped); min_p: [S] float in [0, 1]. Returns
    x with -inf where softmax(x) < min_p * max(softmax(x)) (vLLM's MinPLogitsProcessor); a row's most
    likely token always stays, and a row with min_p 0 is unchanged."""
    p = x.softmax(dim=-1)
    return x.masked_fill(p < min_p[:, None] * p.amax(dim=-1, keepdim=True), _NEG_INF)
