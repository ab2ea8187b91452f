"""A dial target as the flags spell it: `HOST:PORT`, a comma list `A:P,B:P`, or `dns:///NAME:PORT`.

Every host name stands for ALL its addresses: the headless Service of the control planes resolves
to one address per pod, and each of them is a peer. Names are resolved in a thread (getaddrinfo
blocks), again at every use, so peers that come and go are found.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass

import structlog

log = structlog.get_logger("stepwise.target")

DNS_SCHEME = "dns:"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One HOST:PORT of a target, before resolution."""

    host: str  # a name, or an IP literal without brackets
    port: int

    @property
    def is_name(self) -> bool:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return True
        return False


@dataclass(frozen=True, slots=True)
class Address:
    """One resolved address, and the name it was found under (None for an IP literal): a TLS
    certificate is checked against the name."""

    ip: str
    port: int
    name: str | None = None

    @property
    def grpc(self) -> str:
        """The address as a gRPC channel target."""
        return f"[{self.ip}]:{self.port}" if ":" in self.ip else f"{self.ip}:{self.port}"


def parse_target(text: str, flag: str) -> list[Endpoint]:
    """The endpoints of a target; ValueError naming `flag` when it is malformed."""
    spec = text.strip()
    if spec.startswith(DNS_SCHEME):
        # dns:///NAME:PORT (gRPC's form; an authority between the slashes is ignored)
        rest = spec[len(DNS_SCHEME) :].lstrip("/")
        parts = [rest.split("/", 1)[1] if "/" in rest else rest]
    else:
        parts = [part.strip() for part in spec.split(",")]
    endpoints = [_endpoint(part) for part in parts]
    if not endpoints or None in endpoints:
        raise ValueError(f"{flag}: {text!r} is not HOST:PORT, a comma list of them, or dns:///NAME:PORT")
    return [e for e in endpoints if e is not None]


def _endpoint(part: str) -> Endpoint | None:
    host, sep, port = part.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        return None  # an IPv6 literal needs its brackets
    return Endpoint(host, int(port)) if host else None


async def resolve(endpoints: list[Endpoint]) -> list[Address]:
    """Every address of every endpoint, each once, in a stable order. A name that does not resolve
    (no pod is up yet) contributes nothing."""
    found = await asyncio.gather(*(_resolve_one(e) for e in endpoints))
    unique = {(a.ip, a.port): a for addresses in found for a in addresses}
    return [unique[key] for key in sorted(unique)]


async def _resolve_one(endpoint: Endpoint) -> list[Address]:
    if not endpoint.is_name:
        return [Address(endpoint.host, endpoint.port)]
    try:
        infos = await asyncio.to_thread(
            socket.getaddrinfo, endpoint.host, endpoint.port, type=socket.SOCK_STREAM
        )
    except OSError as exc:
        log.debug("name did not resolve", name=endpoint.host, error=str(exc))
        return []
    return [Address(str(info[4][0]), endpoint.port, endpoint.host) for info in infos]
