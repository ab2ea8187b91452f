"""How a live request ends: its KV cached or freed, its handle released, its finish published.

A natural finish (a result's length limit or stop token) and a finish decided outside (a stop string)
cache the request's KV. An abort (docs/scheduler.md#aborts) depends on where the request is, as in
SGLang's abort_request: a queued request holds no KV and leaves the queue; the request mid-chunk is
aborted at the top of the next plan (SGLang's process_pending_chunked_abort), its KV freed; any other
(running, or its last prefill planned) is only marked: it stays in its batch with its KV, is decoded
once more, and ends at that result with its KV cached, its finish published at the mark.
"""

from __future__ import annotations

from control_plane.request import FinishReason, Request
from control_plane.scheduler.chunk import ChunkInProgress
from control_plane.scheduler.intake import Intake
from control_plane.scheduler.kv import KvManager
from control_plane.scheduler.registry import Registry


class Exits:
    """Ending requests, for the public abort/finish and for the rules that end one."""

    def __init__(self, kv: KvManager, registry: Registry, intake: Intake, chunk: ChunkInProgress) -> None:
        self.kv = kv
        self.registry = registry
        self.intake = intake
        self.chunk = chunk

    def abort(self, rid: str, reason: FinishReason) -> bool:
        """Abort a live request (docs/scheduler.md#aborts): a queued one leaves at once, the one
        mid-chunk at the top of the next plan, any other is marked to end at its next result."""
        req = self.registry.live(rid)
        if req is None:
            return False
        if req is self.chunk.req:
            self.chunk.defer_abort(reason)
            return True
        if self.intake.is_waiting(req):
            # A queued request holds no KV (a retracted one gave it back; a backed-up one's host copy
            # goes with its handle).
            self.intake.remove(req)
            self.registry.finish(req, reason)
        elif req.req_pool_idx >= 0:
            # SGLang's abort method 3 (to_finish): the client's call ends now, the request one result later.
            self.kv.columns.mark_aborting(req)
            self.registry.announce(req, reason)
        else:
            self.discard(req, reason)
        return True

    def running(self, rid: str) -> Request | None:
        """The live request `rid` if it holds KV here past its prefill's planning: not queued and
        not mid-chunk (what `finish` takes)."""
        req = self.registry.live(rid)
        if req is None or req is self.chunk.req or self.intake.is_waiting(req):
            return None
        return req

    def finish(self, rid: str, reason: FinishReason) -> bool:
        """Finish a running request for a reason decided outside (a stop string); caches its KV."""
        req = self.running(rid)
        if req is None:
            return False
        self.end(req, reason)
        return True

    def end(self, req: Request, reason: FinishReason) -> None:
        """A running request finished: its KV goes into the tree (docs/scheduler.md#caching-requests)."""
        self.kv.cache_finished_req(req, insert=True)
        self.registry.finish(req, reason)

    def discard(self, req: Request, reason: FinishReason) -> None:
        """An aborted request that holds KV (or a lock): freed, nothing inserted."""
        self.kv.release_aborted(req)
        self.registry.finish(req, reason)

    def abort_group_elsewhere(self, group: str, reason: FinishReason) -> None:
        """A parallel-sample group goes whole: its members still waiting or mid-chunk go with it."""
        for req in self.registry.group(group):
            if not req.finished and (self.intake.is_waiting(req) or req is self.chunk.req):
                self.abort(req.rid, reason)
