"""Finding a control plane to attach to, and when to look again.

A search resolves `--control` to every address (protos/targets.py), asks each one for its
`Census` at once, and picks the accepting control plane with the fewest workers: workers spread
themselves over control planes as they start, without a coordinator. The worker dials the chosen
ADDRESS, not the name (a name stands for every control plane behind a headless Service); with TLS
the certificate is still verified against the name.

One misconfigured control plane must not end the fleet's workers: it has no workers, so it always
looks emptiest. The census request carries the worker's hello and a control plane says whether it
would refuse it for good (then it is not chosen); one that refuses at Connect all the same (one
too old to say, or a race) is remembered and not chosen again. Only when every address answers and
every control plane there refuses does the search say so (the worker exits 2): an address that
does not answer may be a control plane restarting, which may take the worker when it is back.

Between failed searches and after a lost control plane the worker waits a capped, doubling delay
with equal jitter (`backoff_delays`): workers that lost the same control plane at the same moment
come back spread out instead of all at once.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc
import structlog

from data_plane.config import WorkerConfig
from protos import worker_codec
from protos.stepwise.v1 import worker_pb2_grpc
from protos.targets import Address, parse_targets, resolve
from protos.worker import Census, WorkerLimits

CENSUS_TIMEOUT_S = 1.0
BACKOFF_BASE_S = 0.1

CHANNEL_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    # A worker waiting for plans only reads: without pings it would never notice a control plane
    # whose node vanished without closing the connection. Unanswered for 20 + 10 s: lost.
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A control plane that answered a census, at the address it answered on."""

    address: Address
    census: Census

    def same_plane(self, other: Candidate | None) -> bool:
        """Whether `other` is this control plane: the same id, or the same address when either has
        none (one control plane can answer on two addresses: 127.0.0.1 and ::1)."""
        if other is None:
            return False
        ours, theirs = self.census.control_plane_id, other.census.control_plane_id
        if ours and theirs:
            return ours == theirs
        return (self.address.ip, self.address.port) == (other.address.ip, other.address.port)


@dataclass(frozen=True, slots=True)
class Refusal:
    """A control plane that refuses this worker for good, and why (its census said so, or Connect did)."""

    candidate: Candidate
    reason: str


@dataclass(frozen=True, slots=True)
class Found:
    """What a search found: the control plane to attach to (None when none fits), and, only when
    every address answered and every control plane there refuses this worker for good, each
    refusal (the worker then exits 2)."""

    chosen: Candidate | None
    refused_everywhere: tuple[Refusal, ...] = ()


def choose(
    candidates: Sequence[Candidate],
    fingerprint: str,
    avoid: Candidate | None = None,
    refused: Sequence[Candidate] = (),
) -> Candidate | None:
    """The control plane to attach to, None when none fits.

    Fits: accepting, serving this model or none yet, and not refusing this worker for good (its
    census says so, or it is one of `refused`). Among those the fewest workers win, ties go to the
    least loaded (queued + running), then to the lowest address, so every worker that sees the same
    censuses makes the same choice. `avoid` (the control plane that just moved this worker away) is
    passed over while any other fits.
    """
    fit = [
        c
        for c in candidates
        if c.census.accepting
        and c.census.model_fingerprint in ("", fingerprint)
        and not c.census.refuses()
        and not any(c.same_plane(r) for r in refused)
    ]
    others = [c for c in fit if not c.same_plane(avoid)]
    return min(others or fit, key=_rank, default=None)


def _rank(c: Candidate) -> tuple[int, int, str, int]:
    return (c.census.workers, c.census.queued + c.census.running, c.address.ip, c.address.port)


def backoff_delays(base_s: float, cap_s: float, rng: random.Random) -> Iterator[float]:
    """Seconds to wait before each retry: the step doubles from `base_s` up to `cap_s`, and each
    delay is half the step plus a uniform draw over the other half ("equal jitter": the delays
    grow, and two workers that start together drift apart)."""
    step = min(base_s, cap_s)
    while True:
        yield step / 2 + rng.uniform(0.0, step / 2)
        step = min(step * 2, cap_s)


class Retry:
    """When the next search may start. Before the worker was first welcomed, searches end at
    `deadline` (time.monotonic(), from --connect-timeout); after that they go on forever, and each
    welcomed session starts the backoff over."""

    def __init__(self, cap_s: float, deadline: float | None, rng: random.Random | None = None) -> None:
        self._cap_s = cap_s
        self._rng = rng or random.Random()
        self._delays = backoff_delays(BACKOFF_BASE_S, cap_s, self._rng)
        self.deadline = deadline
        self.attempt = 0

    def welcomed(self) -> None:
        self._delays = backoff_delays(BACKOFF_BASE_S, self._cap_s, self._rng)
        self.deadline = None
        self.attempt = 0

    async def wait(self) -> bool:
        """Sleep until the next attempt; False, at once, when the deadline has passed (the last
        delay before it is cut short, so the deadline itself gets one more try)."""
        delay = next(self._delays)
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                return False
            delay = min(delay, left)
        self.attempt += 1
        log.info("redial", attempt=self.attempt, delay_s=round(delay, 3))
        await asyncio.sleep(delay)
        return True

    async def jitter(self) -> None:
        """A short random pause instead of a backoff (after a Move: many workers may move at once)."""
        await asyncio.sleep(self._rng.uniform(0.0, BACKOFF_BASE_S))


class Dialer:
    """Searches the control planes of `--control` and opens channels to them (TLS as configured)."""

    def __init__(self, config: WorkerConfig, hello: WorkerLimits) -> None:
        self._endpoints = parse_targets(config.control, "--control")
        self._hello = hello
        # Control planes that refused this worker for good at Connect, for the rest of the process.
        # What such a refusal rests on (protocol version, --page-size, --chunked-prefill-size, the
        # tokenizer, the limits) is fixed for the life of a control-plane process, and a restarted,
        # corrected one has a new control_plane_id (Candidate.same_plane), so it is tried again.
        self._refused: list[Refusal] = []
        self._tls_server_name = config.tls_server_name
        self._creds = None
        if config.tls_ca is not None:
            self._creds = grpc.ssl_channel_credentials(
                root_certificates=config.tls_ca.read_bytes(),
                private_key=config.tls_key.read_bytes() if config.tls_key else None,
                certificate_chain=config.tls_cert.read_bytes() if config.tls_cert else None,
            )

    def refused(self, candidate: Candidate, reason: str) -> None:
        """`candidate` refused this worker for good at Connect: never choose it again."""
        self._refused.append(Refusal(candidate, reason))

    async def search(self, avoid: Candidate | None = None) -> Found:
        """Ask every address for its census (and whether it would take this worker); what was found."""
        addresses = await resolve(self._endpoints)
        answers = await asyncio.gather(*(self._census(a) for a in addresses))
        candidates = [c for c in answers if c is not None]
        remembered = [r.candidate for r in self._refused]
        chosen = choose(candidates, self._hello.model_fingerprint, avoid, remembered)
        refusals = [r for r in map(self._refusal, candidates) if r is not None]
        log.info(
            "search",
            addresses=len(addresses),
            answered=len(candidates),
            refusing=len(refusals),
            chosen=chosen.address.target if chosen else None,
            workers=chosen.census.workers if chosen else None,
        )
        everywhere = chosen is None and bool(addresses) and len(refusals) == len(addresses)
        return Found(chosen, tuple(refusals) if everywhere else ())

    def _refusal(self, candidate: Candidate) -> Refusal | None:
        """Why `candidate` refuses this worker for good, None when it does not (as far as is known)."""
        if candidate.census.refuses():
            return Refusal(candidate, candidate.census.refusal)
        remembered = next((r for r in self._refused if candidate.same_plane(r.candidate)), None)
        return None if remembered is None else Refusal(candidate, remembered.reason)

    def channel(self, address: Address) -> grpc.aio.Channel:
        """A channel to the address itself: plaintext, or TLS verifying the control plane against
        --tls-server-name, else the host name it was found under (--tls-cert/--tls-key: mutual TLS)."""
        if self._creds is None:
            return grpc.aio.insecure_channel(address.target, options=CHANNEL_OPTIONS)
        options = list(CHANNEL_OPTIONS)
        name = self._tls_server_name or address.tls_name
        if name:
            options.append(("grpc.ssl_target_name_override", name))
        return grpc.aio.secure_channel(address.target, self._creds, options=options)

    async def _census(self, address: Address) -> Candidate | None:
        async with self.channel(address) as channel:
            stub = worker_pb2_grpc.WorkerLinkStub(channel)
            try:
                request = worker_codec.census_request(self._hello)
                reply = await stub.Census(request, timeout=CENSUS_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return Candidate(address, Census())  # a control plane without Census: none attached
                log.debug(
                    "census_failed", address=address.target, error=f"{exc.code().name}: {exc.details()}"
                )
                return None
        return Candidate(address, worker_codec.census_from_proto(reply))
