"""`stepwise bench`: the workloads its flags describe, the report (every metric, refusals counted
and never fatal), --output-file, --plot, the progress bar, and one run against a real stack."""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import get_type_hints

import pytest

from clients import bench, bench_report
from stepwise import cli
from tests.cli.fake_server import CANNED_TOKENS, serve_fake
from tests.cli.runner import ROOT, run_cli_async
from tests.processes import ready_file_sync

pytestmark = pytest.mark.timeout(60)

METRICS = [f"{m}_{s}_ms" for m in ("ttft", "tpot", "itl", "e2e_latency") for s in ("mean", "median", "p99")]
THROUGHPUTS = [
    "request_throughput",
    "input_throughput_tok_s",
    "output_throughput_tok_s",
    "total_throughput_tok_s",
]


def _ns(address: str, *extra: str, as_json: bool = True) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = ["--address", address, "--requests", "4", "--concurrency", "2", "--wait", "5"]
    args += ["--prompt-len", "4,8", "--output-len", "2,4", *extra]
    return parser.parse_args([*args, "--json"] if as_json else args)


async def test_refused_calls_are_counted_and_the_run_goes_on() -> None:
    out = io.StringIO()
    async with serve_fake(refuse_every=3) as fake:
        report = await bench.run(_ns(fake.address, "--requests", "9"), out)
    assert (report["requests"], report["completed"]) == (9, 6)
    assert report["refused"] == {"RESOURCE_EXHAUSTED": 3}
    assert json.loads(out.getvalue()) == report
    assert report["output_throughput_tok_s"] > 0


async def test_text_report_has_a_line_per_metric() -> None:
    out = io.StringIO()
    async with serve_fake(refuse_every=2) as fake:
        await bench.run(_ns(fake.address, as_json=False), out)
    lines = dict(line.split(None, 1) for line in out.getvalue().splitlines())
    assert list(lines) == list(get_type_hints(bench.Report))
    assert lines["refused"] == "RESOURCE_EXHAUSTED 2"
    assert lines["completed"] == "2"
    assert lines["prefix_hit_rate"] == "n/a"  # the fake reports no workers, so no counters


def test_statistics_cover_completed_requests_only() -> None:
    done = bench.Sample(prompt_tokens=10, output_tokens=3, ttft=0.1, latency=0.3, itls=[0.1, 0.1], ok=True)
    refused = bench.Sample(prompt_tokens=50, latency=0.001, refused="UNAVAILABLE")
    report = bench.summarize([done, refused, refused], elapsed=1.0)
    assert report["refused"] == {"UNAVAILABLE": 2}
    assert (report["completed"], report["ttft_mean_ms"], report["e2e_latency_median_ms"]) == (1, 100.0, 300.0)
    assert report["total_throughput_tok_s"] == 13.0  # the refused prompts' tokens are not counted
    assert report["tpot_mean_ms"] == 100.0  # (300 - 100) ms over the 2 tokens after the first
    assert bench.render(bench.summarize([done], 1.0)).splitlines()[2].split() == ["refused", "none"]


def test_percentiles_interpolate_between_ranks() -> None:
    values = [float(v) for v in range(1, 101)]
    assert bench_report.percentile(values, 50) == 50.5
    assert bench_report.percentile(values, 99) == pytest.approx(99.01)
    assert bench_report.percentile([], 99) == 0.0
    stats = bench.summarize([bench.Sample(ttft=t / 1000, latency=1.0, ok=True) for t in (1, 2, 9)], 1.0)
    assert (stats["ttft_mean_ms"], stats["ttft_median_ms"], stats["ttft_p99_ms"]) == (4.0, 2.0, 8.86)


def test_server_hit_rate_is_the_counters_delta() -> None:
    assert bench.server_hit_rate((100, 10), (300, 110)) == 0.5
    assert bench.server_hit_rate(None, (300, 110)) is None
    assert bench.server_hit_rate((0, 0), (0, 0)) is None  # a server that does not count


@pytest.mark.parametrize(("refuse_every", "exit_code"), [(0, 0), (2, 1)])
async def test_exit_code_is_zero_only_when_every_request_completed(refuse_every: int, exit_code: int) -> None:
    async with serve_fake(refuse_every=refuse_every) as fake:
        args = ["bench", "--address", fake.address, "--requests", "4", "--output-len", "2,2", "--json"]
        code, out, err = await run_cli_async(args)
    assert code == exit_code, err
    report = json.loads(out)
    assert report["completed"] == 4 - (2 if refuse_every else 0)
    assert report["refused"] == ({"RESOURCE_EXHAUSTED": 2} if refuse_every else {})
    assert report["output_throughput_tok_s"] > 0


def test_sglang_flag_names_and_the_old_ones_set_the_same_values() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    new = parser.parse_args(["--num-prompts", "5", "--max-concurrency", "3", "--request-rate", "inf"])
    old = parser.parse_args(["--requests", "5", "--concurrency", "3", "--rate", "inf"])
    assert new == old and (new.requests, new.concurrency, new.rate) == (5, 3, float("inf"))
    assert parser.parse_args([]).dataset == "uniform"


def test_each_dataset_flag_set_shapes_the_workload() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    random_args = ["--dataset", "random", "--num-prompts", "6", "--random-input-len", "20"]
    random_args += ["--random-output-len", "5", "--random-range-ratio", "0.5"]
    requests = bench.workload(parser.parse_args(random_args))
    assert len(requests) == 6 and all(
        10 <= len(r.prompt_ids) <= 20 and 2 <= r.max_new_tokens <= 5 for r in requests
    )
    gsp_args = [
        "--dataset",
        "generated-shared-prefix",
        "--gsp-num-groups",
        "2",
        "--gsp-prompts-per-group",
        "3",
    ]
    gsp_args += ["--gsp-system-prompt-len", "10", "--gsp-question-len", "4", "--gsp-output-len", "6"]
    requests = bench.workload(parser.parse_args(gsp_args))
    assert [r.group for r in requests] == [0, 1, 0, 1, 0, 1]
    assert {(len(r.prompt_ids), r.max_new_tokens) for r in requests} == {(14, 6)}
    uniform_args = ["--num-prompts", "4", "--prompt-len", "3,3", "--shared-prefix", "5", "--groups", "2"]
    requests = bench.workload(parser.parse_args(uniform_args))
    assert {len(r.prompt_ids) for r in requests} == {8}
    assert requests[0].prompt_ids[:5] == requests[2].prompt_ids[:5] != requests[1].prompt_ids[:5]


async def test_output_file_has_every_metric_records_and_parameters(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    async with serve_fake(refuse_every=3) as fake:
        args = ["--requests", "6", "--output-file", str(path), "--api-key", "secret"]
        report = await bench.run(_ns(fake.address, *args), io.StringIO())
    document = json.loads(path.read_text())
    assert document["report"] == report
    for key in [
        *METRICS,
        *THROUGHPUTS,
        "duration_s",
        "concurrency_max",
        "prefix_hit_rate",
        "client_hit_rate",
    ]:
        assert key in report, key
    assert report["concurrency_max"] == 2 and report["completed"] == 4
    assert report["total_output_tokens"] == 4 * len(CANNED_TOKENS)
    records = document["requests"]
    assert [r["status"] for r in records].count("RESOURCE_EXHAUSTED") == 2
    ok = [r for r in records if r["status"] == "OK"]
    assert len(ok) == 4 and all(r["output_tokens"] == 3 and r["ttft_s"] > 0 for r in ok)
    assert all(r["latency_s"] >= r["ttft_s"] and 4 <= r["prompt_tokens"] <= 8 for r in ok)
    assert {"itls_s", "start_s", "chunk_tokens", "max_new_tokens"} <= set(ok[0])
    params = document["parameters"]
    assert (params["requests"], params["dataset"], params["rate"]) == (6, "uniform", "inf")
    assert "api_key" not in params and "secret" not in path.read_text()


async def test_poisson_arrivals_spread_the_starts(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    async with serve_fake() as fake:
        await bench.run(_ns(fake.address, "--request-rate", "100", "--output-file", str(path)), io.StringIO())
    starts = [r["start_s"] for r in json.loads(path.read_text())["requests"]]
    assert starts == sorted(starts) and starts[-1] > 0.001


async def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the `plot` extra is not installed")
    path = tmp_path / "run.png"
    async with serve_fake(refuse_every=4) as fake:
        await bench.run(_ns(fake.address, "--requests", "8", "--plot", str(path)), io.StringIO())
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_throughput_buckets_count_tokens_by_arrival_second() -> None:
    from clients import bench_plot

    early = bench.Sample(start=0.2, ttft=0.3, itls=[1.0], chunk_tokens=[2, 3], ok=True)  # at 0.5, 1.5
    late = bench.Sample(start=2.0, ttft=0.1, chunk_tokens=[4], ok=True)  # at 2.1
    refused = bench.Sample(start=0.0, ttft=0.1, chunk_tokens=[9], refused="UNAVAILABLE")
    assert bench_plot.throughput_buckets([early, late, refused]) == [2.0, 3.0, 4.0]


def test_plot_without_matplotlib_is_one_routine_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(cli.RoutineError, match=r"--plot needs matplotlib.*stepwise\[plot\]"):
        cli.cmd_bench(["--address", "127.0.0.1:1", "--wait", "0", "--plot", str(tmp_path / "x.png")])
    assert not (tmp_path / "x.png").exists()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("quiet", [False, True])
async def test_progress_bar_only_on_a_terminal_and_not_when_quiet(quiet: bool) -> None:
    out = _Terminal()
    async with serve_fake() as fake:
        await bench.run(_ns(fake.address, *(["--quiet"] if quiet else []), as_json=False), out)
    assert ("\x1b[" in out.getvalue()) is not quiet  # rich draws with escape codes
    assert out.getvalue().splitlines()[-1].split()[0] == "e2e_latency_p99_ms"


# --- one run against a real stack -----------------------------------------------------------------


@pytest.fixture
def stack_address(tmp_path: Path) -> Iterator[str]:
    """`stepwise up` with one sim worker on ephemeral ports; stopped (its children with it) after."""
    ready = tmp_path / "ready.json"
    args = ["up", "--host", "127.0.0.1", "--port", "0", "--worker-port", "0", "--log-level", "warning"]
    args += ["--backend", "sim", "--sim-cost", "0.001,0,0", "--ready-file", str(ready)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWISE_")}
    proc = subprocess.Popen([sys.executable, "-m", "stepwise.cli", *args], cwd=ROOT, env=env)
    try:
        yield ready_file_sync(ready, proc, 60, "stepwise up")["address"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_bench_against_stepwise_up_reports_the_servers_hit_rate(
    stack_address: str, tmp_path: Path
) -> None:
    path = tmp_path / "run.json"
    args = [
        "bench",
        "--address",
        stack_address,
        "--dataset",
        "generated-shared-prefix",
        "--gsp-num-groups",
        "2",
    ]
    args += ["--gsp-prompts-per-group", "6", "--gsp-system-prompt-len", "64", "--gsp-question-len", "8"]
    args += ["--gsp-output-len", "6", "--max-concurrency", "4", "--json", "--output-file", str(path)]
    code, out, err = await run_cli_async(args)
    assert code == 0, err
    report = json.loads(out)
    assert report["completed"] == 12 and report["total_output_tokens"] == 12 * 6
    assert report["prefix_hit_rate"] > 0.3  # 64 shared tokens per group of 6 prompts
    assert report["prefix_hit_rate"] == pytest.approx(report["client_hit_rate"], abs=0.05)
    assert report["concurrency_max"] == 4 and report["ttft_median_ms"] > 0
    assert len(json.loads(path.read_text())["requests"]) == 12
