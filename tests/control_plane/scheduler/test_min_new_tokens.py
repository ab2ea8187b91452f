"""min_new_tokens (docs/scheduler.md#intake): lowered to max_new_tokens when larger; EOS, stop token ids and
stop strings do not end a request before it (SGLang: `Req.check_finished`, the min_new_tokens clamp in
`scheduler.py:init_req_max_new_tokens`)."""

from __future__ import annotations

import pytest

from control_plane.frontend import client_codec
from control_plane.frontend.detokenize import TextStream
from control_plane.request import FinishKind
from protos.stepwise.v1 import generation_pb2 as gen_pb
from tests.control_plane.factories import EOS, add, by_rid, finishes, make_scheduler, params, prompt
from tests.control_plane.fake_worker import FakeWorker


def _run(sched, worker, rid: str) -> tuple[list[int], FinishKind]:  # type: ignore[no-untyped-def]
    tokens: list[int] = []
    for _ in range(200):
        plan = sched.next_plan()
        if plan is None:
            break
        sched.apply_result(worker.run(plan))
        updates = sched.take_updates()
        tokens += by_rid(updates).get(rid, [])
        if rid in (ended := finishes(updates)):
            return tokens, ended[rid].kind
    raise AssertionError("the request never finished")


def test_eos_does_not_end_a_request_before_min_new_tokens() -> None:
    # The fake worker samples EOS for about every second context; without a minimum the request
    # stops within a few tokens.
    free_tokens, _ = _run_one(min_new_tokens=0)
    assert len(free_tokens) < 8
    tokens, kind = _run_one(min_new_tokens=8)
    assert kind is FinishKind.STOP and len(tokens) >= 8
    # An EOS sampled before the minimum is an ordinary token, streamed like any other.
    assert EOS in tokens[:8] or len(tokens) == 8


def _run_one(min_new_tokens: int) -> tuple[list[int], FinishKind]:
    sched = make_scheduler()
    worker = FakeWorker(4096, eos=EOS, eos_every=2)
    add(sched, "r", prompt(12, 3), params(30, min_new_tokens=min_new_tokens))
    return _run(sched, worker, "r")


def test_min_new_tokens_is_lowered_to_max_new_tokens() -> None:
    sched = make_scheduler()
    req = sched.add_request("r", prompt(12, 3), params(10, min_new_tokens=50))
    assert (req.max_new_tokens, req.min_new_tokens) == (10, 10)


def test_negative_min_new_tokens_is_an_invalid_argument() -> None:
    with pytest.raises(client_codec.InvalidArgument, match=r"^sampling\.min_new_tokens: must be >= 0"):
        client_codec.sampling_from_proto(gen_pb.SamplingParams(min_new_tokens=-1))
    assert client_codec.sampling_from_proto(gen_pb.SamplingParams(min_new_tokens=4)).min_new_tokens == 4


class _Chars:
    """A decoder where token t is the character chr(t)."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:  # type: ignore[no-untyped-def]
        return "".join(chr(i) for i in ids)


def test_stop_strings_count_only_after_min_new_tokens() -> None:
    ids = [ord(c) for c in "ab.cd.ef"]
    stream = TextStream(_Chars(), [], stops=["."], min_new_tokens=4)
    out = []
    for token in ids:
        out.append(stream.push([token]))
        if out[-1].stop is not None:
            break
    # The "." at the third token is within the minimum: streamed; the one at the sixth ends it.
    assert "".join(d.text for d in out) == "ab.cd"
    assert [d.stop for d in out] == [None] * 5 + ["."]
