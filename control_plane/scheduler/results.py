"""Applying a worker's result (SGLang's process_batch_result): append tokens, run the finish checks
in SGLang's order, cache the KV of what finished.

A result answers the oldest plan still in flight (plans execute in order on the worker). Its tokens
are positional: one per extend with `sample` set, then one per decode, in plan order. Decodes are
applied as a few numpy operations on the columns (control_plane/scheduler/columns.py); Python work
is per extend and per request that finishes.

A token is discarded, never streamed, when the row it was planned for no longer holds that tenancy: the
request finished (under overlap its next decode was already planned: the "dead" decode of
docs/scheduler.md#overlap (a)), was aborted, finished by `finish()`, retracted or preempted meanwhile (SGLang:
`if req.is_retracted or req.finished(): continue`). A retracted request re-prefills from the outputs applied
before its retraction.
"""

from __future__ import annotations

import numpy as np

from control_plane.request import AbortCode, FinishKind, FinishReason, Request
from control_plane.scheduler.batch import ScheduledBatch
from control_plane.scheduler.books import SequenceBooks
from control_plane.scheduler.exits import Exits
from control_plane.scheduler.kv import KvManager
from control_plane.scheduler.registry import Registry
from protos.worker import PromptScores, TokenLogprobs

MAX_NEW_TOKENS = FinishReason.length("max_new_tokens")
EOS = FinishReason.stop("eos")
GRAMMAR_UNSATISFIABLE = FinishReason(
    FinishKind.GRAMMAR_UNSATISFIABLE, "the grammar could not be satisfied: no token could follow the output"
)
# No sample's grammar failed (shared: never written to).
NO_FAILURES = np.zeros(0, dtype=np.int64)
# Up to this many rows, a result's finish checks run row by row in plain Python: on a few rows (a
# lightly loaded worker, most of the twin's) numpy's fixed cost per call is most of applying a result.
# tests/control_plane/scheduler/test_results_rows.py runs both ways and compares.
FEW_ROWS = 8
SCORES_LOST = FinishReason.abort("internal error: prompt log probabilities were lost", AbortCode.INTERNAL)


class ResultApplier:
    """The worker's sampled tokens applied to the requests (SGLang's process_batch_result)."""

    def __init__(
        self, kv: KvManager, registry: Registry, books: SequenceBooks, exits: Exits, eos_ids: frozenset[int]
    ) -> None:
        self.kv = kv
        self.registry = registry
        self.books = books
        self.exits = exits
        self._eos_ids = np.array(sorted(eos_ids), dtype=np.int32)
        self._eos_set = frozenset(eos_ids)
        # The logprobs of the result being applied (empty: none asked).
        self._logprobs: tuple[TokenLogprobs, ...] = ()
        # Indices into the result being applied of samples whose grammar failed (empty: none).
        self._grammar_failed = NO_FAILURES

    def process_batch_result(
        self,
        batch: ScheduledBatch,
        token_ids: np.ndarray,
        logprobs: tuple[TokenLogprobs, ...] = (),
        prompt_scores: tuple[PromptScores, ...] = (),
        grammar_failed: np.ndarray | None = None,
    ) -> None:
        """Append the sampled tokens of `batch`'s result (one per sampled extend, then one per decode,
        already checked against the batch), run finish checks, cache or free the KV of finished
        requests. `logprobs` (empty, or one per token) go out with the tokens of requests that asked;
        `prompt_scores` (checked against the plan) are kept by their requests, and a request's whole
        prompt scoring goes out before its first token. `grammar_failed` (indices into the result)
        are the samples whose grammar could not be satisfied: the EOS sampled for them ends them
        with GRAMMAR_UNSATISFIABLE instead of stop."""
        tokens = np.asarray(token_ids, dtype=np.int32)
        sampled = sum(batch.extend_sampled)
        self._logprobs = logprobs
        if grammar_failed is not None:
            self._grammar_failed = np.asarray(grammar_failed, dtype=np.int64)
        if prompt_scores:
            self._keep_scores(batch, prompt_scores)
        self._apply_extends(batch, tokens[:sampled])
        if len(batch.decode_rows):
            self._apply_decodes(batch, tokens[sampled:], sampled)
        self._logprobs = ()
        self._grammar_failed = NO_FAILURES

    def _keep_scores(self, batch: ScheduledBatch, prompt_scores: tuple[PromptScores, ...]) -> None:
        """Rows for requests that still hold the tenancy they were planned for, in position order."""
        columns = self.kv.columns
        for scores in prompt_scores:
            req = batch.extend_reqs[scores.entry]
            if not columns.holds(req, batch.extend_serials[scores.entry]) or not req.scores_pending:
                continue
            if batch.score_starts.get(scores.entry) == req.score_received_to:
                req.score_rows.extend(scores.rows)

    def _apply_extends(self, batch: ScheduledBatch, tokens: np.ndarray) -> None:
        columns = self.kv.columns
        applied: list[Request] = []  # in plan order
        sampled_at: list[int] = []  # each one's token, or -1: a prefill-only request (max_new_tokens 0)
        at = 0
        entries = zip(batch.extend_reqs, batch.extend_serials, batch.extend_sampled, strict=True)
        for req, serial, sampled in entries:
            at += sampled
            if not columns.holds(req, serial):
                continue
            if not sampled:  # a middle chunk: nothing was sampled
                req.inflight_middle_chunks = max(req.inflight_middle_chunks - 1, 0)
                continue
            if req.scores_pending and req.to_finish is None and not self._publish_scores(req):
                self.exits.end(req, SCORES_LOST)
                continue
            applied.append(req)
            sampled_at.append(-1 if req.max_new_tokens == 0 and not req.num_outputs else at - 1)
        if not applied:
            return
        taking = [i for i, t in enumerate(sampled_at) if t >= 0]
        ended: dict[int, FinishReason] = {}
        if taking:
            rows = np.array([applied[i].req_pool_idx for i in taking], dtype=np.int64)
            at_result = np.array([sampled_at[i] for i in taking], dtype=np.int64)
            ended = {
                taking[k]: reason for k, reason in self._append_tokens(rows, tokens[at_result], at_result)
            }
        # In plan order, as SGLang caches them: the tree's state depends on the order of inserts.
        for i, req in enumerate(applied):
            reason = (req.to_finish or MAX_NEW_TOKENS) if sampled_at[i] < 0 else ended.get(i)
            if reason is None:
                self.books.remap(self.kv.cache_unfinished_req(req))
            else:
                self.exits.end(req, reason)

    def _publish_scores(self, req: Request) -> bool:
        """The prompt is done: its scores go out before its first token. False when rows are missing
        (a fault: nothing should lose them); the request is then ended with an error, not answered
        with gaps."""
        rows, req.score_rows, req.scores_sent = tuple(req.score_rows), [], True
        if len(rows) != req.score_rows_wanted:
            return False
        self.registry.prompt_scores(req, rows)
        return True

    def _apply_decodes(self, batch: ScheduledBatch, tokens: np.ndarray, offset: int) -> None:
        columns = self.kv.columns
        rows = batch.decode_rows
        at_result = None
        if self._logprobs or len(self._grammar_failed):
            at_result = offset + np.arange(len(rows), dtype=np.int64)
        held = columns.serial[rows] == batch.decode_serials
        if not held.all():
            rows, tokens = rows[held], tokens[held]
            if at_result is not None:
                at_result = at_result[held]
            if not len(rows):
                return
        columns.commit_decode(rows)
        for i, reason in self._append_tokens(rows, tokens, at_result):
            self.exits.end(columns.reqs[rows[i]], reason)

    def _append_tokens(
        self, rows: np.ndarray, tokens: np.ndarray, at_result: np.ndarray | None = None
    ) -> list[tuple[int, FinishReason]]:
        """Append one token per row, stream the visible ones (with their logprobs, `at_result` being
        each token's index in the result, for the requests that asked), and return (index, reason) of
        the rows that finished, by SGLang's `_check_finished` order: the length limit first (its token
        is streamed unless it is also a stop token or EOS), then, once min_new_tokens are out, a stop
        token id or EOS unless ignore_eos (neither streamed). Before all of them, a request aborted while
        running ends at its token whatever it is, with the abort's reason, and the token is not streamed
        (SGLang's to_finish, checked first in update_finish_state; the client's call has ended)."""
        columns = self.kv.columns
        columns.append(rows, tokens)
        if len(rows) <= FEW_ROWS and not self._logprobs and not len(self._grammar_failed):
            return self._few_rows_finished(rows, tokens)
        n_out = columns.n_out[rows]
        length = n_out >= columns.max_new[rows]
        stop_hit = self._stop_token_hits(rows, tokens)
        matched = stop_hit | (self._is_eos(tokens) & ~columns.ignore_eos[rows])
        counts = n_out >= columns.min_new[rows]
        aborting = columns.aborting[rows]
        finished = length | (matched & counts) | aborting
        visible = ~(matched & (length | counts)) & ~aborting
        scores = None
        if self._logprobs and at_result is not None:
            scores = self._scores_of(rows[visible], at_result[visible])
        self.registry.stream(columns.uid[rows][visible], tokens[visible], scores)
        reqs = columns.reqs
        ended = [
            (i, reqs[rows[i]].to_finish or self._reason(bool(length[i]), bool(stop_hit[i]), int(tokens[i])))
            for i in np.flatnonzero(finished).tolist()
        ]
        if len(self._grammar_failed) and at_result is not None:
            failed = np.isin(at_result, self._grammar_failed)
            ended = [(i, _unsatisfied(reason) if failed[i] else reason) for i, reason in ended]
        return ended

    def _few_rows_finished(self, rows: np.ndarray, tokens: np.ndarray) -> list[tuple[int, FinishReason]]:
        """_append_tokens's checks once the tokens are appended, row by row (neither logprobs nor a
        grammar failure in the result): the same rule, without a dozen numpy calls on a few rows."""
        columns = self.kv.columns
        reqs = columns.reqs
        ended: list[tuple[int, FinishReason]] = []
        hidden: list[int] = []
        for i, (row, token) in enumerate(zip(rows.tolist(), tokens.tolist(), strict=True)):
            n_out = columns.n_out[row]
            length = bool(n_out >= columns.max_new[row])
            stop_hit = bool(columns.has_stop[row]) and token in reqs[row].params.stop_token_ids
            matched = stop_hit or (token in self._eos_set and not columns.ignore_eos[row])
            counts = bool(n_out >= columns.min_new[row])
            aborting = bool(columns.aborting[row])
            if (matched and (length or counts)) or aborting:
                hidden.append(i)
            if length or (matched and counts) or aborting:
                ended.append((i, reqs[row].to_finish or self._reason(length, stop_hit, token)))
        uids = columns.uid[rows]
        if hidden:
            visible = np.ones(len(rows), dtype=bool)
            visible[hidden] = False
            uids, tokens = uids[visible], tokens[visible]
        else:
            tokens = tokens.copy()  # the result's array stays the caller's, as with the mask
        self.registry.stream(uids, tokens)
        return ended

    def _scores_of(self, rows: np.ndarray, at_result: np.ndarray) -> list[tuple[int, TokenLogprobs]]:
        """(index among the streamed tokens, logprobs) of the tokens whose requests asked."""
        reqs, logprobs = self.kv.columns.reqs, self._logprobs
        return [
            (k, logprobs[at])
            for k, (row, at) in enumerate(zip(rows.tolist(), at_result.tolist(), strict=True))
            if reqs[row].params.logprobs
        ]

    @staticmethod
    def _reason(length: bool, stop_token: bool, token: int) -> FinishReason:
        if length:
            return MAX_NEW_TOKENS
        return FinishReason.stop(f"stop token {token}") if stop_token else EOS

    def _stop_token_hits(self, rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Per row: the token is one of the request's own stop token ids (rare: checked row by row)."""
        columns = self.kv.columns
        hits = np.zeros(len(rows), dtype=bool)
        for i in np.flatnonzero(columns.has_stop[rows]).tolist():
            hits[i] = int(tokens[i]) in columns.reqs[rows[i]].params.stop_token_ids
        return hits

    def _is_eos(self, tokens: np.ndarray) -> np.ndarray:
        eos = self._eos_ids
        if len(eos) == 1:
            return tokens == eos[0]
        return np.isin(tokens, eos)


def _unsatisfied(reason: FinishReason) -> FinishReason:
    """A stop at a sample whose grammar failed is the grammar's failure (the worker sampled EOS only
    because nothing else was left); a length limit or an abort reached at the same token stands."""
    return GRAMMAR_UNSATISFIABLE if reason.kind is FinishKind.STOP else reason
