"""Stand-ins around an Engine in process: a worker channel over FakeWorker and a hub that records
what the engine publishes, per uid, in order."""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from control_plane.config import ControlConfig
from control_plane.core.engine import Engine
from control_plane.core.fleet import Fleet
from control_plane.core.inbox import Arrival, LiveSample, Verdict
from control_plane.link import UID_LINK_SHIFT
from control_plane.request import FinishReason, RequestParams
from control_plane.scheduler.records import PromptScoring
from protos.worker import StepPlan, StepResult, TokenLogprobs, TransferOutcome, WorkerLimits
from tests.control_plane.factories import make_config
from tests.control_plane.fake_worker import FakeWorker

# The destination workers' own reports of transfers they hold, by transfer address: a send to one
# of them is reported there as soon as the plan that carries it runs (Engine.worker_received).
Receivers = dict[str, Callable[[TransferOutcome], None]]


class FakeChannel:
    """Plans run on a FakeWorker in order; `log` says when each was sent and received. A send to an
    address in `receivers` is reported there when its plan runs, before the result comes back."""

    def __init__(
        self,
        worker: FakeWorker,
        step_s: float = 0.0,
        log: list[tuple[str, int]] | None = None,
        receivers: Receivers | None = None,
    ) -> None:
        self.worker = worker
        self.step_s = step_s
        self.receivers = receivers if receivers is not None else {}
        self.sent: deque[StepPlan] = deque()
        self.closed = ""
        # The Move that ended the session (empty: none; `closed` is its Shutdown).
        self.moved = ""
        # The Dropped that ended it (the worker was let go and told why).
        self.dropped = ""
        self.log = log if log is not None else []
        self.max_in_flight = 0

    async def send(self, plan: StepPlan) -> None:
        self.sent.append(plan)
        self.max_in_flight = max(self.max_in_flight, len(self.sent))
        self.log.append(("send", plan.step_id))

    async def receive(self) -> StepResult:
        await asyncio.sleep(self.step_s)
        plan = self.sent.popleft()
        self.log.append(("receive", plan.step_id))
        result = self.worker.run(plan)
        for outcome in result.transfers:  # the sender's word: each arrived at once
            send = next(s for s in plan.sends if s.transfer_id == outcome.transfer_id)
            if send.address in self.receivers:
                self.receivers[send.address](outcome)
        return result

    async def close(self, reason: str) -> None:
        if not self.moved and not self.dropped:  # the session ends once, as StreamChannel's does
            self.closed = self.closed or reason

    async def move(self, reason: str) -> None:
        if not self.closed and not self.dropped:
            self.moved = self.moved or reason

    async def drop(self, reason: str) -> None:
        if not self.closed and not self.moved:
            self.dropped = self.dropped or reason


@dataclass(slots=True)
class Stream:
    """What the hub received for one uid."""

    tokens: list[int] = field(default_factory=list)
    finished: FinishReason | None = None
    cached_tokens: int = 0
    admitted: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # Logprobs of the tokens that had them, in order, and the prompt's scores.
    scores: list[TokenLogprobs] = field(default_factory=list)
    prompt_scores: PromptScoring | None = None


class FakeHub:
    """A Publisher that keeps everything, by uid."""

    def __init__(self, log: list[tuple[str, int]] | None = None) -> None:
        self.streams: dict[int, Stream] = {}
        self.verdicts: dict[int, tuple[Verdict, str]] = {}
        self.log = log if log is not None else []
        # The server registers each worker's grammar gate here, as with the real hub.
        self.grammar_gates: dict[object, object] = {}

    def stream(self, uid: int) -> Stream:
        return self.streams.setdefault(uid, Stream())

    def verdict(self, uid: int, verdict: Verdict, message: str = "") -> None:
        self.verdicts[uid] = (verdict, message)

    def admitted(self, uid: int, cached_tokens: int, at: float, worker: str) -> None:
        self.stream(uid).admitted = True

    def tokens(self, uids: np.ndarray, token_ids: np.ndarray, scores: tuple = ()) -> None:
        self.log.append(("publish", len(uids)))
        scored = dict(scores)
        for k, (uid, token) in enumerate(zip(uids.tolist(), token_ids.tolist(), strict=True)):
            stream = self.stream(uid)
            assert stream.finished is None, f"a token for uid {uid} after its finish"
            stream.tokens.append(token)
            if k in scored:
                stream.scores.append(scored[k])

    def prompt_scores(self, scoring: PromptScoring) -> None:
        stream = self.stream(scoring.uid)
        assert not stream.tokens and stream.prompt_scores is None, (
            f"uid {scoring.uid}: prompt scores late or twice"
        )
        stream.prompt_scores = scoring

    def finished(self, uid: int, reason: FinishReason, cached_tokens: int) -> None:
        stream = self.stream(uid)
        assert stream.finished is None, f"uid {uid} finished twice"
        stream.finished, stream.cached_tokens = reason, cached_tokens
        stream.done.set()


_uids = itertools.count(1)


def submit(
    engine: Engine, rid: str, ids: list[int], params: RequestParams, n: int = 1, link: int = 1
) -> list[int]:
    """Submit a call of n samples as the hub would; returns their uids."""
    uids = [(link << UID_LINK_SHIFT) | next(_uids) for _ in range(n)]
    rids = [rid] if n == 1 else [f"{rid}/{i}" for i in range(n)]
    samples = tuple(LiveSample(r, u, rid, "owner", 0.0) for r, u in zip(rids, uids, strict=True))
    engine.submit(Arrival(samples, list(ids), params))
    return uids


async def finished(hub: FakeHub, uids: list[int], timeout: float = 10.0) -> list[Stream]:
    for uid in uids:
        await asyncio.wait_for(hub.stream(uid).done.wait(), timeout)
    return [hub.stream(uid) for uid in uids]


def make_engine(
    vocab: int,
    eos: frozenset[int] = frozenset(),
    capacity: int = 4096,
    overlap: bool = True,
    step_s: float = 0.0,
    log: list[tuple[str, int]] | None = None,
    control: dict[str, object] | None = None,
    worker_id: str = "w-test",
    hub: FakeHub | None = None,
    fleet: Fleet[Engine] | None = None,
    channel_class: type[FakeChannel] = FakeChannel,
    network: dict[str, list[tuple[int, int]]] | None = None,
    role: str = "mixed",
    receivers: Receivers | None = None,
    **scheduler: object,
) -> tuple[Engine, FakeChannel, FakeHub]:
    """An engine over a FakeWorker; `control` sets ControlConfig fields, the rest the scheduler's.
    Engines that share a `hub` publish to one place (as a control plane's engines do); engines
    given one `fleet` (over the router they are attached to) know each other as the server's do.
    Engines whose workers share a `network` can migrate requests between them
    (each announces a transfer address); with a shared `receivers` too, each destination worker
    reports what it received as a real one welcomed with `transfer_reports` does."""
    config = ControlConfig(
        model_dir=Path("."),
        scheduler=make_config(**scheduler),
        decode_log_interval=1,
        overlap=overlap,
        **(control or {}),  # type: ignore[arg-type]
    )
    address = f"{worker_id}:1" if network is not None else ""
    limits = WorkerLimits(worker_id, capacity, 1, 2048, vocab, eos, transfer_address=address, role=role)
    channel = channel_class(FakeWorker(capacity, vocab=vocab, network=network), step_s, log, receivers)
    hub = hub if hub is not None else FakeHub(channel.log)
    engine = Engine(config, limits, channel, hub, fleet)
    if receivers is not None:
        receivers[address] = engine.worker_received
    return engine, channel, hub
