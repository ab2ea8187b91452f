"""Token fairness (docs/scheduler.md#fairness): VTC's counters, lift and least-served-first merge, the
locality bound, retraction of the most-served tenant first, and recordings that replay the decisions."""

from __future__ import annotations

import random

import pytest

from control_plane.record.recorder import RecordingScheduler, recording_header
from control_plane.record.replay import replay_scheduler
from control_plane.request import Request
from control_plane.scheduler.fairness import VirtualCounters, fair_merge
from protos.worker import WorkerLimits
from tests.control_plane.factories import make_config, make_scheduler, params, prompt, run
from tests.control_plane.fake_worker import FakeWorker
from tests.record.conftest import ListSink


def _req(rid: str, tenant: str, n: int = 10, seed: int = 0) -> Request:
    return Request(rid=rid, origin_input_ids=prompt(n, seed), params=params(4, tenant=tenant))


def _counters(**weights: float) -> VirtualCounters:
    return VirtualCounters(make_config(fairness="vtc", tenant_weights=weights))


def test_merge_serves_the_least_served_tenant_first() -> None:
    counters = _counters()
    counters.charge("a", 100, 0)
    queue = [_req(f"a{i}", "a") for i in range(4)] + [_req(f"b{i}", "b") for i in range(4)]
    order = [r.rid for r in fair_merge(queue, counters, 0.0)]
    # b is 100 behind: its ten-token prompts go until it catches up, then the two alternate.
    assert order[:4] == ["b0", "b1", "b2", "b3"]
    assert order[4:] == ["a0", "a1", "a2", "a3"]
    counters.charge("b", 100, 0)
    order = [r.rid for r in fair_merge(queue, counters, 0.0)]
    assert order == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3"]


def test_weights_divide_the_charge() -> None:
    counters = _counters(a=2.0)
    counters.charge("a", 10, 5)  # (1·10 + 2·5) / 2
    counters.charge("b", 10, 5)
    assert counters.counter("a") == 10.0
    assert counters.counter("b") == 20.0


def test_a_tenant_that_becomes_backlogged_is_lifted_to_the_least_backlogged_counter() -> None:
    counters = _counters()
    a, b, c = _req("a", "a"), _req("b", "b"), _req("c", "c")
    counters.joined(a)
    counters.joined(b)
    counters.charge("a", 50, 0)
    counters.charge("b", 80, 0)
    counters.joined(c)  # idle until now: starts at min(50, 80), not at 0
    assert counters.counter("c") == 50.0
    for r in (a, b, c):
        counters.left(r)
    counters.charge("b", 10, 0)
    idle = _req("d", "a")
    counters.joined(idle)  # nobody backlogged: the last served (b, 90) is the floor
    assert counters.counter("a") == 90.0


@pytest.mark.parametrize("seed", range(20))
def test_locality_pick_stays_within_the_bound(seed: int) -> None:
    """Every pick of the merge comes from a tenant within Q of the least-served remaining tenant
    (projected), and each tenant's requests keep the policy's order."""
    rng = random.Random(seed)
    counters = _counters(**{f"t{i}": rng.choice([1.0, 2.0, 4.0]) for i in range(4)})
    for i in range(4):
        counters.charge(f"t{i}", rng.randrange(0, 200), 0)
    queue = [_req(f"r{j}", f"t{rng.randrange(4)}", rng.randrange(1, 60), j) for j in range(40)]
    bound = rng.choice([0.0, 30.0, 200.0])
    merged = fair_merge(queue, counters, bound)
    assert sorted(r.rid for r in merged) == sorted(r.rid for r in queue)
    projected = {t: counters.counter(t) for t in {r.params.tenant for r in queue}}
    left = list(merged)
    for req in merged:
        present = {r.params.tenant for r in left}
        assert projected[req.params.tenant] <= min(projected[t] for t in present) + bound
        left.remove(req)
        projected[req.params.tenant] += counters.prompt_cost(req)
    for t in projected:
        kept = [r.rid for r in merged if r.params.tenant == t]
        assert kept == [r.rid for r in queue if r.params.tenant == t]


def _admission_order(fairness: str) -> list[str]:
    """Tenant a floods 24 requests at step 0, b sends 4 at step 1; two run at a time."""
    sched = make_scheduler(fairness=fairness, max_running_requests=2, chunked_prefill_size=None)
    arrivals = [(0, f"a{i}", prompt(20, i), params(8, tenant="a")) for i in range(24)]
    arrivals += [(1, f"b{i}", prompt(20, 100 + i), params(8, tenant="b")) for i in range(4)]
    out = run(sched, FakeWorker(4096), arrivals)
    return [s.request_id for plan in out.plans for s in plan.new_seqs]


def test_vtc_serves_the_small_tenant_beside_a_flood() -> None:
    fcfs = _admission_order("none")
    vtc = _admission_order("vtc")
    assert max(fcfs.index(f"b{i}") for i in range(4)) >= 24  # FCFS: b waits for the whole flood
    assert max(vtc.index(f"b{i}") for i in range(4)) < 12  # VTC: b alternates with a


def test_retraction_gives_way_from_the_most_served_tenant() -> None:
    sched = make_scheduler(fairness="vtc", chunked_prefill_size=None)
    for i, tenant in enumerate(["a", "b", "a", "b"]):
        sched.add_request(f"r{i}", prompt(10, i), params(50, tenant=tenant))
    worker = FakeWorker(4096)
    for _ in range(2):  # the prefill, then the decode that runs all four
        plan = sched.next_plan()
        assert plan is not None
        sched.apply_result(worker.run(plan))
    assert sched.fairness is not None
    sched.fairness.charge("b", 1000, 0)
    assert set(sched.retraction_order()[:2]) == {"r1", "r3"}
    sched.fairness.charge("a", 5000, 0)
    assert set(sched.retraction_order()[:2]) == {"r0", "r2"}


@pytest.mark.parametrize("fairness", ["vtc", "vtc-locality"])
def test_fair_decisions_replay_identically(fairness: str) -> None:
    """The header carries the fairness settings and the arrivals their tenants, so a replay makes the
    same decisions (under KV pressure: retractions by counter)."""
    config = make_config(
        fairness=fairness,
        tenant_weights={"a": 2.0},
        chunked_prefill_size=64,
        init_new_token_ratio=0.05,
        fairness_locality_bound=50.0,
    )
    limits = WorkerLimits("w0", kv_capacity_tokens=600, page_size=1, max_context=2048, vocab_size=1000)
    sink = ListSink()
    sched = RecordingScheduler(config, limits, sink)
    worker = FakeWorker(600)
    for i in range(12):
        tenant = "abc"[i % 3]
        sched.add_request(f"r{i}", prompt(30 + 7 * i, i % 4), params(40, tenant=tenant))
    for _ in range(2000):
        if sched.is_idle:
            break
        plan = sched.next_plan()
        if plan is None:
            continue
        sched.apply_result(worker.run(plan))
        sched.take_updates()
    assert sched.is_idle
    assert sched.num_retracted_total > 0
    report = replay_scheduler([recording_header(config, limits, "test"), *sink.entries])
    assert report.identical, report.describe()


def test_a_reload_changes_the_weights_charged() -> None:
    counters = _counters(a=1.0)
    counters.charge("a", 100, 0)
    counters.config.retenant({"a": 4.0}, {})
    counters.charge("a", 100, 0)
    assert counters.counter("a") == 125.0


def test_the_default_entry_s_weight_is_every_unlisted_tenant_s() -> None:
    """A tenant file's [defaults] takes a weight like any entry; it was accepted and then ignored
    (an unlisted tenant weighed 1)."""
    from control_plane.tenants.table import parse

    table = parse({"defaults": {"weight": 4.0}, "tenants": {"gold": {"weight": 2.0}}})
    counters = VirtualCounters(
        make_config(fairness="vtc", tenant_weights=table.weights(), tenant_slos=table.slo_defaults())
    )
    counters.charge("gold", 100, 0)
    counters.charge("anyone", 100, 0)
    assert counters.counter("gold") == 50.0
    assert counters.counter("anyone") == 25.0
    # With no weight in [defaults], an unlisted tenant weighs 1, as before.
    plain = parse({"tenants": {"gold": {"weight": 2.0}}})
    assert make_config(fairness="vtc", tenant_weights=plain.weights()).tenant_weight("anyone") == 1.0
