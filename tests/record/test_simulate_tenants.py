"""`stepwise simulate` with tenants (docs/scheduler.md#simulating-tenants): trace fields, the tenant
file, and the summary's per-tenant figures and Jain's index."""

from __future__ import annotations

from pathlib import Path

import pytest

from clients import traces
from stepwise import simulate as sim
from tests.record.conftest import Simulate

pytestmark = pytest.mark.timeout(120)

FLAT_COST = ("--cost", "0.01,0.00001,0", "--summary-only")


def _flood(heavy: int, light: int) -> list[dict]:
    """Everyone at once: `heavy` requests of tenant a, then `light` of tenant b, 64-token prompts."""
    lines = [
        {"rid": f"a{i}", "arrival": 0.0, "prompt_len": 64, "max_new_tokens": 8, "tenant": "a"}
        for i in range(heavy)
    ]
    lines += [
        {"rid": f"b{i}", "arrival": 0.001, "prompt_len": 64, "max_new_tokens": 8, "tenant": "b"}
        for i in range(light)
    ]
    return lines


def test_summary_reports_each_tenant(simulate: Simulate) -> None:
    _, summary = simulate(_flood(30, 10), *FLAT_COST, "--max-running-requests", "4")
    tenants = summary["tenants"]
    assert set(tenants) == {"a", "b"}
    assert tenants["a"]["requests"] == 30 and tenants["b"]["requests"] == 10
    # Weighted service: 64 prompt tokens at 1 and 8 output tokens at 2 each, all served.
    assert tenants["a"]["served_tokens"] == 30 * (64 + 2 * 8)
    assert tenants["b"]["rejected"] == 0
    assert 0 < summary["jain_index"] <= 1
    assert "slo_attainment" not in summary


def test_vtc_evens_the_service_while_both_are_backlogged(simulate: Simulate) -> None:
    flags = (*FLAT_COST, "--max-running-requests", "2")
    _, fcfs = simulate(_flood(40, 20), *flags)
    _, vtc = simulate(_flood(40, 20), *flags, "--fairness", "vtc")
    assert fcfs["jain_index"] < 0.7  # FCFS serves a's 40 first: b gets nothing while both wait
    assert vtc["jain_index"] > 0.99
    assert vtc["tenants"]["b"]["ttft_p99_s"] < fcfs["tenants"]["b"]["ttft_p50_s"]


def test_tenant_weights_from_the_file(simulate: Simulate, tmp_path: Path) -> None:
    table = tmp_path / "tenants.toml"
    table.write_text("[tenants.a]\nweight = 3\n\n[tenants.b]\n")
    flags = (*FLAT_COST, "--max-running-requests", "2", "--fairness", "vtc")
    _, weighted = simulate(_flood(40, 40), *flags, "--tenants", str(table))
    # While both wait, a gets three times b's service: Jain's index of service / weight is ~1.
    assert weighted["jain_index"] > 0.99
    _, plain = simulate(_flood(40, 40), *flags)
    assert plain["tenants"]["a"]["ttft_p50_s"] > weighted["tenants"]["a"]["ttft_p50_s"]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[tenants.a]\nweight = 0\n", "tenants.a.weight"),
        ("[tenants.a]\nwieght = 2\n", "wieght"),
        ("[[tenant]]\nname = 'a'\n", "tenant"),
        ("[tenants.a\n", "not TOML"),
    ],
)
def test_a_bad_tenant_file_is_one_line_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, words: str
) -> None:
    """simulate reads the control plane's tenant file (control_plane/tenants/table.py), and refuses
    a bad one as `stepwise control --tenants` does."""
    path = tmp_path / "t.toml"
    path.write_text(text)
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"rid": "a", "arrival": 0, "prompt_len": 4, "max_new_tokens": 2}\n')
    assert sim.main([str(trace), "--tenants", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]


def test_trace_objectives_must_be_milliseconds() -> None:
    with pytest.raises(ValueError, match="ttft_slo_ms"):
        traces.parse_request({"rid": "r", "prompt_len": 4, "ttft_slo_ms": -1}, 1000)
    req = sim.to_request(
        traces.parse_request({"rid": "r", "prompt_len": 4, "tenant": "x", "tpot_slo_ms": 50}, 1000)
    )
    assert (req.params.tenant, req.params.ttft_slo_ms, req.params.tpot_slo_ms) == ("x", 0.0, 50.0)


def test_the_tenant_files_quotas_refuse_what_a_live_control_plane_would(
    simulate: Simulate, tmp_path: Path
) -> None:
    """The quotas are the control plane's (control_plane/tenants/quota.py) on the simulated clock:
    a's calls past its two concurrent ones are refused and counted in its `rejected` (each once,
    as the scheduler's refusals are), b's all run, and what a refused is never served."""
    table = tmp_path / "tenants.toml"
    table.write_text("[tenants.a]\nmax_concurrent_requests = 2\n")
    _, summary = simulate(_flood(6, 2), *FLAT_COST, "--tenants", str(table))
    a, b = summary["tenants"]["a"], summary["tenants"]["b"]
    assert (a["requests"], a["rejected"], b["rejected"]) == (6, 4, 0)
    assert a["served_tokens"] == 2 * (64 + 2 * 8)
    assert summary["finish_reasons"] == {"length": 4, "refused: max_concurrent_requests": 4}


def test_a_token_rate_refills_on_the_simulated_clock(simulate: Simulate, tmp_path: Path) -> None:
    """A bucket of 100 weighted tokens refilling at 1000 a second: the first two 64-token prompts
    pass (a call needs only a positive balance), the third, a millisecond later, finds it in debt,
    and one a second later finds it full again."""
    table = tmp_path / "tenants.toml"
    table.write_text("[defaults]\ntoken_rate = 1000\ntoken_burst = 100\n")
    lines = [
        {"rid": f"a{i}", "arrival": at, "prompt_len": 64, "max_new_tokens": 8, "tenant": "a"}
        for i, at in enumerate((0.0, 0.001, 0.002, 1.0))
    ]
    _, summary = simulate(lines, *FLAT_COST, "--tenants", str(table))
    assert summary["tenants"]["a"]["rejected"] == 1
    assert summary["finish_reasons"] == {"length": 3, "refused: token_rate": 1}
