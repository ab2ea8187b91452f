"""Publishing a step: the scheduler's token batch and finishes, handed to the frontends (part of
the Engine). Per step, not per token: one call hands over every token of the step as two arrays;
the frontends turn them into text and client messages."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np

from control_plane import metrics
from control_plane.core.inbox import LiveSample, Verdict
from control_plane.core.step_log import StepLog
from control_plane.request import FinishReason
from control_plane.scheduler.scheduler import Scheduler
from protos.worker import StepPlan

INTERNAL_ERROR = "internal error in the control plane (logged); the request could not be continued"


class Publisher(Protocol):
    """Where an engine's output goes (the hub, which sends it to the frontend owning each uid)."""

    def verdict(self, uid: int, verdict: Verdict, message: str = "") -> None: ...

    def admitted(self, uid: int, cached_tokens: int, at: float, worker: str) -> None: ...

    def tokens(self, uids: np.ndarray, token_ids: np.ndarray) -> None: ...

    def finished(self, uid: int, reason: FinishReason, cached_tokens: int) -> None: ...


class Publishing:
    """The engine's output side."""

    scheduler: Scheduler
    publisher: Publisher
    samples: dict[str, LiveSample]
    _groups: dict[str, list[str]]
    worker: str
    log: Any
    step_log: StepLog

    def _note_admissions(self, plan: StepPlan) -> None:
        """A sample's first admission: its queue time, and its cached prompt tokens for usage."""
        now = time.monotonic()
        for seq in plan.new_seqs:
            sample = self.samples.get(seq.request_id)
            if sample is None or sample.admitted is not None:
                continue
            sample.admitted = now
            req = self.scheduler.requests.get(seq.request_id)
            cached = req.cached_tokens if req is not None else 0
            self.publisher.admitted(sample.uid, cached, now, self.worker)
            self.step_log.metrics.queue_time.observe(max(now - sample.arrived, 0.0))

    def _publish(self) -> None:
        updates = self.scheduler.take_updates()
        tokens = updates.tokens
        if len(tokens.uids):
            self.publisher.tokens(tokens.uids, tokens.token_ids)
            self.step_log.metrics.generation_tokens.inc(len(tokens.uids))
        for finished in updates.finished:
            sample = self.samples.get(finished.rid)
            if sample is not None:
                self._finish_sample(sample, finished.reason, finished.cached_tokens)

    def _finish_sample(self, sample: LiveSample, reason: FinishReason, cached_tokens: int = 0) -> None:
        self.publisher.finished(sample.uid, reason, cached_tokens)
        metrics.REQUESTS_FINISHED.labels(self.worker, reason.kind.value).inc()
        self.samples.pop(sample.rid, None)
        rids = self._groups.get(sample.call)
        if rids is not None and all(r not in self.samples for r in rids):
            del self._groups[sample.call]

    def _fail_sample(self, rid: str, reason: FinishReason) -> None:
        """An abort for a sample the scheduler no longer knows (e.g. one it refused)."""
        sample = self.samples.get(rid)
        if sample is not None:
            self._finish_sample(sample, reason)

    def _abort_all(self, message: str) -> None:
        for sample in list(self.samples.values()):
            self._finish_sample(sample, FinishReason.abort(message))

    def _forget(self, samples: Iterable[LiveSample]) -> None:
        """Samples refused at admission: their call gets the verdict, not a finish."""
        for sample in samples:
            self.samples.pop(sample.rid, None)
            self._groups.pop(sample.call, None)
