"""The host backup pool (docs/scheduler.md#host-backup-pool): retracted KV is offloaded, then restored."""

from __future__ import annotations

import random

import pytest

from control_plane.scheduler.scheduler import HOST_POOL_FULL
from tests.control_plane.factories import make_scheduler, params, prompt, run
from tests.control_plane.fake_worker import FakeWorker


def _trace(seed: int, n: int = 16) -> list:
    rng = random.Random(seed)
    return [
        (rng.randint(0, 3), f"r{i}", prompt(rng.randint(2, 40), i), params(40, ignore_eos=True))
        for i in range(n)
    ]


@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_with_a_host_pool_restores_instead_of_recomputing(page_size: int) -> None:
    trace = _trace(1)
    base = run(make_scheduler(capacity=100_000), FakeWorker(100_000), trace)
    sched = make_scheduler(
        capacity=256,
        page_size=page_size,
        host_pool=100_000,
        chunked_prefill_size=16,
        init_new_token_ratio=0.02,
    )
    worker = FakeWorker(256)
    out = run(sched, worker, trace)
    assert sched.num_retracted_total > 0
    assert worker.offloads == sched.num_retracted_total and worker.restores == worker.offloads
    # The fake worker checks every restored slot's content on every read: outputs equal the unpressured run.
    assert out.tokens == base.tokens
    assert all(reason.kind.value == "length" for reason in out.finished.values())
    assert sched.host_used == 0 and not sched.offloaded and not worker.host


def test_a_full_host_pool_aborts_with_a_message_that_says_so() -> None:
    """Under real KV pressure, a retraction the 8-token host pool cannot take aborts the request instead,
    with a message that says so, and the pool never holds more than its size."""
    sched = make_scheduler(capacity=256, host_pool=8, chunked_prefill_size=16, init_new_token_ratio=0.02)
    out = run(sched, FakeWorker(256), _trace(1))
    aborted = [r for r in out.finished.values() if r.kind.value == "abort"]
    assert aborted, "the tiny host pool should have declined a backup"
    assert all("host backup pool has no room" in r.message for r in aborted)
    assert sched.host_used <= 8
    assert sched.kv.available_size() + sched.kv.evictable_size() == 256


def test_the_host_pool_full_message_names_the_tokens_that_did_not_fit() -> None:
    """docs/scheduler.md#host-backup-pool: a backup the host pool cannot hold aborts the request; the
    message counts the KV positions the backup needed (kv_committed_len).

    TEST_RETRACT every 3rd forward (docs/scheduler.md#decode-memory-check). a (10-token prompt) and b (12)
    arrive together: step 1 prefills both (forward 1), steps 2 and 3 decode both (forwards 2, 3). At step
    4 forward_ct = 3: a test retraction. Both have 3 outputs, so the longer prompt goes first
    (docs/scheduler.md#retraction): b. b's committed KV: its 12 prompt positions + the 2 decoded inputs =
    14 > 8 free in the host pool.
    """
    sched = make_scheduler(host_pool=8, test_retract=True, chunked_prefill_size=None)
    arrivals = [(0, "a", prompt(10, 1), params(20)), (0, "b", prompt(12, 2), params(20))]
    out = run(sched, FakeWorker(4096), arrivals)
    assert out.finished["b"].kind.value == "abort"
    assert out.finished["b"].message == HOST_POOL_FULL.format(n=14)
    assert "no room for this request's 14 tokens" in out.finished["b"].message
    assert len(out.tokens["b"]) == 3
    assert out.finished["a"].kind.value == "length" and len(out.tokens["a"]) == 20
    assert sched.host_used == 0 and not sched.offloaded


def test_a_restored_request_beside_a_chunked_prompt_leaves_room_for_its_last_chunks() -> None:
    """Found by the property test (it raised KvOutOfMemory out of next_plan before the forced-chunk
    fallback of docs/scheduler.md#chunked-prefill): c (83 tokens) is being chunked 16 at a time when a,
    backed up to the host pool by a test retraction, is restored beside it. A restore is not chunked (it
    covers all but one token), so it is admitted past the spent chunk budget and takes 40 slots that c's
    later chunks needed.
    Every request must still finish, with the outputs of an unpressured run."""
    arrivals = [
        (0, "a", prompt(30, 1), params(12)),
        (0, "b", prompt(1, 2), params(12)),
        (13, "c", prompt(83, 3), params(1)),
    ]
    sched = make_scheduler(capacity=128, host_pool=4096, chunked_prefill_size=16, test_retract=True)
    out = run(sched, FakeWorker(128), arrivals)
    base = run(make_scheduler(capacity=100_000), FakeWorker(100_000), arrivals)
    assert {rid: r.kind.value for rid, r in out.finished.items()} == {
        "a": "length",
        "b": "length",
        "c": "length",
    }
    assert out.tokens == base.tokens
    assert sched.host_used == 0 and sched.kv.available_size() + sched.kv.evictable_size() == 128
