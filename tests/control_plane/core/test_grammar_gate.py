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
from protos.worker import Grammar, GrammarReady, Prepare, SamplerParams, WorkerLimits

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
