"""The step plan the worker receives: releases, remaps, transfers, new sequences, extend and decode
work as columns."""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import numpy as np

from control_plane.request import Request
from control_plane.scheduler.batch import ScheduledBatch
from control_plane.scheduler.books import SequenceBooks
from control_plane.scheduler.kv import KvManager
from protos.worker import DecodeWork, ExtendWork, NewSeq, StepKind, StepPlan

_Work = TypeVar("_Work", ExtendWork, DecodeWork)


def _read_only(work: _Work) -> _Work:
    for f in dataclasses.fields(work):
        getattr(work, f.name).flags.writeable = False
    return work


# The work of a plan without extends (most plans: decode steps), or without decodes: one shared value
# each (frozen, its arrays read-only), not a dozen empty arrays made for every plan.
NO_EXTENDS = _read_only(ExtendWork())
NO_DECODES = _read_only(DecodeWork())


class PlanBuilder:
    """The decided step as a StepPlan for the worker."""

    def __init__(self, kv: KvManager, books: SequenceBooks) -> None:
        self.kv = kv
        self.books = books

    def build(self, step_id: int, batch: ScheduledBatch | None) -> StepPlan:
        """The plan of `batch` (None: a plan of releases and transfers only), with every change to
        the books queued since the last plan."""
        deltas = self.books.take_deltas()
        if batch is None:
            return StepPlan(
                step_id,
                StepKind.DECODE,
                releases=deltas.releases,
                remaps=deltas.remaps,
                offloads=deltas.offloads,
                sends=deltas.sends,
                receives=deltas.receives,
            )
        extends, new_seqs = self._extend_work(batch)
        decodes = NO_DECODES
        if len(batch.decode_rows):
            decodes = DecodeWork(handles=batch.decode_handles, slots=batch.decode_slots)
        return StepPlan(
            step_id,
            batch.kind,
            releases=deltas.releases,
            remaps=deltas.remaps,
            offloads=deltas.offloads,
            restores=deltas.restores,
            new_seqs=new_seqs,
            extends=extends,
            decodes=decodes,
            sends=deltas.sends,
            receives=deltas.receives,
        )

    def _extend_work(self, batch: ScheduledBatch) -> tuple[ExtendWork, tuple[NewSeq, ...]]:
        reqs = batch.extend_reqs
        if not reqs:
            return NO_EXTENDS, ()
        new_seqs = []
        tokens: list[int] = []
        slots: list[np.ndarray] = []
        scoring = False
        for req in reqs:
            start, end = req.extend_range
            if req.handle in batch.new_handles:
                new_seqs.append(self._new_seq(req, start))
                # A new tenancy scores from the first row not received yet.
                req.score_next = req.score_received_to
            tokens.extend(req.fill_ids[start:end])
            slots.append(self.kv.row(req)[start:end])
            scoring = scoring or req.scores_pending
        work = ExtendWork(
            handles=np.fromiter((r.handle for r in reqs), dtype=np.int64, count=len(reqs)),
            starts=np.fromiter((r.extend_range[0] for r in reqs), dtype=np.int32, count=len(reqs)),
            lens=np.fromiter(
                (r.extend_range[1] - r.extend_range[0] for r in reqs), dtype=np.int32, count=len(reqs)
            ),
            sample=np.array(batch.extend_sampled, dtype=bool),
            token_ids=np.asarray(tokens, dtype=np.int32),
            slots=np.concatenate(slots).astype(np.int64),
        )
        if scoring:
            work = _with_scores(work, reqs)
            batch.score_starts = {
                i: int(work.score_starts[i]) for i in np.flatnonzero(work.score_lens).tolist()
            }
        return work, tuple(new_seqs)

    def _new_seq(self, req: Request, start: int) -> NewSeq:
        history = np.zeros(0, dtype=np.int32)
        if req.params.sampler.needs_history:
            history = np.asarray(req.fill_ids[:start], dtype=np.int32)
        return NewSeq(
            req.handle,
            req.params.sampler,
            prefix_slots=self.kv.row(req)[:start].copy(),
            history_ids=history,
            request_id=req.rid,
            # The client's prompt, whoever generated the rest of the input (a hand-over).
            prompt_len=len(req.origin_input_ids) - req.params.generated_before,
            sim_output_len=req.params.sim_output_len,
        )


def _with_scores(work: ExtendWork, reqs: list[Request]) -> ExtendWork:
    """The extends with their prompt-scoring columns: each scoring request's entry scores the rows of
    its extend from the next unplanned one up to the prompt's second-to-last position (the last one's
    row is the first output token's); the token after the extend is named for the row at its end."""
    n = len(reqs)
    starts, lens, next_ids = np.zeros(n, np.int32), np.zeros(n, np.int32), np.full(n, -1, np.int32)
    for i, req in enumerate(reqs):
        if not req.scores_pending:
            continue
        start, end = req.extend_range
        first = max(start, req.score_next)
        last = min(end, len(req.origin_input_ids) - 1)
        if last <= first:
            continue
        starts[i], lens[i] = first, last - first
        req.score_next = last
        if end < req.seqlen:
            next_ids[i] = req.fill_ids[end]
    return dataclasses.replace(work, score_starts=starts, score_lens=lens, next_ids=next_ids)
