"""`stepwise gateway --workers N`: N processes serve one port, SIGTERM drains them all, a worker that
dies is restarted, and `up --gateway-workers` passes the count on. Against a control plane with a
sim worker (10 ms a step), 127.0.0.1, ephemeral ports; every process is stopped, also on failure.

Which worker serves a connection is read from /proc, not from anything the gateway answers: the
ready file names the workers' pids, and each established TCP connection to the port (its socket's
inode, /proc/net/tcp) belongs to the worker holding that inode among its file descriptors.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from stepwise.up import stop_processes
from tests.e2e.conftest import ControlProcess
from tests.polling import until_sync
from tests.processes import ready_file_sync
from tests.sockets import connections_by_pid

pytestmark = pytest.mark.timeout(180)

STEP_S = 0.01
CONNECTIONS = 16


@dataclass(frozen=True, slots=True)
class Gateway:
    proc: subprocess.Popen[bytes]
    port: int
    pids: list[int]
    log: Path

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=30)

    def connections(self, peer_port: int | None = None) -> dict[int, int]:
        """Established connections to the port per worker pid (a worker with none is listed, 0);
        only the one from our `peer_port` when given."""
        return connections_by_pid(self.port, self.pids, peer_port)

    def owner(self, sock: socket.socket) -> int:
        """The worker pid holding the accepted end of our connection `sock`."""
        port = sock.getsockname()[1]
        holders = [pid for pid, n in self.connections(port).items() if n]
        assert len(holders) == 1, f"workers holding the connection from port {port}: {holders}"
        return holders[0]

    def workers_now(self) -> list[int]:
        """The supervisor's live worker processes (its children other than multiprocessing's
        resource tracker)."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.proc.pid and b"spawn_main" in cmdline:
                found.append(int(entry.name))
        return sorted(found)


@pytest.fixture
async def plane(tmp_path: Path) -> object:
    """A control plane with one sim worker; stopped at teardown."""
    plane = ControlProcess([], tmp_path)
    try:
        await plane.start()
        plane.add_worker("sim-0", "--sim-cost", f"{STEP_S},0,0")
        await plane.wait_workers(1)
        yield plane
    finally:
        plane.stop()


@contextlib.contextmanager
def gateway(plane: ControlProcess, tmp: Path, *flags: str) -> Iterator[Gateway]:
    """`stepwise gateway --workers 2` (unless `flags` say otherwise) in front of `plane`, its log in a
    file; always stopped."""
    ready, log = tmp / "gateway.json", tmp / "gateway.log"
    args = ["gateway", "--control", plane.address, "--port", "0", "--workers", "2"]
    args += ["--ready-file", str(ready), "--log-level", "info", *flags]
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "stepwise.cli", *args], stdout=out, stderr=out)
    try:
        data = ready_file_sync(ready, proc, 90, "the gateway", log=log)
        yield Gateway(proc, data["port"], data.get("worker_pids", []), log)
    finally:
        stop_processes([proc])


def start_stream(gw: Gateway, max_tokens: int) -> socket.socket:
    """A streamed completion on a connection of its own, its response head read (it is being served)."""
    body = json.dumps(
        {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        | {"stream_options": {"include_usage": True}}
    ).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    sock = gw.connect()
    sock.sendall(head.encode() + body)
    first = sock.recv(65536)
    assert first.startswith(b"HTTP/1.1 200 "), first[:300]
    return sock


def read_to_end(sock: socket.socket, timeout: float = 30) -> bytes:
    sock.settimeout(timeout)
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def completion_tokens(stream: bytes) -> int:
    """The usage of a whole streamed completion (chunked SSE), which must end with [DONE]."""
    assert stream.rstrip().endswith(b"0"), stream[-200:]  # the chunked body's last, empty chunk
    assert b"data: [DONE]" in stream, stream[-300:]
    usage = [line for line in stream.split(b"\n") if line.startswith(b"data: {") and b'"usage"' in line]
    assert usage, stream[-300:]
    return int(json.loads(usage[-1][6:])["usage"]["completion_tokens"])


def completion(gw: Gateway) -> httpx.Response:
    body = {"prompt": "Once upon a time", "max_tokens": 4}
    return httpx.post(f"http://127.0.0.1:{gw.port}/v1/completions", json=body, timeout=30)


def streams_on_every_worker(
    gw: Gateway, held: contextlib.ExitStack, n: int, max_tokens: int
) -> list[socket.socket]:
    """`n` streams held open, and more while a worker serves none of them. The kernel hashes each
    connection to a worker, so `n` alone leave one worker without a stream once in 2**(n-1) runs
    (1 in 128 for 8); each further stream halves the odds (32 more: 2**-32 of them). Each stream's
    worker is read right after its response head, while it surely streams: a count of all of them
    at the end would miss early ones that ended meanwhile (50 tokens last from half a second on;
    opening 16 took up to 1.0 s beside three spinning processes)."""
    streams: list[socket.socket] = []
    served = dict.fromkeys(gw.pids, 0)
    while len(streams) < n or (0 in served.values() and len(streams) < n + 32):
        sock = held.enter_context(start_stream(gw, max_tokens))
        streams.append(sock)
        served[gw.owner(sock)] += 1
    assert all(count > 0 for count in served.values()), f"a worker serves no stream: {served}"
    return streams


def test_both_workers_serve_connections_to_the_one_port(plane: ControlProcess, tmp_path: Path) -> None:
    """16 streams held open at once: the kernel spreads them over both workers (SO_REUSEPORT), and
    every one of them streams to its end."""
    with gateway(plane, tmp_path) as gw:
        assert len(gw.pids) == 2 and gw.proc.pid not in gw.pids, gw.pids
        assert gw.workers_now() == sorted(gw.pids)
        with contextlib.ExitStack() as held:
            streams = [held.enter_context(start_stream(gw, 200)) for _ in range(CONNECTIONS)]
            counts = gw.connections()
            assert sum(counts.values()) == CONNECTIONS, counts
            assert all(n > 0 for n in counts.values()), f"a worker served no connection: {counts}"
            for sock in streams:
                assert completion_tokens(read_to_end(sock)) == 200
        assert completion(gw).status_code == 200


def test_sigterm_drains_every_worker_then_exits_0(plane: ControlProcess, tmp_path: Path) -> None:
    """Streams in flight on both workers when SIGTERM comes finish whole (2 s of tokens, inside the
    5 s graceful timeout); the port is refused then, and the supervisor exits 0 with its workers gone."""
    with gateway(plane, tmp_path) as gw:
        with contextlib.ExitStack() as held:
            streams = streams_on_every_worker(gw, held, 8, 200)
            gw.proc.send_signal(signal.SIGTERM)
            for sock in streams:
                assert completion_tokens(read_to_end(sock)) == 200
        assert gw.proc.wait(15) == 0, gw.log.read_text()[-3000:]
        for pid in gw.pids:
            assert not Path(f"/proc/{pid}").exists() or _zombie(pid), f"worker {pid} outlived the gateway"
        with pytest.raises(ConnectionRefusedError):
            gw.connect().close()


def _zombie(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    return True


def test_a_killed_worker_is_reported_and_restarted(plane: ControlProcess, tmp_path: Path) -> None:
    """SIGKILL one worker: the other keeps serving, the supervisor logs the exit and starts a new
    one, which serves too."""
    with gateway(plane, tmp_path) as gw:
        victim, survivor = gw.pids
        os.kill(victim, signal.SIGKILL)
        # Dead (its listening socket closed with it), so no new connection is hashed to it.
        until_sync(lambda: _zombie(victim), 10, "the killed worker to die")
        assert completion(gw).status_code == 200
        until_sync(
            lambda: len(gw.workers_now()) == 2 and victim not in gw.workers_now(),
            30,
            "a worker in the killed one's place",
        )
        until_sync(
            lambda: b"gateway worker accepting again" in gw.log.read_bytes(),
            30,
            "the gateway worker accepting again",
        )
        log = gw.log.read_text()
        assert "gateway worker exited; restarting it" in log and f'"pid": {victim}' in log, log[-3000:]
        assert survivor in gw.workers_now()
        restarted = Gateway(gw.proc, gw.port, gw.workers_now(), gw.log)
        with contextlib.ExitStack() as held:
            streams = streams_on_every_worker(restarted, held, CONNECTIONS, 50)
            for sock in streams:
                assert completion_tokens(read_to_end(sock)) == 50


def test_a_taken_port_is_one_line_and_exit_2(plane: ControlProcess, tmp_path: Path) -> None:
    """The supervisor binds the port before it starts any worker: a port taken by a socket without
    SO_REUSEPORT fails there, as one process's bind would."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        args = ["gateway", "--control", plane.address, "--port", str(port), "--workers", "2"]
        run = subprocess.run(
            [sys.executable, "-m", "stepwise.cli", *args], capture_output=True, text=True, timeout=60
        )
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"cannot bind 127.0.0.1:{port}" in run.stderr, run.stderr[-2000:]


def test_up_passes_gateway_workers_on(tmp_path: Path) -> None:
    """`stepwise up --gateway-workers 2`: the gateway `up` starts supervises two workers that serve."""
    ready = tmp_path / "up.json"
    args = ["up", "--host", "127.0.0.1", "--port", "0", "--worker-port", "0", "--log-level", "warning"]
    args += ["--backend", "sim", "--gateway-port", "0", "--gateway-workers", "2", "--ready-file", str(ready)]
    proc = subprocess.Popen([sys.executable, "-m", "stepwise.cli", *args])
    try:
        until_sync(lambda: ready.exists() or proc.poll() is not None, 120, "stepwise up to start")
        assert proc.poll() is None, f"stepwise up exited with {proc.returncode}"
        host, port = json.loads(ready.read_text())["gateway_address"].rsplit(":", 1)
        gateway_pid = _child(proc.pid, b"gateway")
        assert gateway_pid is not None
        spawned = [pid for pid in _children(gateway_pid) if b"spawn_main" in _cmdline(pid)]
        assert len(spawned) == 2, spawned
        reply = httpx.post(
            f"http://{host}:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30
        )
        assert reply.status_code == 200, reply.text[:300]
    finally:
        stop_processes([proc], timeout=20)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _children(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                    found.append(int(entry.name))
    return found


def _child(parent: int, needle: bytes) -> int | None:
    return next((pid for pid in _children(parent) if needle in _cmdline(pid)), None)
