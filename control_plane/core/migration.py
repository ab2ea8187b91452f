"""Live migration: a running request moves to another worker with its KV, and its stream goes on
there without recomputing anything (docs/migration.md).

The control plane owns both workers' slots, so a migration is plan ops and recorded scheduler calls,
all on the core's one event loop, in three phases (Llumnix's pre-copy, then stop-and-copy):

1. Pre-copy (source engine): `Scheduler.send_kv` has the source's next plan send the request's
   committed KV (KvSend) while it goes on decoding there. The worker copies those slots first and
   sends in the background. The destination worker reports the transfer as soon as it holds it (its
   engine passes the word on: `Engine.worker_received`), and the source's first result after the
   bytes arrived (or failed to) carries a TransferOutcome too; the first word settles it, the other
   is dropped. An idle source is asked for its word with empty plans every POLL_S.
2. Switch (source engine, at its next turn once every sample of the call is pre-copied): the
   destination imports the pre-copied prefix into its tree and holds it (`import_kv(...,
   hold=True)`); each sample is published up to its last token, leaves the source's streams, and
   `Scheduler.export` finishes it there, caching its KV in the source's tree (so the prefix stays
   there), and has the next plan send the tail decoded during the pre-copy. Results in flight for
   it are dropped (it is finished), so no token is published twice.
3. Continue (destination engine, on the first word that the tail arrived, whichever side's):
   `import_kv` places the tail after the held prefix, the next plan's KvReceive writes it before
   any forward, the hold is released, and the request is admitted as an Orphan (handover.py: prompt
   plus streamed tokens), which matches the whole prefix and extends its last token.

A request whose committed KV is less than a page skips phase 1. Failures: a pre-copy that fails, a
destination that leaves, or a request that ends meanwhile, and the request simply stays where it
runs (the destination forgets what arrived); a tail that fails, and the request continues on the
source (its prefix is cached there, so it extends one token), or, when the source is leaving, on
another worker by recompute. A source lost mid-copy hands its requests over like its other ones.
Between the switch and the tail's outcome a request is in exactly one place: this book.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from control_plane import metrics
from control_plane.core.fleet import unreachable
from control_plane.core.handover import orphan_of
from control_plane.core.inbox import Forget, Immigrant, LiveSample, Orphan, Precopied
from control_plane.core.publisher import Streams
from control_plane.request import FinishReason
from control_plane.scheduler.scheduler import Scheduler
from protos.worker import TransferOutcome, WorkerLimits

# Why a migrated request left the source's scheduler (never published: its stream goes on).
MIGRATED = FinishReason.abort("continued on another worker (migrated)")
# How often an idle source asks its worker whether a copy has arrived.
POLL_S = 0.002
# Transfers settled by one side's word whose other word may still come, remembered at most this many.
MAX_SETTLED = 4096


def transfer_source(transfer_id: str) -> str:
    """The worker that sends the transfer: its ids are `<worker id>/<random hex>`."""
    return transfer_id.rpartition("/")[0]


class Destination(Protocol):
    """An engine a request can migrate to."""

    @property
    def worker(self) -> str: ...

    @property
    def limits(self) -> WorkerLimits: ...

    @property
    def serving(self) -> bool: ...

    def precopied(self, transfer_id: str, tokens: tuple[int, ...]) -> bool: ...

    def immigrate(self, item: Immigrant) -> bool: ...

    def forget_transfer(self, transfer_id: str) -> None: ...

    def adopt(self, orphans: list[Orphan]) -> None: ...


@dataclass(slots=True)
class Precopy:
    """A call whose samples' KV is being pre-copied: rid -> (transfer id, positions sent). Once no
    outcome is pending it switches (or is called off) at the source's next turn."""

    rids: list[str]
    destination: Destination
    reason: str
    sent: dict[str, tuple[str, int]]
    # Transfer ids whose outcome is still to come, and whether any failed (why).
    pending: set[str] = field(default_factory=set)
    error: str = ""
    # When the sends were planned (time.monotonic()).
    started: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class Tails:
    """The tails one switch sent (a call's samples, which move together): their requests continue
    on the destination together, once every tail has had its word, so that they stay in step there.
    Each destination's word comes when its own transfer lands, at moments apart."""

    waiting: set[str] = field(default_factory=set)
    words: dict[str, TransferOutcome] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Export:
    """A sample switched off this worker whose tail copy has not been reported yet."""

    transfer_id: str
    orphan: Orphan
    # The tokens whose KV is now the destination's (the leading part of the orphan's input), from
    # `start` on in this transfer; the pre-copy `held` (a transfer id, "" for none) sent the rest.
    tokens: tuple[int, ...]
    start: int
    held: str
    destination: Destination
    reason: str
    started: float
    tails: Tails


class Migrations:
    """One engine's migrations, both ways: those leaving it (pre-copies and tails whose outcome is
    due) and those coming to it."""

    def __init__(
        self,
        worker: str,
        limits: WorkerLimits,
        streams: Streams,
        log: structlog.typing.FilteringBoundLogger,
        fallback: Callable[[], Destination | None],
        on_outcome: Callable[[str, bool], None] = lambda _worker, _landed: None,
    ) -> None:
        self._worker = worker
        self._limits = limits
        self._streams = streams
        self._log = log
        # Where a request whose tail copy failed continues: this engine while it serves, else an heir.
        self._fallback = fallback
        # Told each move's outcome, (destination worker, landed): the fleet's back-off listens.
        self._on_outcome = on_outcome
        # By transfer id (each of a call's samples'), from the send until the call switches.
        self.precopies: dict[str, Precopy] = {}
        self.exports: dict[str, Export] = {}
        # Settled by one side's word: the other side's, if it comes, is dropped (insertion order).
        self._settled: dict[str, None] = {}
        # Switched samples ended while their tail was on its way (an abort, a stop string): by
        # tail transfer id, how they end once it is reported.
        self._ended: dict[str, FinishReason] = {}
        # Migrated here and not yet given their first token here: rid -> when the switch was.
        self.stalls: dict[str, float] = {}
        self._last_poll = 0.0
        # Requests that left with their KV, came with it, and failed to leave so (GetServerInfo).
        self.migrated_out = 0
        self.migrated_in = 0
        self.fallbacks = 0

    # --- state ---------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Copies whose outcome is still to come."""
        return bool(self.exports or self.precopies)

    def underway(self, reasons: tuple[str, ...]) -> bool:
        """A migration for one of `reasons` has not had its outcome yet."""
        return any(p.reason in reasons for p in self.precopies.values()) or any(
            e.reason in reasons for e in self.exports.values()
        )

    def moving(self, rid: str) -> bool:
        """The sample is being pre-copied (it still runs here)."""
        return any(rid in p.sent for p in self.precopies.values())

    def wants_plan(self, idle: bool) -> bool:
        """Whether the engine should send a plan that does nothing (the scheduler has none): with
        no plan in flight (`idle`), a copy's outcome is due for a look every POLL_S."""
        if not idle or not self.busy:
            return False
        now = time.monotonic()
        if now - self._last_poll < POLL_S:
            return False
        self._last_poll = now
        return True

    def wait_s(self) -> float | None:
        """How long an idle loop may sleep (None: as long as it likes)."""
        return POLL_S if self.busy else None

    def heading(self) -> Counter[str]:
        """Samples moving from here whose copy has had no outcome yet, by destination worker."""
        counts: Counter[str] = Counter()
        for copy in {id(c): c for c in self.precopies.values()}.values():
            counts[copy.destination.worker] += len(copy.rids)
        for export in self.exports.values():
            counts[export.destination.worker] += 1
        return counts

    def overdue(self, now: float, deadline_s: Callable[[int], float]) -> list[tuple[str, str, float]]:
        """(transfer id, destination worker, deadline) of each copy whose outcome has not come
        within `deadline_s(positions it carries)` of its start."""
        late = [
            (tid, c.destination.worker, deadline_s(c.sent[rid][1]), c.started)
            for c in {id(c): c for c in self.precopies.values()}.values()
            for rid, (tid, _) in c.sent.items()
            if tid in c.pending
        ]
        late += [
            (tid, e.destination.worker, deadline_s(len(e.tokens) - e.start), e.started)
            for tid, e in self.exports.items()
        ]
        return [(tid, worker, limit) for tid, worker, limit, started in late if now - started > limit]

    def bound_for(self, worker: str) -> list[str]:
        """The transfers on their way to `worker` whose outcome is still to come."""
        pending = [t for t, c in self.precopies.items() if c.destination.worker == worker and t in c.pending]
        return pending + [t for t, e in self.exports.items() if e.destination.worker == worker]

    def in_transit(self, which: Callable[[LiveSample], bool]) -> list[LiveSample]:
        """Switched samples whose tail is on its way (in no engine's streams), those `which` picks."""
        return [e.orphan.sample for e in self.exports.values() if which(e.orphan.sample)]

    def end_in_transit(self, which: Callable[[LiveSample], bool], reason: FinishReason) -> int:
        """End the samples `which` picks among those in transit with `reason` once their tail is
        reported (the destination then forgets it); how many."""
        picked = [tid for tid, e in self.exports.items() if which(e.orphan.sample)]
        for transfer_id in picked:
            self._ended.setdefault(transfer_id, reason)
        return len(picked)

    # --- leaving this worker -------------------------------------------------------------------

    def can_reach(self, destination: Destination) -> str:
        """Why a request cannot migrate to `destination` ("" when it can)."""
        if destination.worker != self._worker and not destination.serving:
            return f"worker {destination.worker} takes no requests"
        return unreachable(self._limits, destination.limits)

    def start(
        self,
        scheduler: Scheduler,
        rids: list[str],
        destination: Destination,
        reason: str,
        precopy: bool = True,
    ) -> bool:
        """Start migrating the samples `rids` (one call's live samples: they move together or not
        at all) to `destination`: a pre-copy of each, or at once (the whole KV as the tail) when one
        has less than a page of KV or `precopy` is off (a prefill worker's hand-off: decoding on
        while the copy runs would wait behind its prefills). False, with nothing changed, when one
        of them is not running here (or is moving already) or the destination cannot take them."""
        if self.can_reach(destination):
            return False
        reqs = [scheduler.running_request(rid) for rid in rids]
        if any(r is None or r.rid not in self._streams or self.moving(r.rid) for r in reqs):
            return False
        page = scheduler.page_size
        if not precopy or any(r is not None and r.kv_committed_len < page for r in reqs):
            self._switch(scheduler, rids, destination, reason, {})
            return True
        copy = Precopy(rids, destination, reason, {})
        address = destination.limits.transfer_address
        for rid in rids:
            transfer_id = self._transfer_id()
            sent = scheduler.send_kv(rid, transfer_id, address)
            assert sent > 0  # running, with a page of committed KV
            copy.sent[rid] = (transfer_id, sent)
            copy.pending.add(transfer_id)
            self.precopies[transfer_id] = copy
        self._log.info("migrating", rids=rids, to=destination.worker, reason=reason)
        return True

    def _transfer_id(self) -> str:
        return f"{self._worker}/{uuid.uuid4().hex}"

    def _switch(
        self,
        scheduler: Scheduler,
        rids: list[str],
        destination: Destination,
        reason: str,
        precopied: dict[str, tuple[str, int]],
    ) -> None:
        """Finish the samples here and send their tails (what `precopied` did not send)."""
        self._streams.publish(scheduler.take_updates())  # their tokens so far reach their clients first
        now = time.monotonic()
        address = destination.limits.transfer_address
        tails = Tails()
        for rid in rids:
            req = scheduler.running_request(rid)
            sample = self._streams.get(rid)
            assert req is not None and sample is not None  # checked by the caller
            orphan = orphan_of(req, sample)
            self._streams.leave(sample)
            held, start = precopied.get(rid, ("", 0))
            transfer_id = self._transfer_id()
            slots = scheduler.export(rid, MIGRATED, transfer_id, address, start)
            assert slots is not None
            tokens = tuple(orphan.input_ids[: len(slots)])
            export = Export(transfer_id, orphan, tokens, start, held, destination, reason, now, tails)
            if len(slots) > start:
                self.exports[transfer_id] = export
                tails.waiting.add(transfer_id)
            elif held or len(slots):  # the pre-copy sent it all: nothing to wait for
                self._arrive(dataclasses.replace(export, transfer_id=""), 0)
            else:  # nothing cached (--disable-radix-cache): it is recomputed there
                destination.adopt([orphan])

    def spilled(
        self, orphan: Orphan, transfer_id: str, tokens: tuple[int, ...], destination: Destination
    ) -> None:
        """A retraction sent the sample's KV to `destination` instead (Scheduler.spill_to): it is
        switched, as after a pre-copy that sent nothing, and continues there once the copy is
        reported (or recomputes there when nothing was cached to send)."""
        self._streams.leave(orphan.sample)
        self._log.info("migrating instead of retracting", rid=orphan.sample.rid, to=destination.worker)
        if not transfer_id:
            destination.adopt([orphan])
            return
        self.exports[transfer_id] = Export(
            transfer_id, orphan, tokens, 0, "", destination, "kv", time.monotonic(), Tails({transfer_id})
        )

    def outcomes(self, outcomes: tuple[TransferOutcome, ...]) -> None:
        """This worker's word on copies it sent (with a step result): arrived, or failed."""
        for outcome in outcomes:
            self._word(outcome, "sender")

    def received(self, outcome: TransferOutcome, receiver: str) -> None:
        """A destination's word that it holds a copy this worker sent, the moment it does: taken
        only from the copy's destination (any other worker naming it is logged and ignored)."""
        copy = self.precopies.get(outcome.transfer_id)
        export = self.exports.get(outcome.transfer_id)
        destination = copy.destination if copy is not None else export.destination if export else None
        if destination is None:  # settled by the sender's word already, or given up meanwhile
            self._settled.pop(outcome.transfer_id, None)
        elif destination.worker != receiver:
            self._log.warning(
                "transfer reported by another worker",
                transfer_id=outcome.transfer_id,
                by=receiver,
                to=destination.worker,
            )
        else:
            self._word(outcome, "receiver")

    def _word(self, outcome: TransferOutcome, reported_by: str) -> None:
        """The first word on a transfer settles it and the other is dropped. A request whose tail
        arrived continues on its destination now; a pre-copied call switches at the next
        `switch_ready`. Nothing here calls the scheduler, so a destination's word is taken whenever
        it comes."""
        transfer_id = outcome.transfer_id
        if transfer_id in self._settled:  # the other side's word came first
            del self._settled[transfer_id]
            return
        copy = self.precopies.get(transfer_id)
        if copy is not None and transfer_id in copy.pending:
            self._settle(transfer_id, outcome, reported_by)
            copy.pending.discard(transfer_id)
            copy.error = copy.error or outcome.error
            metrics.MIGRATION_BYTES.labels(self._worker).inc(outcome.bytes)
        elif (export := self.exports.get(transfer_id)) is not None:
            self._settle(transfer_id, outcome, reported_by)
            tails = export.tails
            tails.words[transfer_id] = outcome
            tails.waiting.discard(transfer_id)
            if not tails.waiting:  # the call's last tail: its samples continue together
                for tail_id, word in tails.words.items():
                    if (tail := self.exports.pop(tail_id, None)) is not None:
                        self._tail_reported(tail, word)
        else:
            self._log.warning("transfer outcome for no migration", transfer_id=transfer_id)

    def _tail_reported(self, export: Export, outcome: TransferOutcome) -> None:
        ended = self._ended.pop(export.transfer_id, None)
        if ended is not None:  # its client left (or a stop string ended it) meanwhile
            self._forget_both(export)
            self._streams.finish(export.orphan.sample, ended)
        elif outcome.error:
            self._give_up(export, outcome.error)
        else:
            self._arrive(export, outcome.bytes)

    def _settle(self, transfer_id: str, outcome: TransferOutcome, reported_by: str) -> None:
        """The first word on a transfer: the other side's is expected too (a failed send's receiver
        says nothing, but remembering it costs an entry of a bounded book)."""
        self._settled[transfer_id] = None
        if len(self._settled) > MAX_SETTLED:
            del self._settled[next(iter(self._settled))]
        if not outcome.error:
            metrics.MIGRATION_ARRIVALS.labels(self._worker, reported_by).inc()

    def switch_ready(self, scheduler: Scheduler) -> None:
        """Switch each call whose pre-copies have all had their word (or call it off): between two
        plans of this worker, on its engine's loop (the only one that calls its scheduler)."""
        if not self.precopies:
            return
        ready = {id(c): c for c in self.precopies.values() if not c.pending}
        for copy in ready.values():
            for transfer_id, _ in copy.sent.values():
                del self.precopies[transfer_id]
            self._precopied(scheduler, copy)

    def _precopied(self, scheduler: Scheduler, copy: Precopy) -> None:
        destination = copy.destination
        why = copy.error or self.can_reach(destination)
        if not why and not all(
            scheduler.running_request(rid) is not None and rid in self._streams for rid in copy.rids
        ):
            why = "it ended or stopped running meanwhile"
        if why:  # it stays here
            if copy.error:
                self._on_outcome(destination.worker, False)
            metrics.MIGRATIONS.labels(self._worker, copy.reason, "called_off").inc()
            for transfer_id, _ in copy.sent.values():
                destination.forget_transfer(transfer_id)
            self._log.info("migration called off", rids=copy.rids, to=destination.worker, why=why)
            return
        for rid in copy.rids:
            transfer_id, sent = copy.sent[rid]
            req = scheduler.running_request(rid)
            assert req is not None
            destination.precopied(transfer_id, tuple(req.fill_ids[:sent]))
        self._switch(scheduler, copy.rids, destination, copy.reason, copy.sent)

    def _arrive(self, export: Export, nbytes: int) -> None:
        destination = export.destination
        item = Immigrant(
            export.orphan, export.transfer_id, export.tokens, export.started, export.start, export.held
        )
        if not destination.immigrate(item):
            if export.transfer_id:
                destination.forget_transfer(export.transfer_id)
            self._give_up(export, f"worker {destination.worker} left before the copy arrived")
            return
        seconds = time.monotonic() - export.started
        self._on_outcome(destination.worker, True)
        self.migrated_out += 1
        metrics.MIGRATIONS.labels(self._worker, export.reason, "ok").inc()
        metrics.MIGRATED_TOKENS.labels(self._worker).inc(len(export.tokens))
        metrics.MIGRATION_BYTES.labels(self._worker).inc(nbytes)
        metrics.MIGRATION_COPY_SECONDS.labels(self._worker).observe(seconds)
        self._log.info(
            "migrated",
            rid=export.orphan.sample.rid,
            to=destination.worker,
            tokens=len(export.tokens),
            tail=len(export.tokens) - export.start,
            bytes=nbytes,
            switch_s=round(seconds, 4),
        )

    def _give_up(self, export: Export, why: str) -> None:
        """The tail did not arrive: the request continues here (or on an heir); the destination
        forgets both copies."""
        self.fallbacks += 1
        self._on_outcome(export.destination.worker, False)
        metrics.MIGRATIONS.labels(self._worker, export.reason, "fallback").inc()
        self._forget_both(export)
        heir = self._fallback()
        self._log.warning(
            "migration failed",
            rid=export.orphan.sample.rid,
            to=export.destination.worker,
            error=why,
            continued_on=heir.worker if heir is not None else None,
        )
        if heir is None:
            self._streams.finish(export.orphan.sample, FinishReason.abort(f"migration failed ({why})"))
        else:
            heir.adopt([export.orphan])

    @staticmethod
    def _forget_both(export: Export) -> None:
        """The destination forgets the tail and the pre-copy's hold."""
        for transfer_id in (export.transfer_id, export.held):
            if transfer_id:
                export.destination.forget_transfer(transfer_id)

    def _drop_copies(self) -> list[Export]:
        """Every copy under way is given up (its destination forgets it); the switched samples,
        but those ended meanwhile, which end here now with their reason."""
        for transfer_id, copy in self.precopies.items():
            copy.destination.forget_transfer(transfer_id)
        self.precopies = {}
        exports, self.exports = list(self.exports.values()), {}
        ended, self._ended = self._ended, {}
        for export in exports:
            self._forget_both(export)
            if export.transfer_id in ended:
                self._streams.finish(export.orphan.sample, ended[export.transfer_id])
        return [e for e in exports if e.transfer_id not in ended]

    def recovered(self) -> None:
        """The scheduler was replaced after a fault of ours: copies it had not planned yet are gone
        with it. Pre-copied requests are salvaged with the others; switched ones continue by the
        fallback (an outcome that still comes finds no migration)."""
        for export in self._drop_copies():
            self.fallbacks += 1
            heir = self._fallback()
            if heir is None:
                self._streams.finish(export.orphan.sample, FinishReason.abort("migration failed"))
            else:
                heir.adopt([export.orphan])

    def lost(self, heir: Destination | None, error: str) -> None:
        """This worker is lost: its copies will never be reported. Pre-copied requests are handed
        over with the others; each switched one continues on `heir` by recompute, or ends if there
        is none."""
        for export in self._drop_copies():
            metrics.MIGRATIONS.labels(self._worker, export.reason, "lost").inc()
            if heir is None:
                message = f"worker {self._worker} disconnected ({error}) while migrating it"
                self._streams.finish(export.orphan.sample, FinishReason.abort(message))
            else:
                heir.adopt([export.orphan])

    def abort_all(self, message: str) -> None:
        """The engine closes: switched requests whose tail is still out end with `message`."""
        for export in self._drop_copies():
            self._streams.finish(export.orphan.sample, FinishReason.abort(message))

    # --- coming to this worker -----------------------------------------------------------------

    def arrive(self, scheduler: Scheduler, item: Immigrant | Precopied | Forget) -> None:
        """A pre-copied prefix is held here; a migrated sample's tail gets its place (the next plan
        receives it) and the hold goes; a Forget: the next plan forgets the transfer (or its hold
        goes). When there is no room, nothing is received: the request recomputes what is missing."""
        if isinstance(item, Forget):
            scheduler.import_kv(item.transfer_id, ())
            return
        if isinstance(item, Precopied):
            scheduler.import_kv(item.transfer_id, item.tokens, hold=True)
            return
        self.migrated_in += 1
        if item.transfer_id:
            scheduler.import_kv(item.transfer_id, item.tokens, start=item.start)
        if item.held:
            scheduler.import_kv(item.held, ())
        self.stalls[item.orphan.sample.rid] = item.since

    def note_tokens(self, scheduler: Scheduler) -> None:
        """After a result: the stall of each migrated request that got its first token here."""
        if not self.stalls:
            return
        now = time.monotonic()
        for rid, since in list(self.stalls.items()):
            req = scheduler.requests.get(rid)
            if req is None or req.num_outputs:
                del self.stalls[rid]
                metrics.MIGRATION_STALL_SECONDS.labels(self._worker).observe(now - since)
