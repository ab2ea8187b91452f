"""Which process holds which TCP connection, read from /proc (Linux).

Processes that share a port through SO_REUSEPORT (the control plane's frontends, the gateway's
workers) get each new connection by the kernel's hash of its addresses, so a test that needs a
connection on a given process finds out where its connections went instead of assuming.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

ESTABLISHED = "01"


def established_inodes(port: int, peer_port: int | None = None) -> set[str]:
    """Socket inodes of the established TCP connections whose local port is `port`, and whose
    remote port is `peer_port` when given."""
    inodes = set()
    # gRPC's servers listen on IPv6 sockets, where an IPv4 peer has a mapped address (tcp6).
    lines = [row for table in ("tcp", "tcp6") for row in _rows(Path("/proc/net") / table)]
    for line in lines:
        fields = line.split()
        local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
        if state != ESTABLISHED or int(local.rsplit(":", 1)[1], 16) != port:
            continue
        if peer_port is None or int(remote.rsplit(":", 1)[1], 16) == peer_port:
            inodes.add(inode)
    return inodes


def _rows(table: Path) -> list[str]:
    """A /proc/net table's rows, less its header (none when the kernel has no such table)."""
    try:
        return table.read_text().splitlines()[1:]
    except FileNotFoundError:
        return []


def connections_by_pid(port: int, pids: Iterable[int], peer_port: int | None = None) -> dict[int, int]:
    """Established connections to `port` each of `pids` holds (a process with none is listed, 0);
    only the one from `peer_port` when given."""
    inodes = established_inodes(port, peer_port)
    counts = {}
    for pid in pids:
        held = 0
        with contextlib.suppress(FileNotFoundError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    link = os.readlink(fd)
                    held += link.startswith("socket:[") and link[8:-1] in inodes
        counts[pid] = held
    return counts
