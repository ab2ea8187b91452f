"""The --control syntax and the resolver: every name stands for all of its addresses."""

from __future__ import annotations

import socket
import time

import pytest

from data_plane import targets
from data_plane.targets import Address, Endpoint, parse_control, resolve


def test_a_single_address() -> None:
    assert parse_control("127.0.0.1:50052") == (Endpoint("127.0.0.1", 50052),)


def test_a_comma_list_with_spaces_and_prefixes() -> None:
    parsed = parse_control("cp-0.local:50052, dns:///cp.svc:7000,[::1]:9")
    assert parsed == (Endpoint("cp-0.local", 50052), Endpoint("cp.svc", 7000), Endpoint("::1", 9))


def test_dns_target_syntax() -> None:
    assert parse_control("dns:///stepwise-workers.default.svc:50052") == (
        Endpoint("stepwise-workers.default.svc", 50052),
    )


@pytest.mark.parametrize(
    "text",
    [
        "",
        " , ",
        "host",
        "host:",
        "host:0",
        "host:65536",
        "host:http",
        "::1:50052",
        "[nope]:1",
        "dns://8.8.8.8/cp:1",
        "a:1,,b:2",
    ],
)
def test_malformed_values_are_refused_naming_the_flag(text: str) -> None:
    with pytest.raises(ValueError, match="--control"):
        parse_control(text)


def test_an_ipv6_address_is_dialled_in_brackets() -> None:
    assert Address("::1", 9, "localhost").target == "[::1]:9"
    assert Address("10.0.0.1", 9, "cp").target == "10.0.0.1:9"


def _fake_dns(table: dict[str, list[tuple[int, str]]], slow: frozenset[str] = frozenset()):  # type: ignore[no-untyped-def]
    """A getaddrinfo that answers from `table` (host -> (family, ip)), sleeping first for `slow` hosts."""

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):  # type: ignore[no-untyped-def]
        if host in slow:
            time.sleep(0.6)
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [
            (fam, socket.SOCK_STREAM, 6, "", (ip, port) if fam == socket.AF_INET else (ip, port, 0, 0))
            for fam, ip in table[host]
        ]

    return getaddrinfo


V4, V6 = socket.AF_INET, socket.AF_INET6


async def test_a_name_resolves_to_every_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """A headless Service: one A record per control-plane pod, all of them candidates."""
    dns = {"cp.svc": [(V4, "10.0.0.7"), (V4, "10.0.0.3"), (V6, "fd00::5"), (V4, "10.0.0.7")]}
    monkeypatch.setattr(targets.socket, "getaddrinfo", _fake_dns(dns))
    found = await resolve(parse_control("dns:///cp.svc:50052"), timeout_s=1.0)
    assert found == [
        Address("10.0.0.7", 50052, "cp.svc"),
        Address("10.0.0.3", 50052, "cp.svc"),
        Address("fd00::5", 50052, "cp.svc"),
    ]


async def test_each_address_once_across_a_list(monkeypatch: pytest.MonkeyPatch) -> None:
    dns = {"a": [(V4, "10.0.0.1"), (V4, "10.0.0.2")], "b": [(V4, "10.0.0.2")], "10.0.0.9": [(V4, "10.0.0.9")]}
    monkeypatch.setattr(targets.socket, "getaddrinfo", _fake_dns(dns))
    found = await resolve(parse_control("a:1,b:1,b:2,10.0.0.9:1"), timeout_s=1.0)
    assert [(a.ip, a.port, a.host) for a in found] == [
        ("10.0.0.1", 1, "a"),
        ("10.0.0.2", 1, "a"),
        ("10.0.0.2", 2, "b"),
        ("10.0.0.9", 1, "10.0.0.9"),
    ]


async def test_names_that_do_not_resolve_in_time_are_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    dns = {"good": [(V4, "10.0.0.1")], "slow": [(V4, "10.0.0.2")]}
    monkeypatch.setattr(targets.socket, "getaddrinfo", _fake_dns(dns, slow=frozenset({"slow"})))
    started = time.monotonic()
    found = await resolve(parse_control("missing:1,slow:1,good:1"), timeout_s=0.1)
    assert found == [Address("10.0.0.1", 1, "good")]
    assert time.monotonic() - started < 0.5  # the slow lookup was not waited for


async def test_the_real_resolver_finds_loopback() -> None:
    found = await resolve(parse_control("127.0.0.1:50052"), timeout_s=2.0)
    assert found == [Address("127.0.0.1", 50052, "127.0.0.1")]
