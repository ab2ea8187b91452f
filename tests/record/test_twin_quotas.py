"""A tenant file's quotas on the fleet twin (`simulate --workers N --tenants FILE`): checked at each
arrival with the control plane's own book on the simulated clock, refusals counted in the tenant's
`rejected`, concurrency released when a request ends wherever it ran (after a hand-over or a
migration too) (docs/scheduler.md#simulating-tenants)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stepwise import simulate as sim
from tests.record.conftest import write_trace

pytestmark = pytest.mark.timeout(120)

FLAT_COST = ("--cost", "0.01,0.00001,0")


def _tenants(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return path


def _fleet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], requests: list[dict], *flags: str
) -> tuple[dict, dict[str, dict]]:
    """The summary and the per-request rows by rid."""
    trace = write_trace(tmp_path / "trace.jsonl", requests)
    rows_path = tmp_path / "rows.jsonl"
    capsys.readouterr()
    code = sim.main([str(trace), "--summary-only", "--per-request", str(rows_path), *FLAT_COST, *flags])
    assert code == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out.splitlines()[0])["summary"]
    rows = {r["rid"]: r for r in map(json.loads, rows_path.read_text().splitlines())}
    return summary, rows


def _request(rid: str, arrival: float, tenant: str = "a", tokens: int = 8) -> dict:
    return {"rid": rid, "arrival": arrival, "prompt_len": 64, "max_new_tokens": tokens, "tenant": tenant}


def _refused(rows: dict[str, dict]) -> dict[str, str]:
    return {rid: r["finish"] for rid, r in rows.items() if r["finish"].startswith("refused")}


def test_concurrency_quota_refuses_exactly_the_calls_past_it_across_workers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The quota is the control plane's, over all its workers: a's first two calls run (on two
    workers), its next four are refused and counted once each in its `rejected`; b is untouched;
    a's call after its first two ended runs again."""
    table = _tenants(tmp_path, "[tenants.a]\nmax_concurrent_requests = 2\n")
    requests = [_request(f"a{i}", 0.001 * i) for i in range(6)]
    requests += [_request("b0", 0.01, "b"), _request("b1", 0.011, "b"), _request("a6", 5.0)]
    summary, rows = _fleet(tmp_path, capsys, requests, "--workers", "2", "--tenants", str(table))
    assert _refused(rows) == {f"a{i}": "refused: max_concurrent_requests" for i in range(2, 6)}
    assert {rows["a0"]["workers"][0], rows["a1"]["workers"][0]} == {"0", "1"}
    assert all(rows[rid]["workers"] == [] for rid in _refused(rows))
    a, b = summary["tenants"]["a"], summary["tenants"]["b"]
    assert (a["requests"], a["rejected"], b["requests"], b["rejected"]) == (7, 4, 2, 0)
    # What a refused is never served: 64 prompt tokens at 1 and 8 outputs at 2 for each that ran.
    assert a["served_tokens"] == 3 * (64 + 2 * 8)
    assert summary["finish_reasons"] == {"length": 5, "refused: max_concurrent_requests": 4}


def test_queued_quota_and_token_rate_on_the_fleet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """max_queued_requests counts the calls not yet prefilled on any worker; the token bucket refills
    on the simulated clock (100 tokens, 1000 a second: two 64-token prompts pass, a third a
    millisecond later finds the bucket in debt, one a second later finds it full)."""
    rate = _tenants(tmp_path, "[defaults]\ntoken_rate = 1000\ntoken_burst = 100\n")
    requests = [_request(f"a{i}", at) for i, at in enumerate((0.0, 0.001, 0.002, 1.0))]
    summary, rows = _fleet(tmp_path, capsys, requests, "--workers", "2", "--tenants", str(rate))
    assert _refused(rows) == {"a2": "refused: token_rate"}
    assert summary["tenants"]["a"]["rejected"] == 1

    queued = _tenants(tmp_path, "[tenants.a]\nmax_queued_requests = 2\n")
    # One worker's running cap of 1 keeps the later ones queued: a0 runs, a1 and a2 wait, a3 is
    # refused; on two workers a1 runs too, so a3 finds one queued and passes.
    burst = [_request(f"a{i}", 0.0001 * i, tokens=40) for i in range(4)]
    one = ("--tenants", str(queued), "--max-running-requests", "1", "--routing-policy", "least-loaded")
    _, rows = _fleet(tmp_path, capsys, burst, "--workers", "1", *one)
    assert _refused(rows) == {"a3": "refused: max_queued_requests"}
    _, rows = _fleet(tmp_path, capsys, burst, "--workers", "2", *one)
    assert _refused(rows) == {}


@pytest.mark.parametrize("event", ["kill:{w}@0.3", "drain:{w}@0.3"])
def test_a_moved_request_holds_its_slot_until_it_ends_elsewhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], event: str
) -> None:
    """One concurrent request for a: a0 starts on a worker that is killed (a0 recomputes on the
    heir) or drained (a0 migrates with its KV) at 0.3 s. a1, arriving while a0 runs on the heir,
    is refused (the hand-over kept the slot: neither released nor taken twice); a2, arriving after
    a0 ended on the heir, runs (its end there released the slot)."""
    table = _tenants(tmp_path, "[tenants.a]\nmax_concurrent_requests = 1\n")
    flags = ("--workers", "2", "--tenants", str(table))
    probe = [_request("a0", 0.0, tokens=100)]
    _, rows = _fleet(tmp_path, capsys, probe, *flags)
    first = rows["a0"]["workers"][0]
    ended = rows["a0"]["e2e_s"]
    assert ended > 0.6
    requests = [*probe, _request("a1", 0.5), _request("a2", ended + 2.0)]
    summary, rows = _fleet(tmp_path, capsys, requests, *flags, "--event", event.format(w=first))
    assert len(rows["a0"]["workers"]) == 2 and rows["a0"]["workers"][0] == first
    assert rows["a0"]["finish"] == "length" and rows["a0"]["output_tokens"] == 100
    assert rows["a0"]["e2e_s"] < requests[-1]["arrival"]
    assert _refused(rows) == {"a1": "refused: max_concurrent_requests"}
    assert rows["a2"]["finish"] == "length"
    assert summary["tenants"]["a"]["rejected"] == 1


def test_a_request_lost_with_its_worker_releases_its_slot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The only worker is killed: its request ends (abort, no heir) and its slot is released, so
    the tenant's next call on the added worker runs."""
    table = _tenants(tmp_path, "[tenants.a]\nmax_concurrent_requests = 1\n")
    requests = [_request("a0", 0.0, tokens=100), _request("a1", 2.0)]
    flags = ("--workers", "1", "--event", "kill:0@0.3", "--event", "add@1", "--tenants", str(table))
    _, rows = _fleet(tmp_path, capsys, requests, *flags)
    assert rows["a0"]["finish"] == "abort"
    assert rows["a1"]["finish"] == "length" and rows["a1"]["workers"] == ["1"]


def test_one_worker_refuses_what_simulate_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same book at the same points of the step loop: with a concurrency quota, --workers 1 plans
    the same steps (the timeline's bytes) and counts the same refusals per tenant as the single-worker
    simulator. Only a refusal's time differs: the fleet refuses at the arrival itself (its core checks
    before routing), the single worker at the turn that takes the arrival."""
    path = _tenants(tmp_path, "[tenants.a]\nmax_concurrent_requests = 2\n")
    requests = [_request(f"a{i}", 0.003 * i, "a" if i % 3 else "b", tokens=5 + i % 7) for i in range(30)]
    trace = write_trace(tmp_path / "trace.jsonl", requests)
    runs = []
    for fleet in ((), ("--workers", "1", "--per-request", str(tmp_path / "rows.jsonl"))):
        capsys.readouterr()
        assert sim.main([str(trace), "--json", *FLAT_COST, "--tenants", str(path), *fleet]) == 0
        lines = capsys.readouterr().out.splitlines()
        summary = next(json.loads(line)["summary"] for line in lines if line.startswith('{"summary"'))
        runs.append((lines[: summary["steps"]], summary))
    (plain_steps, plain), (fleet_steps, fleet) = runs
    assert fleet_steps == plain_steps
    assert fleet["finish_reasons"] == plain["finish_reasons"]
    assert plain["tenants"]["a"]["rejected"] > 0
    for name in ("a", "b"):
        for key in ("requests", "rejected", "served_tokens", "ttft_p50_s", "ttft_p99_s"):
            assert fleet["tenants"][name][key] == plain["tenants"][name][key]
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert all(r["e2e_s"] == 0 for r in rows if r["finish"].startswith("refused"))


def test_the_fleet_summary_carries_the_tenant_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Tenants without quotas (weights, VTC): --workers 1 prints the single-worker simulator's bytes,
    its tenant figures and Jain's index included; on two workers each tenant's service adds up."""
    path = _tenants(tmp_path, "[tenants.a]\nweight = 3\n")
    requests = [_request(f"r{i}", 0.002 * i, "a" if i % 2 else "b", tokens=4 + i % 9) for i in range(40)]
    trace = write_trace(tmp_path / "trace.jsonl", requests)
    flags = ("--json", *FLAT_COST, "--tenants", str(path), "--fairness", "vtc", "--max-running-requests", "3")
    outputs = []
    for fleet in ((), ("--workers", "1")):
        capsys.readouterr()
        assert sim.main([str(trace), *flags, *fleet]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    assert json.loads(outputs[0].splitlines()[-1])["summary"]["jain_index"] is not None
    summary, rows = _fleet(tmp_path, capsys, requests, "--workers", "2", "--tenants", str(path))
    for name in ("a", "b"):
        mine = [r for rid, r in rows.items() if requests[int(rid[1:])]["tenant"] == name]
        served = sum(64 + 2 * r["output_tokens"] for r in mine)
        assert summary["tenants"][name]["served_tokens"] == served
        assert summary["tenants"][name]["requests"] == len(mine) == 20
    assert {w for r in rows.values() for w in r["workers"]} == {"0", "1"}
