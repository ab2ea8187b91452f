"""The live requests by rid, and what to publish about them: streamed tokens and finishes, held until
`take_updates`."""

from __future__ import annotations

import numpy as np

from control_plane.request import FinishReason, Request
from control_plane.scheduler.books import SequenceBooks
from control_plane.scheduler.records import RequestFinished, StepUpdates, TokenBatch


class Registry:
    """Every request from intake to its finish, and the updates not yet taken."""

    def __init__(self, books: SequenceBooks) -> None:
        self.books = books
        self.requests: dict[str, Request] = {}
        # Streamed tokens (uids, ids) per applied result, and finishes, until `take_updates`.
        self._token_uids: list[np.ndarray] = []
        self._token_ids: list[np.ndarray] = []
        self._finished: list[RequestFinished] = []

    def add(self, req: Request) -> None:
        self.requests[req.rid] = req

    def live(self, rid: str) -> Request | None:
        """The request if it has not finished."""
        req = self.requests.get(rid)
        return None if req is None or req.finished else req

    def group(self, group: str) -> list[Request]:
        """The live members of a parallel-sample group."""
        return [r for r in self.requests.values() if r.params.group == group]

    def finish(self, req: Request, reason: FinishReason) -> None:
        """The request has ended; its KV must already be cached or freed (it holds no row)."""
        req.finish(reason)
        if req.handle >= 0:
            self.books.release(req)
        self.requests.pop(req.rid, None)
        self._finished.append(RequestFinished(req.rid, req.uid, reason, req.cached_tokens))

    def stream(self, uids: np.ndarray, tokens: np.ndarray) -> None:
        if len(tokens):
            self._token_uids.append(uids)
            self._token_ids.append(tokens)

    def take_updates(self) -> StepUpdates:
        """Tokens and finishes since the last call (tokens first: see StepUpdates)."""
        tokens = TokenBatch()
        if self._token_ids:
            tokens = TokenBatch(_concat(self._token_uids), _concat(self._token_ids))
        updates = StepUpdates(tokens, tuple(self._finished))
        self._token_uids, self._token_ids, self._finished = [], [], []
        return updates


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
