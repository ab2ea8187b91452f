"""What reaches an engine between steps (arrivals, aborts, stop-string finishes, a lost worker's
orphans, migrated samples), and the core's record of each live sample.

The engine applies its inbox at the top of every loop turn, so the scheduler sees each item at a
well-defined step: the one the recorder stamps.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

from control_plane.request import FinishReason, RequestParams


class Verdict(enum.Enum):
    """The core's answer to an arrival (the frontend maps it to a gRPC status)."""

    ACCEPTED = "accepted"
    QUEUE_FULL = "queue_full"  # RESOURCE_EXHAUSTED
    SLO_UNMEETABLE = "slo_unmeetable"  # RESOURCE_EXHAUSTED: its TTFT objective cannot be met (--slo-cost)
    REJECTED = "rejected"  # UNAVAILABLE: the server refuses (SGLang's 503), the input is fine
    UNAVAILABLE = "unavailable"  # no worker could take it
    DUPLICATE = "duplicate"  # ALREADY_EXISTS: the request id is live
    INVALID = "invalid"  # INVALID_ARGUMENT: e.g. longer than the worker's context
    INTERNAL = "internal"
    OVER_QUOTA = "over_quota"  # RESOURCE_EXHAUSTED with a retry-after: the tenant's quota (--tenants)
    FORBIDDEN = "forbidden"  # PERMISSION_DENIED: the key may not name that tenant


@dataclass(slots=True, eq=False)
class LiveSample:
    """One sample of a Generate call as the core knows it: whom to tell, and when it arrived."""

    rid: str
    # The frontend's stream key (its link id in the top bits).
    uid: int
    # The Generate call's request id (== rid when n == 1).
    call: str
    # Who may abort it: an API key's id, or the client's connection.
    owner: str
    # CLOCK_MONOTONIC seconds (the frontend's stamp).
    arrived: float
    admitted: float | None = None
    # Faults of our own this sample lived through (see handover.py).
    faults: int = 0


@dataclass(frozen=True, slots=True)
class Arrival:
    """A Generate call: its samples (rid, or rid/i for n > 1) are queued together or not at all."""

    samples: tuple[LiveSample, ...]
    input_ids: list[int]
    params: RequestParams


@dataclass(frozen=True, slots=True)
class AbortItem:
    rid: str
    reason: FinishReason


@dataclass(frozen=True, slots=True)
class StopItem:
    """A frontend ended the sample on a stop string: finish it and cache its KV."""

    rid: str
    reason: FinishReason


@dataclass(frozen=True, slots=True)
class Orphan:
    """A live sample of a lost worker (or of a scheduler restarted after a fault), to continue from
    where it stopped."""

    sample: LiveSample
    # The prompt plus every token already streamed: the next token continues the generation.
    input_ids: list[int]
    # The client's parameters with max_new_tokens reduced by what was generated.
    params: RequestParams


@dataclass(frozen=True, slots=True)
class Precopied:
    """A running request's KV pre-copied here (migration.py): hold it in the prefix cache until the
    request comes."""

    transfer_id: str
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Immigrant:
    """A sample migrated here with its KV (migration.py): import the tail, release the pre-copy's
    hold, then admit the orphan."""

    orphan: Orphan
    # The tail's transfer ("" when the pre-copy sent everything).
    transfer_id: str
    # The tokens whose KV the source sent (the leading part of the orphan's input): the tail from
    # `start` on, the pre-copy `held` (a transfer id, "" for none) the rest.
    tokens: tuple[int, ...]
    # When its source switched it off (the client's gap starts there).
    since: float
    start: int = 0
    held: str = ""


@dataclass(frozen=True, slots=True)
class Forget:
    """A migration to here was given up: the worker drops the transfer (now, or when it arrives)."""

    transfer_id: str


Item = Arrival | AbortItem | StopItem | Orphan | Precopied | Immigrant | Forget


class Inbox:
    """What waits for the engine's next turn, and the event that wakes its loop when something
    comes."""

    def __init__(self) -> None:
        self.items: list[Item] = []
        self.wake = asyncio.Event()

    def __bool__(self) -> bool:
        return bool(self.items)

    def put(self, *items: Item) -> None:
        self.items.extend(items)
        self.wake.set()

    def take(self) -> list[Item]:
        items, self.items = self.items, []
        return items

    def arriving(self) -> int:
        """Samples waiting to be admitted (arrivals, orphans, immigrants)."""
        return sum(
            len(m.samples) if isinstance(m, Arrival) else 1
            for m in self.items
            if isinstance(m, Arrival | Orphan | Immigrant)
        )

    def waiting_rids(self) -> set[str]:
        """Samples whose arrival, orphan or immigrant is still here."""
        waiting = {s.rid for item in self.items if isinstance(item, Arrival) for s in item.samples}
        waiting |= {item.orphan.sample.rid for item in self.items if isinstance(item, Immigrant)}
        return waiting | {item.sample.rid for item in self.items if isinstance(item, Orphan)}
