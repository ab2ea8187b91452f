"""Destinations that failed a move sit out a while (docs/migration.md#a-failing-destination).

A destination whose move failed (its pre-copy or tail copy failed, or it left or was lost while a
copy was on its way to it) is no candidate for `first_s`, twice that after a further failure, and so
on up to `max_s`; a move that lands resets it. When its time is up it is on probation: one move at a
time goes to it (a probe), and no other until that one has had its outcome. So the moves started
toward a failing destination are bounded by one per back-off, however often its sources decide,
and the others are tried meanwhile. Failures of moves started before the first one was reported (a
burst toward a destination that hung) count as one.

Plain state: every call takes the time (`now`, seconds on any monotonic clock) from its caller.
"""

from __future__ import annotations

from dataclasses import dataclass

FIRST_S = 0.5
MAX_S = 30.0


@dataclass(slots=True)
class _Record:
    failures: int = 0
    until: float = 0.0
    probing: bool = False


class Backoff:
    def __init__(self, first_s: float = FIRST_S, max_s: float = MAX_S) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self._records: dict[str, _Record] = {}

    def allows(self, worker: str, now: float) -> bool:
        """Whether a move may go to `worker` now."""
        record = self._records.get(worker)
        return record is None or (now >= record.until and not record.probing)

    def on_probation(self, worker: str) -> bool:
        """Whether `worker` failed lately: at most one move may go to it at a time."""
        return worker in self._records

    def started(self, worker: str) -> None:
        """A move to `worker` started (on probation: it is the probe)."""
        record = self._records.get(worker)
        if record is not None:
            record.probing = True

    def failed(self, worker: str, now: float) -> float:
        """A move to `worker` failed: how long it now sits out."""
        record = self._records.setdefault(worker, _Record())
        if record.failures and now < record.until and not record.probing:
            return record.until - now  # the same burst: already sitting out
        record.failures += 1
        seconds = min(self.first_s * 2 ** (record.failures - 1), self.max_s)
        record.until, record.probing = now + seconds, False
        return seconds

    def landed(self, worker: str) -> None:
        """A move to `worker` landed: it is a candidate like any other again."""
        self._records.pop(worker, None)

    def forget(self, worker: str) -> None:
        """`worker` detached: a worker that attaches under its id starts afresh."""
        self._records.pop(worker, None)
