"""Recording files: length-delimited records, parts rotated by size, a reader that survives a crash.

A session `DIR/<worker>-<n>` is written as parts `<worker>-<n>.0000.rec`, `.0001.rec`, ...; each
part begins with a header (a continuation repeats the session's header with its part number and
first step). Every record is preceded by its length as a base-128 varint, protobuf's delimited
format. A crash can leave the last record of the last part cut short: the reader stops there with a
TruncatedRecording warning and yields everything before it. Damage anywhere else is an error
(DamagedRecording, with the byte offset): a damaged middle never passes for a shorter recording.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from control_plane.record import codec
from control_plane.record.entries import Entry, Header

SUFFIX = ".rec"
_PART = re.compile(r"^(?P<session>.+)\.(?P<part>\d{4})\.rec$")
_BUFFER_BYTES = 1 << 20


class TruncatedRecording(UserWarning):
    """The recording ends inside a record (the writer crashed); what came before is still read."""


class RecordingError(Exception):
    """The path does not name a readable recording."""


class DamagedRecording(RecordingError):
    """The recording is damaged before its tail (a record that does not decode, a length prefix
    that is not one, a torn part that is not the last): it cannot be trusted past the damage."""


# --- varints ------------------------------------------------------------------------------------------


def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(f: BinaryIO) -> int | None:
    """The next varint; None at a clean end of file; EOFError inside one."""
    shift = result = 0
    while True:
        byte = f.read(1)
        if not byte:
            if shift:
                raise EOFError("file ends inside a length prefix")
            return None
        result |= (byte[0] & 0x7F) << shift
        if byte[0] < 0x80:
            return result
        shift += 7
        if shift > 63:
            raise ValueError("length prefix longer than 10 bytes")


# --- writing ------------------------------------------------------------------------------------------


def check_writable(directory: Path) -> None:
    """RecordingError unless recordings can be written under `directory` (created if missing): a
    file is created and removed there, so a read-only or full file system is found at start."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".stepwise-probe-{os.getpid()}"
        probe.write_bytes(b"\0" * 4096)
        probe.unlink()
    except OSError as exc:
        raise RecordingError(f"cannot write recordings there: {exc.strerror or exc}") from None


def session_path(directory: Path, worker_id: str) -> Path:
    """A fresh session name under `directory`: `<worker>-<n>` with the first unused n."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", worker_id) or "worker"
    n = 1
    while part_path(directory / f"{safe}-{n}", 0).exists():
        n += 1
    return directory / f"{safe}-{n}"


def part_path(session: Path, part: int) -> Path:
    return session.with_name(f"{session.name}.{part:04d}{SUFFIX}")


class RecordWriter:
    """Appends records to a session's current part; `end_step` flushes and rotates by size."""

    def __init__(self, session: Path, header: Header, max_bytes: int) -> None:
        session.parent.mkdir(parents=True, exist_ok=True)
        self.session = session
        self.header = header
        self.max_bytes = max_bytes
        self.part = -1
        self._file: BinaryIO | None = None
        self._open_part(0, header.first_step)

    @property
    def path(self) -> Path:
        return part_path(self.session, self.part)

    def _open_part(self, part: int, first_step: int) -> None:
        if self._file is not None:
            self._file.close()
        self.part = part
        self._file = open(self.path, "xb", buffering=_BUFFER_BYTES)  # noqa: SIM115 (closed in close())
        self.append(codec.encode(dataclasses.replace(self.header, part=part, first_step=first_step)))

    def append(self, record: bytes) -> None:
        assert self._file is not None, "the writer is closed"
        self._file.write(varint(len(record)))
        self._file.write(record)

    def end_step(self, step: int) -> None:
        """Flush (once per step: a crash loses at most the step in progress); rotate if too big."""
        if self._file is None:
            return
        self._file.flush()
        if self._file.tell() >= self.max_bytes:
            self._open_part(self.part + 1, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# --- reading ------------------------------------------------------------------------------------------


def recording_parts(path: Path) -> list[Path]:
    """The files to read, in order, for a part file, a session name, or a directory with one session."""
    if path.is_dir():
        return _only_session(path)
    match = _PART.match(path.name)
    if path.is_file() and match is None:
        return [path]
    session = path.with_name(match["session"]) if match else path
    first = int(match["part"]) if match else 0
    parts: list[Path] = []
    while part_path(session, first + len(parts)).is_file():
        parts.append(part_path(session, first + len(parts)))
    if not parts:
        raise RecordingError(f"no recording at {path}")
    return parts


def _only_session(directory: Path) -> list[Path]:
    sessions = sorted({m["session"] for p in directory.iterdir() if (m := _PART.match(p.name))})
    if len(sessions) != 1:
        found = ", ".join(sessions) or "none"
        raise RecordingError(f"{directory} holds {len(sessions)} recordings ({found}); name one")
    return recording_parts(directory / sessions[0])


@dataclass(frozen=True, slots=True)
class _Span:
    """One complete record of a part: where its length prefix starts, and its size."""

    offset: int
    size: int


def _spans(path: Path, last: bool) -> tuple[list[_Span], str]:
    """Every complete record of a part, found from the length prefixes alone (no record is decoded),
    and a description of the torn tail ("" when the part ends on a record boundary).

    Only a crash can leave a record cut short, and only in the part being written: a torn tail of
    the last part is reported, anywhere else it is damage. A length prefix longer than a varint can
    be is damage wherever it is."""
    spans: list[_Span] = []
    # The size when the scan starts: a recording still being written is read as it was then (what
    # the writer appends meanwhile, possibly half a record, is not part of this read).
    end = path.stat().st_size
    with open(path, "rb", buffering=_BUFFER_BYTES) as f:
        while True:
            offset = f.tell()
            if offset >= end:
                return spans, ""
            try:
                size = _read_varint(f)
            except EOFError as exc:
                torn = f"{exc} at byte {offset}"
                break
            except ValueError as exc:
                raise DamagedRecording(f"{path}: damaged at byte {offset} ({exc})") from None
            if size is None or f.tell() > end:
                torn = f"file ends inside a length prefix at byte {offset}"
                break
            if f.tell() + size > end:
                torn = f"record at byte {offset} of {size} bytes has only {end - f.tell()}"
                break
            f.seek(size, 1)
            spans.append(_Span(offset, size))
    if not last:
        raise DamagedRecording(f"{path}: damaged: {torn}, but this is not the recording's last part")
    return spans, f"{path}: torn tail ({torn}); read up to the last whole record"


class RecordingReader:
    """Reads a recording across its parts, and says how much of it was read.

    The parts are scanned first (length prefixes only), so damage in the framing is found before
    the first entry is used, and `total` is known from the start: the replays report `checked` of
    `total` complete records. A record that does not decode is damage: DamagedRecording names the
    file, the byte offset and the record's index in its part. A torn tail is one
    TruncatedRecording warning, and everything before it is read.
    """

    def __init__(self, path: Path) -> None:
        self.parts = recording_parts(path)
        self._spans: list[list[_Span]] = []
        self.torn = ""
        for index, part in enumerate(self.parts):
            spans, torn = _spans(part, last=index == len(self.parts) - 1)
            self._spans.append(spans)
            self.torn = torn or self.torn
        self.total = sum(map(len, self._spans))
        self.checked = 0

    def records(self) -> Iterator[tuple[Path, int, int, bytes]]:
        """(part, index in the part, byte offset, raw record) for every complete record."""
        if self.torn:
            warnings.warn(self.torn, TruncatedRecording, stacklevel=2)
        for part, spans in zip(self.parts, self._spans, strict=True):
            with open(part, "rb", buffering=_BUFFER_BYTES) as f:
                for index, span in enumerate(spans):
                    f.seek(span.offset)
                    _read_varint(f)
                    yield part, index, span.offset, f.read(span.size)

    def entries(self) -> Iterator[Entry]:
        """Every entry: one header first, the continuation headers of later parts dropped."""
        for part, index, offset, data in self.records():
            try:
                entry = codec.decode(data)
            except Exception as exc:  # protobuf's DecodeError has no stable import path
                raise DamagedRecording(
                    f"{part}: damaged at byte {offset} (record {index} does not decode: {exc}); "
                    "nothing past it can be trusted"
                ) from None
            self.checked += 1
            if part is not self.parts[0] and index == 0 and isinstance(entry, Header):
                continue
            yield entry

    def summary(self) -> str:
        """How much was checked, for the replays' last line."""
        torn = "; a torn tail was ignored" if self.torn else ""
        return f"{self.checked} of {self.total} complete records checked{torn}"


def read_entries(path: Path) -> Iterator[Entry]:
    """Every entry of a recording across its parts (see RecordingReader)."""
    yield from RecordingReader(path).entries()


def read_header(path: Path) -> Header:
    for entry in read_entries(path):
        if isinstance(entry, Header):
            return entry
        break
    raise RecordingError(f"{path} does not start with a header")
