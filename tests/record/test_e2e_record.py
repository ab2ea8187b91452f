"""Record a real session (processes on loopback, embedded model), then replay it both ways."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from clients.client import StepwiseClient
from control_plane.record import codec
from control_plane.record.entries import ApplyResult, NextPlan
from control_plane.record.files import read_entries, recording_parts, varint
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
