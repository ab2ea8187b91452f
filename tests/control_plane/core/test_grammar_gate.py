"""The grammar gate (control_plane/core/grammar_gate.py): a call held to a grammar reaches the
engine only once its worker said the grammar is compiled, so no step compiles (issue 37, item 4);
and the Prepare / GrammarReady messages on the wire."""

from __future__ import annotations

import asyncio

import pytest

from control_plane.core.grammar_gate import GrammarGate
from control_plane.core.inbox import Arrival, LiveSample, Verdict
from control_plane.request import RequestParams
from protos import worker_codec
from protos.worker import Grammar, GrammarReady, Prepare, SamplerParams, StepPlan, WorkerLimits

pytestmark = pytest.mark.timeout(30)

G1 = Grammar("llguidance", "regex", "[a-z]+")
G2 = Grammar("llguidance", "json_schema", '{"type": "object"}')


def _arrival(rid: str, grammar: Grammar | None, uid: int = 1) -> Arrival:
    params = RequestParams(sampler=SamplerParams(grammar=grammar))
    return Arrival((LiveSample(rid, uid, rid, "me", 0.0),), [1, 2, 3], params)


class _Worker:
    """The gate's view of a worker and its engine: what was submitted, refused and asked for."""

    def __init__(self, enabled: bool = True, deadline_s: float = 5.0) -> None:
        self.submitted: list[str] = []
        self.refused: list[tuple[str, Verdict, str]] = []
        self.asked: list[Grammar] = []
        self.gate = GrammarGate(
            "w1",
            lambda a: self.submitted.append(a.samples[0].rid),
            lambda a, v, m: self.refused.append((a.samples[0].rid, v, m)),
            self._prepare,
            enabled,
            deadline_s,
        )

    async def _prepare(self, grammar: Grammar) -> None:
        self.asked.append(grammar)


async def test_a_call_waits_for_its_grammar_and_others_pass() -> None:
    w = _Worker()
    w.gate.submit(_arrival("plain", None))
    w.gate.submit(_arrival("a", G1))
    w.gate.submit(_arrival("b", G1))
    w.gate.submit(_arrival("c", G2))
    await asyncio.sleep(0)
    assert w.submitted == ["plain"]
    assert w.asked == [G1, G2], "each grammar is asked for once"
    w.gate.ready(GrammarReady(G1))
    assert w.submitted == ["plain", "a", "b"]
    w.gate.submit(_arrival("d", G1))  # compiled there now: straight on
    assert w.submitted[-1] == "d" and w.asked == [G1, G2]
    w.gate.ready(GrammarReady(G2, "does not compile on this worker: x"))
    assert w.refused == [("c", Verdict.INVALID, "sampling: does not compile on this worker: x")]
    assert w.gate.held == 0


async def test_a_worker_that_does_not_prepare_gets_every_call_at_once() -> None:
    w = _Worker(enabled=False)
    w.gate.submit(_arrival("a", G1))
    assert w.submitted == ["a"] and not w.asked


async def test_a_call_held_past_the_deadline_is_refused_unavailable() -> None:
    w = _Worker(deadline_s=0.05)
    w.gate.submit(_arrival("a", G1))
    await asyncio.sleep(0.2)
    assert [(rid, verdict) for rid, verdict, _ in w.refused] == [("a", Verdict.UNAVAILABLE)]
    w.gate.ready(GrammarReady(G1))  # the late answer still counts for the next call
    w.gate.submit(_arrival("b", G1))
    assert w.submitted == ["b"]


async def test_held_calls_are_aborted_and_refused_when_the_worker_goes() -> None:
    w = _Worker()
    w.gate.submit(_arrival("a", G1))
    w.gate.submit(_arrival("b", G1))
    assert w.gate.holds("a", "me") and not w.gate.holds("a", "someone else")
    assert w.gate.abort("a")
    w.gate.close()
    assert w.refused == [("b", Verdict.UNAVAILABLE, "worker w1 is gone")]
    w.gate.ready(GrammarReady(G1))
    assert not w.submitted


def test_prepare_and_grammar_ready_on_the_wire() -> None:
    decoded = worker_codec.PlanDecoder().control(worker_codec.prepare_to_proto(G2))
    assert decoded == Prepare(G2)
    ready = GrammarReady(G1, "why")
    assert (
        worker_codec.grammar_ready_from_proto(worker_codec.grammar_ready_to_proto(ready).grammar_ready)
        == ready
    )
    hello = WorkerLimits("w", 16, 1, 64, 32, prepares_grammars=True)
    assert worker_codec.hello_from_proto(worker_codec.hello_to_proto(hello).hello).prepares_grammars


async def _heir(grammar_gate: bool = True):  # type: ignore[no-untyped-def]
    """An engine over a fake worker that prepares grammars, its gate wired as the server wires it,
    and the handles of the new sequences in the plans it sends."""
    from tests.control_plane.fake_core import make_engine

    engine, channel, hub = make_engine(1000, frozenset({0}), worker_id="heir")
    asked: list[Grammar] = []

    async def prepare(grammar: Grammar) -> None:
        asked.append(grammar)

    gate = GrammarGate("heir", engine.submit, lambda a, v, m: None, prepare, True, 5.0)
    if grammar_gate:
        engine.grammar_gate = gate
    planned: list[int] = []
    send = channel.send

    async def recording_send(plan: StepPlan) -> None:
        planned.extend(s.handle for s in plan.new_seqs)
        await send(plan)

    channel.send = recording_send  # type: ignore[method-assign]
    return engine, hub, gate, asked, planned


def _orphan(rid: str, uid: int):  # type: ignore[no-untyped-def]
    from control_plane.core.inbox import Orphan

    params = RequestParams(max_new_tokens=4, ignore_eos=True, sampler=SamplerParams(grammar=G1))
    return Orphan(LiveSample(rid, uid, rid, "owner", 0.0), [5, 6, 7, 8], params)


async def test_a_handed_over_sequence_is_planned_only_once_its_grammar_is_ready_on_the_heir() -> None:
    """Issue 37 item 4: a sequence handed over from another worker went straight to the heir's
    scheduler, and its first plan made the heir compile the grammar inside that step."""
    from tests.control_plane.fake_core import finished

    engine, hub, gate, asked, planned = await _heir()
    runner = asyncio.create_task(engine.run())
    try:
        engine.adopt([_orphan("moved", 1 << 40)])
        await asyncio.sleep(0.2)
        assert asked == [G1], "the heir was not asked to compile the orphan's grammar"
        assert not planned, "the orphan was planned before its grammar was compiled on the heir"
        gate.ready(GrammarReady(G1))
        (stream,) = await finished(hub, [1 << 40], timeout=5)
        assert stream.finished is not None and stream.finished.kind.value == "length"
        assert len(planned) == 1
    finally:
        engine.stop()
        await asyncio.wait_for(runner, 5)


async def test_a_held_orphan_aborted_meanwhile_never_reaches_the_scheduler() -> None:
    from tests.control_plane.fake_core import finished

    engine, hub, gate, _asked, planned = await _heir()
    runner = asyncio.create_task(engine.run())
    try:
        engine.adopt([_orphan("moved", 1 << 40)])
        await asyncio.sleep(0.05)
        assert engine.abort("moved", "the client left")
        (stream,) = await finished(hub, [1 << 40], timeout=5)
        assert stream.finished is not None and stream.finished.kind.value == "abort"
        gate.ready(GrammarReady(G1))
        await asyncio.sleep(0.2)
        assert not planned and not engine.knows("moved")
    finally:
        engine.stop()
        await asyncio.wait_for(runner, 5)


async def test_a_held_orphan_goes_on_when_the_worker_never_answers() -> None:
    """A running stream is not refused: past the deadline it goes on (the step compiles, as before)."""
    from tests.control_plane.fake_core import finished

    engine, hub, gate, _asked, planned = await _heir()
    gate.deadline_s = 0.1
    runner = asyncio.create_task(engine.run())
    try:
        engine.adopt([_orphan("moved", 1 << 40)])
        (stream,) = await finished(hub, [1 << 40], timeout=5)
        assert stream.finished is not None and stream.finished.kind.value == "length"
        assert len(planned) == 1
    finally:
        engine.stop()
        await asyncio.wait_for(runner, 5)
