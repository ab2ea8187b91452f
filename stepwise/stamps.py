"""What a live recording's timing stamps say (entries.py `at_s`, `received_s`; the control plane's
clock): each step's span, and the two client path terms `stepwise simulate --fit-cost` fits
(docs/debugging.md#step-cost-models).

- A step's span: from the later of its plan being made and the previous result being applied, to
  its own result being applied. In a busy stretch that is the gap between two results (the
  forward, the worker's hand-off of the plan to its thread and back, the result's way back, and
  the control plane's turn where it outlasts the forward); after an idle wait it is the whole
  round trip from the plan. A simulated clock that advances by spans reaches each step's end when
  the live control plane had its result.
- `arrive_s`: from a call reaching the control plane's frontend to the scheduler taking it,
  median over the requests that arrived while the scheduler was idle (so no step was in the way:
  the wait for the step in flight is the simulation's to reproduce, not a term's).
- `publish_s`: from a step's result being applied to the finishes it made being published (the
  engine first plans and sends the next step), median over the finishes.
- the hand-off (printed, not a term: the span holds it): what a busy step's span holds beyond the
  worker's forward and its wait for the plan (`forward_s`, `wait_s`): the plan's hand-off to the
  forward and the result's way back to the control plane, median over the steps whose plan was
  made before the previous result was applied.

Recordings made before the stamps have none (every `at_s` 0): no spans, no terms.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from control_plane.record.entries import AddRequest, ApplyResult, Entry, Finished, NextPlan, OnIdle


@dataclass(slots=True)
class Stamps:
    """Collects the stamps of the entries passed through `noting`."""

    # step id -> its span, seconds (steps whose span is known).
    spans: dict[int, float] = field(default_factory=dict)
    # Frontend-to-scheduler seconds of the requests added while the scheduler was idle.
    arrivals: list[float] = field(default_factory=list)
    # Result-to-publication seconds of every stamped finish.
    publishes: list[float] = field(default_factory=list)
    # Busy steps' span less their forward and wait.
    hand_offs: list[float] = field(default_factory=list)
    # Whether any plan or result carried a stamp.
    stamped: bool = False
    _planned: dict[int, float] = field(default_factory=dict)
    _applied: float = 0.0
    _idle_step: int = -1
    _plans: int = 0

    def noting(self, entries: Iterable[Entry]) -> Iterator[Entry]:
        """The entries, unchanged, their stamps noted on the way."""
        for entry in entries:
            self._note(entry)
            yield entry

    def _note(self, entry: Entry) -> None:
        if isinstance(entry, NextPlan):
            if entry.plan is not None:
                self._plans += 1
                if entry.at_s > 0:
                    self.stamped = True
                    self._planned[entry.plan.step_id] = entry.at_s
        elif isinstance(entry, ApplyResult):
            self._apply(entry)
        elif isinstance(entry, OnIdle):
            self._idle_step = entry.step
        elif isinstance(entry, AddRequest):
            idle = self._idle_step == entry.step
            if idle and not entry.error and entry.at_s > 0 and entry.received_s > 0:
                self.arrivals.append(max(0.0, entry.at_s - entry.received_s))
        elif isinstance(entry, Finished) and entry.at_s > 0 and self._applied > 0:
            self.publishes.append(max(0.0, entry.at_s - self._applied))

    def _apply(self, entry: ApplyResult) -> None:
        if entry.at_s <= 0:
            return
        self.stamped = True
        planned = self._planned.pop(entry.result.step_id, 0.0)
        if planned > 0 and self._applied > 0:
            span = self.spans[entry.result.step_id] = entry.at_s - max(self._applied, planned)
            if planned <= self._applied:
                self.hand_offs.append(span - entry.result.forward_s - entry.result.wait_s)
        elif planned > 0:  # the session's first result: its round trip from the plan
            self.spans[entry.result.step_id] = entry.at_s - planned
        self._applied = entry.at_s

    @property
    def arrive_s(self) -> float:
        return statistics.median(self.arrivals) if self.arrivals else 0.0

    @property
    def hand_off_s(self) -> float:
        return statistics.median(self.hand_offs) if self.hand_offs else 0.0

    @property
    def publish_s(self) -> float:
        return statistics.median(self.publishes) if self.publishes else 0.0
