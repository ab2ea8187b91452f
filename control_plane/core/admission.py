"""Admission at the top of a turn: a Generate call's samples, or a request that continues here (an
orphan of a lost or leaving worker, an immigrant), become scheduler requests, and the publisher
hears the verdict."""

from __future__ import annotations

import dataclasses

import structlog

from control_plane.core.inbox import Arrival, Orphan, Verdict
from control_plane.core.publisher import Streams
from control_plane.record.recorder import note_received
from control_plane.request import FinishReason, RequestParams
from control_plane.scheduler.scheduler import QueueFull, RequestRejected, Scheduler, SloUnmeetable

SEED_SPACE = 1 << 64


def admit(
    scheduler: Scheduler, streams: Streams, arrival: Arrival, log: structlog.typing.FilteringBoundLogger
) -> None:
    """Add every sample of a call, or none: a refusal withdraws the samples already queued."""
    added: list[str] = []
    n = len(arrival.samples)
    try:
        for i, sample in enumerate(arrival.samples):
            params = sample_params(arrival.params, i, n, sample.call)
            note_received(scheduler, sample.rid, sample.arrived)
            scheduler.add_request(sample.rid, arrival.input_ids, params, uid=sample.uid)
            added.append(sample.rid)
    except Exception as exc:
        verdict = _verdict(exc)
        if verdict is Verdict.INTERNAL:
            log.exception("admission failed", rid=arrival.samples[0].call)
        for rid in added:
            scheduler.abort(rid, FinishReason.abort(str(exc)))
        streams.refuse(arrival.samples, verdict, str(exc))
        return
    streams.accept(arrival.samples)


def admit_orphan(scheduler: Scheduler, streams: Streams, orphan: Orphan, worker: str) -> None:
    """A request that continues here; one the scheduler refuses ends with an abort that says why."""
    try:
        scheduler.add_request(orphan.sample.rid, orphan.input_ids, orphan.params, uid=orphan.sample.uid)
    except (QueueFull, RequestRejected, ValueError) as exc:
        message = f"its worker went away and {worker} could not take it over: {exc}"
        streams.finish(orphan.sample, FinishReason.abort(message))


def _verdict(exc: Exception) -> Verdict:
    if isinstance(exc, SloUnmeetable):
        return Verdict.SLO_UNMEETABLE
    if isinstance(exc, QueueFull):
        return Verdict.QUEUE_FULL
    if isinstance(exc, RequestRejected):
        return Verdict.REJECTED
    if isinstance(exc, ValueError):
        return Verdict.DUPLICATE
    return Verdict.INTERNAL


def sample_params(params: RequestParams, index: int, n: int, group: str) -> RequestParams:
    """Sample i of n: seed + i, and a group name so the samples are retracted together or not at all.
    Only sample 0 scores the prompt (the call hears its prompt log probabilities once); the others
    match the prefix cache as usual."""
    if n == 1:
        return params
    seed = params.sampler.seed
    # Seeds are uint64 on the wire: sample i's seed wraps around rather than overflowing.
    wrapped = None if seed is None else (seed + index) % SEED_SPACE
    sampler = params.sampler if wrapped is None else dataclasses.replace(params.sampler, seed=wrapped)
    start = params.logprob_start_len if index == 0 else -1
    return dataclasses.replace(params, sampler=sampler, group=group, logprob_start_len=start)
