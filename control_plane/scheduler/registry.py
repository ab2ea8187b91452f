"""The live requests by rid, and what to publish about them: streamed tokens and finishes, held until
`take_updates`."""

from __future__ import annotations

import numpy as np

from control_plane.request import FinishReason, Request
from control_plane.scheduler.books import SequenceBooks, frozen_empty
from control_plane.scheduler.records import PromptScoring, RequestFinished, StepUpdates, TokenBatch
from protos.worker import TokenLogprobs

# What take_updates answers when nothing happened: one shared value (frozen, its arrays read-only).
NO_UPDATES = StepUpdates(TokenBatch(frozen_empty(np.uint64), frozen_empty(np.int32)))


class Registry:
    """Every request from intake to its finish, and the updates not yet taken."""

    def __init__(self, books: SequenceBooks) -> None:
        self.books = books
        self.requests: dict[str, Request] = {}
        # Streamed tokens (uids, ids) per applied result, and finishes, until `take_updates`.
        self._token_uids: list[np.ndarray] = []
        self._token_ids: list[np.ndarray] = []
        # (index among the tokens above, logprobs) of streamed tokens whose requests asked.
        self._scores: list[tuple[int, TokenLogprobs]] = []
        self._streamed = 0
        self._prompt_scores: list[PromptScoring] = []
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
        """The request has ended; its KV must already be cached or freed (it holds no row). One that
        was announced (`announce`) is published no more."""
        announced = req.to_finish is not None
        req.finish(reason)
        if req.handle >= 0:
            self.books.release(req)
        if not announced:
            self._published(req, reason)

    def announce(self, req: Request, reason: FinishReason) -> None:
        """An abort that ends the request only at its next result (docs/scheduler.md#aborts): its
        client's call ends now, so its finish is published now and it is no longer live, though it
        keeps its KV and its place in the batch until `finish`."""
        req.to_finish = reason
        self._published(req, reason)

    def _published(self, req: Request, reason: FinishReason) -> None:
        if self.requests.get(req.rid) is req:
            del self.requests[req.rid]
        self._finished.append(RequestFinished(req.rid, req.uid, reason, req.cached_tokens))

    def stream(
        self, uids: np.ndarray, tokens: np.ndarray, scores: list[tuple[int, TokenLogprobs]] | None = None
    ) -> None:
        """Tokens to publish; `scores` index into `tokens`."""
        if len(tokens):
            if scores:
                offset = self._streamed
                self._scores.extend((offset + k, lp) for k, lp in scores)
            self._token_uids.append(uids)
            self._token_ids.append(tokens)
            self._streamed += len(tokens)

    def prompt_scores(self, req: Request, rows: tuple[TokenLogprobs, ...]) -> None:
        """A request's whole prompt scoring, published before its first token."""
        self._prompt_scores.append(
            PromptScoring(req.uid, req.params.logprob_start_len, req.origin_input_ids, rows)
        )

    def take_updates(self) -> StepUpdates:
        """Tokens and finishes since the last call (prompt scores, then tokens, then finishes: see
        StepUpdates)."""
        if not (self._token_ids or self._finished or self._prompt_scores):
            return NO_UPDATES  # the engine and the twin ask after every step, often for nothing
        tokens = TokenBatch()
        if self._token_ids:
            tokens = TokenBatch(_concat(self._token_uids), _concat(self._token_ids), tuple(self._scores))
        updates = StepUpdates(tokens, tuple(self._finished), tuple(self._prompt_scores))
        self._token_uids, self._token_ids, self._finished = [], [], []
        self._scores, self._streamed, self._prompt_scores = [], 0, []
        return updates


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
