"""Live migration between two engines of one control plane (control_plane/core/migration.py), over
FakeWorkers that share a network: a send arrives at once, and the result of the plan that carried it
says so. Tokens depend on a sequence's context alone, so a migrated request must stream exactly what
it streams where it started."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator

import pytest
import structlog

from control_plane import metrics
from control_plane.core.engine import Engine
from control_plane.core.fleet import Fleet, Router
from control_plane.request import FinishKind, RequestParams
from protos.worker import SamplerParams, StepPlan, StepResult, TransferOutcome
from tests.control_plane.fake_core import FakeHub, make_engine, submit
from tests.polling import until

pytestmark = pytest.mark.timeout(60)

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def _params(max_new: int) -> RequestParams:
    return RequestParams(max_new_tokens=max_new, ignore_eos=True, sampler=SamplerParams(temperature=0.0))


class Pair:
    """Engines `a` and `b` behind one router, their workers on one network, both loops running.
    With `reports`, each worker also reports the transfers it received (as a real worker welcomed
    with `transfer_reports` does); without, only the sender's results say a copy arrived."""

    def __init__(self, reports: bool = False) -> None:
        self.hub = FakeHub()
        self.router = Router[Engine]("test")
        self.fleet = Fleet(self.router)
        network: dict[str, list[tuple[int, int]]] = {}
        wiring = {
            "hub": self.hub,
            "fleet": self.fleet,
            "network": network,
            "receivers": {} if reports else None,
        }
        self.receivers = wiring["receivers"]
        self.a, self.channel_a, _ = make_engine(1000, step_s=0.002, worker_id="a", **wiring)  # type: ignore[arg-type]
        self.b, self.channel_b, _ = make_engine(1000, step_s=0.002, worker_id="b", **wiring)  # type: ignore[arg-type]
        self.network = network
        self.tasks = []
        for engine in (self.a, self.b):
            self.router.attach(engine)
            self.tasks.append(asyncio.create_task(engine.run()))

    async def close(self) -> None:
        for engine in (self.a, self.b):
            engine.stop()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    made = Pair()
    try:
        yield made
    finally:
        await made.close()


@pytest.fixture
async def reporting_pair() -> AsyncIterator[Pair]:
    made = Pair(reports=True)
    try:
        yield made
    finally:
        await made.close()


async def _alone(max_new: int, prompt: list[int] = PROMPT) -> list[int]:
    """What the request streams on one engine that never migrates."""
    engine, _, hub = make_engine(1000, step_s=0.0)
    task = asyncio.create_task(engine.run())
    try:
        [uid] = submit(engine, "r", prompt, _params(max_new))
        await asyncio.wait_for(hub.stream(uid).done.wait(), 20)
        return hub.stream(uid).tokens
    finally:
        engine.stop()
        await task


def _books_empty(engine: Engine) -> bool:
    return engine.scheduler.books() == (0, 0) and not engine.migration.busy and engine.scheduler.is_idle


async def test_a_migrated_request_streams_what_it_streams_where_it_started(pair: Pair) -> None:
    [uid] = submit(pair.a, "r", PROMPT, _params(40))
    stream = pair.hub.stream(uid)
    await until(lambda: len(stream.tokens) >= 5, 20.0, "five tokens on a", every_s=0.001)
    assert pair.a.migration.start(pair.a.scheduler, ["r"], pair.b, "test")
    await asyncio.wait_for(stream.done.wait(), 20)
    assert stream.finished is not None and stream.finished.kind is FinishKind.LENGTH
    assert stream.tokens == await _alone(40)
    assert (pair.a.migration.migrated_out, pair.b.migration.migrated_in) == (1, 1)
    await until(
        lambda: _books_empty(pair.a) and _books_empty(pair.b), 20.0, "both books at zero", every_s=0.001
    )
    assert pair.network == {} and pair.b.scheduler.kv.protected_size() == 0


async def test_an_abort_while_the_tail_is_on_its_way_ends_the_request_and_nothing_else(pair: Pair) -> None:
    """Between the switch and the tail's outcome the sample is in no engine's streams: the abort is
    found there (knows, owner_of), ends the stream with its reason, and the destination forgets both
    copies instead of admitting it."""
    [uid] = submit(pair.a, "r", PROMPT, _params(400))
    stream = pair.hub.stream(uid)
    await until(lambda: len(stream.tokens) >= 3, 20.0, "three tokens on a", every_s=0.001)
    # Once a has switched, its next result (which would carry the tail's outcome) waits for the gate.
    gate, receive = asyncio.Event(), pair.channel_a.receive

    async def gated() -> StepResult:
        if pair.a.migration.exports:
            await gate.wait()
        return await receive()

    pair.channel_a.receive = gated  # type: ignore[method-assign]
    assert pair.a.migration.start(pair.a.scheduler, ["r"], pair.b, "test")
    await until(lambda: bool(pair.a.migration.exports), 20.0, "the switch", every_s=0.001)
    assert pair.a.knows("r") and pair.a.owner_of("r") == "owner" and not pair.a.streams.knows("r")
    assert pair.a.abort("r", "client went away")
    gate.set()
    await asyncio.wait_for(stream.done.wait(), 20)
    assert stream.finished is not None and stream.finished.kind is FinishKind.ABORT
    assert "client went away" in stream.finished.message
    await until(
        lambda: _books_empty(pair.a) and _books_empty(pair.b), 20.0, "both books at zero", every_s=0.001
    )
    assert pair.b.migration.migrated_in == 0 and "r" not in pair.b.scheduler.requests
    assert pair.network == {}, "the destination forgot both copies"
    assert pair.b.scheduler.kv.protected_size() == 0, "the pre-copy's hold was released"


def _arrivals(worker: str) -> dict[str, int]:
    """Copies sent from `worker` that arrived so far, by whose word came first."""
    return {
        by: int(
            metrics.REGISTRY.get_sample_value(
                "stepwise:migration_arrivals_total", {"worker": worker, "reported_by": by}
            )
            or 0
        )
        for by in ("receiver", "sender")
    }


def _hold_the_tail_s_result(pair: Pair) -> asyncio.Event:
    """The result of a's plan that sent a tail (a's own word that it arrived) waits for the event
    that this returns; the plan still runs at once, so its send lands and b reports it."""
    gate, receive = asyncio.Event(), pair.channel_a.receive

    async def held() -> StepResult:
        tails = set(pair.a.migration.exports)  # switched: their tails are sent or on their way
        result = await receive()
        if tails & {t.transfer_id for t in result.transfers}:
            await gate.wait()
        return result

    pair.channel_a.receive = held  # type: ignore[method-assign]
    return gate


@pytest.mark.parametrize("precopy", [True, False], ids=["pre-copy-then-tail", "all-at-once"])
async def test_the_destination_s_word_continues_a_request_while_the_source_s_result_is_held_back(
    reporting_pair: Pair, precopy: bool
) -> None:
    """The destination reports a transfer the moment it holds it: the request continues there and
    ends while the source's own word on the tail (its next result: a long prefill under PD) has
    not come. Each copy is counted once, as reported by the receiver; the source's later word on
    the same transfers is dropped without a warning."""
    pair = reporting_pair
    before = _arrivals("a")
    [uid] = submit(pair.a, "r", PROMPT, _params(40))
    stream = pair.hub.stream(uid)
    await until(lambda: len(stream.tokens) >= 5, 20.0, "five tokens on a", every_s=0.001)
    gate = _hold_the_tail_s_result(pair)
    with structlog.testing.capture_logs() as logs:
        assert pair.a.migration.start(pair.a.scheduler, ["r"], pair.b, "test", precopy=precopy)
        await asyncio.wait_for(stream.done.wait(), 20)
        assert not gate.is_set()
        assert stream.finished is not None and stream.finished.kind is FinishKind.LENGTH
        assert stream.tokens == await _alone(40)
        assert (pair.a.migration.migrated_out, pair.b.migration.migrated_in) == (1, 1)
        gate.set()
        await until(
            lambda: _books_empty(pair.a) and _books_empty(pair.b), 20.0, "both books at zero", every_s=0.001
        )
    copies = 2 if precopy else 1
    after = _arrivals("a")
    assert (after["receiver"] - before["receiver"], after["sender"] - before["sender"]) == (copies, 0)
    assert not [e for e in logs if e["log_level"] in ("warning", "error")], logs
    assert pair.network == {} and pair.b.scheduler.kv.protected_size() == 0


async def test_the_samples_of_a_call_continue_together_when_their_tails_arrive_apart(
    reporting_pair: Pair,
) -> None:
    """Each sample's tail is a transfer of its own, and the destination reports each when it lands,
    at different moments: the call's samples still continue on b at one step (a group moves
    together), so they stay in step there as they were on a."""
    pair = reporting_pair
    assert isinstance(pair.receivers, dict)
    loop, report, apart = asyncio.get_running_loop(), pair.receivers["b:1"], iter(range(100))
    pair.receivers["b:1"] = lambda outcome: loop.call_later(0.02 * next(apart), report, outcome)
    introduced: list[list[str]] = []
    send = pair.channel_b.send

    async def recording(plan: StepPlan) -> None:
        if plan.new_seqs:
            introduced.append(sorted(n.request_id for n in plan.new_seqs))
        await send(plan)

    pair.channel_b.send = recording  # type: ignore[method-assign]
    gate = _hold_the_tail_s_result(pair)  # a's own word on the tails would come at once
    uids = submit(pair.a, "r", PROMPT, _params(40), n=3)
    await until(
        lambda: all(len(pair.hub.stream(u).tokens) >= 5 for u in uids),
        20.0,
        "five tokens each on a",
        every_s=0.001,
    )
    assert pair.a.migration.start(pair.a.scheduler, ["r/0", "r/1", "r/2"], pair.b, "test")
    for uid in uids:
        await asyncio.wait_for(pair.hub.stream(uid).done.wait(), 20)
    gate.set()
    assert introduced == [["r/0", "r/1", "r/2"]]
    want = await _alone(40)
    assert [pair.hub.stream(u).tokens for u in uids] == [want] * 3


async def test_a_receiver_s_word_after_the_sender_s_changes_nothing(pair: Pair) -> None:
    """Whichever word comes second, or a word on a transfer nobody waits for (a copy given up, a
    stale one), is dropped quietly: the request moved once and is not admitted again."""
    sent: list[tuple[str, int]] = []
    send = pair.channel_a.send

    async def recording(plan: StepPlan) -> None:
        sent.extend((s.transfer_id, 16 * len(s.slots)) for s in plan.sends)
        await send(plan)

    pair.channel_a.send = recording  # type: ignore[method-assign]
    [uid] = submit(pair.a, "r", PROMPT, _params(40))
    stream = pair.hub.stream(uid)
    await until(lambda: len(stream.tokens) >= 5, 20.0, "five tokens on a", every_s=0.001)
    assert pair.a.migration.start(pair.a.scheduler, ["r"], pair.b, "test")
    await asyncio.wait_for(stream.done.wait(), 20)
    assert len(sent) == 2  # the pre-copy and the tail, both settled by a's results
    before = _arrivals("a")
    with structlog.testing.capture_logs() as logs:
        for transfer_id, nbytes in [*sent, ("a/unknown", 64), ("gone/elsewhere", 64)]:
            pair.b.worker_received(TransferOutcome(transfer_id, "", nbytes))
        await until(
            lambda: _books_empty(pair.a) and _books_empty(pair.b), 20.0, "both books at zero", every_s=0.001
        )
    assert _arrivals("a") == before
    assert not [e for e in logs if e["log_level"] in ("warning", "error")], logs
    assert stream.tokens == await _alone(40)
    assert (pair.a.migration.migrated_out, pair.b.migration.migrated_in) == (1, 1)


async def test_only_the_copy_s_destination_can_say_it_arrived(pair: Pair) -> None:
    """A word that a copy arrived from a worker other than its destination is logged and ignored;
    the destination's own then continues the request."""
    gate = _hold_the_tail_s_result(pair)
    [uid] = submit(pair.a, "r", PROMPT, _params(40))
    stream = pair.hub.stream(uid)
    await until(lambda: len(stream.tokens) >= 5, 20.0, "five tokens on a", every_s=0.001)
    assert pair.a.migration.start(pair.a.scheduler, ["r"], pair.b, "test", precopy=False)
    [tail] = pair.a.migration.exports
    await until(lambda: tail in pair.network, 20.0, "the tail at b", every_s=0.001)  # its result held back
    with structlog.testing.capture_logs() as logs:
        pair.a.mover.copy_arrived(TransferOutcome(tail, "", 64), receiver="c")
    assert [e["event"] for e in logs] == ["transfer reported by another worker"]
    assert tail in pair.a.migration.exports and pair.b.migration.migrated_in == 0
    pair.b.worker_received(TransferOutcome(tail, "", 64))
    await asyncio.wait_for(stream.done.wait(), 20)
    gate.set()
    assert stream.tokens == await _alone(40)


def _moves(worker: str) -> Counter[str]:
    """Successful migrations off `worker` so far, by reason (the process-wide counter)."""
    return Counter(
        {
            reason: int(
                metrics.REGISTRY.get_sample_value(
                    "stepwise:migrations_total", {"worker": worker, "reason": reason, "outcome": "ok"}
                )
                or 0
            )
            for reason in ("kv", "balance", "drain", "test")
        }
    )


async def _two_engines(capacities: dict[str, int], **scheduler: object) -> tuple[FakeHub, list[Engine]]:
    """Engines behind one router whose workers share a network, wired as the server wires them."""
    hub, router = FakeHub(), Router[Engine]("test")
    fleet = Fleet(router)
    network: dict[str, list[tuple[int, int]]] = {}
    engines = []
    for worker, capacity in capacities.items():
        engine, _, _ = make_engine(
            1000,
            capacity=capacity,
            step_s=0.002,
            worker_id=worker,
            hub=hub,
            fleet=fleet,
            network=network,
            **scheduler,
        )
        router.attach(engine)
        engines.append(engine)
    return hub, engines


@contextlib.asynccontextmanager
async def _running(engines: list[Engine]) -> AsyncIterator[None]:
    tasks = [asyncio.create_task(e.run()) for e in engines]
    try:
        yield
    finally:
        for engine in engines:
            engine.stop()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


@pytest.mark.parametrize(
    ("balance", "steps"),
    [(True, 16), (True, 1), (False, 16)],
    ids=["look-ahead-16", "look-ahead-1", "disable-kv-balance"],
)
async def test_a_worker_short_of_kv_migrates_to_one_with_room_instead_of_retracting(
    balance: bool, steps: int
) -> None:
    """Four requests fill a's 200 slots at admission (the new-token ratio expects less output than
    they make); b is empty. Before a's next decode would not fit, requests move to b with their KV:
    nothing is retracted (recomputed) and every stream is what it is alone. With a look-ahead of
    one step no pre-copy can end in time: the retraction itself sends its victims to b (spill_to).
    Switched off, a retracts."""
    hub, engines = await _two_engines(
        {"a": 200, "b": 1000},
        control={"kv_balance": balance, "kv_balance_steps": steps},
        init_new_token_ratio=0.3,
    )
    a, b = engines
    before = _moves("a")
    async with _running(engines):
        prompts = [[5 + i, 6, 7, 8, 9, 10, 11, 12] for i in range(4)]
        uids = [submit(a, f"r{i}", p, _params(60))[0] for i, p in enumerate(prompts)]
        for uid in uids:
            await asyncio.wait_for(hub.stream(uid).done.wait(), 30)
        if balance:
            assert a.scheduler.num_retracted_total == 0, "a retracted though b had room"
            assert b.migration.migrated_in >= 1
            assert _moves("a") - before == {"kv": b.migration.migrated_in}
        else:
            assert a.scheduler.num_retracted_total > 0 and b.migration.migrated_in == 0
        for uid, prompt in zip(uids, prompts, strict=True):
            assert hub.stream(uid).tokens == await _alone(60, prompt)
        await until(lambda: _books_empty(a) and _books_empty(b), 20.0, "both books at zero", every_s=0.001)


async def test_a_queue_beside_free_kv_moves_running_requests_there() -> None:
    """Eight requests go to a (a routing key would do that), which admits four for its 200 slots
    (the ratio 1.0 reserves every request's whole output: nothing retracts); b is empty. Running
    requests move to b so that a admits its queue sooner; every stream is what it is alone."""
    hub, engines = await _two_engines({"a": 200, "b": 1000}, init_new_token_ratio=1.0)
    a, b = engines
    before = _moves("a")
    async with _running(engines):
        prompts = [[40 + i, 6, 7, 8, 9, 10, 11, 12] for i in range(8)]
        uids = [submit(a, f"r{i}", p, _params(40))[0] for i, p in enumerate(prompts)]
        for uid in uids:
            await asyncio.wait_for(hub.stream(uid).done.wait(), 30)
        assert b.migration.migrated_in >= 1 and a.scheduler.num_retracted_total == 0
        assert _moves("a") - before == {"balance": b.migration.migrated_in}
        for uid, prompt in zip(uids, prompts, strict=True):
            assert hub.stream(uid).tokens == await _alone(40, prompt)
        await until(lambda: _books_empty(a) and _books_empty(b), 20.0, "both books at zero", every_s=0.001)


async def test_a_constrained_call_moves_only_once_its_destination_holds_the_grammar_compiled(
    pair: Pair,
) -> None:
    """Issue 37 item 4: a live migration's destination compiled the moved call's grammar inside the
    step that admitted it (its gate was passed by). The move now waits: the destination is asked to
    compile first, and the call moves at a later decision, once the worker said it holds it."""
    from control_plane.core.fleet.placement import Move
    from control_plane.core.grammar_gate import GrammarGate
    from protos.worker import Grammar, GrammarReady

    grammar = Grammar("llguidance", "regex", "[a-z]+")
    asked: list[Grammar] = []

    async def prepare(g: Grammar) -> None:
        asked.append(g)

    gate = GrammarGate("b", pair.b.submit, lambda a, v, m: None, prepare, True, 30.0)
    pair.b.grammar_gate = gate
    params = RequestParams(
        max_new_tokens=60, ignore_eos=True, sampler=SamplerParams(temperature=0.0, grammar=grammar)
    )
    [uid] = submit(pair.a, "r", PROMPT, params)
    stream = pair.hub.stream(uid)
    await until(lambda: len(stream.tokens) >= 3, 20.0, "three tokens on a", every_s=0.001)
    assert not pair.a.start_move(Move(("r",), "b", "test")), "moved before b compiled the grammar"
    await until(lambda: asked == [grammar], 5.0, "b asked to compile the grammar", every_s=0.001)
    assert not pair.a.migration.busy and pair.a.streams.knows("r")
    gate.ready(GrammarReady(grammar))
    assert pair.a.start_move(Move(("r",), "b", "test"))
    await asyncio.wait_for(stream.done.wait(), 20)
    assert stream.finished is not None and stream.finished.kind is FinishKind.LENGTH
    assert pair.b.migration.migrated_in == 1 and asked == [grammar]
