"""A frontend's side of a request: the Generate call's events, and each sample's text stream.

The core streams token ids; here they become text (incremental detokenization), stop strings are
matched, and client messages are cut: the first token at once, then one message per
`--stream-interval` tokens, then the rest with the finish. A sample with stop strings is matched
token by token as its ids arrive (a stop ends the stream at once and tells the core); one without
is detokenized only when a message is due, a batch of ids at a time.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from control_plane.frontend.detokenize import TextStream
from control_plane.request import FinishReason
from protos.stepwise.v1 import generation_pb2 as gen_pb


@dataclass(frozen=True, slots=True)
class Chunk:
    index: int
    token_ids: tuple[int, ...]
    text: str
    # One per token when the sample asked for log probabilities, else empty.
    logprobs: tuple[gen_pb.TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Prompt:
    """The call's prompt log probabilities: sent before any chunk."""

    logprobs: gen_pb.PromptLogprobs


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


@dataclass(frozen=True, slots=True)
class Lost:
    """The frontend lost its core: the call ends with gRPC status UNAVAILABLE (the control plane
    failed as a whole; the client may retry elsewhere), whatever it had streamed."""

    message: str


Event = Chunk | Done | Lost | Prompt


@dataclass(slots=True, eq=False)
class Call:
    """One Generate call: its samples, and what its handler has to send next.

    The link's reader only records: ids go to a sample's `pending` (cheap, per token), and a sample
    whose message is due joins `due`. The handler cuts the messages when it runs (`take`): text is
    decoded there, once per message, for every id that arrived meanwhile. So the reader keeps up
    with the core however far behind the streams are (verdicts and replies behind it are read at
    once), and a stream that cannot keep up gets fewer, larger messages instead of a backlog.
    """

    rid: str
    owner: str
    arrived: float
    # Whether `owner` is an API key's id (the core binds keys to tenants).
    authenticated: bool = False
    # Events in order (a prompt's scores, a sample's last chunk and Done, Lost), before `due`.
    events: deque[Event] = field(default_factory=deque)
    # Samples with a message due, cut by the handler when it runs.
    due: list[Sample] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    # Resolves with the core's verdict: (grpc status code value, message); 0 is accepted.
    verdict: asyncio.Future[tuple[int, str]] | None = None
    # With a refusal over a tenant's quota: when to try again (the `retry-after` trailer), seconds.
    retry_after_s: float = 0.0
    # The handler's wait for something to send, while it waits.
    _waiter: asyncio.Future[None] | None = None

    @property
    def live(self) -> bool:
        return any(not s.done for s in self.samples)

    @property
    def streaming(self) -> bool:
        """Every sample's first message went: later ones wait for the pacer's slot (pacer.py)."""
        return all(s.first_token is not None or s.done for s in self.samples)

    def post(self, event: Event) -> None:
        self.events.append(event)
        self._wake()

    def mark_due(self, sample: Sample) -> None:
        if not sample.queued:
            sample.queued = True
            self.due.append(sample)
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Until there is something to send (at once when there is)."""
        while not self.events and not self.due:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


@dataclass(slots=True, eq=False)
class Sample:
    """One sample's stream: ids in, text out, stop strings, message cutting, usage and timings."""

    uid: int
    call: Call
    index: int
    prompt_len: int
    text: TextStream
    has_stops: bool
    # Ids received but not yet in a client message (and, without stop strings, not yet detokenized).
    pending: list[int] = field(default_factory=list)
    # Whether tokens carry log probabilities (then one per pending id here).
    scored: bool = False
    pending_scores: list[gen_pb.TokenLogprob] = field(default_factory=list)
    # Text of pending ids already detokenized (samples with stop strings).
    pending_text: str = ""
    admitted: float | None = None
    first_token: float | None = None
    last_message: float = 0.0
    cached_tokens: int = 0
    completion_tokens: int = 0
    worker: str = ""
    # The inter-token latency histogram's child for `worker`, resolved at the first later message
    # (prometheus_client's labels() takes a lock and builds a key on every call).
    itl: Any = None
    # In its call's `due` list.
    queued: bool = False
    done: bool = False

    def receive(self, token: int, score: gen_pb.TokenLogprob | None = None) -> str | None:
        """Take one output id (with its log probabilities when the sample asked); returns the stop
        string it completed, if any (the sample is then done apart from its Done event, which
        `finish` sends)."""
        self.completion_tokens += 1
        self.pending.append(token)
        if self.scored:
            self.pending_scores.append(score if score is not None else gen_pb.TokenLogprob(token_id=token))
        if not self.has_stops:
            return None
        delta = self.text.push((token,))
        self.pending_text += delta.text
        return delta.stop

    def message_due(self, interval: int) -> bool:
        return bool(self.pending) and (self.first_token is None or len(self.pending) >= interval)

    def flush(self) -> Chunk | None:
        """The pending ids and their text as one chunk (None when there is nothing to send)."""
        if not self.pending and not self.pending_text:
            return None
        tokens, self.pending = tuple(self.pending), []
        scores, self.pending_scores = tuple(self.pending_scores), []
        text = self.pending_text if self.has_stops else self.text.push(tokens).text
        self.pending_text = ""
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
        self.last_message = now
        return Chunk(self.index, tokens, text, scores)

    def finish(self, reason: FinishReason) -> list[Event]:
        """The last chunk (pending ids and held-back text; none after a stop string) and Done."""
        events: list[Event] = []
        chunk = self.flush()
        tail = self.text.finish()
        if chunk is not None or tail:
            base = chunk or Chunk(self.index, (), "")
            events.append(Chunk(self.index, base.token_ids, base.text + tail, base.logprobs))
        now = time.monotonic()
        arrived = self.call.arrived
        admitted = self.admitted if self.admitted is not None else now
        first = self.first_token if self.first_token is not None else now
        events.append(
            Done(
                index=self.index,
                reason=reason,
                prompt_tokens=self.prompt_len,
                cached_tokens=self.cached_tokens,
                completion_tokens=self.completion_tokens,
                queue_s=max(admitted - arrived, 0.0),
                ttft_s=max(first - arrived, 0.0),
                total_s=now - arrived,
            )
        )
        self.done = True
        return events
