"""Incremental detokenization with stop strings: constant work per generated token.

Re-decoding a sequence's whole output after every step costs O(length) per token, O(length²)
per sequence. A :class:`Detokenizer` feeds each new token id to the ``tokenizers`` library's
``DecodeStream``, which decodes a small window of recent ids and returns only the new text (or
nothing while a multi-byte character is still incomplete, e.g. a byte-fallback token that
holds the first bytes of an emoji). Stop strings are looked for in the new text plus the tail
that a stop string could straddle, never in the whole text (vLLM's ``StopChecker`` over
``IncrementalDetokenizer``).

With ``min_tokens``, the text of the first ``min_tokens`` tokens is not searched: a stop string
must end after it (vLLM v1's detokenizer, its ``stop_check_offset``).

While a sequence runs, :meth:`Detokenizer.visible` holds back the last ``max(len(stop)) - 1``
characters, so a stream never shows the first characters of a stop string that would later be
cut (vLLM holds back the same amount).
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class Detokenizer:
    """The decoded text of one sequence's generated tokens, grown one token at a time.

    Args:
        tokenizer: a transformers fast tokenizer (its ``backend_tokenizer`` decodes).
        stop: strings that end the sequence; the text is cut before the first one found.
        skip_special_tokens: leave special tokens (``<|im_end|>``) out of the text.
        min_tokens: no stop string ends within the text of the first ``min_tokens`` tokens.

    Raises:
        TypeError: ``tokenizer`` has no fast (``tokenizers``) backend.
    """

    __slots__ = ("_backend", "_stream", "_stop", "_hold", "_min_tokens", "_count", "_floor", "text", "stop_hit")

    def __init__(self, tokenizer, stop: list[str] = (), *, skip_special_tokens: bool = True, min_tokens: int = 0):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError(f"{type(tokenizer).__name__} has no fast tokenizer backend for incremental decoding")
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stop = list(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._min_tokens = min_tokens
        self._count = 0  # tokens stepped
        self._floor = 0  # characters of text a stop string must end after (the first min_tokens tokens')
        #: Text decoded so far (cut before the stop string once one is found).
        self.text = ""
        #: The stop string found, or None.
        self.stop_hit: str | None = None

    def step(self, token_id: int) -> str | None:
        """Decode ``token_id`` after the tokens so far; returns the stop string it completed, if any.

        After a stop string is found the text stays cut and later tokens are ignored.
        """
        if self.stop_hit is not None:
            return None
        new = self._stream.step(self._backend, token_id)
        self._count += 1
        if not new:
            return None
        start = max(0, len(self.text) - self._hold)  # a stop string may begin in the held tail
        self.text += new
        if self._count <= self._min_tokens:
            self._floor = len(self.text)
            return None
        if self._stop:
            hits = [(at, s) for s in self._stop if (at := self.text.find(s, max(start, self._floor - len(s) + 1))) >= 0]
            if hits:
                at, s = min(hits)
                self.text, self.stop_hit = self.text[:at], s
                return s
        return None

    def visible(self, finished: bool) -> str:
        """The text a stream may show: all of it once ``finished``, else without the held-back tail."""
        if finished or not self._hold:
            return self.text
        return self.text[:max(0, len(self.text) - self._hold)]
