"""Chunked prefill life cycle (docs/scheduler.md#chunked-prefill; SGLang's scripted chunked-prefill suite,
chunk 256)."""

from __future__ import annotations

from collections import Counter

import pytest

from control_plane.request import FinishReason
from protos.worker import StepKind, StepPlan
from tests.control_plane.factories import EOS, FakeWorker, Outcome, make_scheduler, params, prompt, run


def run_requests(*prompts: list[int], chunk: int | None = 256, max_new: int = 4) -> Outcome:
    sched = make_scheduler(capacity=8192, chunked_prefill_size=chunk)
    arrivals = [(0, f"r{i}", ids, params(max_new)) for i, ids in enumerate(prompts)]
    return run(sched, FakeWorker(8192, eos=EOS), arrivals)


def extend_passes(plans: list[StepPlan]) -> Counter[int]:
    """Extend entries per handle over a run."""
    return Counter(h for p in plans for h in p.extends.handles.tolist())


@pytest.mark.parametrize(
    ("prompt_len", "passes"), [(100, 1), (256, 1), (257, 2), (512, 2), (768, 3), (1000, 4)]
)
def test_number_of_extend_passes(prompt_len: int, passes: int) -> None:
    out = run_requests(prompt(prompt_len))
    assert extend_passes(out.plans) == {1: passes}
    assert len(out.tokens["r0"]) == 4


def test_radix_hit_shrinks_the_number_of_chunks() -> None:
    shared = prompt(512, seed=3)
    sched = make_scheduler(capacity=8192, chunked_prefill_size=256)
    worker = FakeWorker(8192, eos=EOS)
    run(sched, worker, [(0, "warm", shared, params(2))])
    # 768 tokens would take 3 passes; 512 are cached, so only the 256-token tail is computed.
    out = run(sched, worker, [(0, "hit", shared + prompt(256, seed=4), params(2))])
    assert list(extend_passes(out.plans).values()) == [1]
    assert out.plans[0].extends.starts.tolist() == [512]


def test_only_one_request_is_mid_chunk_at_a_time() -> None:
    out = run_requests(prompt(600, seed=1), prompt(600, seed=2))
    handles_seen: list[int] = []
    for plan in out.plans:
        assert (~plan.extends.sample).sum() <= 1
        handles_seen += [h for h in plan.extends.handles.tolist() if h not in handles_seen]
    # The second long request starts only in the pass where the first one's last chunk runs.
    first_of_2 = next(i for i, p in enumerate(out.plans) if 2 in p.extends.handles.tolist())
    assert out.plans[first_of_2].extends.handles.tolist() == [1, 2]
    assert out.plans[first_of_2].extends.sample.tolist() == [True, False]
    assert extend_passes(out.plans) == {1: 3, 2: 3}


def test_chunk_budget_is_shared_with_new_requests() -> None:
    out = run_requests(prompt(300, seed=1), prompt(100, seed=2))
    second = out.plans[1]
    assert second.extends.handles.tolist() == [1, 2]
    assert second.extends.lens.tolist() == [44, 100]


def test_first_decode_immediately_follows_the_last_chunk() -> None:
    out = run_requests(prompt(700), max_new=3)
    kinds = [p.kind for p in out.plans if len(p.extends) or len(p.decodes)]
    assert kinds == [StepKind.PREFILL] * 3 + [StepKind.DECODE] * 2
    assert out.plans[3].decodes.handles.tolist() == [1]


def test_middle_chunks_sample_nothing_and_outputs_match_unchunked() -> None:
    ids = prompt(900, seed=5)
    chunked = run_requests(ids, max_new=8)
    whole = run_requests(ids, chunk=None, max_new=8)
    assert [p.extends.sample.tolist() for p in chunked.plans[:4]] == [[False], [False], [False], [True]]
    assert chunked.tokens == whole.tokens


def test_mixed_chunk_decodes_inside_the_prefill_step() -> None:
    sched = make_scheduler(capacity=8192, chunked_prefill_size=256, enable_mixed_chunk=True)
    arrivals = [(0, "short", prompt(20, seed=1), params(6)), (2, "long", prompt(600, seed=2), params(3))]
    out = run(sched, FakeWorker(8192, eos=EOS), arrivals)
    mixed = [p for p in out.plans if p.kind is StepKind.MIXED]
    assert mixed, [p.kind for p in out.plans]
    # The running request is charged one token of the chunk budget per mixed step.
    assert all(p.extends.lens.tolist() == [255] for p in mixed[:2])
    sched = make_scheduler(capacity=8192, chunked_prefill_size=None)
    reference = run(sched, FakeWorker(8192, eos=EOS), arrivals)
    assert out.tokens == reference.tokens


def test_abort_of_the_chunked_request_is_applied_at_the_next_plan() -> None:
    sched = make_scheduler(capacity=8192, chunked_prefill_size=256)
    worker = FakeWorker(8192, eos=EOS)

    def abort_mid_chunk(s: object, step: int) -> None:
        if step == 1:
            assert sched.chunked_req is not None
            assert sched.abort("r0", FinishReason.abort("cancelled"))
            # Only marked: the request is still the chunked one and has not finished yet.
            assert sched.chunked_req is not None and sched.requests["r0"].finished is False
            assert sched.take_updates().empty

    out = run(sched, worker, [(0, "r0", prompt(900), params(4))], on_step=abort_mid_chunk)
    assert out.finished["r0"].message == "cancelled"
    assert sched.chunked_req is None and sched.live_handles() == 0
    assert sched.kv.protected_size() == 0
    assert sched.kv.available_size() + sched.kv.evictable_size() == sched.capacity


def test_mixed_decode_allocation_evicts_like_every_allocation() -> None:
    # Found by the property test: the pool is nearly all evictable cache when r2 arrives; the mixed step skips
    # the decode memory check, so its decode allocation must evict by itself
    # (docs/scheduler.md#locks-and-eviction).
    shapes = [(1, 32), (71, 1), (1, 1), (1, 1), (1, 1), (1, 1), (1, 1), (52, 1), (1, 56), (1, 53)]
    arrivals = [
        (23 if i == 2 else 0, f"r{i}", prompt(n, seed=i), params(m)) for i, (n, m) in enumerate(shapes)
    ]
    arrivals[6] = (0, "r6", prompt(100, seed=101) + prompt(1, seed=6), params(1))
    arrivals[8] = (0, "r8", prompt(20, seed=102) + prompt(1, seed=8), params(56))
    sched = make_scheduler(capacity=260, chunked_prefill_size=16, enable_mixed_chunk=True)
    # Which plan (by index) was being planned when the tree evicted.
    plans: list[object] = []
    evictions: list[int] = []
    evict, next_plan = sched.kv.tree.evict, sched.next_plan

    def counted(num_tokens: int) -> object:
        evictions.append(len(plans))
        return evict(num_tokens)

    def recording() -> object:
        plan = next_plan()
        if plan is not None:
            plans.append(plan)
        return plan

    sched.kv.tree.evict = counted  # type: ignore[method-assign]
    sched.next_plan = recording  # type: ignore[method-assign]
    out = run(sched, FakeWorker(260, eos=EOS), arrivals)
    assert len(out.finished) == len(arrivals)
    mixed = [i for i, p in enumerate(out.plans) if p.kind is StepKind.MIXED and i >= 20]
    assert mixed
    # The event the test is named after: the pool was made room in by evicting cached prefixes while
    # a mixed step was being planned (the decode memory check before mixing, or the allocation).
    assert any(i in mixed for i in evictions), (mixed, evictions)
