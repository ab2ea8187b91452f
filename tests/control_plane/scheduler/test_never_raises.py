"""next_plan never raises on ordinary traffic (docs/scheduler.md#chunked-prefill, #mixed-chunk).

Two places could ask the allocator for more than the pool has: the decode fused into a mixed-chunk
step (admission pre-charges one token per running request, a decode at a page boundary takes a
page), and a forced continuation chunk when the budget is spent (SGLang forces the whole chunk
budget). Both now fall back as SGLang's loop would let them: the mix is skipped for that step, the
forced chunk is cut to what the pool can supply, or parked, or ended when nothing can ever free room.
"""

from __future__ import annotations

from control_plane.request import FinishKind
from control_plane.scheduler.admission import OOM_CHUNK
from protos.worker import StepKind
from tests.control_plane.factories import EOS, FakeWorker, finishes, make_scheduler, params, prompt


def _step(sched, worker):  # type: ignore[no-untyped-def]
    plan = sched.next_plan()
    assert plan is not None
    sched.apply_result(worker.run(plan))
    return plan, sched.take_updates()


def test_a_mixed_step_whose_decode_does_not_fit_runs_the_prefill_alone() -> None:
    sched = make_scheduler(capacity=512, page_size=4, enable_mixed_chunk=True, chunked_prefill_size=16)
    worker = FakeWorker(512, eos=EOS)
    for i in range(3):
        sched.add_request(f"r{i}", prompt(8, i), params(40, ignore_eos=True))
    for _ in range(4):
        _step(sched, worker)
    # Step on until a running request's next token starts a page: its decode needs a fresh page.
    while not any(int(n) % 4 == 0 for n in sched.running.seq_lens):
        _step(sched, worker)
    assert len(sched.running) == 3
    sched.add_request("new", prompt(4, 99), params(2, ignore_eos=True))
    # Between admission and the mix, the pool runs dry (as if the prefill had taken the last pages).
    alloc_for_extend = sched.kv.alloc_for_extend

    def extend_then_drain(reqs):  # type: ignore[no-untyped-def]
        rows = alloc_for_extend(reqs)
        sched.kv.allocator.alloc(sched.kv.available_size())
        return rows

    sched.kv.alloc_for_extend = extend_then_drain  # type: ignore[method-assign]
    plan = sched.next_plan()  # raised KvOutOfMemory out of the fused decode's allocation before
    assert plan is not None and plan.kind is StepKind.PREFILL and not len(plan.decodes)
    assert len(sched.running) == 3  # they wait a step, then decode under the memory check


def test_a_forced_chunk_takes_only_what_the_pool_can_supply() -> None:
    sched = make_scheduler(capacity=256, page_size=4, chunked_prefill_size=16)
    worker = FakeWorker(256, eos=EOS)
    sched.add_request("long", prompt(100, 1), params(4, ignore_eos=True))
    _step(sched, worker)  # the first chunk of 16
    assert sched.chunked_req is not None
    # Leave exactly 8 free slots (the chunk budget is 16): the next chunk is cut to 8.
    sched.kv.allocator.alloc(sched.kv.available_size() - 8)
    plan, _ = _step(sched, worker)
    assert plan.extends.lens.tolist() == [8]


def test_a_chunk_with_no_room_and_nothing_running_ends_with_a_reason() -> None:
    sched = make_scheduler(capacity=256, page_size=4, chunked_prefill_size=16)
    worker = FakeWorker(256, eos=EOS)
    sched.add_request("long", prompt(100, 1), params(4, ignore_eos=True))
    _step(sched, worker)
    sched.kv.allocator.alloc(sched.kv.available_size())
    plan = sched.next_plan()
    updates = finishes(sched.take_updates())
    reason = updates["long"]
    assert reason is not None and reason.kind is FinishKind.ABORT and reason.message == OOM_CHUNK
    assert sched.chunked_req is None and plan is not None and plan.releases.tolist() == [1]
