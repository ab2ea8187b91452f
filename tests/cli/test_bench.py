"""`stepwise bench` counts refused calls by status code and keeps going."""

from __future__ import annotations

import argparse
import io
import json

import pytest

from clients import bench
from tests.cli.fake_server import serve_fake
from tests.cli.runner import run_cli_async

pytestmark = pytest.mark.timeout(60)


def _ns(address: str, requests: int, as_json: bool = True) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = ["--address", address, "--requests", str(requests), "--concurrency", "2", "--wait", "5"]
    args += ["--prompt-len", "4,8", "--output-len", "2,4"]
    return parser.parse_args([*args, "--json"] if as_json else args)


async def test_refused_calls_are_counted_and_the_run_goes_on() -> None:
    out = io.StringIO()
    async with serve_fake(refuse_every=3) as fake:
        report = await bench.run(_ns(fake.address, 9), out)
    assert (report["requests"], report["completed"]) == (9, 6)
    assert report["refused"] == {"RESOURCE_EXHAUSTED": 3}
    assert json.loads(out.getvalue()) == report
    assert report["output_throughput_tok_s"] > 0


async def test_text_report_has_a_refused_line() -> None:
    out = io.StringIO()
    async with serve_fake(refuse_every=2) as fake:
        await bench.run(_ns(fake.address, 4, as_json=False), out)
    lines = dict(line.split(None, 1) for line in out.getvalue().splitlines())
    assert lines["refused"] == "RESOURCE_EXHAUSTED 2"
    assert lines["completed"] == "2"


def test_statistics_cover_completed_requests_only() -> None:
    done = bench.Sample(prompt_tokens=10, output_tokens=3, ttft=0.1, latency=0.3, itls=[0.1, 0.1], ok=True)
    refused = bench.Sample(prompt_tokens=50, latency=0.001, refused="UNAVAILABLE")
    report = bench.summarize([done, refused, refused], elapsed=1.0)
    assert report["refused"] == {"UNAVAILABLE": 2}
    assert (report["completed"], report["ttft_mean_ms"], report["latency_p50_s"]) == (1, 100.0, 0.3)
    assert report["total_throughput_tok_s"] == 13.0  # the refused prompts' tokens are not counted
    assert bench.render(bench.summarize([done], 1.0)).splitlines()[2].split() == ["refused", "none"]


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
