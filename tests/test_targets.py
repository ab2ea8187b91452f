"""Dial targets (protos/targets.py), as `--control` and `--peers` spell them, and the resolver: every
name stands for all of its addresses."""

from __future__ import annotations

import socket
import threading

import pytest
import structlog

from protos import targets
from protos.targets import Address, Endpoint, parse_targets, resolve

FLAGS = ("--control", "--peers")

# ---- the syntax --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("127.0.0.1:50052", (Endpoint("127.0.0.1", 50052),)),
        ("10.0.0.1:50052", (Endpoint("10.0.0.1", 50052),)),
        (" a:1, b.example:2 ", (Endpoint("a", 1), Endpoint("b.example", 2))),
        (
            "cp-0.local:50052, dns:///cp.svc:7000,[::1]:9",
            (Endpoint("cp-0.local", 50052), Endpoint("cp.svc", 7000), Endpoint("::1", 9)),
        ),
        ("[::1]:7", (Endpoint("::1", 7),)),
        ("dns:///control-headless:50052", (Endpoint("control-headless", 50052),)),
        ("dns:///stepwise-workers.default.svc:50052", (Endpoint("stepwise-workers.default.svc", 50052),)),
    ],
)
def test_targets_parse(text: str, want: tuple[Endpoint, ...]) -> None:
    for flag in FLAGS:
        assert parse_targets(text, flag) == want


@pytest.mark.parametrize(
    "text",
    [
        "",
        " , ",
        "host",
        "host:",
        ":5",
        "host:0",
        "host:65536",
        "h:70000",
        "host:http",
        "::1:50052",
        "::1:5",
        "[nope]:1",
        "a:1,,b:2",
        "dns:///x",
        # gRPC's dns://SERVER/NAME would ask that DNS server; ours asks the system's resolver, so a
        # server is refused rather than silently ignored.
        "dns://8.8.8.8/cp:1",
        "dns://8.8.8.8/control:50052",
    ],
)
def test_malformed_values_are_refused_naming_the_flag(text: str) -> None:
    for flag in FLAGS:
        with pytest.raises(ValueError, match=rf"^{flag}: .* is not HOST:PORT"):
            parse_targets(text, flag)


def test_an_ipv6_address_is_dialled_in_brackets() -> None:
    assert Address("::1", 9, "localhost").target == "[::1]:9"
    assert Address("::1", 9, "::1").target == "[::1]:9"
    assert Address("10.0.0.1", 9, "cp").target == "10.0.0.1:9"


def test_a_certificate_is_verified_against_the_name_never_an_ip_literal() -> None:
    assert Address("10.0.0.1", 9, "cp.svc").tls_name == "cp.svc"
    assert Address("10.0.0.1", 9, "10.0.0.1").tls_name is None
    assert Address("::1", 9, "::1").tls_name is None


# ---- resolution --------------------------------------------------------------------------------


def _fake_dns(table: dict[str, list[tuple[int, str]]], slow: SlowLookups | None = None):  # type: ignore[no-untyped-def]
    """A getaddrinfo that answers from `table` (host -> (family, ip)); `slow`'s hosts block first."""

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):  # type: ignore[no-untyped-def]
        if slow is not None and host in slow.hosts:
            slow.block()
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [
            (fam, socket.SOCK_STREAM, 6, "", (ip, port) if fam == socket.AF_INET else (ip, port, 0, 0))
            for fam, ip in table[host]
        ]

    return getaddrinfo


class SlowLookups:
    """Lookups of `hosts` that block until the test releases them (10 s at most), so a test can see
    by the order of events, not by a clock, whether the caller waited for them."""

    def __init__(self, *hosts: str) -> None:
        self.hosts = frozenset(hosts)
        self.released = threading.Event()
        self.answered = threading.Event()

    def block(self) -> None:
        self.released.wait(10)
        self.answered.set()


V4, V6 = socket.AF_INET, socket.AF_INET6


async def test_a_name_resolves_to_every_address_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """A headless Service: one A record per control-plane pod, all of them candidates."""
    dns = {"cp.svc": [(V4, "10.0.0.7"), (V4, "10.0.0.3"), (V6, "fd00::5"), (V4, "10.0.0.7")]}
    monkeypatch.setattr(targets.socket, "getaddrinfo", _fake_dns(dns))
    found = await resolve(parse_targets("dns:///cp.svc:50052", "--control"), timeout_s=1.0)
    assert found == [
        Address("10.0.0.7", 50052, "cp.svc"),
        Address("10.0.0.3", 50052, "cp.svc"),
        Address("fd00::5", 50052, "cp.svc"),
    ]


async def test_each_address_once_across_a_list(monkeypatch: pytest.MonkeyPatch) -> None:
    dns = {"a": [(V4, "10.0.0.1"), (V4, "10.0.0.2")], "b": [(V4, "10.0.0.2")], "10.0.0.9": [(V4, "10.0.0.9")]}
    monkeypatch.setattr(targets.socket, "getaddrinfo", _fake_dns(dns))
    found = await resolve(parse_targets("a:1,b:1,b:2,10.0.0.9:1", "--peers"), timeout_s=1.0)
    assert [(a.ip, a.port, a.host) for a in found] == [
        ("10.0.0.1", 1, "a"),
        ("10.0.0.2", 1, "a"),
        ("10.0.0.2", 2, "b"),
        ("10.0.0.9", 1, "10.0.0.9"),
    ]


async def test_an_ip_literal_stands_for_itself_without_a_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(targets.socket, "getaddrinfo", _fake_dns({}))  # any lookup would fail
    found = await resolve((Endpoint("10.1.2.3", 6), Endpoint("::0001", 7), Endpoint("10.1.2.3", 6)))
    assert found == [Address("10.1.2.3", 6, "10.1.2.3"), Address("::1", 7, "::0001")]


async def test_names_not_resolved_in_time_are_logged_and_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    dns = {"good": [(V4, "10.0.0.1")], "slow": [(V4, "10.0.0.2")]}
    slow = SlowLookups("slow")
    monkeypatch.setattr(targets.socket, "getaddrinfo", _fake_dns(dns, slow))
    try:
        with structlog.testing.capture_logs() as logs:
            # 1 s is ample for the quick lookups' threads on a loaded machine; the slow one blocks for 10.
            found = await resolve(parse_targets("missing:1,slow:1,good:1", "--control"), timeout_s=1.0)
        assert not slow.answered.is_set()  # resolve returned while the slow lookup was still blocked
    finally:
        slow.released.set()
    assert found == [Address("10.0.0.1", 1, "good")]
    assert sorted(e["host"] for e in logs if e["event"] == "resolve_failed") == ["missing", "slow"]
    assert slow.answered.wait(10)  # its thread ends once released


async def test_the_real_resolver_finds_loopback() -> None:
    found = await resolve(parse_targets("127.0.0.1:50052", "--control"), timeout_s=2.0)
    assert found == [Address("127.0.0.1", 50052, "127.0.0.1")]


async def test_the_real_resolver_finds_every_address_of_a_name() -> None:
    found = await resolve([Endpoint("localhost", 5), Endpoint("10.1.2.3", 6), Endpoint("10.1.2.3", 6)])
    assert Address("10.1.2.3", 6, "10.1.2.3") in found
    assert len([a for a in found if a.ip == "10.1.2.3"]) == 1
    local = [a for a in found if a.host == "localhost"]
    assert local and all(a.port == 5 and a.tls_name == "localhost" for a in local)
    assert Address("127.0.0.1", 5, "localhost") in local


async def test_a_name_that_does_not_resolve_contributes_nothing() -> None:
    assert await resolve([Endpoint("no-such-host.invalid", 5)]) == []
