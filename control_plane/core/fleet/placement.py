"""Placement: after each step of a worker, which of its running calls move to another worker, and
where (docs/migration.md). Pure functions of plain values: the deciding worker's calls and KV room,
and its candidates (`Peer`: role, room, load); fleet.py reads those off the live engines (a
simulator builds them itself) and the engine starts the moves returned.

Four reasons, one decision per step, tried in this order:

- "test" (STEPWISE_TEST_MIGRATE, a test knob): every `test_interval` steps one ready call, drawn
  from a seeded generator, moves to the least loaded candidate (`one_at_random`);
- "pd": a prefill worker hands each ready call to the least loaded decode worker with room for it
  and its next `steps` tokens, its whole KV in one copy (`to_decode`);
- "kv" and "balance": KV room among workers of one role (balance.py's rules, `balance`);
- "drain": a worker that drains or moves away sends every call it can to the least loaded
  candidates (`drain`; the engine asks on each turn of leaving, not after a step).

A call is "ready" when each of its samples made a token here (moving one before its first token on
each worker could go on for ever) and none is moving already; only movable calls (every sample
running here, none moving) are ever returned, each at most once. A candidate's load counts the
calls on their way to it, and each hand-off or drain move counts toward its target at once, so a
burst spreads instead of piling on the worker that was idlest before it (a hung one, whose copies
never land, stays idlest for ever otherwise). A candidate on probation gets at most one move per
decision.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from control_plane.core.fleet.balance import KV, Room, fits, roomiest, why_move
from protos.worker import WorkerLimits


@dataclass(frozen=True, slots=True)
class Rules:
    """The placement knobs of one worker (ControlConfig's)."""

    # Look-ahead in decode steps (--kv-balance-steps) and the free-share gap that balances.
    steps: int = 16
    threshold: float = 0.3
    kv_balance: bool = True
    # STEPWISE_TEST_MIGRATE: a ready call moves every this many steps (0: never).
    test_interval: int = 0


@dataclass(frozen=True, slots=True)
class Call:
    """One live call (its samples move together or not at all)."""

    rids: tuple[str, ...]
    # KV slots its running samples hold.
    tokens: int = 0
    # Every sample runs here (holds KV, past its prefill) and none is being moved.
    movable: bool = True
    # Every sample made a token here.
    started: bool = True
    # A sample ends within the look-ahead anyway.
    ends_soon: bool = False

    @property
    def ready(self) -> bool:
        return self.movable and self.started


NO_ROOM = Room(0, 0, 0)


@dataclass(frozen=True, slots=True)
class Peer:
    """A worker a call could move to."""

    worker: str
    role: str = "mixed"
    room: Room = NO_ROOM
    # Queued and running requests, and samples on their way to it.
    load: int = 0
    # On probation after failed moves: one move at most.
    once: bool = False


@dataclass(frozen=True, slots=True)
class Move:
    rids: tuple[str, ...]
    to: str
    reason: str
    # Pre-copy while it decodes on (False: the whole KV at once, a prefill worker's hand-off).
    precopy: bool = True


@dataclass(frozen=True, slots=True)
class Spill:
    """Where the scheduler's retractions go instead (`to` None: nowhere), with the room there."""

    to: str | None
    tokens: int


NO_SPILL = Spill(None, 0)


@dataclass(frozen=True, slots=True)
class Plan:
    moves: tuple[Move, ...] = ()
    # A new spill target for the scheduler (None: leave it as it is).
    spill: Spill | None = None


def unreachable(mine: WorkerLimits, theirs: WorkerLimits) -> str:
    """Why a call cannot move between these two workers' KV ("" when it can)."""
    if mine.worker_id == theirs.worker_id:
        return "it is this worker"
    if not mine.transfer_address or not theirs.transfer_address:
        return "a worker serves no KV transfer link"
    if (mine.page_size, mine.dtype, mine.model_fingerprint) != (
        theirs.page_size,
        theirs.dtype,
        theirs.model_fingerprint,
    ):
        return "the workers differ in page size, dtype or model"
    return ""


def one_at_random(calls: Iterable[Call], peers: Sequence[Peer], rng: random.Random) -> Plan:
    """The test knob: one ready call, drawn from `rng`, to the least loaded peer."""
    ready = [c for c in calls if c.ready]
    if not peers or not ready:
        return Plan()
    target = min(peers, key=lambda p: (p.load, p.worker))
    return Plan((Move(rng.choice(ready).rids, target.worker, "test"),))


def to_decode(calls: Iterable[Call], decoders: Sequence[Peer], steps: int) -> Plan:
    """A prefill worker's hand-off: each ready call to the least loaded decode worker with room for
    it and its next `steps` tokens (ties: the roomiest, then the smallest id); with none, it
    decodes here meanwhile."""
    rooms = {p.worker: p.room.headroom for p in decoders}
    loads = {p.worker: p.load for p in decoders}
    once = {p.worker for p in decoders if p.once}
    moves = []
    for call in calls:
        if not call.ready:
            continue
        need = call.tokens + steps * len(call.rids)
        fitting = [w for w in rooms if rooms[w] >= need]
        if not fitting:
            continue
        target = min(fitting, key=lambda w: (loads[w], -rooms[w], w))
        moves.append(Move(call.rids, target, "pd", precopy=False))
        rooms[target] -= need
        loads[target] += len(call.rids)
        if target in once:
            del rooms[target]
    return Plan(tuple(moves))


def balance(here: Room, peers: Sequence[Peer], calls: Iterable[Call], rules: Rules, underway: bool) -> Plan:
    """KV room among workers of one role (balance.py). When a retraction may come within the
    look-ahead, the scheduler is told to send its victims to the roomiest peer instead (the spill),
    and ready `calls` (in the order a retraction would release them) move there ahead of it, as
    many as cover the shortfall; for a queue beside another worker's free KV, one. None while a
    move of these reasons is `underway`: the next decision reads its outcome. `calls` is read only
    when a move is due (it may be a generator)."""
    if here.headroom >= 0 and not here.queued:
        return Plan(spill=NO_SPILL)  # the common case
    rooms = {p.worker: p.room for p in peers}
    target = roomiest(rooms)
    if target is None:
        return Plan(spill=NO_SPILL)
    there = rooms[target]
    spill = Spill(target if here.headroom < 0 else None, there.headroom)
    why = why_move(here, there, rules.threshold)
    if why is None or underway:
        return Plan(spill=spill)
    once = any(p.once for p in peers if p.worker == target)
    short = -here.headroom
    moves = []
    for call in calls:
        if not call.ready or call.ends_soon:
            continue
        growth = rules.steps * len(call.rids)
        if not fits(why, here, there, call.tokens, growth):
            continue
        moves.append(Move(call.rids, target, why))
        short -= call.tokens + growth
        if why != KV or short <= 0 or once:
            break
        there = Room(there.headroom - call.tokens - growth, there.capacity, there.queued)
    return Plan(tuple(moves), spill)


def drain(calls: Iterable[Call], peers: Sequence[Peer]) -> Plan:
    """A leaving worker: each movable call to the least loaded peer, counting each move."""
    loads = {p.worker: p.load for p in peers}
    once = {p.worker for p in peers if p.once}
    moves = []
    for call in calls:
        if not loads:
            break
        if not call.movable:
            continue
        target = min(loads, key=lambda w: (loads[w], w))
        moves.append(Move(call.rids, target, "drain"))
        loads[target] += len(call.rids)
        if target in once:
            del loads[target]
    return Plan(tuple(moves))
