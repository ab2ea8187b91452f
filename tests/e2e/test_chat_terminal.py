"""`stepwise chat` in a real terminal (a pseudo-terminal from the stdlib's `pty`), on the embedded
model: Ctrl-C stops a reply and the prompt returns, a second Ctrl-C at the prompt leaves, the servers'
logs stay out of the conversation, and a reply cut by the token limit says so."""

from __future__ import annotations

import contextlib
import os
import pty
import re
import select
import signal
import sys
import time
from collections.abc import Iterator

import pytest

pytestmark = pytest.mark.timeout(180)

CTRL_C = b"\x03"


class Terminal:
    """A process on the child end of a pseudo-terminal (its controlling terminal: a Ctrl-C typed
    here is SIGINT to its foreground process group, as in a shell); all it printed is kept."""

    def __init__(self, *argv: str) -> None:
        pid, fd = pty.fork()
        if pid == 0:  # the child: the terminal is its stdin, stdout and stderr
            os.execv(sys.executable, [sys.executable, *argv])
        self.pid, self.fd, self.output = pid, fd, ""
        self.status: int | None = None

    def expect(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        """Read until `pattern` matches the output after what earlier expects consumed."""
        deadline = time.monotonic() + timeout
        while True:
            found = re.search(pattern, self.output[self._seen :])
            if found is not None:
                self._seen += found.end()
                return found
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} in {self.output[self._seen :]!r}"
            if select.select([self.fd], [], [], min(left, 0.5))[0]:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:  # EIO: the child closed the terminal
                    chunk = b""
                assert chunk, f"the terminal closed before {pattern!r}: {self.output[self._seen :]!r}"
                self.output += chunk.decode(errors="replace")

    _seen = 0

    def type(self, data: bytes) -> None:
        os.write(self.fd, data)

    def wait(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
                return self.status
            if select.select([self.fd], [], [], 0.1)[0]:
                with contextlib.suppress(OSError):  # EIO: the child closed the terminal
                    self.output += os.read(self.fd, 65536).decode(errors="replace")
        raise AssertionError(f"still running: {self.output[-500:]!r}")

    def close(self) -> None:
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except ProcessLookupError:
                pass
        os.close(self.fd)


@pytest.fixture
def chat() -> Iterator[Terminal]:
    # A long reply to stop (EOS ignored, up to the context) and a short one cut by the limit.
    terminal = Terminal(
        "-m", "stepwise.cli", "chat", "--model", "embedded", "--ignore-eos", "--max-new-tokens", "200"
    )
    try:
        yield terminal
    finally:
        terminal.close()


def test_ctrl_c_stops_the_reply_and_a_second_one_at_the_prompt_leaves(chat: Terminal) -> None:
    chat.expect(r"you> ")
    chat.type(b"Tell me a story\n")
    chat.expect(r"assistant> .{20}")  # the reply is under way
    started = time.monotonic()
    chat.type(CTRL_C)
    chat.expect(r"\[stopped; this turn is not kept\]")
    stopped_after = time.monotonic() - started
    chat.expect(r"you> ")
    # The conversation goes on: the next reply is whole, cut at the limit, and says so.
    chat.type(b"Again\n")
    again = time.monotonic()
    chat.expect(r"\[cut at the token limit", timeout=120)
    print(f"a whole reply took {time.monotonic() - again:.1f} s")
    chat.expect(r"you> ")
    chat.type(CTRL_C)
    chat.expect(r"Ctrl-C again leaves")
    chat.type(CTRL_C)
    assert chat.wait() == 0
    print(f"stopped {stopped_after:.2f} s after Ctrl-C")
    assert stopped_after < 5
    # Nothing but the conversation: no log line of the servers' (structlog's `[error    ] ...` on a
    # terminal, JSON events elsewhere), no traceback.
    log_line = r"\[(?:critical|error|warning|info|debug)\s*\]|\{\"(?:event|level)\"|Traceback"
    assert not re.search(log_line, chat.output), chat.output
