"""`stepwise simulate --workers N` (stepwise/twin.py): the fleet on one simulated clock."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest

from stepwise import simulate as sim
from tests.record.conftest import write_trace

FLAT_COST = ("--cost", "0.01,0,0")


def _requests(n: int = 60, seed: int = 7, rate: float = 20.0) -> list[dict]:
    """Requests with shared prefixes, EOS and length finishes, priorities and a few aborts."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        req = {
            "rid": f"r{i}",
            "arrival": round(t, 4),
            "prompt_len": rng.randint(20, 400),
            "prefix_group": rng.randint(0, 4),
            "prefix_len": 64,
            "max_new_tokens": rng.randint(5, 80),
            "output_len": rng.randint(3, 90),
            "priority": rng.randint(0, 3),
        }
        if i % 9 == 0:
            req["abort_at"] = round(t + 0.05, 4)
        out.append(req)
    return out


def _run(tmp_path: Path, capsys: pytest.CaptureFixture[str], requests: list[dict], *flags: str) -> str:
    trace = write_trace(tmp_path / "trace.jsonl", requests)
    capsys.readouterr()
    assert sim.main([str(trace), *flags]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def _fleet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], requests: list[dict], *flags: str
) -> tuple[dict, dict[str, dict]]:
    """The fleet's summary line and the per-request rows by rid."""
    rows_path = tmp_path / "rows.jsonl"
    out = _run(tmp_path, capsys, requests, "--summary-only", "--per-request", str(rows_path), *flags)
    fleet = json.loads(out.splitlines()[-1])["fleet"]
    rows = {r["rid"]: r for r in map(json.loads, rows_path.read_text().splitlines())}
    return fleet, rows


def test_two_runs_of_a_fleet_print_the_same_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flags = ("--roles", "p:1,d:1,m:2", "--event", "kill:2@1", "--event", "add@1.5", "--event", "drain:3@2")
    first = _run(tmp_path, capsys, _requests(), *flags)
    second = _run(tmp_path, capsys, _requests(), *flags)
    assert first == second
    assert '"fleet"' in first


@pytest.mark.parametrize(
    "flags",
    [
        (),
        ("--disable-overlap-schedule", "--chunked-prefill-size", "64"),
        ("--kv-tokens", "1200", "--enable-priority-scheduling"),
        ("--schedule-policy", "lpm", "--json"),
    ],
)
def test_one_worker_prints_what_simulate_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...]
) -> None:
    """--workers 1 runs the fleet's loop (router, placement, events) and prints the same bytes as the
    single-worker simulator: timeline, aborts, priorities."""
    plain = _run(tmp_path, capsys, _requests(), *flags)
    fleet = _run(tmp_path, capsys, _requests(), "--workers", "1", *flags)
    assert fleet == plain
    assert '"abort": ' in plain.splitlines()[-1]


def test_one_worker_under_retractions_prints_what_simulate_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STEPWISE_INIT_NEW_TOKEN_RATIO", "0.01")  # admit optimistically, then run out
    requests = [
        {"rid": rid, "arrival": arrival, "prompt_len": 10, "max_new_tokens": 60, "ignore_eos": True}
        for rid, arrival in (("first", 0.0), ("second", 0.1), ("third", 0.2))
    ]
    plain = _run(tmp_path, capsys, requests, "--kv-tokens", "140", *FLAT_COST)
    fleet = _run(tmp_path, capsys, requests, "--kv-tokens", "140", "--workers", "1", *FLAT_COST)
    assert fleet == plain
    assert json.loads(plain.splitlines()[-1])["summary"]["retractions"] >= 1


def _finished_ok(rows: dict[str, dict]) -> set[str]:
    return {rid for rid, r in rows.items() if r["finish"] in ("stop", "length")}


def test_a_killed_workers_requests_finish_elsewhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    requests = [r | {"abort_at": None} for r in _requests()]
    fleet, rows = _fleet(tmp_path, capsys, requests, "--workers", "3", "--event", "kill:1@1")
    assert fleet["per_worker"][1]["state"] == "killed"
    assert _finished_ok(rows) == set(rows)  # none lost
    moved = [r for r in rows.values() if r["workers"][:1] == ["1"] and len(r["workers"]) > 1]
    assert moved, "the killed worker had live requests"
    assert fleet["handed_over"] >= len(moved)
    assert fleet["recomputed_tokens"] > 0
    late = [r for r in rows.values() if r["arrival_s"] > 1.1]
    assert late and all("1" not in r["workers"] for r in late)


def test_a_drained_worker_finishes_or_moves_its_requests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    requests = [r | {"abort_at": None} for r in _requests()]
    fleet, rows = _fleet(tmp_path, capsys, requests, "--workers", "3", "--event", "drain:0@1")
    assert fleet["per_worker"][0]["state"] == "drained"
    assert _finished_ok(rows) == set(rows)
    assert fleet["migrations"].get("drain", 0) + fleet["handed_over"] > 0
    assert all(r["workers"][0] != "0" for r in rows.values() if r["arrival_s"] > 1.0)


def test_an_added_worker_takes_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # No shared prefixes: the cache-aware router has no reason to keep them on the first worker.
    requests = [r | {"abort_at": None, "prefix_len": 0} for r in _requests()]
    fleet, rows = _fleet(tmp_path, capsys, requests, "--workers", "1", "--event", "add@1")
    assert fleet["workers"] == 2
    assert fleet["per_worker"][1]["served"] > 0
    assert all(r["arrival_s"] > 1.0 for r in rows.values() if r["workers"][:1] == ["1"])
    assert _finished_ok(rows) == set(rows)


def test_trace_lines_carry_events(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    requests = [r | {"abort_at": None} for r in _requests()]
    by_flag, _ = _fleet(tmp_path, capsys, requests, "--workers", "2", "--event", "kill:0@1")
    line = {"event": "kill", "worker": 0, "at": 1}
    by_line, _ = _fleet(tmp_path, capsys, [*requests[:20], line, *requests[20:]], "--workers", "2")
    assert by_line == by_flag


def test_decode_workers_prefill_nothing_of_the_prompts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """PD roles: every request is prefilled on the prefill worker and handed over with its KV; a
    decode worker extends only each arrival's last streamed token (its KV is not committed yet)."""
    requests = [r | {"abort_at": None} for r in _requests()]
    fleet, rows = _fleet(tmp_path, capsys, requests, "--roles", "prefill,decode,decode")
    decoders = [w for w in fleet["per_worker"] if w["role"] == "decode"]
    assert all(w["prefill_tokens"] == w["served"] for w in decoders)
    assert sum(w["served"] for w in decoders) == fleet["migrations"]["pd"] > 0
    assert all(r["workers"][0] == "0" for r in rows.values())
    assert _finished_ok(rows) == set(rows)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--workers", "2", "--event", "kill:5@1"), "there is no worker 5"),
        (("--workers", "2", "--event", "explode:1@1"), "--event 'explode:1@1'"),
        (("--workers", "2", "--roles", "prefill,decode,decode"), "--roles: names 3 workers"),
        (("--roles", "p:1,x:2"), "--roles: 'x'"),
        (("--workers", "2", "--worker-cost", "7=0.01,0,0"), "--worker-cost: worker 7"),
        (("--workers", "2", "--record", "rec"), "--record records one worker"),
    ],
)
def test_bad_fleet_flags_are_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], says: str
) -> None:
    trace = write_trace(tmp_path / "trace.jsonl", _requests(5))
    assert sim.main([str(trace), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ({"event": "kill", "worker": "one", "at": 1}, "trace.jsonl:2: worker:"),
        ({"event": "kill", "worker": 0, "at": -1}, "trace.jsonl:2: at:"),
        ({"event": "melt", "worker": 0, "at": 1}, "trace.jsonl:2: event:"),
    ],
)
def test_a_bad_event_line_names_line_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: dict, says: str
) -> None:
    requests = _requests(3)
    trace = write_trace(tmp_path / "trace.jsonl", [requests[0], line, *requests[1:]])
    assert sim.main([str(trace), "--workers", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_slo_attainment_and_goodput_follow_the_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    requests = [r | {"abort_at": None} for r in _requests()]
    _, rows = _fleet(tmp_path, capsys, requests, "--workers", "2")
    ttfts = sorted(r["ttft_s"] for r in rows.values())
    slo_ttft = ttfts[len(ttfts) // 2]
    fleet, rows = _fleet(
        tmp_path, capsys, requests, "--workers", "2", "--slo-ttft", str(slo_ttft), "--slo-tpot", "1"
    )
    meets = [r["ttft_s"] <= slo_ttft and (r["tpot_s"] is None or r["tpot_s"] <= 1) for r in rows.values()]
    assert fleet["slo"]["both_attained"] == round(sum(meets) / len(rows), 6)
    assert 0.4 < fleet["slo"]["ttft_attained"] < 0.7
    # Goodput: requests meeting both per simulated second (the summary's simulated_s).
    simulated_s = len(rows) / fleet["completed_rps"]
    assert fleet["slo"]["goodput_rps"] == pytest.approx(sum(meets) / simulated_s, rel=1e-4)
    for r in rows.values():
        assert 0 <= r["queue_s"] <= r["ttft_s"] <= r["e2e_s"]
        if r["output_tokens"] > 1:
            assert r["tpot_s"] == pytest.approx(
                (r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1), abs=1e-5
            )
    assert fleet["ttft_s"]["p50"] <= fleet["ttft_s"]["p90"] <= fleet["ttft_s"]["p99"]


def test_plot_draws_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "fleet.png"
    _run(tmp_path, capsys, _requests(), "--workers", "2", "--summary-only", "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_copy_from_a_killed_source_recomputes_and_none_is_lost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """PD hand-offs under way when the prefill worker dies: the copies die with it (a slow link
    keeps them on the wire), and those calls recompute on an heir."""
    requests = [r | {"abort_at": None} for r in _requests()]
    flags = ("--roles", "p:2,d:2", "--link-gbps", "0.001", "--event", "kill:0@1")
    fleet, rows = _fleet(tmp_path, capsys, requests, *flags)
    assert fleet["migration_fallbacks"] > 0
    assert _finished_ok(rows) == set(rows)


@pytest.mark.parametrize(
    "flags",
    [
        ("--roles", "p:1,d:1,m:2", "--event", "kill:2@1", "--event", "add@1.5", "--event", "drain:3@2"),
        ("--workers", "3", "--kv-tokens", "1500", "--enable-priority-scheduling"),
        ("--roles", "p:2,d:2", "--link-gbps", "0.001", "--event", "kill:0@1"),
    ],
)
def test_the_in_process_link_prints_what_the_codec_prints(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flags: tuple[str, ...],
) -> None:
    """The twin hands plans and results to its sim workers as they are (TwinSetup.wire False): the
    same bytes as through the worker codec, request rows included."""
    from stepwise import twin_cli

    def rows(wire: bool) -> tuple[str, str]:
        made = twin_cli.setup_from_args
        monkeypatch.setattr(twin_cli, "setup_from_args", lambda *a: dataclasses.replace(made(*a), wire=wire))
        out = _run(tmp_path, capsys, _requests(), "--per-request", str(tmp_path / "rows.jsonl"), *flags)
        monkeypatch.setattr(twin_cli, "setup_from_args", made)
        return out, (tmp_path / "rows.jsonl").read_text()

    direct, wired = rows(False), rows(True)
    assert direct == wired
    assert '"fleet"' in direct[0]
