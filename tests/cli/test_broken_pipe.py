"""A closed stdout ends a command quietly: `stepwise replay show --json REC | head -1` exits 141 (what
a shell reports for a process that SIGPIPE ended, as `cat` gives) and prints nothing on stderr.

Each command that prints a lot runs for real with a stdout whose reader is already gone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stepwise.cli import EXIT_READER_LEFT
from tests.cli.fake_server import serve_fake
from tests.cli.runner import run_cli, run_cli_into_closed_pipe, run_cli_into_closed_pipe_async

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    lines = [{"rid": f"r{i}", "prompt_len": 8, "max_new_tokens": 16, "arrival": i * 0.01} for i in range(8)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def recording(trace: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("rec")
    made = run_cli(["simulate", str(trace), "--record", str(directory), "--summary-only"])
    assert made.returncode == 0, made.stderr
    return directory


def assert_quiet_end(code: int, stderr: str) -> None:
    assert (code, stderr) == (EXIT_READER_LEFT, ""), (code, stderr)
    assert EXIT_READER_LEFT == 141


@pytest.mark.parametrize("extra", [["--json"], []])
def test_replay_show(recording: Path, extra: list[str]) -> None:
    result = run_cli_into_closed_pipe(["replay", "show", str(recording), *extra])
    assert_quiet_end(result.returncode, result.stderr)


@pytest.mark.parametrize("extra", [["--json"], []])
def test_simulate(trace: Path, extra: list[str]) -> None:
    result = run_cli_into_closed_pipe(["simulate", str(trace), *extra])
    assert_quiet_end(result.returncode, result.stderr)


def test_help() -> None:
    result = run_cli_into_closed_pipe(["control", "--help"])
    assert_quiet_end(result.returncode, result.stderr)


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "hi"],
        ["bench", "--json", "--requests", "2", "--prompt-len", "2,2", "--output-len", "2,2"],
    ],
)
async def test_client_commands(command: list[str]) -> None:
    async with serve_fake() as fake:
        code, err = await run_cli_into_closed_pipe_async([*command, "--address", fake.address])
    assert_quiet_end(code, err)
