"""The last step's receipts on their way to the memory service: with the next step's AppendSlots
when they can wait, in a CommitComputedTokens of their own when they cannot.

A step's receipts make its positions computed in the memory service (and fill the prefix cache);
the next step's AppendSlots then grows the same sequences. Sending both in one AppendSlots call
(its ``receipts`` field, taken before the appends) saves a round trip per step, the way vLLM's
scheduler updates and schedules in one pass. A receipt waits for the next AppendSlots only when
its sequence will be appended there and nothing else needs it first:

- a sequence that finished, or is freed this step, is committed at once (before the free: a
  request done in its prefill step still fills the cache);
- beam search, parallel sampling and reserved requests (no AppendSlots) are committed at once;
- any other memory call that touches the lease's sequences first (frees of aborted requests,
  forks, swap-in) flushes what waits (:meth:`Commits.flush`), and so does a step with no
  AppendSlots.

An AppendSlots takes its receipts only when it takes its appends (all or nothing). When one is
refused for lack of blocks, the engine commits the receipts it carried at once
(:meth:`Commits.commit_taken`), before a preemption frees or swaps out a victim whose positions
they prove; a receipt already taken is skipped by the memory service.
"""

from __future__ import annotations

from collections.abc import Callable

from client.engine.scheduler import ScheduledSeq
from client.lease import Lease
from client.services import MemoryClient
from pagedkv.runtime.limits import MAX_BATCH


class Commits:
    """Receipts waiting for the next AppendSlots, by sequence id, for the engine's lease of the
    moment (``lease()``; a new lease after recovery voids what waited)."""

    def __init__(self, memory: MemoryClient, lease: Callable[[], Lease]):
        self.memory = memory
        self._lease = lease
        self._waiting: dict[int, tuple[object, object]] = {}  # seq_id -> (Sequence, receipt)
        self._sent: dict[int, object] = {}  # seq_id -> Sequence, of the receipts last taken
        self._lease_id: str | None = None

    def __len__(self) -> int:
        return len(self._waiting)

    def after_step(self, items: list[tuple[ScheduledSeq, object, bool]]) -> None:
        """Hand in one step's receipts: ``(scheduled, receipt, may_wait)`` each. Those that may
        not wait go now in one CommitComputedTokens (with whatever waited); the rest wait.

        Raises:
            client.errors.ServiceError: the memory service refused the commit.
        """
        self._check_lease()
        now = []
        for x, receipt, may_wait in items:
            if may_wait:
                self._waiting[x.seq.seq_id] = (x.seq, receipt)
            else:
                now.append((x.seq, receipt))
        if now:
            self._commit([*self._drain(), *now])

    def take(self) -> list:
        """The waiting receipts for the step's AppendSlots (they leave this queue); their sequences
        stay known for :meth:`granted` and, if that call is refused, :meth:`commit_taken`."""
        self._check_lease()
        self._sent = {seq_id: seq for seq_id, (seq, _) in self._waiting.items()}
        return [r for _, r in self._drain()]

    def granted(self, grants) -> None:
        """Fresh grants an AppendSlots returned for taken receipts whose sequence it did not append
        (``committed_grants``)."""
        for g in grants:
            seq = self._sent.get(g.seq_id)
            if seq is not None:
                seq.grant = g

    def commit_taken(self, receipts: list) -> None:
        """Commit now receipts :meth:`take` gave to an AppendSlots that was refused, before a
        preemption (free or swap-out) needs its victim's positions proven.

        Raises:
            client.errors.ServiceError: the memory service refused the commit.
        """
        self._commit([(self._sent[r.seq_id], r) for r in receipts if r.seq_id in self._sent])

    def flush(self) -> None:
        """Commit whatever waits now (before a call that needs it proven, or a step with no
        AppendSlots).

        Raises:
            client.errors.ServiceError: the memory service refused the commit.
        """
        self._check_lease()
        if self._waiting:
            self._commit(self._drain())

    def clear(self) -> None:
        """Drop what waits (the lease or its sequences are gone)."""
        self._waiting.clear()

    def _check_lease(self) -> None:
        lease_id = self._lease().lease_id
        if lease_id != self._lease_id:  # a new lease after recovery: the old one's receipts are void
            self._waiting.clear()
            self._lease_id = lease_id

    def _drain(self) -> list[tuple[object, object]]:
        out = list(self._waiting.values())
        self._waiting.clear()
        return out

    def _commit(self, pairs: list[tuple[object, object]]) -> None:
        by_id = {seq.seq_id: seq for seq, _ in pairs if seq.seq_id is not None}
        receipts = [r for _, r in pairs]
        for at in range(0, len(receipts), MAX_BATCH):
            for g in self.memory.commit(self._lease().lease_id, receipts[at:at + MAX_BATCH]).grants:
                seq = by_id.get(g.seq_id)
                if seq is not None:
                    seq.grant = g
