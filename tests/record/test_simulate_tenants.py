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
