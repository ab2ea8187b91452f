"""Fixtures for recording tests: the end-to-end process fixtures, and recordings made by `simulate`."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from control_plane.record.entries import Entry
from tests.e2e.conftest import model_dir, start_stack

__all__ = ["model_dir", "start_stack"]

Simulate = Callable[..., tuple[list[dict], dict]]


def write_trace(path: Path, requests: Sequence[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    return path


@pytest.fixture
def simulate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Simulate:
    """`lines, summary = simulate(requests, *flags)`: run `stepwise simulate --json` in process."""
    from stepwise import simulate as sim

    def run(requests: Sequence[dict], *flags: str) -> tuple[list[dict], dict]:
        trace = write_trace(tmp_path / "trace.jsonl", requests)
        capsys.readouterr()
        assert sim.main([str(trace), "--json", *flags]) == 0
        out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        return out[:-1], out[-1]["summary"]

    return run


class ListSink:
    """A recorder sink that keeps the entries in memory."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []

    def write(self, entry: Entry) -> None:
        self.entries.append(entry)

    def end_step(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass
