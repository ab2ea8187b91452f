"""--full-prefix-dedup (docs/scheduler.md#full-prefix-dedup): the in-batch dedup counts the prefills
still in flight, whose KV is not in the tree yet, and covers the uncached part of requests with a
long cached prefix. With SGLang's dedup (the default), LPM computes a shared prefix again in both
cases."""

from __future__ import annotations

import pytest

from control_plane.request import RequestParams
from tests.control_plane.factories import make_scheduler, params, prompt, run
from tests.control_plane.fake_worker import FakeWorker

SHARED, OWN = 64, 16
Arrivals = list[tuple[int, str, list[int], RequestParams]]


def _computed(full_dedup: bool, arrivals: Arrivals, overlap: bool, **config: object) -> int:
    """Prompt tokens the plans computed."""
    sched = make_scheduler(
        capacity=40_000,
        schedule_policy="lpm",
        chunked_prefill_size=2 * (SHARED + OWN),
        full_prefix_dedup=full_dedup,
        **config,
    )
    out = run(sched, FakeWorker(40_000, vocab=1000), arrivals, overlap=overlap)
    assert len(out.finished) == len(arrivals)
    return sum(len(plan.extends.token_ids) for plan in out.plans)


def _in_flight(singles: int) -> Arrivals:
    """Step 0: x1 and y1 (one prefill batch holds both). Step 1: x2 and y2, then `singles` requests
    that share nothing."""
    x, y = prompt(SHARED, 1), prompt(SHARED, 2)
    arrivals = [(0, "x1", x + prompt(OWN, 11), params(4)), (0, "y1", y + prompt(OWN, 21), params(4))]
    arrivals += [(1, "x2", x + prompt(OWN, 12), params(4)), (1, "y2", y + prompt(OWN, 22), params(4))]
    return arrivals + [(1, f"s{i}", prompt(SHARED + OWN, 100 + i), params(4)) for i in range(singles)]


@pytest.mark.parametrize(("limit", "singles"), [(128, 6), (0, 140)], ids=["shallow", "deep"])
def test_a_group_s_prefix_is_prefilled_once_when_its_first_prefill_is_still_in_flight(
    limit: int, singles: int
) -> None:
    """Under overlap, x2 and y2 are planned before x1's and y1's KV is in the tree."""
    arrivals = _in_flight(singles)
    every = len(arrivals) * (SHARED + OWN)
    # SGLang's dedup: x2 and y2 go next and compute the prefix again.
    assert _computed(False, arrivals, True, cache_aware_queue_limit=limit) == every
    # Counting x1 and y1 in flight, the singles go first and x2, y2 then find their prefix cached.
    assert _computed(True, arrivals, True, cache_aware_queue_limit=limit) == every - 2 * SHARED


def test_requests_sharing_an_uncached_part_beyond_a_cached_prefix_compute_it_once() -> None:
    """p caches P; then y2 and y3 come, each P + Q + its own tokens. Both match P (more than the
    check threshold), so SGLang's dedup skips them and LPM admits them together: Q twice."""
    p, q = prompt(SHARED, 1), prompt(SHARED, 2)
    arrivals: Arrivals = [(0, "p", p + prompt(OWN, 10), params(1))]
    arrivals += [(20, f"y{i}", p + q + prompt(OWN, 20 + i), params(4)) for i in (2, 3)]
    arrivals += [(20, f"s{i}", prompt(SHARED + OWN, 100 + i), params(4)) for i in range(4)]
    every = (SHARED + OWN) * 5 + 2 * (SHARED + OWN)
    for overlap in (False, True):
        assert _computed(False, arrivals, overlap) == every
        assert _computed(True, arrivals, overlap) == every - SHARED
