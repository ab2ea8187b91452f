"""Where the control planes are: the `--control` syntax, and every address its names stand for.

`--control` is HOST:PORT, a comma list of them (`A:P,B:P`), or `dns:///NAME:PORT` (gRPC's name
syntax; each item of a list may carry the prefix). HOST is a name, an IPv4 address or a bracketed
IPv6 address (`[::1]:50052`). A name resolves to ALL its addresses, again at every search: a headless
Kubernetes Service has one A record per control-plane pod, and pods come and go.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass

import structlog

DNS_PREFIX = "dns:///"

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One HOST:PORT of `--control`, as written (brackets of an IPv6 host removed)."""

    host: str
    port: int


@dataclass(frozen=True, slots=True)
class Address:
    """One address a control plane may listen on, and the name it was found under."""

    ip: str
    port: int
    # The host from --control: what a TLS certificate is verified against.
    host: str

    @property
    def target(self) -> str:
        """What gRPC dials: ip:port, or [ip]:port for IPv6."""
        return f"[{self.ip}]:{self.port}" if ":" in self.ip else f"{self.ip}:{self.port}"


def parse_control(text: str) -> tuple[Endpoint, ...]:
    """The endpoints of a `--control` value; ValueError naming the flag when it is empty or malformed."""
    items = [item.strip() for item in text.split(",")]
    if not any(items):
        raise ValueError("--control is empty; give HOST:PORT, A:P,B:P or dns:///NAME:PORT")
    return tuple(_endpoint(item) for item in items)


def _endpoint(item: str) -> Endpoint:
    spec = item.removeprefix(DNS_PREFIX)
    if not spec or spec.startswith("dns:"):
        raise ValueError(f"--control: {item!r} is not HOST:PORT or dns:///NAME:PORT")
    host, _, port = spec.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if not _is_ipv6(host):
            raise ValueError(f"--control: {item!r}: only an IPv6 address goes in brackets")
    elif not host or ":" in host:
        raise ValueError(f"--control: {item!r} is not HOST:PORT (an IPv6 host goes in brackets)")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--control: {item!r} has no port in 1..65535")
    return Endpoint(host, int(port))


def _is_ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return True


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def resolve(endpoints: tuple[Endpoint, ...], timeout_s: float) -> list[Address]:
    """Every address of every endpoint, in order, each (ip, port) once. A name that does not resolve
    within `timeout_s` (the lookup runs in a thread) is logged and left out."""
    found = await asyncio.gather(*(_lookup(endpoint, timeout_s) for endpoint in endpoints))
    unique: dict[tuple[str, int], Address] = {}
    for addresses in found:
        for address in addresses:
            unique.setdefault((address.ip, address.port), address)
    return list(unique.values())


async def _lookup(endpoint: Endpoint, timeout_s: float) -> list[Address]:
    try:
        infos = await asyncio.wait_for(
            asyncio.to_thread(socket.getaddrinfo, endpoint.host, endpoint.port, type=socket.SOCK_STREAM),
            timeout_s,
        )
    except (OSError, TimeoutError) as exc:
        log.warning("resolve_failed", host=endpoint.host, error=str(exc) or type(exc).__name__)
        return []
    families = (socket.AF_INET, socket.AF_INET6)
    ips = dict.fromkeys(str(info[4][0]) for info in infos if info[0] in families)
    return [Address(ip, endpoint.port, endpoint.host) for ip in ips]
