"""The scheduler's half of live migration (docs/migration.md): `export` on the source, `import_kv` on
the destination, the plan ops they queue, and `next_plan(always=True)`.

Two schedulers drive two FakeWorkers that share a network: a KvSend copies the (token, position)
contents of its slots when the source runs the plan, a KvReceive writes them into the destination's
slots. Every forward reads each sequence's context back through its slots, so a wrong slot, a
missing receive or a bad skip is a KvCorruption, and tokens depend on the context alone: a request
migrated back and forth must stream exactly what it streams on one worker.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from control_plane.core.handover import orphan_of
from control_plane.core.inbox import LiveSample, Orphan
from control_plane.core.migration import MIGRATED
from control_plane.record.entries import Header, ImportKv
from control_plane.record.recorder import RecordingScheduler, recording_header
from control_plane.record.replay import replay_scheduler
from control_plane.request import FinishReason
from control_plane.scheduler.scheduler import Scheduler
from protos.worker import StepResult
from tests.control_plane.factories import (
    OVERLAP_DEPTH,
    add,
    by_rid,
    check_pool,
    make_scheduler,
    params,
    prompt,
    run,
    run_plan,
    uid_of,
)
from tests.control_plane.fake_worker import FakeWorker
from tests.record.conftest import ListSink


def _run_until_running(sched: Scheduler, worker: FakeWorker, rid: str, steps: int = 3) -> None:
    for _ in range(steps):
        plan = sched.next_plan()
        assert plan is not None
        sched.apply_result(run_plan(sched, worker, plan))
    assert sched.running_request(rid) is not None


def test_export_caches_the_prefix_and_the_next_plan_sends_it_before_releasing() -> None:
    sched, worker = make_scheduler(), FakeWorker(4096)
    add(sched, "a", prompt(12), params(20))
    _run_until_running(sched, worker, "a")
    req = sched.requests["a"]
    handle, committed = req.handle, req.kv_committed_len
    tokens = list(req.fill_ids[:committed])
    slots = sched.export("a", MIGRATED, "t1", "dest:1")
    assert slots is not None and len(slots) == committed == 12 + 3 - 1
    # The tree holds the request's KV at those slots (its prefix stays here) and no one locks them.
    assert sched.kv.tree.match_prefix(np.asarray(tokens)).indices.tolist() == slots.tolist()
    assert sched.kv.protected_size() == 0
    assert [f.reason for f in sched.take_updates().finished] == [MIGRATED]
    plan = sched.next_plan()
    assert plan is not None
    assert [(t.transfer_id, t.address, t.slots.tolist()) for t in plan.sends] == [
        ("t1", "dest:1", slots.tolist())
    ]
    assert handle in plan.releases.tolist()
    sent = worker.run(plan)
    assert worker.network["t1"] == [(t, p) for p, t in enumerate(tokens)]
    sched.apply_result(sent)
    check_pool(sched)


def test_export_of_a_request_that_is_not_running_changes_nothing() -> None:
    sched = make_scheduler()
    add(sched, "queued", prompt(8), params(4))
    assert sched.export("queued", MIGRATED, "t1", "dest:1") is None
    assert sched.export("nobody", MIGRATED, "t2", "dest:1") is None
    plan = sched.next_plan()
    assert plan is not None and not plan.sends and "queued" in sched.requests


def test_import_places_the_kv_in_the_tree_and_the_orphan_extends_one_token() -> None:
    network: dict[str, list[tuple[int, int]]] = {}
    sched, worker = make_scheduler(), FakeWorker(4096, network=network)
    tokens = prompt(20, seed=3)
    network["t1"] = [(t, p) for p, t in enumerate(tokens)]
    placed = sched.import_kv("t1", tokens)
    assert placed is not None
    skip, slots = placed
    assert skip == 0 and len(slots) == 20
    add(sched, "b", [*tokens, 77], params(4))
    plan = sched.next_plan()
    assert plan is not None
    assert [(r.transfer_id, r.slots.tolist(), r.skip) for r in plan.receives] == [("t1", slots.tolist(), 0)]
    assert plan.extends.lens.tolist() == [1]  # the whole moved prefix matched
    assert plan.new_seqs[0].prefix_slots.tolist() == slots.tolist()
    sched.apply_result(run_plan(sched, worker, plan))
    check_pool(sched)
    assert "t1" not in network


def test_import_skips_what_the_tree_caches_already() -> None:
    network: dict[str, list[tuple[int, int]]] = {}
    sched, worker = make_scheduler(page_size=4), FakeWorker(4096, network=network)
    shared = prompt(16, seed=5)
    out = run(sched, worker, [(0, "first", [*shared, 1, 2, 3], params(2))])
    assert out.finished["first"].kind.value == "length"
    moved = [*shared, 9, 9, 9, 9]
    network["t1"] = [(t, p) for p, t in enumerate(moved)]
    placed = sched.import_kv("t1", moved)
    assert placed is not None
    skip, slots = placed
    assert skip == 16 and len(slots) == 4
    plan = sched.next_plan()
    assert plan is not None and plan.receives[0].skip == 16
    worker.run(plan)
    sched.apply_result(StepResult(plan.step_id, np.zeros(0, dtype=np.int32)))
    check_pool(sched)


def test_import_without_room_forgets_the_transfer() -> None:
    sched, worker = make_scheduler(capacity=64), FakeWorker(64)
    add(sched, "hog", prompt(40), params(10))
    _run_until_running(sched, worker, "hog")
    assert sched.import_kv("t1", prompt(48, seed=9)) is None
    assert sched.import_kv("t2", ()) is None  # given up: forgotten too
    plan = sched.next_plan()
    assert plan is not None
    assert [(r.transfer_id, len(r.slots)) for r in plan.receives] == [("t1", 0), ("t2", 0)]
    check_pool(sched)


def test_an_always_plan_does_nothing_and_takes_its_result() -> None:
    sched = make_scheduler()
    assert sched.next_plan() is None
    plan = sched.next_plan(always=True)
    assert plan is not None and not plan.new_seqs and not len(plan.decodes.handles)
    sched.apply_result(FakeWorker(4096).run(plan))
    assert sched.is_idle


# --- two workers, requests migrating between them -------------------------------------------------


@dataclass
class _Node:
    sched: Scheduler
    worker: FakeWorker
    in_flight: deque[StepResult] = field(default_factory=deque)


@dataclass
class _Move:
    """A tail on its way (`transfer_id` ""), or a pre-copy (`orphan` None) of `rid`."""

    transfer_id: str
    to: int
    tokens: list[int]
    orphan: Orphan | None
    rid: str = ""
    start: int = 0
    held: str = ""


def _collect(node: _Node, tokens: dict[str, list[int]], finished: dict[str, FinishReason]) -> None:
    updates = node.sched.take_updates()
    for rid, new in by_rid(updates).items():
        assert rid not in finished, f"{rid} streamed after its finish"
        tokens.setdefault(rid, []).extend(new)
    for f in updates.finished:
        if f.reason == MIGRATED:
            continue  # its stream goes on elsewhere
        assert f.rid not in finished, f"{f.rid} finished twice"
        finished[f.rid] = f.reason


def _has_run(sched: Scheduler, rid: str) -> bool:
    req = sched.running_request(rid)
    return req is not None and req.num_outputs > 0


def _switch(sched: Scheduler, rid: str, to: int, start: int, held: str) -> list[_Move]:
    """Finish `rid` here and send what the pre-copy (`held`, positions [0, start)) did not."""
    req = sched.requests[rid]
    orphan = orphan_of(req, LiveSample(rid, uid_of(rid), rid, "", 0.0))
    transfer_id = f"tail/{rid}/{sched.step_id}"
    slots = sched.export(rid, MIGRATED, transfer_id, "other", start)
    assert slots is not None and len(slots) >= start
    tail = transfer_id if len(slots) > start else ""
    return [_Move(tail, to, orphan.input_ids[: len(slots)], orphan, rid, start, held)]


def _arrive(dest: Scheduler, move: _Move) -> None:
    assert move.orphan is not None
    if move.transfer_id:
        dest.import_kv(move.transfer_id, move.tokens, start=move.start)
    if move.held:
        dest.import_kv(move.held, ())
    add(dest, move.orphan.sample.rid, move.orphan.input_ids, move.orphan.params)


def _migrating_run(
    arrivals: list[tuple[str, list[int], int]],
    overlap: bool,
    migrate_every: int,
    seed: int,
    schedulers: list[Scheduler],
    precopy: bool = True,
) -> tuple[dict[str, list[int]], dict[str, FinishReason], int]:
    network: dict[str, list[tuple[int, int]]] = {}
    nodes = [_Node(s, FakeWorker(s.capacity, network=network)) for s in schedulers]
    for i, (rid, ids, n) in enumerate(arrivals):
        add(nodes[i % 2].sched, rid, ids, params(n))
    rng = random.Random(seed)
    depth = OVERLAP_DEPTH if overlap else 1
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in arrivals}
    finished: dict[str, FinishReason] = {}
    moving: list[_Move] = []
    moves = precopies = 0
    for step in range(20_000):
        progressed = False
        for i, node in enumerate(nodes):
            plan = node.sched.next_plan()
            if plan is not None:
                node.in_flight.append(run_plan(node.sched, node.worker, plan))
                check_pool(node.sched)
                progressed = True
            if node.in_flight and (len(node.in_flight) >= depth or plan is None):
                node.sched.apply_result(node.in_flight.popleft())
                check_pool(node.sched)
                progressed = True
            _collect(node, tokens, finished)
            for move in [m for m in moving if m.transfer_id in network]:  # its send has run
                moving.remove(move)
                progressed = True
                dest, source = nodes[move.to].sched, nodes[1 - move.to]
                if move.orphan is None:  # a pre-copy arrived: hold it there, switch the rest
                    if source.sched.running_request(move.rid) is None:
                        dest.import_kv(move.transfer_id, ())  # it finished meanwhile: called off
                        continue
                    dest.import_kv(move.transfer_id, move.tokens, hold=True)
                    moving.extend(
                        _switch(source.sched, move.rid, move.to, len(move.tokens), move.transfer_id)
                    )
                    _collect(source, tokens, finished)
                else:
                    _arrive(dest, move)
            for move in [m for m in moving if not m.transfer_id]:  # the pre-copy sent it all
                moving.remove(move)
                _arrive(nodes[move.to].sched, move)
            if migrate_every and step % migrate_every == i:
                # Moved only once it has a token here: a request moved back and forth before its
                # first token on each worker would never progress.
                running = sorted(rid for rid in node.sched.requests if _has_run(node.sched, rid))
                running = [rid for rid in running if all(m.rid != rid for m in moving)]
                if running:
                    rid = rng.choice(running)
                    req = node.sched.requests[rid]
                    sent = node.sched.send_kv(rid, f"pre/{i}/{step}/{rid}", "other") if precopy else 0
                    if sent:
                        precopies += 1
                        moving.append(
                            _Move(f"pre/{i}/{step}/{rid}", 1 - i, list(req.fill_ids[:sent]), None, rid)
                        )
                    else:
                        moving.extend(_switch(node.sched, rid, 1 - i, 0, ""))
                        _collect(node, tokens, finished)
                    moves += 1
        if not progressed and not moving:
            break
    assert not moving and not network, "every transfer was received"
    for node in nodes:
        assert node.sched.is_idle and node.sched.books() == (0, 0)
        assert node.worker.seqs == {}
        assert node.sched.kv.protected_size() == 0, "a pre-copy's hold outlived its migration"
    assert not precopy or not moves or precopies, "no migration started with a pre-copy"
    return tokens, finished, moves


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    max_new=st.lists(st.integers(1, 24), min_size=6, max_size=6),
    shared=st.integers(0, 24),
    page_size=st.sampled_from([1, 4]),
    chunk=st.sampled_from([None, 8]),
    overlap=st.booleans(),
    migrate_every=st.integers(2, 6),
    seed=st.integers(0, 1000),
    precopy=st.booleans(),
)
def test_requests_migrated_back_and_forth_stream_what_one_worker_streams(
    lens: list[int],
    max_new: list[int],
    shared: int,
    page_size: int,
    chunk: int | None,
    overlap: bool,
    migrate_every: int,
    seed: int,
    precopy: bool,
) -> None:
    """Outputs, finishes and both workers' books at zero, with a shared prefix, chunked prefill,
    paging, overlap and pre-copy on and off, against one scheduler that never migrates."""
    common = prompt(shared, seed=99)
    arrivals = [(f"r{i}", [*common, *prompt(n, seed=i)], max_new[i]) for i, n in enumerate(lens)]
    config = {"page_size": page_size, "chunked_prefill_size": chunk}
    reference = run(
        make_scheduler(**config),  # type: ignore[arg-type]
        FakeWorker(4096),
        [(0, rid, ids, params(n)) for rid, ids, n in arrivals],
        overlap=overlap,
    )
    schedulers = [make_scheduler(**config) for _ in range(2)]  # type: ignore[arg-type]
    tokens, finished, moves = _migrating_run(arrivals, overlap, migrate_every, seed, schedulers, precopy)
    assert tokens == reference.tokens
    assert {rid: r.kind for rid, r in finished.items()} == {
        rid: r.kind for rid, r in reference.finished.items()
    }
    if any(len(streamed) >= 16 for streamed in reference.tokens.values()):
        assert moves > 0


def test_a_recorded_session_with_migrations_replays_identically_and_an_edit_is_found() -> None:
    base = make_scheduler()
    sinks = [ListSink(), ListSink()]
    schedulers: list[Scheduler] = [RecordingScheduler(base.config, base.limits, sink) for sink in sinks]
    arrivals = [(f"r{i}", prompt(6 + 3 * i, seed=i), 12) for i in range(4)]
    _, _, moves = _migrating_run(arrivals, True, 3, 7, schedulers)
    assert moves > 0
    for sink in sinks:
        header: Header = recording_header(base.config, base.limits, "test")
        report = replay_scheduler([header, *sink.entries])
        assert report.identical, report.describe()
        assert report.counts.get("exports", 0) + report.counts.get("imports", 0) > 0
    entries = sinks[1].entries if any(isinstance(e, ImportKv) for e in sinks[1].entries) else sinks[0].entries
    i = next(k for k, e in enumerate(entries) if isinstance(e, ImportKv) and e.input_ids)
    edited = entries[i]
    assert isinstance(edited, ImportKv)
    entries = [
        *entries[:i],
        ImportKv(edited.step, edited.transfer_id, edited.input_ids[:-4], edited.outcome),
        *entries[i + 1 :],
    ]
    report = replay_scheduler([recording_header(base.config, base.limits, "test"), *entries])
    assert not report.identical and "import_kv" in report.describe()


def _drain_steps(sched: Scheduler, worker: FakeWorker, tokens: dict[str, list[int]]) -> bool:
    """One plan run and applied; its tokens collected. False when there was nothing to do."""
    plan = sched.next_plan()
    if plan is None:
        return False
    sched.apply_result(run_plan(sched, worker, plan))
    for rid, ids in by_rid(sched.take_updates()).items():
        tokens.setdefault(rid, []).extend(ids)
    return True


def test_a_retraction_with_a_spill_worker_sends_its_victims_there_with_their_kv() -> None:
    """a's 120 slots are overfilled at admission (ratio 0.1); its retractions go to b instead
    (`spill_to`): each victim finishes on a with its KV sent, b imports it and continues the
    request from its streamed tokens. Nothing is retracted, every request streams what it streams on
    one large worker, and a's recording (with its SpillTo) replays identically."""
    arrivals = [(f"r{i}", prompt(10, seed=i), 40) for i in range(4)]
    big, big_worker = make_scheduler(capacity=4096), FakeWorker(4096)
    want: dict[str, list[int]] = {}
    for rid, ids, n in arrivals:
        add(big, rid, ids, params(n, ignore_eos=True))
    while _drain_steps(big, big_worker, want):
        pass

    network: dict[str, list[tuple[int, int]]] = {}
    base = make_scheduler(capacity=120, init_new_token_ratio=0.1)
    sink = ListSink()
    a = RecordingScheduler(base.config, base.limits, sink)
    b = make_scheduler(capacity=1000)
    wa, wb = FakeWorker(120, network=network), FakeWorker(1000, network=network)
    a.spill_to("b:1", 1000)
    for rid, ids, n in arrivals:
        add(a, rid, ids, params(n, ignore_eos=True))
    got: dict[str, list[int]] = {}
    moved: list[str] = []
    for _ in range(500):
        plan = a.next_plan()
        emigrants = list(a.emigrants)
        if plan is not None:
            a.apply_result(run_plan(a, wa, plan))  # its sends reach the network before b's receives
            for rid, ids in by_rid(a.take_updates()).items():
                got.setdefault(rid, []).extend(ids)
        for e in emigrants:
            assert e.transfer_id and e.tokens == tuple(e.req.fill_ids[: len(e.tokens)])
            streamed = got.get(e.req.rid, [])
            assert streamed == e.req.output_ids
            b.import_kv(e.transfer_id, e.tokens)
            n = e.req.params.max_new_tokens
            assert n is not None
            add(b, e.req.rid, e.req.origin_input_ids + streamed, params(n - len(streamed), ignore_eos=True))
            moved.append(e.req.rid)
        busy_b = _drain_steps(b, wb, got)
        if plan is None and not busy_b and a.is_idle and b.is_idle:
            break
    assert moved, "a was meant to run short of KV"
    assert a.num_retracted_total == 0
    assert got == want
    assert network == {}
    check_pool(a)
    check_pool(b)
    report = replay_scheduler([recording_header(base.config, base.limits, "test"), *sink.entries])
    assert report.identical, report.describe()
