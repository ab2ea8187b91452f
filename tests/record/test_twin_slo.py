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


def _request(rid: str, arrival: float, prompt: int, tokens: int, ttft_ms: float = 0.0) -> dict:
    out = {"rid": rid, "arrival": arrival, "prompt_len": prompt, "max_new_tokens": tokens, "tenant": "a"}
    return {**out, "ttft_slo_ms": ttft_ms} if ttft_ms else out


def test_an_admitted_request_its_heir_cannot_take_is_lost_not_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """a0 (TTFT objective 100 ms) is admitted and streams on worker 0; four 8,000-token prompts
    (no objective) queue on worker 1; worker 0 is killed at 0.3 s and the heir's SLO admission
    refuses a0's continuation (its queue is 0.3 s of prefill). A live core ends such an orphan with
    an abort (core/admission.py:admit_orphan), so the summary counts a0 among the admitted
    requests, as one that missed, and not as refused at arrival."""
    requests = [_request("a0", 0.0, 64, 100, ttft_ms=100.0)]
    requests += [_request(f"b{i}", 0.25 + 0.001 * i, 8000, 1) for i in range(4)]
    trace = write_trace(tmp_path / "trace.jsonl", requests)
    rows_path = tmp_path / "rows.jsonl"
    flags = ["--cost", COST, "--slo-cost", COST, "--workers", "2", "--routing-policy", "least-loaded"]
    capsys.readouterr()
    code = sim.main(
        [str(trace), "--summary-only", "--per-request", str(rows_path), *flags, "--event", "kill:0@0.3"]
    )
    assert code == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out.splitlines()[0])["summary"]
    rows = {r["rid"]: r for r in map(json.loads, rows_path.read_text().splitlines())}
    a0 = rows["a0"]
    assert a0["workers"] == ["0"] and 0 < a0["output_tokens"] < 100  # it streamed, then was lost
    assert a0["finish"] == "abort"
    assert summary["finish_reasons"] == {"length": 4, "abort": 1}
    assert (summary["slo_requests"], summary["slo_rejected"], summary["slo_attainment"]) == (1, 0, 0.0)
    assert summary["tenants"]["a"]["rejected"] == 0
