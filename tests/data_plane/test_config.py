"""The worker's flags for finding, balancing over and leaving control planes."""

from __future__ import annotations

import argparse
import dataclasses
import pathlib

import pytest

from data_plane import worker
from data_plane.config import add_arguments, config_from_args
from data_plane.kv_transfer import DEFAULT_HOLD_S, TransferDeadline

NEW_FLAGS = ("--control", "--reconnect-max-backoff", "--drain-timeout", "--health-port", "--health-host")


def parse(*argv: str):  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(["--model", "/m", *argv]))


def test_defaults() -> None:
    config = parse()
    assert (config.control, config.drain_timeout_s, config.reconnect_max_backoff_s) == (
        "127.0.0.1:50052",
        30.0,
        5.0,
    )
    assert (config.health_port, config.health_host) == (0, "0.0.0.0")


def test_the_flags_reach_the_config() -> None:
    config = parse(
        "--control",
        "dns:///cp.svc:50052",
        "--drain-timeout",
        "0",
        "--reconnect-max-backoff",
        "0.5",
        "--health-port",
        "8081",
        "--health-host",
        "127.0.0.1",
    )
    assert config.control == "dns:///cp.svc:50052"
    assert (config.drain_timeout_s, config.reconnect_max_backoff_s) == (0.0, 0.5)
    assert (config.health_port, config.health_host) == (8081, "127.0.0.1")


@pytest.mark.parametrize("argv", [("--control", ""), ("--control", "a:1,b")])
def test_a_control_that_is_not_a_target_is_refused_naming_the_flag(argv: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="--control"):
        parse(*argv)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (("--drain-timeout", "-1"), "--drain-timeout"),
        (("--reconnect-max-backoff", "0"), "--reconnect-max-backoff"),
        (("--drain-timeout", "nan"), "--drain-timeout"),
        (("--drain-timeout", "inf"), "--drain-timeout"),
        (("--reconnect-max-backoff", "nan"), "--reconnect-max-backoff"),
        (("--connect-timeout", "nan"), "--connect-timeout"),
        (("--connect-timeout", "-1"), "--connect-timeout"),
        (("--health-port", "65536"), "--health-port"),
        (("--health-port", "-1"), "--health-port"),
    ],
)
def test_values_out_of_range_are_refused_by_the_flags_naming_the_flag(
    argv: tuple[str, ...], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The flags' types hold the ranges (flagtypes; every flag: tests/cli/test_flag_table.py)."""
    with pytest.raises(SystemExit) as exited:
        parse(f"{argv[0]}={argv[1]}")
    assert exited.value.code == 2 and f"argument {flag}: expected" in capsys.readouterr().err


def test_help_describes_every_new_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        worker.main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for flag in NEW_FLAGS:
        assert flag in text
    assert "dns:///NAME:PORT" in text and "Exit codes" in text


def test_flags_build_a_frozen_config() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ns = parser.parse_args(["--model", "/m", "--kv-tokens", "512", "--page-size", "16", "--control", "h:1"])
    config = config_from_args(ns)
    assert (config.model, config.kv_tokens, config.page_size, config.control) == (
        pathlib.Path("/m"),
        512,
        16,
        "h:1",
    )
    assert config.worker_id  # hostname-pid by default
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.page_size = 1  # type: ignore[misc]
    with pytest.raises(SystemExit) as exited:  # out of its flag's range (tests/cli/test_flag_table.py)
        parser.parse_args(["--model", "/m", "--page-size", "0"])
    assert exited.value.code == 2


def test_the_transfer_flags_reach_the_config_and_choose_the_transport(tmp_path: pathlib.Path) -> None:
    default = parse()
    assert (default.transfer_port, default.transfer_host, default.transfer_buffer_bytes) == (
        0,
        "127.0.0.1",
        1 << 30,
    )
    assert worker.make_transport(default) is not None
    config = parse("--transfer-port", "7000", "--transfer-host", "::1", "--transfer-buffer-bytes", "0")
    assert (config.transfer_port, config.transfer_host, config.transfer_buffer_bytes) == (7000, "::1", 0)
    assert worker.make_transport(parse("--transfer-port", "-1")) is None
    ca = tmp_path / "ca.crt"
    ca.write_text("not read here")
    assert worker.make_transport(parse("--tls-ca", str(ca))) is None  # no certificate to serve with


def test_the_transfer_deadline_flags_reach_the_transport() -> None:
    # The flags' defaults are the rule's own (config.py repeats them so that parsing needs no torch).
    assert worker.make_transport(parse())._deadline == TransferDeadline()  # type: ignore[union-attr]
    config = parse("--transfer-deadline-floor", "1.5", "--transfer-deadline-bytes-per-s", "1e6")
    transport = worker.make_transport(config)
    assert transport is not None and transport._deadline == TransferDeadline(1.5, 1e6)


def test_the_hold_timeout_reaches_the_store() -> None:
    default = worker.make_transport(parse())
    assert default is not None and default.received.hold_s == DEFAULT_HOLD_S
    transport = worker.make_transport(parse("--transfer-hold-timeout", "42"))
    assert transport is not None and transport.received.hold_s == 42.0


def test_a_role_reaches_the_config_and_needs_the_transfer_link() -> None:
    assert parse().role == "mixed"
    assert parse("--role", "prefill").role == "prefill"
    assert parse("--role", "decode", "--transfer-port", "50060").role == "decode"
    with pytest.raises(ValueError, match="--role decode moves requests with their KV"):
        parse("--role", "decode", "--transfer-port", "-1")
    assert parse("--role", "prefill", "--backend", "sim").role == "prefill"  # the sim moves zeros
