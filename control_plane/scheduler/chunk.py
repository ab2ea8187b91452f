"""The chunk in progress (docs/scheduler.md#chunked-prefill): the one request whose prefill is being
split (SGLang's chunked_req), and an abort of it deferred to the next plan."""

from __future__ import annotations

from control_plane.request import FinishReason, Request


class ChunkInProgress:
    """At most one request is mid-chunk. It holds a row and KV but is in neither the waiting queue nor
    the running batch, so retraction and preemption never touch it."""

    def __init__(self) -> None:
        self.req: Request | None = None
        self._pending_abort: FinishReason | None = None

    def start(self, req: Request) -> None:
        """The adder truncated a new request: it is mid-chunk from this step."""
        assert self.req is None, "only one request may be mid-chunk"
        self.req = req

    def advance(self, still_chunking: Request | None) -> None:
        """The continuation's verdict (`add_chunked_req`): the request, or None after its last chunk."""
        self.req = still_chunking

    def drop(self) -> None:
        """The request ended mid-chunk."""
        self.req = None

    def defer_abort(self, reason: FinishReason) -> None:
        """Applied at the top of the next plan (SGLang's process_pending_chunked_abort)."""
        self._pending_abort = reason

    def take_pending_abort(self) -> tuple[Request, FinishReason] | None:
        """The request and the reason of a deferred abort, if one is due; it is no longer mid-chunk."""
        req, reason = self.req, self._pending_abort
        if req is None or reason is None:
            return None
        self.req, self._pending_abort = None, None
        return req, reason
