"""Batched, reproducible token sampling from logits with per-sequence parameters.

The random draw of a sequence at output position t depends only on (seed, t): a stable 64-bit
mix of the two (`draw_seed`) keys one Philox4x32-10 uniform ``u`` (`kernels.draws`: computed on the
logits' device, on a GPU by a Triton kernel, with the same bits everywhere), and the token is the
first whose cumulative filtered probability exceeds ``u`` times the total (inverse-transform
sampling, as FlashInfer's sampling kernels; one random number per row instead of one per
vocabulary entry). So a sample is the same whatever else shares the batch, equals a solo run with
that seed, and a preempted request resumes on the same draws. The n samples of one request use
seeds seed, seed+1, ...

Order as vLLM's sampler: the token bitmask (structured output), min_tokens and logit_bias
(`compute_service.logits_processors`), penalties (repetition, presence, frequency:
`compute_service.penalties`), then greedy's argmax or temperature, min-p, top-k, then top-p over
what top-k kept. Logprobs are vLLM's default: log_softmax of the raw logits (before all of these).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

import kernels.draws
from compute_service.logits_processors import TokenMasks, apply_min_p, check_logits_controls, constrain
from compute_service.penalties import TokenHistory, penalised
from pagedkv.runtime.limits import MAX_LOGPROBS

_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class SamplingParams:
    """How the worker picks the next token of one sequence. Raises ValueError on a bad value.

    Request-level settings (max_tokens, n, stops, ignore_eos) belong to the client
    (`client.params.SamplingParams`): the worker only draws one token per step.
    """

    temperature: float = 1.0  # 0 = greedy (argmax); > 0 divides the logits
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set with cumulative probability >= top_p; in (0, 1]
    seed: int | None = None  # draw seed; None = fresh entropy each draw (not reproducible)
    logprobs: int | None = None  # top logprobs per output token (0..MAX_LOGPROBS); None = off
    repetition_penalty: float = 1.0  # > 0; seen tokens' logits > 0 divided, others multiplied; 1 = off
    presence_penalty: float = 0.0  # in [-2, 2], subtracted from every generated token's logit; 0 = off
    frequency_penalty: float = 0.0  # in [-2, 2], subtracted once per occurrence in the output; 0 = off
    min_p: float = 0.0  # in [0, 1]; drop tokens below min_p * the top probability (after temperature); 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id >= 0, finite bias) pairs, each id once
    min_tokens: int = 0  # >= 0; min_tokens_stop_ids get -inf while output position < min_tokens; 0 = off
    min_tokens_stop_ids: tuple[int, ...] = ()  # ids >= 0: the model's EOS ids and the request's stop ids

    def __post_init__(self) -> None:
        if not self.temperature >= 0 or self.temperature == float("inf"):
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not 0 <= self.seed <= _MASK64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.logprobs}"
            )
        # vLLM's SamplingParams._verify_args bounds.
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        check_logits_controls(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty is on (the step must then carry the sequence's tokens)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(slots=True)
class SamplerOutput:
    """Result for S sequences. Logprob tensors are None unless some sequence asked for them."""

    token_ids: torch.Tensor  # [S] int64, chosen tokens
    logprobs: torch.Tensor | None  # [S] float32, log_softmax(raw logits) of the chosen token
    top_ids: torch.Tensor | None  # [S, K] int64, K = max requested; row s valid up to its own k
    top_logprobs: torch.Tensor | None  # [S, K] float32, descending


def draw_seed(seed: int, t: int) -> int:
    """Stable 64-bit generator seed for (seed, output position t) (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + (t + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest value (the first on ties, NaN counting as largest, as
    ``torch.argmax``): x [S, V] float; returns [S] int64 on x's device.

    On the CPU through numpy, whose vectorised argmax is ~10x faster than torch's row
    reduction here (~0.3 ms vs ~3 ms for [32, 49152] float32 on one core).
    """
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and x.dim() == 2 and x.shape[1]:
        return torch.from_numpy(x.detach().numpy().argmax(axis=-1).astype("int64", copy=False))
    return x.argmax(dim=-1)


def filtered_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Probabilities after temperature, min-p, top-k and top-p, renormalised.

    logits: [S, V] float; temperature: [S] float (> 0); top_k: [S] int64 (0 = off);
    top_p: [S] float in (0, 1]; min_p: [S] float in [0, 1] (0 = off) or None (off for every row).
    Returns [S, V] float32 with zeros where filtered out.
    Ties at the top-k boundary are all kept (as in vLLM's threshold filter). A row that a tiny
    temperature sends to +inf is scaled after subtracting its maximum instead (the same
    distribution in exact arithmetic, without inf - inf = NaN); `logits` must be finite or -inf
    (a masked token), with a finite entry in every row.
    """
    x = logits.float() / temperature[:, None]
    over = torch.isposinf(x).any(dim=-1)  # [S] bool
    if bool(over.any()):
        rows = logits.float()[over]
        x[over] = (rows - rows.amax(dim=-1, keepdim=True)) / temperature[over, None]
    if min_p is not None:
        x = apply_min_p(x, min_p)
    vocab = x.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    if bool((k < vocab).any()) or bool((top_p < 1).any()):
        sorted_x, _ = x.sort(dim=-1, descending=True)  # [S, V]
        kth = sorted_x.gather(1, (k - 1)[:, None])  # [S, 1] k-th largest value
        x = x.masked_fill(x < kth, float("-inf"))
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        # top-p: keep a token when the mass strictly before it (in sorted order) is < top_p.
        p_sorted = sorted_x.softmax(dim=-1)
        before = p_sorted.cumsum(dim=-1) - p_sorted
        keep = (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
        # smallest kept value = threshold; every token at or above it survives
        n_keep = keep.sum(dim=-1, keepdim=True).clamp(min=1)
        thresh = sorted_x.gather(1, n_keep - 1)
        x = x.masked_fill(x < thresh, float("-inf"))
    return x.softmax(dim=-1)


def inverse_transform(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token of each row whose cumulative probability first exceeds ``u`` times the row's
    total (inverse-transform sampling; the cumulative sums in float64).

    probs: [S, V] float, >= 0, each row with a positive sum; u: [S] float in (0, 1), on probs'
    device. Returns [S] int64 there. A token of probability 0 is never chosen.
    """
    cdf = probs.double().cumsum(dim=-1)
    target = (u.double() * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)


def processed_logits(logits: torch.Tensor, params: Sequence[SamplingParams], output_positions: Sequence[int],
                     history: TokenHistory | None = None, masks: TokenMasks | None = None) -> torch.Tensor:
    """The logits greedy's argmax and the draws read: ``logits`` [S, V] float32 after the token
    bitmask, min_tokens, logit_bias (`compute_service.logits_processors.constrain`) and the
    penalties (arguments as `sample`, checked there). ``logits`` itself when no row uses any, else
    a new tensor: the raw logits stay for the logprobs."""
    x = constrain(logits, params, output_positions, masks)
    return penalised(x, params, history) if history is not None else x


def draw_probs(x: torch.Tensor, params: Sequence[SamplingParams], rows: list[int]) -> torch.Tensor:
    """The distribution each sampled row draws from: `filtered_probs` of ``x[rows]`` ([S, V] float32,
    `processed_logits`) with the rows' temperature, min_p, top_k and top_p; rows: indices of rows
    with temperature > 0. Returns [len(rows), V] float32 on x's device."""
    dev = x.device
    temp = torch.tensor([params[i].temperature for i in rows], dtype=torch.float32, device=dev)
    top_k = torch.tensor([params[i].top_k for i in rows], dtype=torch.int64, device=dev)
    top_p = torch.tensor([params[i].top_p for i in rows], dtype=torch.float32, device=dev)
    min_p = [params[i].min_p for i in rows]
    min_p = torch.tensor(min_p, dtype=torch.float32, device=dev) if any(min_p) else None  # skipped when all 0
    return filtered_probs(x[torch.tensor(rows, device=dev)], temp, top_k, top_p, min_p)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_positions: Sequence[int],
    history: TokenHistory | None = None,
    masks: TokenMasks | None = None,
) -> SamplerOutput:
    """Pick one token per row of `logits`.

    Args:
        logits: [S, V] float32 (the model's chosen rows).
        params: S `SamplingParams`, one per row; the token ids they name are below V.
        output_positions: S ints >= 0, the index of the token being drawn among the sequence's
            generated tokens (0 for the first); with `seed` fixes the draw, and min_tokens reads it.
        history: the prompt and generated tokens of the rows whose params set a penalty (every
            such row must be in it); None when no row does.
        masks: the token bitmasks of the rows that carry one (each allowing a token below V); None
            when no row does.

    Returns a `SamplerOutput`. Raises ValueError when the lengths disagree, a position is < 0, or
    a row with a penalty has no history.
    """
    s, vocab = logits.shape
    if len(params) != s or len(output_positions) != s:
        raise ValueError(
            f"logits has {s} rows but got {len(params)} params and "
            f"{len(output_positions)} output positions"
        )
    if any(t < 0 for t in output_positions):
        raise ValueError(f"output positions must be >= 0, got {list(output_positions)}")
    logits = logits.float()
    want_history = [i for i, p in enumerate(params) if p.has_penalties]
    if want_history != (history.rows if history is not None else []):
        raise ValueError(f"rows {want_history} set a penalty but the history covers "
                         f"{history.rows if history is not None else []}")
    x = processed_logits(logits, params, output_positions, history, masks)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    # greedy for every row (sampled rows are overwritten); the draws only when some row samples
    tokens = row_argmax(x)
    if rows:
        dev = logits.device
        probs = draw_probs(x, params, rows)
        keys = [draw_seed(int.from_bytes(os.urandom(8), "little") if params[i].seed is None else params[i].seed,
                          output_positions[i]) for i in rows]
        u = kernels.draws.uniforms(keys, dev)  # on the logits' device, the same bits on every device
        tokens[torch.tensor(rows, device=tokens.device)] = inverse_transform(probs, u).to(tokens.device)

    want = [p.logprobs for p in params if p.logprobs is not None]
    if not want:
        return SamplerOutput(tokens, None, None, None)
    logp = logits.log_softmax(dim=-1)  # [S, V]
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    top_lp, top_ids = logp.topk(max(want), dim=-1)  # [S, K] each
    return SamplerOutput(tokens, chosen, top_ids, top_lp)
