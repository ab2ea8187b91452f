"""The recorder's sink when writes fail (a full disk): it stops, once, and raises nothing."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from control_plane.config import ControlConfig, SchedulerConfig
from control_plane.record.entries import Header, OnIdle
from control_plane.record.files import RecordingError, RecordWriter, check_writable
from control_plane.record.recorder import FileSink, RecordingScheduler, make_scheduler
from protos.worker import WorkerLimits

LIMITS = WorkerLimits("w", 64, 1, 128, 100, frozenset({2}))


class FullDisk:
    """A file whose writes fail with ENOSPC after `room` bytes."""

    def __init__(self, room: int) -> None:
        self.room = room

    def write(self, data: bytes) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return len(data)

    def flush(self) -> None: ...

    def tell(self) -> int:
        return 0

    def close(self) -> None: ...


def test_a_failing_write_stops_the_recording_once(tmp_path: Path) -> None:
    writer = RecordWriter(tmp_path / "s", Header(SchedulerConfig(), LIMITS), 1 << 20)
    writer._file = FullDisk(room=64)  # type: ignore[assignment]
    sink = FileSink(writer)
    with capture_logs() as logs:
        for step in range(20):
            sink.write(OnIdle(step))
            sink.end_step(step)
        sink.close()
    assert sink.stopped
    assert [e["event"] for e in logs] == ["recording stopped: a write failed; serving goes on"]
    assert "No space left" in logs[0]["error"]


def test_a_session_that_cannot_be_opened_records_nothing_and_serves(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    config = ControlConfig(tmp_path, record_dir=blocker / "rec")
    with capture_logs() as logs:
        scheduler = make_scheduler(config, LIMITS)
    assert not isinstance(scheduler, RecordingScheduler)
    assert logs[0]["event"] == "recording not started: serving goes on"


def test_check_writable(tmp_path: Path) -> None:
    check_writable(tmp_path / "new" / "dir")
    assert (tmp_path / "new" / "dir").is_dir() and not list((tmp_path / "new" / "dir").iterdir())
    (tmp_path / "f").write_text("x")
    with pytest.raises(RecordingError, match="cannot write recordings there"):
        check_writable(tmp_path / "f" / "rec")


def test_simulate_into_an_unwritable_directory_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from stepwise import simulate

    trace = tmp_path / "t.jsonl"
    trace.write_text('{"rid": "a", "arrival": 0, "prompt_len": 10, "max_new_tokens": 5}\n')
    (tmp_path / "f").write_text("x")
    assert simulate.main([str(trace), "--record", str(tmp_path / "f" / "rec")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and err[0].startswith("stepwise simulate: --record") and "cannot write there" in err[0]
    )
