"""The client side of a request: the events its Generate call reads, its stream state, and
publishing the scheduler's updates as text (detokenization and stop strings happen here)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from control_plane import metrics
from control_plane.request import FinishReason, RequestParams
from control_plane.scheduler.plan import StepPlan
from control_plane.scheduler.scheduler import RequestUpdate, Scheduler
from control_plane.tokenizer import TextStream

INTERNAL_ERROR = "internal error in the control plane (logged); the request could not be continued"


@dataclass(frozen=True, slots=True)
class Chunk:
    index: int
    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True, slots=True)
class Done:
    index: int
    reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queue_s: float
    ttft_s: float
    total_s: float


Event = Chunk | Done


@dataclass(slots=True)
class RequestStream:
    """The client side of one request (one sample): text stream, timestamps, where events go."""

    rid: str
    # The Generate call this sample belongs to (== rid when n == 1).
    call: str
    index: int
    prompt_len: int
    text: TextStream
    # Shared by the samples of one Generate call.
    events: asyncio.Queue[Event]
    arrived: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    first_token: float | None = None
    last_token: float = 0.0
    completion_tokens: int = 0
    done: bool = False
    # Faults of our own this request lived through (see Engine._recover).
    faults: int = 0
    # Who submitted it (an API key's id, or the client's connection); only they may abort it.
    owner: str = ""


@dataclass(slots=True)
class Submission:
    """One Generate call: its samples' request ids and the queue their events arrive on."""

    rid: str
    rids: list[str]
    events: asyncio.Queue[Event]
    # Resolves once the scheduler has taken (or refused, with QueueFull etc.) every sample.
    accepted: asyncio.Future[None]


@dataclass(frozen=True, slots=True)
class Arrival:
    submission: Submission
    streams: list[RequestStream]
    input_ids: list[int]
    params: list[RequestParams]


@dataclass(frozen=True, slots=True)
class AbortItem:
    rid: str
    reason: FinishReason


@dataclass(frozen=True, slots=True)
class Orphan:
    """A live request of a lost worker, to continue on another one from where it stopped."""

    stream: RequestStream
    # The prompt plus every token already streamed: the next token continues the generation.
    input_ids: list[int]
    # The client's parameters with max_new_tokens reduced by what was generated.
    params: RequestParams


class Publishing:
    """Turns the scheduler's updates into each Generate call's events (part of the Engine)."""

    scheduler: Scheduler
    streams: dict[str, RequestStream]
    _groups: dict[str, list[str]]
    worker: str
    log: Any

    def _fail_stream(self, rid: str, reason: FinishReason) -> None:
        """An abort for a request the scheduler no longer knows (e.g. still in the inbox)."""
        stream = self.streams.get(rid)
        if stream is not None and not stream.done:
            self._finish_stream(stream, reason)

    def _note_admissions(self, plan: StepPlan) -> None:
        now = time.monotonic()
        for seq in plan.new_seqs:
            req = self.scheduler.by_handle.get(seq.handle)
            stream = self.streams.get(req.rid) if req is not None else None
            if stream is not None and stream.admitted is None:
                stream.admitted = now
                metrics.QUEUE_TIME.labels(self.worker).observe(now - stream.arrived)

    def _publish(self) -> None:
        while updates := self.scheduler.take_updates():
            for update in updates:
                self._publish_one(update)

    def _publish_one(self, update: RequestUpdate) -> None:
        stream = self.streams.get(update.rid)
        if stream is None or stream.done:
            return
        try:
            self._deliver(stream, update)
        except Exception:
            # A fault in one request's text (detokenizer, stop matcher) ends that request alone.
            self.log.exception("publishing failed", rid=stream.rid)
            self.scheduler.abort(stream.rid, FinishReason.abort(INTERNAL_ERROR))
            if not stream.done:
                self._finish_stream(stream, FinishReason.abort(INTERNAL_ERROR))

    def _deliver(self, stream: RequestStream, update: RequestUpdate) -> None:
        if update.token_ids:
            self._push_tokens(stream, update.token_ids)
        if update.finished is not None:
            self._finish_stream(stream, update.finished, update.cached_tokens)

    def _push_tokens(self, stream: RequestStream, token_ids: tuple[int, ...]) -> None:
        now = time.monotonic()
        if stream.first_token is None:
            stream.first_token = now
            metrics.TTFT.labels(self.worker).observe(now - stream.arrived)
        else:
            metrics.ITL.labels(self.worker).observe(now - stream.last_token)
        stream.last_token = now
        metrics.GENERATION_TOKENS.labels(self.worker).inc(len(token_ids))
        stream.completion_tokens += len(token_ids)
        delta = stream.text.push(token_ids)
        stream.events.put_nowait(Chunk(stream.index, token_ids, delta.text))
        if delta.stop is not None:
            # Finished here; its KV is cached and its handle released in the next plan.
            self.scheduler.finish(stream.rid, FinishReason.stop(f"stop string {delta.stop!r}"))

    def _finish_stream(self, stream: RequestStream, reason: FinishReason, cached_tokens: int = 0) -> None:
        tail = stream.text.finish()
        if tail:
            stream.events.put_nowait(Chunk(stream.index, (), tail))
        now = time.monotonic()
        admitted = stream.admitted if stream.admitted is not None else now
        first = stream.first_token if stream.first_token is not None else now
        stream.events.put_nowait(
            Done(
                index=stream.index,
                reason=reason,
                prompt_tokens=stream.prompt_len,
                cached_tokens=cached_tokens,
                completion_tokens=stream.completion_tokens,
                queue_s=admitted - stream.arrived,
                ttft_s=first - stream.arrived,
                total_s=now - stream.arrived,
            )
        )
        stream.done = True
        metrics.E2E_LATENCY.labels(self.worker).observe(now - stream.arrived)
        metrics.REQUESTS_FINISHED.labels(self.worker, reason.kind.value).inc()
        self.streams.pop(stream.rid, None)
        rids = self._groups.get(stream.call)
        if rids is not None and all(r not in self.streams for r in rids):
            del self._groups[stream.call]

    def _abort_all(self, message: str) -> None:
        for stream in list(self.streams.values()):
            if not stream.done:
                self._finish_stream(stream, FinishReason.abort(message))

    def _forget(self, submission: Submission) -> None:
        for rid in submission.rids:
            self.streams.pop(rid, None)
        self._groups.pop(submission.rid, None)
