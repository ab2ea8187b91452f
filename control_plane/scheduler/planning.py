"""The step plan the worker receives: releases, remaps, transfers, new sequences, extend and decode
work as columns."""

from __future__ import annotations

import numpy as np

from control_plane.request import Request
from control_plane.scheduler.admission import Admission
from control_plane.scheduler.batch import ScheduledBatch
from control_plane.scheduler.state import StepStats
from protos.worker import DecodeWork, ExtendWork, NewSeq, StepKind, StepPlan


class Planning(Admission):
    """The decided step as a StepPlan for the worker."""

    def _build_plan(self, batch: ScheduledBatch | None, stats: StepStats) -> StepPlan:
        releases = np.asarray(self._releases, dtype=np.int64)
        # A remap or an offload queued for a request released since (retracted, preempted, aborted,
        # refused re-entry by a full queue) is moot: the worker drops the sequence first.
        released = set(self._releases)
        remaps = tuple(r for r in self._remaps if r.handle not in released)
        offloads = tuple(t for t in self._offloads if t.handle not in released)
        restores = tuple(self._restores)
        self._releases, self._remaps, self._offloads, self._restores = [], [], [], []
        if batch is None:
            return StepPlan(
                self.step_id, StepKind.DECODE, releases=releases, remaps=remaps, offloads=offloads
            )
        extends, new_seqs = self._extend_work(batch)
        decodes = DecodeWork()
        if len(batch.decode_rows):
            decodes = DecodeWork(handles=self._decode_handles, slots=self._decode_slots)
        return StepPlan(
            self.step_id,
            batch.kind,
            releases=releases,
            remaps=remaps,
            offloads=offloads,
            restores=restores,
            new_seqs=new_seqs,
            extends=extends,
            decodes=decodes,
        )

    def _extend_work(self, batch: ScheduledBatch) -> tuple[ExtendWork, tuple[NewSeq, ...]]:
        reqs = batch.extend_reqs
        if not reqs:
            return ExtendWork(), ()
        new_seqs = []
        tokens: list[int] = []
        slots: list[np.ndarray] = []
        for req in reqs:
            start, end = req.extend_range
            if req.handle in self._introduced:
                new_seqs.append(self._new_seq(req, start))
            tokens.extend(req.fill_ids[start:end])
            slots.append(self.kv.row(req)[start:end])
        return (
            ExtendWork(
                handles=np.fromiter((r.handle for r in reqs), dtype=np.int64, count=len(reqs)),
                starts=np.fromiter((r.extend_range[0] for r in reqs), dtype=np.int32, count=len(reqs)),
                lens=np.fromiter(
                    (r.extend_range[1] - r.extend_range[0] for r in reqs), dtype=np.int32, count=len(reqs)
                ),
                sample=np.array(batch.extend_sampled, dtype=bool),
                token_ids=np.asarray(tokens, dtype=np.int32),
                slots=np.concatenate(slots).astype(np.int64),
            ),
            tuple(new_seqs),
        )

    def _new_seq(self, req: Request, start: int) -> NewSeq:
        history = np.zeros(0, dtype=np.int32)
        if req.params.sampler.uses_penalties:
            history = np.asarray(req.fill_ids[:start], dtype=np.int32)
        return NewSeq(
            req.handle,
            req.params.sampler,
            prefix_slots=self.kv.row(req)[:start].copy(),
            history_ids=history,
            request_id=req.rid,
            prompt_len=len(req.origin_input_ids),
            sim_output_len=req.params.sim_output_len,
        )
