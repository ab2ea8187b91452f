"""The worker's gRPC health service (grpc.health.v1) on `--health-host:--health-port`.

Two services, as Kubernetes probes ask them:
- "" (liveness and startup): SERVING once the model is loaded;
- "stepwise.v1.WorkerLink" (readiness): SERVING while attached to a control plane (welcomed) and
  not draining.
Everything is NOT_SERVING until set otherwise. The server starts before the model loads, so a
startup probe gets an answer (NOT_SERVING) during a long load instead of a refused connection.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

READY_SERVICE = "stepwise.v1.WorkerLink"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class WorkerHealth:
    """The statuses, and the server that answers for them once `start` is called (a worker without
    --health-port keeps the statuses and never starts the server)."""

    def __init__(self) -> None:
        self._servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self._server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        """Listen on host:port (0: any free port, see `.port`); OSError naming it when taken."""
        await self._servicer.set("", _NOT_SERVING)
        await self._servicer.set(READY_SERVICE, _NOT_SERVING)
        # Without SO_REUSEPORT, a port another process holds is an error here, not a shared port.
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = server.add_insecure_port(where)
        except RuntimeError:
            self.port = 0
        if not self.port:
            raise OSError(f"--health-port: cannot listen on {where} (is another server using it?)")
        await server.start()
        self._server = server

    async def set_loaded(self) -> None:
        await self._servicer.set("", _SERVING)

    async def set_ready(self, ready: bool) -> None:
        await self._servicer.set(READY_SERVICE, _SERVING if ready else _NOT_SERVING)

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None
