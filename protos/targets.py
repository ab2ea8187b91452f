"""A dial target as the flags spell it (`--control`, `--peers`), and every address it stands for.

A target is HOST:PORT, a comma list of them (`A:P,B:P`), or `dns:///NAME:PORT` (gRPC's name
syntax; each item of a list may carry the prefix). HOST is a name, an IPv4 address or a bracketed
IPv6 address (`[::1]:50052`). A name resolves to ALL its addresses, again at every `resolve`: a
headless Kubernetes Service has one A record per control-plane pod, and pods come and go.

Both planes dial by these rules (the worker its control planes, a control plane its peers), so
they live here, beside the other things the planes share.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

DNS_PREFIX = "dns:///"
# A lookup runs in a thread (getaddrinfo blocks); one that takes longer than this is given up on.
RESOLVE_TIMEOUT_S = 2.0

log = structlog.get_logger("stepwise.targets")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One HOST:PORT of a target, as written (brackets of an IPv6 host removed), before resolution."""

    host: str
    port: int


@dataclass(frozen=True, slots=True)
class Address:
    """One resolved address, and the host of the target it was found under."""

    ip: str
    port: int
    # The endpoint's host: a name, or the IP literal itself.
    host: str

    @property
    def target(self) -> str:
        """What gRPC dials: ip:port, or [ip]:port for IPv6."""
        return f"[{self.ip}]:{self.port}" if ":" in self.ip else f"{self.ip}:{self.port}"

    @property
    def tls_name(self) -> str | None:
        """The name to verify a TLS certificate against (the address is dialled, not the name);
        None when the host was an IP literal."""
        return None if _is_ip_literal(self.host) else self.host


def parse_targets(text: str, flag: str) -> tuple[Endpoint, ...]:
    """The endpoints of a target; ValueError naming `flag` when it is empty or malformed."""
    items = [item.strip() for item in text.split(",")]
    if not any(items):
        raise ValueError(f"{flag}: {text!r} is not HOST:PORT, A:P,B:P or dns:///NAME:PORT (it is empty)")
    return tuple(_endpoint(item, flag) for item in items)


def _endpoint(item: str, flag: str) -> Endpoint:
    spec = item.removeprefix(DNS_PREFIX)
    if not spec:
        raise ValueError(f"{flag}: {item!r} is not HOST:PORT or dns:///NAME:PORT")
    if spec.startswith("dns:"):
        # gRPC's dns://SERVER/NAME asks that DNS server; names here go to the system's resolver, so
        # a server is refused rather than silently ignored.
        raise ValueError(f"{flag}: {item!r} is not HOST:PORT or dns:///NAME:PORT (3 slashes, no server)")
    host, _, port = spec.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if not _is_ipv6(host):
            raise ValueError(f"{flag}: {item!r} is not HOST:PORT: only an IPv6 address goes in brackets")
    elif not host or ":" in host:
        raise ValueError(f"{flag}: {item!r} is not HOST:PORT (an IPv6 host goes in brackets)")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag}: {item!r} is not HOST:PORT: the port must be in 1..65535")
    return Endpoint(host, int(port))


def _is_ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return True


def _is_ip_literal(host: str) -> bool:
    return _canonical_ip(host) is not None


def _canonical_ip(host: str) -> str | None:
    """`host` as getaddrinfo would spell it, when it is an IP literal (`::0001` is `::1`)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


async def resolve(endpoints: Sequence[Endpoint], timeout_s: float = RESOLVE_TIMEOUT_S) -> list[Address]:
    """Every address of every endpoint, in order, each (ip, port) once (the first endpoint that
    finds it names it). An IP literal stands for itself; a name that does not resolve within
    `timeout_s` (no pod is up yet, or no such name) is logged and contributes nothing."""
    found = await asyncio.gather(*(_lookup(endpoint, timeout_s) for endpoint in endpoints))
    unique: dict[tuple[str, int], Address] = {}
    for addresses in found:
        for address in addresses:
            unique.setdefault((address.ip, address.port), address)
    return list(unique.values())


async def _lookup(endpoint: Endpoint, timeout_s: float) -> list[Address]:
    ip = _canonical_ip(endpoint.host)
    if ip is not None:
        return [Address(ip, endpoint.port, endpoint.host)]  # no lookup, no thread
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
