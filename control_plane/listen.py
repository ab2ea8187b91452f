"""Listening: credentials, binding gRPC servers, and the guard that keeps the client port ours.

The client port is shared by the control plane's frontends through SO_REUSEPORT, and by them only:
the core first binds it exclusively (a second control plane on the same port fails right there),
then turns that socket into the group's first member with SO_REUSEPORT and listens on it, so that
each frontend joins the group. Once every frontend listens, the guard closes; the frontends keep
the port. Between the exclusive bind and the listen there are microseconds in which another
control plane's bind could also succeed; nothing else can join.
"""

from __future__ import annotations

import socket

import grpc

from control_plane.config import Security


def server_credentials(
    security: Security,
) -> tuple[grpc.ServerCredentials | None, grpc.ServerCredentials | None]:
    """(client port, worker port) credentials: None for plaintext. The worker port asks for client
    certificates chaining to --worker-ca and refuses connections without one."""
    if security.tls_cert is None or security.tls_key is None:
        return None, None
    pair = [(security.tls_key.read_bytes(), security.tls_cert.read_bytes())]
    client = grpc.ssl_server_credentials(pair)
    if security.worker_ca is None:
        return client, None
    worker = grpc.ssl_server_credentials(
        pair, root_certificates=security.worker_ca.read_bytes(), require_client_auth=True
    )
    return client, worker


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def bind(
    server: grpc.aio.Server,
    host: str,
    port: int,
    creds: grpc.ServerCredentials | None,
    probe: bool = True,
) -> int:
    """Bind `host:port` (0 picks a free port); OSError naming the address when it cannot be had.

    With `probe`, the port is first tried with a plain socket, so a taken port is one clear OSError
    rather than gRPC's own error log followed by one."""
    where = address(host, port)
    if probe and port:
        with _socket(host) as test:
            test.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is fine
            _bind_or_explain(test, host, port, where)
    try:
        bound = server.add_secure_port(where, creds) if creds else server.add_insecure_port(where)
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {where} (is another server using it?)") from exc
    if bound == 0:
        raise OSError(f"cannot listen on {where} (is another server using it?)")
    return bound


class PortGuard:
    """Holds the client port for this control plane's frontends until they all listen on it."""

    def __init__(self, host: str, port: int) -> None:
        self._socket: socket.socket | None = _socket(host)
        sock = self._socket
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT port is free
        try:
            _bind_or_explain(sock, host, port, address(host, port))
            # Bound without SO_REUSEPORT, the bind above was exclusive; from here on the frontends
            # (same user, SO_REUSEPORT) may join.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.listen(1)
        except BaseException:
            sock.close()
            raise
        self.port: int = sock.getsockname()[1]

    def release(self) -> None:
        """The frontends listen: let go of the port (a connection that reached the guard is reset)."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _socket(host: str) -> socket.socket:
    return socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)


def _bind_or_explain(sock: socket.socket, host: str, port: int, where: str) -> None:
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        raise OSError(f"cannot listen on {where}: {exc.strerror} (is another server using it?)") from None
