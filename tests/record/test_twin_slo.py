"""SLO admission on the fleet twin (`simulate --workers N --slo-cost ...`): what the summary counts
as refused and as admitted when a request moves between workers (docs/scheduler.md#simulating-tenants)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stepwise import simulate as sim
from tests.record.conftest import write_trace

pytestmark = pytest.mark.timeout(120)

COST = "0.01,0.00001,0,0"


def _request(
    rid: str, arrival: float, prompt: int, tokens: int, ttft_ms: float = 0.0, tenant: str = "a"
) -> dict:
    out = {"rid": rid, "arrival": arrival, "prompt_len": prompt, "max_new_tokens": tokens, "tenant": tenant}
    return {**out, "ttft_slo_ms": ttft_ms} if ttft_ms else out


def _run(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[dict, dict]:
    """a0 (TTFT objective 100 ms) is admitted and streams on worker 0; four 8,000-token prompts of
    tenant b (no objective) queue on the workers; worker 0 is killed at 0.3 s, so a0 continues on
    worker 1 behind 0.3 s of prefill. The summary and a0's row."""
    requests = [_request("a0", 0.0, 64, 100, ttft_ms=100.0)]
    requests += [_request(f"b{i}", 0.25 + 0.001 * i, 8000, 1, tenant="b") for i in range(4)]
    trace = write_trace(tmp_path / "trace.jsonl", requests)
    rows_path = tmp_path / "rows.jsonl"
    flags = ["--cost", COST, "--slo-cost", COST, "--workers", "2", "--routing-policy", "least-loaded", *extra]
    capsys.readouterr()
    code = sim.main(
        [str(trace), "--summary-only", "--per-request", str(rows_path), *flags, "--event", "kill:0@0.3"]
    )
    assert code == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out.splitlines()[0])["summary"]
    rows = {r["rid"]: r for r in map(json.loads, rows_path.read_text().splitlines())}
    return summary, rows["a0"]


def test_a_continuation_that_already_streamed_is_not_refused_for_its_ttft(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """a0's first token came out on worker 0 within its objective: the heir's SLO admission does
    not check the continuation's TTFT again (it would abort a stream for an objective already
    met), so a0 ends on worker 1 and counts as meeting it."""
    summary, a0 = _run(tmp_path, capsys)
    assert a0["workers"] == ["0", "1"] and a0["output_tokens"] == 100 and a0["finish"] == "length"
    assert summary["finish_reasons"] == {"length": 5}
    assert (summary["slo_requests"], summary["slo_rejected"], summary["slo_attainment"]) == (1, 0, 1.0)


def test_an_admitted_request_its_heir_cannot_take_is_lost_not_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With the heir's queue full (--max-queued-requests 2), a0's continuation is refused there. A
    live core ends such an orphan with an abort (core/admission.py:admit_orphan), so the summary
    counts a0 among the admitted requests, as one that missed, and not as refused at arrival."""
    summary, a0 = _run(tmp_path, capsys, "--max-queued-requests", "2")
    assert a0["workers"] == ["0"] and 0 < a0["output_tokens"] < 100  # it streamed, then was lost
    assert a0["finish"] == "abort"
    assert (summary["slo_requests"], summary["slo_rejected"], summary["slo_attainment"]) == (1, 0, 0.0)
    assert summary["tenants"]["a"]["rejected"] == 0
