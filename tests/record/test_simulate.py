"""`stepwise simulate`: deterministic, and its timeline follows docs/scheduler.md on hand-made traces."""

from __future__ import annotations

from pathlib import Path

import pytest

from stepwise import simulate as sim
from tests.record.conftest import Simulate, write_trace

pytestmark = pytest.mark.timeout(120)

# One step costs exactly 10 ms: arrival times translate into step numbers.
FLAT_COST = ("--cost", "0.01,0,0")


def _passes(lines: list[dict], rid: str) -> list[dict]:
    return [e for line in lines for e in line["extends"] if e["rid"] == rid]


def test_two_runs_print_the_same_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    requests = [
        {
            "rid": f"r{i}",
            "arrival": 0.003 * i,
            "prompt_len": 40 + 13 * i,
            "prefix_group": f"g{i % 3}",
            "prefix_len": 24,
            "max_new_tokens": 30,
            "output_len": 5 + i % 17,
        }
        for i in range(40)
    ]
    trace = write_trace(tmp_path / "t.jsonl", requests)
    flags = [str(trace), "--json", "--kv-tokens", "900", "--chunked-prefill-size", "64"]
    outputs = []
    for _ in range(2):
        capsys.readouterr()
        assert sim.main(flags) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    assert '"summary"' in outputs[0].splitlines()[-1]


@pytest.mark.parametrize(("prompt", "passes"), [(256, 1), (257, 2), (512, 2), (768, 3), (2560, 10)])
def test_chunk_counts(simulate: Simulate, prompt: int, passes: int) -> None:
    """docs/scheduler.md#chunked-prefill: chunk 256 → prompt 256 runs in one pass, 257 in two, 768 in
    three."""
    lines, _ = simulate(
        [{"rid": "a", "arrival": 0, "prompt_len": prompt, "max_new_tokens": 2}],
        "--chunked-prefill-size",
        "256",
    )
    extends = _passes(lines, "a")
    assert len(extends) == passes
    assert [e["chunked"] for e in extends] == [True] * (passes - 1) + [False]
    assert extends[-1]["end"] == prompt
    assert all(e["end"] - e["start"] <= 256 for e in extends)


@pytest.mark.parametrize(("mode", "seen_at"), [("--disable-overlap-schedule", 6), ("", 7)])
def test_prefill_goes_before_decode(simulate: Simulate, mode: str, seen_at: int) -> None:
    """An arrival is prefilled in the first step after it is seen; decode then resumes with both.

    Without overlap plan k is made when step k-1 has ended (clock 0.01·(k-1)): b (0.055) is seen by
    plan 7. With overlap plan k is made while step k-1 runs, on the clock of step k-2's end: plan 8.
    Then b is decoded in the very next plan, before its first token is known (docs/scheduler.md#overlap)."""
    lines, _ = simulate(
        [
            {"rid": "a", "arrival": 0, "prompt_len": 30, "max_new_tokens": 20},
            {"rid": "b", "arrival": 0.055, "prompt_len": 30, "max_new_tokens": 5},
        ],
        *FLAT_COST,
        *([mode] if mode else []),
    )
    kinds = [line["kind"] for line in lines]
    assert kinds[: seen_at + 1] == ["prefill"] + ["decode"] * (seen_at - 1) + ["prefill"]
    assert [e["rid"] for e in lines[seen_at]["extends"]] == ["b"]
    assert lines[seen_at]["decodes"] == []
    assert lines[seen_at + 1]["kind"] == "decode" and lines[seen_at + 1]["decodes"] == ["a", "b"]


def test_overlap_and_no_overlap_generate_the_same(simulate: Simulate) -> None:
    """The same trace with and without overlap: same tokens and finishes (the summary), at least as
    many steps with overlap (its dead decodes: each request decodes once more, docs/scheduler.md#overlap)."""
    requests = [
        {"rid": f"r{i}", "arrival": 0.002 * i, "prompt_len": 20 + 9 * i, "max_new_tokens": 12 + i}
        | {"output_len": 6 + i % 5}
        for i in range(12)
    ]
    flags = ("--kv-tokens", "400", "--chunked-prefill-size", "32")
    _, overlap = simulate(requests, *flags)
    _, plain = simulate(requests, *flags, "--disable-overlap-schedule")
    for key in ("requests", "finish_reasons", "output_tokens", "prompt_tokens"):
        assert overlap[key] == plain[key], key
    assert overlap["steps"] >= plain["steps"]


def test_retraction_takes_the_fewest_outputs_first(
    simulate: Simulate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/scheduler.md#retraction: under KV pressure, the request with the fewest generated tokens goes
    first."""
    monkeypatch.setenv("STEPWISE_INIT_NEW_TOKEN_RATIO", "0.01")  # admit optimistically, then run out
    requests = [
        {"rid": rid, "arrival": arrival, "prompt_len": 10, "max_new_tokens": 60, "ignore_eos": True}
        for rid, arrival in (("first", 0.0), ("second", 0.1), ("third", 0.2))
    ]
    # Each admission needs 70 tokens; all three fit at first, and outgrow 140 while decoding.
    lines, summary = simulate(requests, "--kv-tokens", "140", *FLAT_COST)
    at = next(i for i, line in enumerate(lines) if line["retracted"])
    outputs = {rid: _outputs_before(lines[:at], rid) for rid in ("first", "second", "third")}
    assert outputs["first"] > outputs["second"] > outputs["third"]
    assert lines[at]["retracted"][0] == "third"
    assert summary["retractions"] >= 1
    assert summary["finish_reasons"] == {"length": 3}


def _outputs_before(lines: list[dict], rid: str) -> int:
    """Tokens generated so far: one per final extend pass, one per decode."""
    final_extends = sum(1 for e in _passes(lines, rid) if not e["chunked"])
    return final_extends + sum(line["decodes"].count(rid) for line in lines)


def test_shared_prefixes_hit_the_cache(simulate: Simulate) -> None:
    requests = [
        {"rid": f"r{i}", "arrival": 0.05 * i, "prompt_len": 100, "prefix_group": "sys", "prefix_len": 64}
        | {"max_new_tokens": 4}
        for i in range(4)
    ]
    lines, summary = simulate(requests)
    assert summary["cached_tokens"] == 3 * 64
    assert summary["prompt_tokens"] == 400 and summary["output_tokens"] == 16
    assert [e["start"] for r in ("r1", "r2", "r3") for e in _passes(lines, r)] == [64, 64, 64]


def test_bad_trace_is_refused_with_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(
        '{"rid": "a", "arrival": 1, "prompt_len": 4}\n{"rid": "b", "arrival": 0, "prompt_len": 4}\n'
    )
    assert sim.main([str(trace)]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err


# Aborts from the trace (docs/debugging.md#simulating-a-trace): with FLAT_COST and no overlap, plan k is made
# at clock 0.01 · (k − 1), and an abort whose time the clock has reached is applied before that plan.
ABORTS = [
    {"rid": "run", "arrival": 0, "prompt_len": 30, "max_new_tokens": 20},
    # Arrives at plan 3 and is chunked (32 a step); aborted before plan 5, mid-chunk.
    {"rid": "long", "arrival": 0.02, "prompt_len": 100, "max_new_tokens": 5, "abort_at": 0.035},
    # Queued behind "long"'s chunks; aborted before plan 4.
    {"rid": "q", "arrival": 0.02, "prompt_len": 10, "max_new_tokens": 5, "abort_at": 0.025},
    # Prefilled by plan 6; aborted before plan 7, its last prefill done and not yet merged.
    {"rid": "last", "arrival": 0.05, "prompt_len": 10, "max_new_tokens": 5, "abort_at": 0.055},
    # Prefilled by plan 6 too, and decoding when aborted before plan 12.
    {"rid": "dec", "arrival": 0.05, "prompt_len": 10, "max_new_tokens": 20, "abort_at": 0.105},
]


def _aborted_at(lines: list[dict]) -> dict[str, int]:
    return {a["rid"]: line["step"] for line in lines for a in line["aborted"]}


def test_trace_aborts_of_queued_mid_chunk_last_prefill_and_running_requests(simulate: Simulate) -> None:
    """docs/scheduler.md#aborts, from the trace: a queued request is never extended; a request mid-chunk gets
    no further chunk; the last-prefill and the running one are decoded once more, in the plan made right
    after their abort, and never again."""
    lines, summary = simulate(
        ABORTS, *FLAT_COST, "--chunked-prefill-size", "32", "--disable-overlap-schedule"
    )
    assert _aborted_at(lines) == {"q": 4, "long": 5, "last": 7, "dec": 12}
    assert _passes(lines, "q") == []
    assert [(e["start"], e["chunked"]) for e in _passes(lines, "long")] == [(0, True), (32, True)]
    for rid, step in (("last", 7), ("dec", 12)):
        decoded = [line["step"] for line in lines if rid in line["decodes"]]
        assert decoded[-1] == step, rid
    assert [line["step"] for line in lines if "last" in line["decodes"]] == [7]
    assert summary["finish_reasons"] == {"abort": 4, "length": 1}
    # Streamed: "run" 20; "last" its prefill's token only; "dec" its prefill's and 5 decodes' (plans 7-11).
    assert summary["output_tokens"] == 20 + 1 + 6


def test_trace_aborts_record_and_replay_identically(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The aborts are scheduler calls like the engine's: recorded, and replayed exactly (overlap on)."""
    from stepwise import replay

    trace = write_trace(tmp_path / "t.jsonl", ABORTS)
    rec = tmp_path / "rec"
    flags = [*FLAT_COST, "--chunked-prefill-size", "32", "--summary-only", "--record", str(rec)]
    assert sim.main([str(trace), *flags]) == 0
    capsys.readouterr()
    assert replay.main(["scheduler", str(rec)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("identical: ") and "4 aborts" in out.splitlines()[0], out


@pytest.mark.parametrize(
    ("value", "says"),
    [('"soon"', "abort_at: want seconds"), ("0.01", "abort_at: 0.01 is before"), ("true", "abort_at: want")],
)
def test_a_bad_abort_at_is_refused_with_the_line_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, says: str
) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(
        '{"rid": "a", "arrival": 0, "prompt_len": 4}\n'
        f'{{"rid": "b", "arrival": 0.02, "prompt_len": 4, "abort_at": {value}}}\n'
    )
    assert sim.main([str(trace)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.jsonl:2: " in err[0] and says in err[0], err
