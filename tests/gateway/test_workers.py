"""The gateway's supervisor without a gateway: the port it holds, and a worker that cannot start.

The serving, draining and restarting workers are tests/e2e/test_gateway_workers.py's."""

from __future__ import annotations

import socket
import sys
from multiprocessing.connection import Connection

import pytest

from gateway.app import GatewayConfig
from gateway.workers import Supervisor, WorkerStartError, join_port, reserve_port


def exit_at_once(
    config: GatewayConfig, host: str, port: int, index: int, log_level: str, ready: Connection, parent: int
) -> None:
    """A worker entry that exits before it accepts (spawned: importable, so module level)."""
    sys.exit(3)


def never_accepts(
    config: GatewayConfig, host: str, port: int, index: int, log_level: str, ready: Connection, parent: int
) -> None:
    import time

    time.sleep(60)


def test_the_reserved_port_is_the_workers_alone_and_takes_no_connection() -> None:
    held = reserve_port("127.0.0.1", 0)
    port = held.getsockname()[1]
    try:
        with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{port}"):
            reserve_port("127.0.0.1", port)
        with pytest.raises(ConnectionRefusedError):  # held, yet not listening
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        first, second = join_port("127.0.0.1", port), join_port("127.0.0.1", port)
        with first, second:
            first.listen(64)
            second.listen(64)
            clients = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(32)]
            accepted = []
            for server in (first, second):
                server.setblocking(False)
                count = 0
                while True:
                    try:
                        server.accept()[0].close()
                    except BlockingIOError:
                        break
                    count += 1
                accepted.append(count)
            for client in clients:
                client.close()
        assert sum(accepted) == 32 and all(accepted), accepted
    finally:
        held.close()


@pytest.mark.timeout(60)
def test_a_worker_that_exits_while_starting_fails_the_start_and_stops_the_rest() -> None:
    sock = reserve_port("127.0.0.1", 0)
    supervisor = Supervisor(GatewayConfig("127.0.0.1:1", "m"), "127.0.0.1", sock, 2, "warning", exit_at_once)
    with pytest.raises(WorkerStartError, match="exited with code 3 while starting"):
        supervisor.run(None)
    assert not supervisor.pids()


@pytest.mark.timeout(60)
def test_a_worker_that_never_accepts_times_out_and_is_stopped() -> None:
    sock = reserve_port("127.0.0.1", 0)
    supervisor = Supervisor(GatewayConfig("127.0.0.1:1", "m"), "127.0.0.1", sock, 1, "warning", never_accepts)
    with pytest.raises(WorkerStartError, match=r"gateway workers \[0\] did not accept within 3 s"):
        supervisor.run(None, start_timeout=3)
    assert not supervisor.pids()
