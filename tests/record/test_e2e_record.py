"""Record a real session (processes on loopback, embedded model), then replay it both ways."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from clients.client import Generation, StepwiseClient, apply_response, generate_request
from control_plane.record import codec
from control_plane.record.entries import AddRequest, ApplyResult, Finished, NextPlan
from control_plane.record.files import read_entries, recording_parts, varint
from protos.stepwise.v1 import generation_pb2 as gen_pb
from stepwise import replay

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = [
    "Once upon a time",
    "The king said",
    "In the morning the old man walked slowly down to the river, and there he",
    "It was a dark and stormy night; the rain fell in torrents, except at occasional intervals, when it",
    "The little bird sang",
    "And so they travelled on through the forest until",
]


async def _generate_all(address: str) -> None:
    async with StepwiseClient(address) as client:
        gens = await asyncio.gather(
            *(client.generate(p, max_new_tokens=12 + 3 * i, temperature=0.0) for i, p in enumerate(PROMPTS))
        )
        info = await client.server_info()
    assert all(g.finish_reason in ("stop", "length") for g in gens)
    assert info.workers[0].retractions > 0, "STEPWISE_TEST_RETRACT was meant to force retractions"


async def _wait_for_idle_flush(rec_dir: Path, timeout: float = 10.0) -> Path:
    """The recording's first part, once it holds the results of every plan (flushed at each step)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        parts = list(rec_dir.glob("*.0000.rec"))
        if parts:
            entries = list(read_entries(parts[0]))
            plans = sum(isinstance(e, NextPlan) and e.plan is not None for e in entries)
            if plans and plans == sum(isinstance(e, ApplyResult) for e in entries):
                return parts[0]
        assert asyncio.get_running_loop().time() < deadline, "the recording did not settle"
        await asyncio.sleep(0.1)


def _assert_stamped(entries: list) -> None:
    """A live recording's timing stamps (stepwise/stamps.py): every call received before the scheduler
    took it, results applied in order, each after its plan, finishes published after a result."""
    plans, applied = {}, 0.0
    for e in entries:
        if isinstance(e, AddRequest):
            assert 0 < e.received_s <= e.at_s, e
        elif isinstance(e, NextPlan) and e.plan is not None:
            plans[e.plan.step_id] = e.at_s
        elif isinstance(e, ApplyResult):
            assert plans.pop(e.result.step_id) < e.at_s and applied <= e.at_s, e
            applied = e.at_s
        elif isinstance(e, Finished):
            assert 0 < applied <= e.at_s, e
    assert applied > 0


def _rewrite(path: Path, entries: list) -> None:
    path.write_bytes(b"".join(varint(len(b)) + b for b in map(codec.encode, entries)))


async def test_recorded_session_replays_identically_and_edits_are_found(
    start_stack, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setenv("STEPWISE_TEST_RETRACT", "1")
    rec_dir = tmp_path / "rec"
    stack = await start_stack(["--record", str(rec_dir), "--chunked-prefill-size", "16"])
    await _generate_all(stack.address)
    path = await _wait_for_idle_flush(rec_dir)
    stack.stop()
    assert recording_parts(rec_dir) == [path]

    capsys.readouterr()
    assert replay.main(["scheduler", str(path)]) == 0
    assert replay.main(["worker", str(path), "--model", str(model_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("identical:") and out[1].startswith("identical:"), out

    entries = list(read_entries(path))
    assert any(
        isinstance(e, NextPlan) and e.plan is not None and not e.plan.extends.sample.all() for e in entries
    ), "chunk 16 was meant to cut a prompt"
    _assert_stamped(entries)

    # One field of one plan: scheduler replay names the step and the field.
    i = next(k for k, e in enumerate(entries) if isinstance(e, NextPlan) and e.plan and len(e.plan.extends))
    plan = entries[i].plan
    tokens = plan.extends.token_ids.copy()
    tokens[1] += 1
    edited = list(entries)
    edited[i] = NextPlan(
        entries[i].step,
        dataclasses.replace(plan, extends=dataclasses.replace(plan.extends, token_ids=tokens)),
    )
    _rewrite(path, edited)
    assert replay.main(["scheduler", str(path)]) == 1
    assert f"step {plan.step_id}: plan.extends.token_ids[1] differs" in capsys.readouterr().out

    # One token of one result: worker replay names the step.
    j = [k for k, e in enumerate(entries) if isinstance(e, ApplyResult) and len(e.result.token_ids)][5]
    result = entries[j].result
    sampled = result.token_ids.copy()
    sampled[0] = (sampled[0] + 1) % 1000
    edited = list(entries)
    edited[j] = ApplyResult(dataclasses.replace(result, token_ids=sampled))
    _rewrite(path, edited)
    assert replay.main(["worker", str(path), "--model", str(model_dir)]) == 1
    assert f"step {result.step_id}: result.token_ids[0] differs" in capsys.readouterr().out


async def test_recorded_constrained_session_replays_identically(
    start_stack, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """Constrained requests (JSON schemas, regexes, a choice, GBNF; greedy, seeded, n = 2) under
    forced retraction and chunked prefill: both replays are identical, so the worker's replay masks
    as the live run did; a recorded grammar edited is found (the replay really applies it)."""
    from tests.e2e.test_constrained import CASES, check

    monkeypatch.setenv("STEPWISE_TEST_RETRACT", "1")
    rec_dir = tmp_path / "rec"
    stack = await start_stack(["--record", str(rec_dir), "--chunked-prefill-size", "16"])
    cases = CASES[::3]
    calls = [
        (case, generate_request(PROMPTS[i % len(PROMPTS)], case.params(temperature=t, seed=i, n=n)))
        for t, n in ((0.0, 1), (1.0, 1), (1.0, 2))
        for i, case in enumerate(cases)
    ]

    async def samples(request: gen_pb.GenerateRequest) -> list[Generation]:
        gens = [Generation() for _ in range(request.sampling.n)]
        async for response in client.stream(request):
            apply_response(gens[getattr(response, response.WhichOneof("event")).index], response)
        return gens

    async with StepwiseClient(stack.address) as client:
        results = await asyncio.gather(*(samples(request) for _, request in calls))
        info = await client.server_info()
    assert info.workers[0].retractions > 0, "STEPWISE_TEST_RETRACT was meant to force retractions"
    for (case, request), gens in zip(calls, results, strict=True):
        for gen in gens:
            check(case, gen, f"recorded, temperature {request.sampling.temperature:g}")
    path = await _wait_for_idle_flush(rec_dir)
    stack.stop()

    capsys.readouterr()
    assert replay.main(["scheduler", str(path)]) == 0
    assert replay.main(["worker", str(path), "--model", str(model_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("identical:") and out[1].startswith("identical:"), out

    # The grammar of one greedy sequence swapped for another: the worker's replay samples otherwise.
    entries = list(read_entries(path))
    i, seq = next(
        (k, s)
        for k, e in enumerate(entries)
        if isinstance(e, NextPlan) and e.plan is not None
        for s in e.plan.new_seqs
        if s.sampler.grammar is not None
        and s.sampler.temperature == 0.0
        and s.sampler.grammar.kind == "regex"
    )
    entry = entries[i]
    assert isinstance(entry, NextPlan) and entry.plan is not None and seq.sampler.grammar is not None
    grammar = dataclasses.replace(seq.sampler.grammar, spec="[a-z]{40}")
    swapped = dataclasses.replace(seq, sampler=dataclasses.replace(seq.sampler, grammar=grammar))
    new_seqs = tuple(swapped if s is seq else s for s in entry.plan.new_seqs)
    edited = list(entries)
    edited[i] = NextPlan(entry.step, dataclasses.replace(entry.plan, new_seqs=new_seqs))
    _rewrite(path, edited)
    assert replay.main(["worker", str(path), "--model", str(model_dir)]) == 1
    assert "differs" in capsys.readouterr().out
