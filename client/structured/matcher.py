"""One constrained sequence's place in its grammar, on the front (the worker keeps no grammar state)."""

from __future__ import annotations

import llguidance


class GrammarMatcher:
    """llguidance's matcher for one sequence: the tokens allowed next, and each sampled token fed back.

    A step that samples the sequence sends :meth:`bitmask` (StepSequence.token_bitmask); the token
    the worker drew goes to :meth:`accept`. Preemption and worker failover recompute KV but never
    take back a generated token, so the matcher never rolls back.
    """

    __slots__ = ("_m", "_words", "_eos_mask", "_mask", "error")

    def __init__(self, matcher: llguidance.LLMatcher, mask_words: int, eos_mask: bytes):
        self._m, self._words, self._eos_mask = matcher, mask_words, eos_mask
        self._mask: bytes | None = None
        #: Why the sequence left its grammar (llguidance's message), or None.
        self.error: str | None = None

    def bitmask(self) -> bytes:
        """The tokens allowed next: ``mask_words`` packed little-endian int32 words, bit i of word j
        = token 32 j + i allowed. Once the grammar is complete only end-of-sequence is allowed.
        Computed once per position (a step that is retried reuses it).

        A matcher that fails here (llguidance's per-step limits, an internal error) or allows no
        token gets the end-of-sequence mask instead, with ``error`` set: its sequence ends at the
        next token and the step's other sequences are not refused with it."""
        if self._mask is None:
            try:
                mask = self._m.compute_bitmask()[:4 * self._words]
            except Exception as e:  # noqa: BLE001 - one sequence's grammar must not fail the batch
                self.error, mask = f"structured output: {e}", b""
            if self._m.is_error() or not mask.strip(b"\x00"):
                self.error = self.error or self._m.get_error() or "structured output: the grammar allows no token"
                mask = self._eos_mask
            self._mask = mask
        return self._mask

    def accept(self, token: int) -> bool:
        """Advance past ``token`` (the one the worker sampled); False when the grammar does not
        allow it (``error`` says why; the sequence must end)."""
        self._mask = None
        if self.error is None and self._m.consume_token(token):
            return True
        self.error = self._m.get_error() or f"token {token} is not allowed by the grammar"
        return False

    @property
    def failed(self) -> bool:
        """Whether llguidance has stopped this matcher on an error (after :meth:`bitmask` or :meth:`accept`):
        the grammar allows nothing more, end-of-sequence included (an empty language fails at its first mask)."""
        return self._m.is_error()

    @property
    def reason(self) -> str:
        """llguidance's reason for stopping, its first line (its state dump dropped); "" while it runs."""
        return (self._m.get_error() or "").split("\n", 1)[0].strip()

    @property
    def done(self) -> bool:
        """Whether the grammar is complete and allows nothing but the end of the sequence."""
        return self._m.is_stopped()

    def fork(self) -> GrammarMatcher:
        """An independent copy at the same place (a parallel sample forked from this sequence)."""
        return GrammarMatcher(self._m.deep_copy(), self._words, self._eos_mask)
