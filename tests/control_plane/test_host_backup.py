"""The host backup pool (SCHEDULER.md Appendix A): retracted KV is offloaded, then restored."""

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
    sched = make_scheduler(capacity=256, host_pool=8, chunked_prefill_size=16, init_new_token_ratio=0.02)
    out = run(sched, FakeWorker(256), _trace(1))
    aborted = [r for r in out.finished.values() if r.kind.value == "abort"]
    assert aborted, "the tiny host pool should have declined a backup"
    assert all("host backup pool has no room" in r.message for r in aborted)
    assert aborted[0].message == HOST_POOL_FULL.format(n=aborted[0].message.split("'s ")[1].split(" ")[0])
    assert sched.host_used <= 8
    assert sched.kv.available_size() + sched.kv.evictable_size() == 256
