"""`stepwise bench --dataset trace FILE`: the live run sends the workload `stepwise simulate FILE` runs
(same rids, prompt ids, output lengths and arrival times, scaled as the same flags say), a bad trace is
one line naming the line and field (exit 2), and a run against a sim stack arrives as sent."""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from clients import bench
from clients.datasets import FIRST_TOKEN_ID, BenchRequest
from control_plane.request import RequestParams
from data_plane.sim import TOKEN_FLOOR
from stepwise import cli, traces
from stepwise import simulate as sim
from tests.cli.runner import run_cli_async
from tests.cli.test_bench import stack_address

__all__ = ["stack_address"]

pytestmark = pytest.mark.timeout(60)

EXCERPT = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_head300.jsonl"
VOCAB = 1024

# Every way the stepwise format bounds a request's output: max_new_tokens alone, an earlier EOS
# (output_len), EOS ignored past output_len, output_len alone.
SHARED = {"prefix_group": "s", "prefix_len": 20}
STEPWISE_TRACE = [
    {"rid": "a", "arrival": 0.0, "prompt_len": 30, **SHARED, "max_new_tokens": 6},
    {"rid": "b", "arrival": 0.01, "prompt_len": 25, **SHARED, "max_new_tokens": 9, "output_len": 4},
    {"rid": "c", "arrival": 0.015, "prompt_ids": [5, 6, 7, 8], "max_new_tokens": 5, "output_len": 2,
     "ignore_eos": True},
    {"rid": "d", "arrival": 0.04, "prompt_len": 12, "output_len": 7},
]  # fmt: skip


def _write(path: Path, lines: Sequence[object]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _bench_ns(trace: Path, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(["--dataset", "trace", str(trace), "--vocab", str(VOCAB), *flags])


def _admitted(trace: Path, *flags: str) -> list[tuple[str, list[int], int, float]]:
    """What `stepwise simulate` with these flags admits: (rid, prompt ids, tokens generated, arrival),
    in the order it admits them."""
    ns = sim.build_parser().parse_args([str(trace), "--vocab-size", str(VOCAB), *flags])
    setup = sim.setup_from_args(ns)
    simulation = sim.Simulation(setup, traces.read_trace(ns, VOCAB))
    seen: list[tuple[str, list[int], float]] = []
    add = simulation.scheduler.add_request

    def spy(rid: str, input_ids: Sequence[int], params: RequestParams, uid: int) -> None:
        seen.append((rid, list(input_ids), simulation.progress[rid].arrival))
        add(rid, input_ids, params, uid)

    simulation.scheduler.add_request = spy  # type: ignore[method-assign]
    simulation.run()
    return [(rid, ids, simulation.progress[rid].output_tokens, at) for rid, ids, at in seen]


def _sent(requests: list[BenchRequest]) -> list[tuple[str, list[int], int, float]]:
    return [(r.rid, r.prompt_ids, r.max_new_tokens, r.arrival or 0.0) for r in requests]


def test_fleet_event_lines_are_no_requests(tmp_path: Path) -> None:
    trace = _write(
        tmp_path / "t.jsonl", [STEPWISE_TRACE[0], {"event": "kill", "at": 0.01}, STEPWISE_TRACE[1]]
    )
    assert [r.rid for r in bench.workload(_bench_ns(trace))] == ["a", "b"]


def test_the_readers_token_floor_is_the_sim_workers() -> None:
    assert FIRST_TOKEN_ID == TOKEN_FLOOR


@pytest.mark.parametrize("scales", [(), ("--time-scale", "0.5", "--load-scale", "2", "--limit", "3")])
def test_bench_sends_what_simulate_admits_stepwise_format(tmp_path: Path, scales: tuple[str, ...]) -> None:
    trace = _write(tmp_path / "t.jsonl", STEPWISE_TRACE)
    sent = _sent(bench.workload(_bench_ns(trace, *scales)))
    assert sent == _admitted(trace, *scales)
    assert [n for _, _, n, _ in sent] == [6, 4, 5, 7][: len(sent)]
    factor = 0.25 if scales else 1.0
    assert [at for *_, at in sent] == [r["arrival"] * factor for r in STEPWISE_TRACE][: len(sent)]


def test_bench_sends_what_simulate_admits_mooncake(tmp_path: Path) -> None:
    flags = ("--trace-format", "mooncake", "--block-size", "16", "--limit", "5", "--load-scale", "4")
    lines = [json.loads(line) for line in EXCERPT.read_text().splitlines()[:5]]
    # The excerpt's prompts in blocks of 16 tokens: each hash id names 16 tokens, lengths kept exact.
    small = [
        {**x, "input_length": 16 * len(x["hash_ids"]) - 3, "output_length": 1 + i}
        for i, x in enumerate(lines)
    ]
    trace = _write(tmp_path / "mc.jsonl", small)
    sent = _sent(bench.workload(_bench_ns(trace, *flags)))
    assert sent == _admitted(trace, *flags)
    assert [(len(ids), n, at) for _, ids, n, at in sent] == [
        (x["input_length"], x["output_length"], x["timestamp"] / 1000 / 4) for x in small
    ]


@pytest.mark.parametrize(
    ("lines", "flags", "words"),
    [
        ([STEPWISE_TRACE[0], {"rid": "x", "arrival": 1, "max_new_tokens": 2}], (), "t.jsonl:2: 'prompt_len'"),
        ([STEPWISE_TRACE[0], '{"rid": "x",'], (), "t.jsonl:2: Expecting"),
        ([{"rid": "x", "prompt_len": 3}], (), "request 'x': max_new_tokens or output_len"),
        (
            [{"timestamp": 1, "input_length": 4, "output_length": 1, "hash_ids": [0, 1]}],
            ("--trace-format", "mooncake", "--block-size", "8"),
            "t.jsonl:1: hash_ids: 2 ids for input_length 4",
        ),
        (
            [{"timestamp": 1, "input_length": 4, "hash_ids": [0]}],
            ("--trace-format", "mooncake"),
            "t.jsonl:1: missing field 'output_length'",
        ),
    ],
)
def test_a_bad_trace_is_one_line_and_exit_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    lines: list[object],
    flags: tuple[str, ...],
    words: str,
) -> None:
    trace = _write(tmp_path / "t.jsonl", lines)
    # No server at that address: the trace is read before anything is sent.
    assert cli.main(["bench", "--address", "127.0.0.1:1", "--dataset", "trace", str(trace), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stepwise bench: ") and words in err, err
    assert len(err.splitlines()) == 1


def test_a_trace_dataset_without_its_file_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--address", "127.0.0.1:1", "--dataset", "trace"]) == 2
    assert "--dataset trace: wants the trace FILE" in capsys.readouterr().err


async def test_arrivals_are_paced_by_the_trace(tmp_path: Path) -> None:
    """Sent at their offsets from the start, whatever --max-concurrency says."""
    from tests.cli.fake_server import serve_fake

    trace = _write(tmp_path / "t.jsonl", [{**r, "arrival": 0.1 * i} for i, r in enumerate(STEPWISE_TRACE)])
    out = tmp_path / "run.json"
    async with serve_fake() as fake:
        ns = _bench_ns(trace, "--address", fake.address, "--max-concurrency", "1", "--output-file", str(out))
        await bench.run(ns, io.StringIO())
    records = json.loads(out.read_text())["requests"]
    starts = [r["start_s"] for r in records]
    assert [r["rid"] for r in records] == ["a", "b", "c", "d"]
    assert all(0.1 * i <= s < 0.1 * i + 0.08 for i, s in enumerate(starts)), starts


async def test_a_traces_routing_keys_are_sent(tmp_path: Path) -> None:
    """The fleet's router reads them: without them a live fleet routes the trace otherwise than
    `stepwise simulate --workers N` does."""
    from tests.cli.fake_server import serve_fake

    keys = ["k1", "", "k2", "k1"]
    trace = _write(
        tmp_path / "t.jsonl", [{**r, "routing_key": k} for r, k in zip(STEPWISE_TRACE, keys, strict=True)]
    )
    async with serve_fake() as fake:
        await bench.run(_bench_ns(trace, "--address", fake.address), io.StringIO())
    assert sorted((r.request_id, r.routing_key) for r in fake.requests) == list(
        zip("abcd", keys, strict=True)
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_trace_against_a_sim_stack_arrives_as_sent(stack_address: str, tmp_path: Path) -> None:
    requests = [
        {"rid": f"r{i}", "arrival": 0.02 * i, "prompt_len": 8 + 5 * i, "prefix_group": "p", "prefix_len": 6,
         "max_new_tokens": 3 + i % 5}
        for i in range(12)
    ]  # fmt: skip
    trace = _write(tmp_path / "t.jsonl", requests)
    out = tmp_path / "run.json"
    args = ["bench", "--address", stack_address, "--dataset", "trace", str(trace), "--vocab", str(VOCAB)]
    code, _, err = await run_cli_async([*args, "--json", "--output-file", str(out)])
    assert code == 0, err
    records = json.loads(out.read_text())["requests"]
    assert [r["rid"] for r in records] == [r["rid"] for r in requests]
    for record, request in zip(records, requests, strict=True):
        assert record["status"] == "OK"
        assert record["usage_prompt_tokens"] == record["prompt_tokens"] == request["prompt_len"]
        assert record["usage_completion_tokens"] == record["output_tokens"] == request["max_new_tokens"]
        assert record["start_s"] >= request["arrival"]
