"""This worker's calls on their way to other workers, as the fleet decides (core/fleet/).

After each step the fleet says which running calls move and where (prefill/decode hand-off, KV
balancing, the test knob), and where the scheduler's retractions go instead of retracting (the
spill worker); while the worker leaves it says where each running call migrates. The Mover does
it: a move starts once its destination holds the call's grammars compiled (migration.py copies
the KV and switches the call), the spill worker's address goes to the scheduler, and each request
the scheduler spilled leaves the streams for the spill worker.

It also settles the word of the copies: a destination reports a copy whole (usually sooner than
this worker's own word), and a copy to a worker that left or was lost, or with no word within the
step deadline for its size, fails, so its call goes on here instead of waiting for an outcome
that may never come.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from control_plane.config import ControlConfig
from control_plane.core.fleet import Call, Fleet, Move, Rules, Spill
from control_plane.core.handover import orphan_of
from control_plane.core.migration import Migrations, transfer_source
from control_plane.core.publisher import Streams
from control_plane.scheduler.scheduler import Scheduler
from protos.worker import Grammar, TransferOutcome

if TYPE_CHECKING:
    from control_plane.core.engine import Engine


class Mover:
    """One engine's side of placement: the fleet decides, the mover starts the moves. The engine
    calls it on its own loop and hands it its scheduler (replaced after a fault of ours)."""

    def __init__(
        self,
        config: ControlConfig,
        fleet: Fleet[Engine],
        migration: Migrations,
        streams: Streams,
        wake: asyncio.Event,
    ) -> None:
        self.rules = Rules(
            config.kv_balance_steps,
            config.kv_balance_threshold,
            config.kv_balance,
            config.test_migrate_interval,
        )
        self._step_deadline_s = config.limits.step_deadline_s
        self._fleet = fleet
        self._migration = migration
        self._streams = streams
        # The engine's loop sleeps on it when idle: a copy's word wakes it to switch the call.
        self._wake = wake
        # The worker the scheduler's retractions go to instead (Scheduler.spill_to), if any.
        self._spill_to: Engine | None = None

    def place(self, member: Engine) -> None:
        """After a step of `member` (this engine): the moves the fleet decides for its calls."""
        plan = self._fleet.place(member, self.rules)
        if plan.spill is not None:
            self._spill(member.scheduler, plan.spill)
        for move in plan.moves:
            self.start(member.scheduler, move)

    def drain(self, member: Engine) -> int:
        """A turn of `member` leaving: start migrating its running calls where the fleet says;
        how many samples started."""
        moves = self._fleet.drain(member).moves
        return sum(len(move.rids) for move in moves if self.start(member.scheduler, move))

    def start(self, scheduler: Scheduler, move: Move) -> bool:
        """Start migrating a call (migration.py); False when it cannot start."""
        destination = self._fleet.member(move.to)
        if destination is None or not destination.holds_compiled(_grammars(scheduler, move.rids)):
            return False
        if not self._migration.start(scheduler, list(move.rids), destination, move.reason, move.precopy):
            return False
        self._fleet.started(move.to)
        return True

    def _spill(self, scheduler: Scheduler, spill: Spill) -> None:
        """Where the scheduler's retractions go instead (None: nowhere, they retract)."""
        if spill.to is None and self._spill_to is None:
            return
        self._spill_to = self._fleet.member(spill.to) if spill.to is not None and spill.tokens > 0 else None
        address = self._spill_to.limits.transfer_address if self._spill_to is not None else ""
        scheduler.spill_to(address, spill.tokens)

    def emigrate(self, scheduler: Scheduler) -> None:
        """The latest plan sent requests to the spill worker instead of retracting them: each
        leaves the streams and continues there once its copy is reported (migration.py)."""
        destination = self._spill_to
        for emigrant in scheduler.emigrants:
            sample = self._streams.get(emigrant.req.rid)
            assert sample is not None and destination is not None  # running here; spill_to was set
            orphan = orphan_of(emigrant.req, sample)
            self._migration.spilled(orphan, emigrant.transfer_id, emigrant.tokens, destination)

    def recovered(self) -> None:
        """The scheduler was replaced after a fault of ours: the fresh one spills nowhere."""
        self._spill_to = None

    def calls(self, scheduler: Scheduler, steps: int, by_retraction: bool) -> Iterator[Call]:
        """The live calls as placement sees them: as they came, or (`by_retraction`) in the order a
        retraction would release them (then only those running)."""
        live = list(self._streams.live_calls())
        if by_retraction:
            of = {rid: tuple(call) for call in live for rid in call}
            order = dict.fromkeys(of[rid] for rid in scheduler.retraction_order() if rid in of)
            live = [list(call) for call in order]
        for rids in live:
            reqs = [scheduler.running_request(rid) for rid in rids]
            running = [r for r in reqs if r is not None]
            yield Call(
                tuple(rids),
                tokens=sum(r.kv_allocated_len for r in running),
                movable=len(running) == len(rids) and not any(map(self._migration.moving, rids)),
                started=all(r.num_outputs > 0 for r in running),
                ends_soon=any(r.max_new_tokens - r.num_outputs <= steps for r in running),
            )

    # --- the word of the copies ----------------------------------------------------------------

    def worker_received(self, outcome: TransferOutcome, receiver: str) -> None:
        """`receiver`'s worker holds a transfer in full: the word goes to the engine whose
        worker sent it."""
        source = self._fleet.member(transfer_source(outcome.transfer_id))
        if source is not None:
            source.mover.copy_arrived(outcome, receiver)

    def copy_arrived(self, outcome: TransferOutcome, receiver: str) -> None:
        """A copy this worker sent is at its destination, `receiver` says: a tail's request
        continues there now, a pre-copied call switches at the loop's next turn."""
        self._migration.received(outcome, receiver)
        self._wake.set()

    def destination_gone(self, worker: str, why: str) -> None:
        """`worker` left or was lost: each copy on its way there from here fails now, so its call
        goes on here (or recomputes on an heir) instead of waiting on an outcome that may never
        come (a hung destination's)."""
        for transfer_id in self._migration.bound_for(worker):
            self.copy_arrived(TransferOutcome(transfer_id, error=why), worker)

    def fail_overdue_copies(self) -> None:
        """A copy with no word past the step deadline for its size fails (a hung destination, or
        a send that never ends): its call goes on as after any failed copy, and the destination
        sits out a back-off."""
        for transfer_id, worker, limit in self._migration.overdue(time.monotonic(), self._step_deadline_s):
            self.copy_arrived(
                TransferOutcome(transfer_id, error=f"no word on the copy within {limit:.1f} s"), worker
            )


def _grammars(scheduler: Scheduler, rids: Iterable[str]) -> list[Grammar]:
    """The grammars of the running requests `rids` (a move waits until its destination holds them
    compiled)."""
    reqs = [scheduler.running_request(rid) for rid in rids]
    grammars = [r.params.sampler.grammar for r in reqs if r is not None]
    return [grammar for grammar in grammars if grammar is not None]
