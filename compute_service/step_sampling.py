"""A sampled sequence's request read for the sampler: its sampling parameters and token history.

A ``StepSequence`` that is sampled carries ``SamplingParams`` (unset fields: greedy / off) and,
when they set a penalty, the token ids it was sampled from so far (``prompt_token_ids``,
``output_token_ids``; `compute_service.penalties`). `build_step_inputs` reads both here, once
per sequence, and refuses a step whose values are out of range or whose history does not match
the sequence's length.
"""

from __future__ import annotations

import numpy as np

from compute_service.sampling import SamplingParams
from pagedkv.compute.v1 import compute_service_pb2 as pb
from pagedkv.runtime.errors import InvalidArgumentError

#: Parsed sampling parameters by their message's bytes (a batch mostly repeats a few settings).
_SAMPLING_CACHE: dict[bytes, SamplingParams] = {}
_SAMPLING_CACHE_SIZE = 1024


def sampling_from_proto(sp: pb.SamplingParams, where: str) -> SamplingParams:
    """Worker-side sampling parameters; unset fields mean greedy / off (penalties: 1, 0, 0).

    Equal messages give one shared instance (cached by their bytes): read it, never change it.

    Raises:
        InvalidArgumentError: a value out of range.
    """
    key = sp.SerializeToString(deterministic=True)
    params = _SAMPLING_CACHE.get(key)
    if params is None:
        params = _sampling_from_proto(sp, where)
        if len(_SAMPLING_CACHE) >= _SAMPLING_CACHE_SIZE:
            _SAMPLING_CACHE.clear()
        _SAMPLING_CACHE[key] = params
    return params


def _sampling_from_proto(sp: pb.SamplingParams, where: str) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=sp.temperature if sp.HasField("temperature") else 0.0,
            top_k=sp.top_k if sp.HasField("top_k") else 0,
            top_p=sp.top_p if sp.HasField("top_p") else 1.0,
            seed=sp.seed if sp.HasField("seed") else None,
            logprobs=sp.num_logprobs if sp.HasField("num_logprobs") else None,
            repetition_penalty=sp.repetition_penalty if sp.HasField("repetition_penalty") else 1.0,
            presence_penalty=sp.presence_penalty if sp.HasField("presence_penalty") else 0.0,
            frequency_penalty=sp.frequency_penalty if sp.HasField("frequency_penalty") else 0.0,
        )
    except ValueError as e:
        raise InvalidArgumentError(f"{where}: bad sampling parameters: {e}") from e


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
