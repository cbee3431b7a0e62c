"""A sampled sequence's request read for the sampler: its sampling parameters, token history and bitmask.

A ``StepSequence`` that is sampled carries ``SamplingParams`` (unset fields: greedy / off), when they
set a penalty the token ids it was sampled from so far (``prompt_token_ids``, ``output_token_ids``;
`compute_service.penalties`), and under structured output the tokens its grammar allows next
(``token_bitmask``; `compute_service.logits_processors`). `build_step_inputs` reads them here, once
per sequence, and refuses a step whose values are out of range, whose history does not match the
sequence's length, or whose bitmask has the wrong size or allows no token. A sequence with
``skip_sampling`` is not sampled: none of these is read.
"""

from __future__ import annotations

import numpy as np

from compute_service.logits_processors import check_in_vocab
from compute_service.sampling import SamplingParams
from pagedkv.compute.v1 import compute_service_pb2 as pb
from pagedkv.runtime.errors import InvalidArgumentError

#: Parsed sampling parameters by (vocabulary size, their message's bytes): a batch mostly repeats a few settings.
_SAMPLING_CACHE: dict[tuple[int, bytes], SamplingParams] = {}
_SAMPLING_CACHE_SIZE = 1024


def sampling_from_proto(sp: pb.SamplingParams, where: str, vocab_size: int) -> SamplingParams:
    """Worker-side sampling parameters; unset fields mean greedy / off (penalties: 1, 0, 0; min_p 0,
    no logit_bias, min_tokens 0).

    Equal messages give one shared instance (cached by their bytes): read it, never change it.

    Raises:
        InvalidArgumentError: a value out of range, or a token id (logit_bias, min_tokens_stop_ids)
            outside [0, vocab_size).
    """
    key = (vocab_size, sp.SerializeToString(deterministic=True))
    params = _SAMPLING_CACHE.get(key)
    if params is None:
        params = _sampling_from_proto(sp, where, vocab_size)
        if len(_SAMPLING_CACHE) >= _SAMPLING_CACHE_SIZE:
            _SAMPLING_CACHE.clear()
        _SAMPLING_CACHE[key] = params
    return params


def _sampling_from_proto(sp: pb.SamplingParams, where: str, vocab_size: int) -> SamplingParams:
    try:
        params = SamplingParams(
            temperature=sp.temperature if sp.HasField("temperature") else 0.0,
            top_k=sp.top_k if sp.HasField("top_k") else 0,
            top_p=sp.top_p if sp.HasField("top_p") else 1.0,
            seed=sp.seed if sp.HasField("seed") else None,
            logprobs=sp.num_logprobs if sp.HasField("num_logprobs") else None,
            repetition_penalty=sp.repetition_penalty if sp.HasField("repetition_penalty") else 1.0,
            presence_penalty=sp.presence_penalty if sp.HasField("presence_penalty") else 0.0,
            frequency_penalty=sp.frequency_penalty if sp.HasField("frequency_penalty") else 0.0,
            min_p=sp.min_p if sp.HasField("min_p") else 0.0,
            logit_bias=tuple((b.token_id, b.bias) for b in sp.logit_bias),
            min_tokens=sp.min_tokens if sp.HasField("min_tokens") else 0,
            min_tokens_stop_ids=tuple(sp.min_tokens_stop_ids),
        )
        check_in_vocab(params, vocab_size)
    except ValueError as e:
        raise InvalidArgumentError(f"{where}: bad sampling parameters: {e}") from e
    return params


def token_bitmask(s: pb.StepSequence, vocab_size: int, where: str) -> np.ndarray | None:
    """The ``token_bitmask`` of a sampled sequence as [4 * ceil(vocab_size / 32)] uint8 (a
    little-endian bit array, 1 = allowed), or None when unset (every token allowed).

    Raises:
        InvalidArgumentError: a mask of another size, or one that allows no token below vocab_size.
    """
    if not s.HasField("token_bitmask"):
        return None
    words = (vocab_size + 31) // 32
    mask = np.frombuffer(s.token_bitmask, dtype=np.uint8)
    if mask.size != 4 * words:
        raise InvalidArgumentError(
            f"{where}: token_bitmask has {mask.size} bytes; the vocabulary of {vocab_size} tokens takes "
            f"ceil({vocab_size} / 32) = {words} int32 words ({4 * words} bytes)")
    full, rest = divmod(vocab_size, 8)
    if not mask[:full].any() and not (rest and int(mask[full]) & ((1 << rest) - 1)):
        raise InvalidArgumentError(f"{where}: token_bitmask allows no token; a sampled sequence needs one")
    return mask


def token_history(s: pb.StepSequence, params: SamplingParams, vocab_size: int,
                  where: str) -> tuple[np.ndarray, np.ndarray]:
    """(prompt ids, generated ids), int64, of a sampled sequence whose ``params`` set a penalty.

    The prompt is read only with a repetition penalty (else an empty array). The step must carry
    exactly ``output_index`` generated ids and, with a repetition penalty, a non-empty prompt whose
    length plus ``output_index`` is the sequence's length after the step (its last position + 1):
    the history of exactly the tokens in its KV cache.

    Raises:
        InvalidArgumentError: a history that is missing, of the wrong length, or has an id outside
            [0, vocab_size).
    """
    n_out = len(s.output_token_ids)
    if n_out != s.output_index:
        raise InvalidArgumentError(
            f"{where}: sampling sets a penalty, so output_token_ids must hold the {s.output_index} tokens "
            f"generated so far (output_index); got {n_out}")
    seq_len = s.positions[-1] + 1
    prompt = np.zeros(0, dtype=np.int64)
    if params.repetition_penalty != 1.0:
        n_prompt = len(s.prompt_token_ids)
        if n_prompt == 0 or n_prompt + n_out != seq_len:
            raise InvalidArgumentError(
                f"{where}: sampling sets a repetition penalty, so prompt_token_ids and output_token_ids must "
                f"hold the sequence's {seq_len} tokens (positions 0..{seq_len - 1}); got {n_prompt} + {n_out}")
        prompt = ints(s.prompt_token_ids, n_prompt)
    elif n_out >= seq_len:
        raise InvalidArgumentError(
            f"{where}: {n_out} generated tokens but the sequence has only {seq_len} tokens after this step")
    output = ints(s.output_token_ids, n_out)
    for name, ids in (("prompt_token_ids", prompt), ("output_token_ids", output)):
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise InvalidArgumentError(f"{where}: {name} must be in [0, {vocab_size}) (the vocabulary)")
    return prompt, output


def ints(values, count: int) -> np.ndarray:
    """``count`` ints from an iterable as int64 (raises InvalidArgumentError past int64)."""
    try:
        return np.fromiter(values, dtype=np.int64, count=count)
    except (OverflowError, ValueError) as e:
        raise InvalidArgumentError(f"Step: a value is outside int64: {e}") from e
