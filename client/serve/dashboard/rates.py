"""Rates over the last minutes for the dashboard: tokens/s, prefix-cache hit rate, KV usage.

:class:`History` keeps cumulative counters sampled at the feed's ticks, one kept sample per
:data:`STEP` seconds over :data:`SPAN` seconds (60 points), so a rate over any window is a
difference of two samples, and the series the page draws is bounded whatever the tick rate.
Samples exist only while the feed runs (someone watches); the first sample after a pause spans
the pause, so its rate is the mean over it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

#: Seconds between kept samples, and seconds of history kept.
STEP, SPAN = 5.0, 300.0
#: Seconds the "now" rates average over.
NOW_WINDOW = 10.0


@dataclass(slots=True, frozen=True)
class Sample:
    """Cumulative counters at one instant."""

    #: Seconds (time.time()).
    time: float
    #: Prompt and output tokens served by this front (its metrics' totals).
    prompt_tokens: float
    generation_tokens: float
    #: The pool's prefix-cache lookups and hits, tokens (GetStats).
    prefix_queries: int
    prefix_hits: int
    #: Used / total blocks of the pool now (not cumulative).
    kv_usage: float
    #: Requests this front preempted (cumulative).
    preemptions: int


class History:
    """The samples of the last :data:`SPAN` seconds (one per :data:`STEP`) and the latest one."""

    def __init__(self) -> None:
        self._kept: collections.deque[Sample] = collections.deque(maxlen=int(SPAN / STEP) + 1)
        self.latest: Sample | None = None

    def add(self, s: Sample) -> None:
        """Record ``s``; it is kept when :data:`STEP` seconds passed since the last kept one."""
        if not self._kept or s.time - self._kept[-1].time >= STEP:
            self._kept.append(s)
        self.latest = s

    def _before(self, t: float) -> Sample | None:
        """The newest kept sample at or before ``t`` (else the oldest)."""
        best = None
        for s in self._kept:
            if s.time <= t or best is None:
                best = s
            if s.time > t:
                break
        return best

    def now(self, window: float = NOW_WINDOW) -> dict:
        """Rates over the last ``window`` seconds (or since the feed started, when that is less)."""
        last = self.latest
        if last is None:
            return {"window_s": 0.0, "prompt_tokens_per_s": 0.0, "generation_tokens_per_s": 0.0,
                    "prefix_cache_hit_rate": None}
        first = self._before(last.time - window) or last
        return {"window_s": round(last.time - first.time, 3)} | _rates(first, last)

    def series(self) -> list[dict]:
        """One point per kept sample after the first: its rates since the previous kept sample."""
        kept = list(self._kept)
        return [{"time": round(b.time, 3), "kv_usage": round(b.kv_usage, 4)} | _rates(a, b)
                for a, b in zip(kept, kept[1:])]


def _rates(a: Sample, b: Sample) -> dict:
    dt = b.time - a.time
    dq = b.prefix_queries - a.prefix_queries
    return {"prompt_tokens_per_s": round((b.prompt_tokens - a.prompt_tokens) / dt, 3) if dt > 0 else 0.0,
            "generation_tokens_per_s": round((b.generation_tokens - a.generation_tokens) / dt, 3) if dt > 0 else 0.0,
            "prefix_cache_hit_rate": round((b.prefix_hits - a.prefix_hits) / dq, 4) if dq > 0 else None,
            "preemptions": b.preemptions - a.preemptions}


__all__ = ["NOW_WINDOW", "SPAN", "STEP", "History", "Sample"]
