"""Routine failures print one line naming the problem and exit 2; bugs keep their traceback.

Each case runs the real command in a subprocess, as a person would.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from stepwise import cli
from tests.certs import make_ca, make_cert
from tests.cli.fake_server import CANNED_TEXT, serve_fake
from tests.cli.runner import assert_one_line, run_cli, run_cli_async


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["control", "--port", "abc"], ["stepwise control:", "--port", "abc"]),
        (["worker", "--kv-tokens", "-5"], ["stepwise worker:", "--kv-tokens", "-5"]),
        (["generate", "hi", "--max-new-tokens", "x"], ["stepwise generate:", "--max-new-tokens"]),
        (["bench", "--requests", "many"], ["stepwise bench:", "--requests"]),
        (["control", "--schedule-policy", "nope"], ["stepwise control:", "--schedule-policy"]),
        (["generate"], ["stepwise generate:", "prompt"]),
        (["up", "--port", "abc"], ["stepwise control:", "--port"]),
        (["up", "--kv-tokens", "x"], ["stepwise worker:", "--kv-tokens"]),
        (["generate", "hi", "--tls-ca", "/nonexistent/ca.pem"], ["--tls-ca", "/nonexistent/ca.pem"]),
        (["replay", "bogus"], ["stepwise replay:", "bogus"]),
        (["simulate"], ["stepwise simulate:", "trace"]),
        (["simulate", "t.jsonl", "--kv-tokens", "x"], ["stepwise simulate:", "--kv-tokens"]),
        (["up", "--nope"], ["stepwise up:", "--nope"]),
        (["gateway", "--max-body-bytes", "0"], ["stepwise gateway:", "--max-body-bytes"]),
        (["gateway", "--header-timeout", "0"], ["stepwise gateway:", "--header-timeout"]),
        (["gateway", "--max-connections", "0"], ["stepwise gateway:", "--max-connections", "1.."]),
        (["gateway", "--max-connections", "999999999"], ["stepwise gateway:", "--max-connections", "ulimit"]),
    ],
)
def test_bad_flag_value(args: list[str], names: list[str]) -> None:
    result = run_cli(args)
    assert_one_line(result.returncode, result.stderr, *names)


FREE = ["--port", "0", "--worker-port", "0"]


@pytest.mark.parametrize(
    ("args", "names"),
    [
        # Each of these was a traceback (or, the last, a frontend that crashed again and again).
        (["control", "--port", "-1", "--worker-port", "0"], ["stepwise control:", "--port", "-1"]),
        (["control", "--port", "65536", "--worker-port", "0"], ["stepwise control:", "--port", "65536"]),
        (["control", "--port", "0", "--worker-port", "99999"], ["stepwise control:", "--worker-port"]),
        (["control", "--metrics-port", "70000", *FREE], ["stepwise control:", "--metrics-port", "70000"]),
        (["control", "--log-level", "LOUD", *FREE], ["stepwise control:", "--log-level", "LOUD"]),
        (["worker", "--backend", "sim", "--log-level", "LOUD"], ["stepwise worker:", "--log-level"]),
        (["worker", "--backend", "sim", "--health-port", "65536"], ["stepwise worker:", "--health-port"]),
        (["gateway", "--port", "-1"], ["stepwise gateway:", "--port", "-1"]),
        (["gateway", "--port", "65536"], ["stepwise gateway:", "--port", "65536"]),
        (["gateway", "--port", "0", "--log-level", "LOUD"], ["stepwise gateway:", "--log-level"]),
        (["control", "--max-concurrent-streams", "4294967296", *FREE], ["--max-concurrent-streams"]),
        (["up", "--port", "-1"], ["stepwise control:", "--port", "-1"]),
        (["up", "--control-planes", "1000"], ["stepwise up:", "--control-planes", "1000"]),
        (["up", "--gateway-port", "65536"], ["stepwise up:", "--gateway-port"]),
        # up sets these itself: a value given to it would have been replaced without a word.
        (["up", "--control", "10.0.0.1:50052"], ["stepwise up:", "--control", "set by up"]),
        (["up", "--worker-id", "w"], ["stepwise up:", "--worker-id", "set by up"]),
    ],
)
def test_out_of_range_value_is_one_line(args: list[str], names: list[str]) -> None:
    result = run_cli(args)
    assert_one_line(result.returncode, result.stderr, *names)


@pytest.mark.parametrize(
    ("args", "env", "names"),
    [
        (
            ["control", *FREE],
            {"STEPWISE_METRICS_PORT": "70000"},
            ["STEPWISE_METRICS_PORT=70000", "--metrics"],
        ),
        (
            ["worker"],
            {"STEPWISE_CONNECT_TIMEOUT": "nan"},
            ["STEPWISE_CONNECT_TIMEOUT=nan", "--connect-timeout"],
        ),
        (["up"], {"STEPWISE_FRONTENDS": "65"}, ["stepwise control:", "STEPWISE_FRONTENDS=65", "--frontends"]),
    ],
)
def test_out_of_range_environment_value_is_one_line(
    args: list[str], env: dict[str, str], names: list[str]
) -> None:
    result = run_cli(args, env)
    assert_one_line(result.returncode, result.stderr, *names)


@pytest.mark.parametrize(
    ("args", "env", "names"),
    [
        (["control"], {"STEPWISE_PORT": "abc"}, ["stepwise control:", "STEPWISE_PORT=abc", "an integer"]),
        (["control"], {"STEPWISE_MAX_QUEUED_REQUESTS": "x"}, ["STEPWISE_MAX_QUEUED_REQUESTS=x"]),
        (["control"], {"STEPWISE_SCHEDULE_POLICY": "nope"}, ["STEPWISE_SCHEDULE_POLICY=nope", "choice"]),
        (["control"], {"STEPWISE_ENABLE_MIXED_CHUNK": "maybe"}, ["STEPWISE_ENABLE_MIXED_CHUNK=maybe"]),
        (["generate", "hi"], {"STEPWISE_MAX_NEW_TOKENS": "x"}, ["stepwise generate:", "STEPWISE_MAX_NEW"]),
        (
            ["control", "--port", "0", "--worker-port", "0"],
            {"STEPWISE_INIT_NEW_TOKEN_RATIO": "x"},
            ["stepwise control:", "STEPWISE_INIT_NEW_TOKEN_RATIO=x"],
        ),
    ],
)
def test_bad_environment_value_names_the_variable(
    args: list[str], env: dict[str, str], names: list[str]
) -> None:
    result = run_cli(args, env)
    assert_one_line(result.returncode, result.stderr, *names)


@pytest.mark.parametrize("command", ["generate hi", "bench --requests 1"])
def test_no_server_at_the_address(command: str) -> None:
    result = run_cli([*command.split(), "--address", "127.0.0.1:1", "--wait", "1"])
    line = assert_one_line(result.returncode, result.stderr, "127.0.0.1:1", "no control plane serving")
    assert line.startswith(f"stepwise {command.split()[0]}: "), line
    assert result.stdout == ""


@pytest.mark.parametrize("command", ["control", "worker --backend sim"])
def test_model_that_is_not_a_directory(command: str, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    result = run_cli([*command.split(), "--model", str(missing)])
    assert_one_line(result.returncode, result.stderr, "--model", str(missing))


def _control_on_a_taken_port() -> tuple[subprocess.CompletedProcess[str], int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        return run_cli(["control", "--host", "127.0.0.1", "--port", str(port), "--worker-port", "0"]), port


def test_control_port_already_taken() -> None:
    result, port = _control_on_a_taken_port()
    assert "Traceback" not in result.stderr and result.returncode == 2, result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith("stepwise control: ") and f"127.0.0.1:{port}" in last, result.stderr


def test_control_port_already_taken_is_one_line() -> None:
    result, port = _control_on_a_taken_port()
    assert_one_line(result.returncode, result.stderr, "stepwise control:", f"127.0.0.1:{port}")


def test_unknown_or_missing_command() -> None:
    result = run_cli(["nope"])
    assert_one_line(result.returncode, result.stderr, "unknown command 'nope'", "generate")
    result = run_cli([])
    assert_one_line(result.returncode, result.stderr, "usage: stepwise")


async def test_refused_call_is_one_line() -> None:
    async with serve_fake(api_key="right") as fake:
        code, out, err = await run_cli_async(
            ["generate", "hi", "--address", fake.address, "--api-key", "wrong"]
        )
        assert_one_line(code, err, "stepwise generate:", "refused the call (UNAUTHENTICATED")
        assert out == ""
        code, out, err = await run_cli_async(
            ["generate", "hi", "--address", fake.address, "--api-key", "right"]
        )
    assert code == 0, err
    assert out.startswith("hi" + CANNED_TEXT), out


async def test_tls_flags_reach_the_client(tmp_path: Path) -> None:
    ca = make_ca(tmp_path / "ca")
    other = make_ca(tmp_path / "other", "other-ca")
    server = make_cert(ca, tmp_path / "server", "control")
    async with serve_fake(tls=server, api_key="k") as fake:
        base = ["generate", "hi", "--address", fake.address, "--api-key", "k", "--wait", "3"]
        code, out, err = await run_cli_async([*base, "--tls-ca", str(other.cert)])
        assert_one_line(code, err, "stepwise generate:", fake.address, "CERTIFICATE_VERIFY_FAILED")
        code, out, err = await run_cli_async([*base, "--tls-ca", str(ca.cert)])
    assert code == 0, err
    assert out.startswith("hi" + CANNED_TEXT), out
    assert fake.metadata["Generate"][-1]["authorization"] == "Bearer k"


def test_help_describes_every_command() -> None:
    result = run_cli(["--help"])
    assert result.returncode == 0, result.stderr
    for name in cli.COMMANDS:
        assert f"  {name} " in result.stdout, result.stdout
    for name in ("generate", "bench", "up", "demo"):
        result = run_cli([name, "--help"])
        assert result.returncode == 0 and f"usage: stepwise {name}" in result.stdout, result.stderr


def test_a_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(argv: Sequence[str]) -> int:
        raise KeyError("a bug, not a routine failure")

    monkeypatch.setitem(cli.COMMANDS, "generate", replace(cli.COMMANDS["generate"], run=broken))
    with pytest.raises(KeyError, match="a bug"):
        cli.main(["generate", "hi"])


def test_routine_error_maps_to_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def routine(argv: Sequence[str]) -> int:
        raise cli.RoutineError("--model: model directory /x\ndoes not exist")

    monkeypatch.setitem(cli.COMMANDS, "generate", replace(cli.COMMANDS["generate"], run=routine))
    assert cli.main(["generate"]) == 2
    assert capsys.readouterr().err == "stepwise generate: --model: model directory /x does not exist\n"
