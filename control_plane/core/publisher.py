"""An engine's live samples and what the frontends hear about them: a call's verdict, a sample's
admission, its tokens, its finish. Per step, not per token: one call hands over every token of
the step as two arrays; the frontends turn them into text and client messages.

A sample is here from its submission (or adoption from a lost worker) until its finish is
published or it continues on another engine. A call hears its verdict before anything else of
its samples, whichever way they end: the frontend holds a call's stream until its verdict comes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol

import numpy as np

from control_plane import metrics
from control_plane.core.inbox import LiveSample, Verdict
from control_plane.link import link_of
from control_plane.request import FinishReason, Request
from control_plane.scheduler.records import PromptScoring, StepUpdates
from protos.worker import StepPlan, TokenLogprobs

INTERNAL_ERROR = "internal error in the control plane (logged); the request could not be continued"


class Publisher(Protocol):
    """Where an engine's output goes (the hub, which sends it to the frontend owning each uid)."""

    def verdict(self, uid: int, verdict: Verdict, message: str = "") -> None: ...

    def admitted(self, uid: int, cached_tokens: int, at: float, worker: str) -> None: ...

    def tokens(
        self, uids: np.ndarray, token_ids: np.ndarray, scores: tuple[tuple[int, TokenLogprobs], ...] = ()
    ) -> None: ...

    def prompt_scores(self, scoring: PromptScoring) -> None: ...

    def finished(self, uid: int, reason: FinishReason, cached_tokens: int) -> None: ...


class Streams:
    """The live samples of one engine, by request id (rid, or rid/i of an n > 1 call), and their
    calls; every message about them goes out through here."""

    def __init__(self, publisher: Publisher, worker: str, worker_metrics: metrics.WorkerMetrics) -> None:
        self._publisher = publisher
        self._worker = worker
        self._metrics = worker_metrics
        self._samples: dict[str, LiveSample] = {}
        # Each call's samples (the rids of those not yet finished among them), by the call's id.
        self._calls: dict[str, list[str]] = {}
        # Calls submitted here that have not heard their verdict: the call's id -> its first uid.
        self._unanswered: dict[str, int] = {}

    # --- what is live ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._samples)

    def __contains__(self, rid: str) -> bool:
        return rid in self._samples

    def get(self, rid: str) -> LiveSample | None:
        return self._samples.get(rid)

    def rids(self) -> list[str]:
        return list(self._samples)

    def knows(self, rid: str) -> bool:
        """A live call's id or a live sample's."""
        return rid in self._calls or rid in self._samples

    def rids_of(self, rid: str) -> list[str]:
        """The live samples of the call `rid`, or the sample `rid` itself."""
        return [r for r in self._calls.get(rid, [rid]) if r in self._samples]

    def rid_of_uid(self, uid: int) -> str | None:
        return next((r for r, s in self._samples.items() if s.uid == uid), None)

    def rids_of_link(self, link_id: int) -> list[str]:
        """The live samples a frontend submitted."""
        return [r for r, s in self._samples.items() if link_of(s.uid) == link_id]

    def owner_of(self, rid: str) -> str | None:
        sample = next((self._samples[r] for r in self.rids_of(rid)), None)
        return sample.owner if sample is not None else None

    def admitted_at(self, rid: str) -> float | None:
        """When the sample first had a forward (None: not yet, or not live)."""
        sample = self._samples.get(rid)
        return sample.admitted if sample is not None else None

    def live_calls(self) -> Iterator[list[str]]:
        """The live samples of each call, a call at a time."""
        for rids in self._calls.values():
            live = [rid for rid in rids if rid in self._samples]
            if live:
                yield live

    # --- coming and going -----------------------------------------------------------------------

    def arrive(self, samples: tuple[LiveSample, ...]) -> None:
        """A Generate call submitted here: live from now on, and waiting for its verdict."""
        self._add(samples)
        self._unanswered[samples[0].call] = samples[0].uid

    def adopt(self, sample: LiveSample) -> None:
        """A sample that continues here (its call had its verdict where it started)."""
        self._add((sample,))

    def accept(self, samples: tuple[LiveSample, ...]) -> None:
        self._answer(samples[0].call, Verdict.ACCEPTED)

    def refuse(self, samples: tuple[LiveSample, ...], verdict: Verdict, message: str) -> None:
        """A call that does not run here (refused at admission, say): it gets the verdict, never a
        finish."""
        self._unanswered.pop(samples[0].call, None)
        self._publisher.verdict(samples[0].uid, verdict, message)
        for sample in samples:
            self._samples.pop(sample.rid, None)
        self._calls.pop(samples[0].call, None)

    def leave(self, sample: LiveSample) -> None:
        """The sample continues on another engine: nothing more of it is published here."""
        self._answer(sample.call, Verdict.ACCEPTED)
        self._drop(sample)

    def _add(self, samples: Iterable[LiveSample]) -> None:
        for sample in samples:
            self._samples[sample.rid] = sample
            self._calls.setdefault(sample.call, []).append(sample.rid)

    def _answer(self, call: str, verdict: Verdict, message: str = "") -> None:
        uid = self._unanswered.pop(call, None)
        if uid is not None:
            self._publisher.verdict(uid, verdict, message)

    def _drop(self, sample: LiveSample) -> None:
        self._samples.pop(sample.rid, None)
        rids = self._calls.get(sample.call)
        if rids is not None and all(r not in self._samples for r in rids):
            del self._calls[sample.call]

    # --- publishing -----------------------------------------------------------------------------

    def note_admissions(self, plan: StepPlan, requests: Mapping[str, Request]) -> None:
        """A sample's first admission: its queue time, and its cached prompt tokens for usage."""
        now = time.monotonic()
        for seq in plan.new_seqs:
            sample = self._samples.get(seq.request_id)
            if sample is None or sample.admitted is not None:
                continue
            sample.admitted = now
            req = requests.get(seq.request_id)
            cached = req.cached_tokens if req is not None else 0
            self._publisher.admitted(sample.uid, cached, now, self._worker)
            self._metrics.queue_time.observe(max(now - sample.arrived, 0.0))

    def publish(self, updates: StepUpdates) -> None:
        """A step's prompt scores, its tokens, then its finishes (a sample's prompt scores precede its
        tokens, every token its finish)."""
        for scoring in updates.prompt_scores:
            self._publisher.prompt_scores(scoring)
        tokens = updates.tokens
        if len(tokens.uids):
            self._publisher.tokens(tokens.uids, tokens.token_ids, tokens.scores)
            self._metrics.generation_tokens.inc(len(tokens.uids))
        for finished in updates.finished:
            sample = self._samples.get(finished.rid)
            if sample is not None:
                self.finish(sample, finished.reason, finished.cached_tokens)

    def finish(self, sample: LiveSample, reason: FinishReason, cached_tokens: int = 0) -> None:
        self._answer(sample.call, Verdict.ACCEPTED)  # let the call through to read its finish
        self._publisher.finished(sample.uid, reason, cached_tokens)
        metrics.REQUESTS_FINISHED.labels(self._worker, reason.kind.value).inc()
        self._drop(sample)

    def fail(self, rid: str, reason: FinishReason) -> None:
        """An abort for a sample the scheduler no longer knows (e.g. one it refused)."""
        sample = self._samples.get(rid)
        if sample is not None:
            self.finish(sample, reason)

    def abort_all(self, message: str) -> None:
        for sample in list(self._samples.values()):
            self.finish(sample, FinishReason.abort(message))
