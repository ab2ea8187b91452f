"""A damaged recording is never reported as identical (`stepwise replay`, as a real process).

A crash can tear only the tail of a recording: the last record of the last part cut short. That
is a warning, and the rest replays. Damage anywhere else (a record that does not decode, a length
prefix that is not one, a torn middle part) is an error that names the file and the true byte
offset, exit 1; and the summary always says how many records were checked out of how many.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from control_plane.record.files import DamagedRecording, read_entries, recording_parts, varint
from stepwise import simulate
from tests.record.conftest import write_trace

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]

TRACE = [
    {
        "rid": f"r{i}",
        "arrival": 0.004 * i,
        "prompt_len": 30 + 7 * i,
        "max_new_tokens": 24,
        "output_len": 12 + i,
    }
    for i in range(10)
]


def _replay(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stepwise.cli", "replay", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
    )


@pytest.fixture
def recording(tmp_path: Path) -> Callable[..., list[Path]]:
    def make(*extra: str) -> list[Path]:
        trace = write_trace(tmp_path / "trace.jsonl", TRACE)
        out = tmp_path / "rec"
        assert (
            simulate.main([str(trace), "--kv-tokens", "400", "--summary-only", "--record", str(out), *extra])
            == 0
        )
        return recording_parts(out)

    return make


def _offsets(path: Path) -> list[tuple[int, int, int]]:
    """(offset of the length prefix, offset of the data, size) of every record of a file."""
    data, pos, out = path.read_bytes(), 0, []
    while pos < len(data):
        size = shift = 0
        start = pos
        while True:
            byte = data[pos]
            pos += 1
            size |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        out.append((start, pos, size))
        pos += size
    return out


def _spoil(path: Path, index: int) -> int:
    """Overwrite record `index`'s bytes with 0xff (its length prefix kept); returns its offset."""
    start, body, size = _offsets(path)[index]
    data = bytearray(path.read_bytes())
    data[body : body + size] = b"\xff" * size
    path.write_bytes(bytes(data))
    return start


def test_a_record_damaged_mid_file_is_an_error_with_its_offset(recording: Callable[..., list[Path]]) -> None:
    (part,) = recording()
    records = _offsets(part)
    middle = len(records) // 2
    offset = _spoil(part, middle)
    for what in ("scheduler", "show"):
        done = _replay(what, str(part))
        assert done.returncode == 1, (what, done.stdout[-500:], done.stderr[-500:])
        assert f"byte {offset}" in done.stderr
        assert "identical" not in done.stdout
        assert f"record {middle} " in done.stderr


def test_a_length_prefix_that_is_not_one_is_damage(recording: Callable[..., list[Path]]) -> None:
    (part,) = recording()
    start, _, _ = _offsets(part)[3]
    data = bytearray(part.read_bytes())
    data[start : start + 11] = b"\xff" * 11  # 11 continuation bytes: no varint is that long
    part.write_bytes(bytes(data))
    done = _replay("scheduler", str(part))
    assert done.returncode == 1
    assert f"byte {start}" in done.stderr


@pytest.mark.parametrize("keep", ["all but one byte", "half the last record"])
def test_only_a_torn_tail_is_a_warning_and_the_summary_counts_records(
    recording: Callable[..., list[Path]], keep: str
) -> None:
    (part,) = recording()
    records = _offsets(part)
    _, body, size = records[-1]
    end = body + size - 1 if keep == "all but one byte" else body + size // 2
    part.write_bytes(part.read_bytes()[:end])
    done = _replay("scheduler", str(part))
    assert done.returncode == 0, done.stderr[-500:]
    assert "torn tail" in done.stderr
    complete = len(records) - 1
    assert f"{complete} of {complete} complete records" in done.stdout


def test_an_intact_recording_says_every_record_was_checked(recording: Callable[..., list[Path]]) -> None:
    (part,) = recording()
    total = len(_offsets(part))
    done = _replay("scheduler", str(part))
    assert done.returncode == 0
    assert done.stdout.startswith("identical")
    assert f"{total} of {total} complete records" in done.stdout


def test_a_torn_part_before_the_last_is_damage(recording: Callable[..., list[Path]]) -> None:
    parts = recording("--record-max-bytes", "4000")
    assert len(parts) >= 3
    first = parts[0]
    first.write_bytes(first.read_bytes()[:-3])
    done = _replay("scheduler", str(first))
    assert done.returncode == 1
    assert first.name in done.stderr


def test_reading_a_damaged_recording_raises(recording: Callable[..., list[Path]]) -> None:
    (part,) = recording()
    offset = _spoil(part, 2)
    with pytest.raises(DamagedRecording, match=f"byte {offset}"):
        list(read_entries(part))


def test_varint_round_trip_used_by_the_helper() -> None:
    assert varint(300) == b"\xac\x02"
