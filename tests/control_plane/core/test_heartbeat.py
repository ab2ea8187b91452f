"""The frontend heartbeat: the core's judgment (Silence), the frontend's answering thread on a real
socket while its event loop is blocked, and the hub killing a frontend that stops answering."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import time
from pathlib import Path

import pytest

from control_plane.config import ControlConfig, add_arguments, control_config_from_args
from control_plane.core.fleet import Router
from control_plane.core.heartbeat import Silence
from control_plane.core.hub import FrontendHub
from control_plane.frontend.heartbeat import Heartbeat
from control_plane.link import FrameReader, FrameWriter, LinkClosed, read_frame, write_frame
from protos.stepwise.v1 import frontend_pb2 as fe_pb
from protos.stepwise.v1 import generation_pb2 as gen_pb

pytestmark = pytest.mark.timeout(30)


# --- Silence: the core's judgment -----------------------------------------------------------------


def test_a_frontend_that_answers_every_ping_is_never_stalled_even_late() -> None:
    silence = Silence(interval_s=1.0, timeout_s=3.0)
    for t in range(100):
        seq = silence.tick(float(t))
        if t > 0:
            silence.pong(seq - 1, loop_silent_s=0.9)  # each answer one interval late
        assert silence.stalled() == ""


def test_a_frontend_that_never_answers_is_stalled_after_the_timeout() -> None:
    silence = Silence(interval_s=1.0, timeout_s=3.0)
    verdicts = []
    for t in range(6):
        silence.tick(float(t))
        verdicts.append(silence.stalled())
    assert [bool(why) for why in verdicts] == [False, False, False, False, True, True]
    assert "has not answered a heartbeat for 4.0 s" in verdicts[4]  # more than 3 s


def test_an_answer_ends_the_silence() -> None:
    silence = Silence(interval_s=1.0, timeout_s=3.0)
    for t in range(3):
        silence.tick(float(t))
    silence.pong(1, loop_silent_s=0.0)  # late, but the process runs
    assert silence.silent_s == 0.0
    silence.tick(3.0)
    assert silence.stalled() == ""


def test_a_core_that_stalled_itself_blames_no_frontend() -> None:
    """The core's own loop froze for 30 s: the answers wait unread; one tick counts 2 intervals."""
    silence = Silence(interval_s=1.0, timeout_s=3.0)
    silence.tick(0.0)
    silence.tick(30.0)
    assert silence.silent_s == 2.0 and silence.stalled() == ""


def test_a_wedged_event_loop_is_stalled_though_the_process_answers() -> None:
    silence = Silence(interval_s=1.0, timeout_s=3.0)
    seq = silence.tick(0.0)
    silence.pong(seq, loop_silent_s=2.5)
    assert silence.stalled() == ""
    seq = silence.tick(1.0)
    silence.pong(seq, loop_silent_s=3.5)
    assert "event loop has not run for 3.5 s" in silence.stalled()


def test_answers_to_no_ping_of_ours_are_ignored() -> None:
    silence = Silence(interval_s=1.0, timeout_s=3.0)
    for t in range(5):
        silence.tick(float(t))
        silence.pong(0, 0.0)
        silence.pong(99, 0.0)
    assert silence.stalled()


# --- the flags ---------------------------------------------------------------------------------------


def _config(*flags: str) -> ControlConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return control_config_from_args(parser.parse_args(list(flags)), Path("."))


def test_the_heartbeat_flags() -> None:
    config = _config()
    assert (config.frontend_heartbeat_interval_s, config.frontend_heartbeat_timeout_s) == (1.0, 10.0)
    config = _config("--frontend-heartbeat-interval", "0.2", "--frontend-heartbeat-timeout", "0.4")
    assert (config.frontend_heartbeat_interval_s, config.frontend_heartbeat_timeout_s) == (0.2, 0.4)


@pytest.mark.parametrize(
    "flags",
    [
        ["--frontend-heartbeat-interval", "0"],
        ["--frontend-heartbeat-interval", "nan"],
        ["--frontend-heartbeat-interval", "61", "--frontend-heartbeat-timeout", "200"],
        ["--frontend-heartbeat-timeout", "inf"],
    ],
)
def test_heartbeat_flags_out_of_their_range_are_usage_errors(flags: list[str]) -> None:
    """Each flag's own range is its type's (tests/cli/test_flag_table.py walks every flag)."""
    with pytest.raises(SystemExit) as exited:
        _config(*flags)
    assert exited.value.code == 2


def test_a_timeout_shorter_than_two_intervals_names_both_flags() -> None:
    with pytest.raises(
        ValueError,
        match=r"--frontend-heartbeat-timeout 1\.5 must be at least twice --frontend-heartbeat-interval 1",
    ):
        _config("--frontend-heartbeat-timeout", "1.5")


# --- the frontend's answering thread --------------------------------------------------------------


def _listener(tmp_path: Path) -> tuple[socket.socket, str]:
    path = str(tmp_path / "hb.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    server.settimeout(10)
    return server, path


async def test_the_frontend_answers_while_its_event_loop_is_blocked(tmp_path: Path) -> None:
    server, path = _listener(tmp_path)
    silent: list[str] = []
    hello = fe_pb.FrontendHello(index=2, pid=os.getpid(), heartbeat_of=7)
    heartbeat = Heartbeat(path, hello, interval_s=0.1, timeout_s=5.0, on_silent=silent.append)
    heartbeat.start()
    try:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(5)
            assert read_frame(conn, fe_pb.FrontendMessage).hello.heartbeat_of == 7
            # The event loop is blocked from here on (this test runs on it): a long burst of work.
            started = time.monotonic()
            pongs = []
            for seq in (1, 2, 3):
                time.sleep(0.4)
                write_frame(conn, fe_pb.CoreMessage(ping=fe_pb.Ping(seq=seq)))
                pongs.append(read_frame(conn, fe_pb.FrontendMessage).pong)
            blocked = time.monotonic() - started
    finally:
        heartbeat.stop()
        server.close()
    assert [p.seq for p in pongs] == [1, 2, 3]
    # Answered by the thread: each pong reports the loop's silence, which only grew meanwhile.
    assert pongs[0].loop_silent_s >= 0.3
    assert pongs[2].loop_silent_s >= blocked - 0.2 > pongs[0].loop_silent_s
    assert silent == []


async def test_the_frontend_notices_a_core_that_stops_pinging(tmp_path: Path) -> None:
    server, path = _listener(tmp_path)
    loop = asyncio.get_running_loop()
    silent: asyncio.Future[str] = loop.create_future()
    hello = fe_pb.FrontendHello(index=0, pid=os.getpid(), heartbeat_of=1)
    heartbeat = Heartbeat(path, hello, interval_s=0.1, timeout_s=0.5, on_silent=silent.set_result)
    heartbeat.start()
    try:
        conn, _ = await asyncio.to_thread(server.accept)
        with conn:
            started = time.monotonic()
            reason = await asyncio.wait_for(silent, 5)  # the connection stays open: only silence tells
            waited = time.monotonic() - started
    finally:
        heartbeat.stop()
        server.close()
    assert "no heartbeat for 0.5 s" in reason
    assert 0.4 < waited < 3.0


# --- the hub ----------------------------------------------------------------------------------------


async def _fake_frontend(path: str, pid: int) -> tuple[FrameReader[fe_pb.CoreMessage], FrameWriter, int]:
    """A frontend's link (hello, welcome), by hand."""
    reader, writer = await asyncio.open_unix_connection(path)
    out = FrameWriter(writer)
    out.write(fe_pb.FrontendMessage(hello=fe_pb.FrontendHello(index=1, pid=pid)))
    frames = FrameReader(reader, fe_pb.CoreMessage)
    return frames, out, (await frames.read()).welcome.link_id


@pytest.mark.parametrize("loop_silent_s", [None, 5.0], ids=["stops-answering", "loop-wedged"])
async def test_the_hub_kills_a_frontend_that_stalls_and_closes_its_link(
    tmp_path: Path, loop_silent_s: float | None
) -> None:
    config = ControlConfig(
        model_dir=Path("."), frontend_heartbeat_interval_s=0.05, frontend_heartbeat_timeout_s=0.5
    )
    stalled: list[tuple[int, int]] = []
    router = Router(model_name="m", on_change=lambda n: None, routing=config.routing)
    hub = FrontendHub(config, router, gen_pb.ServerInfo, on_stalled=lambda i, p: stalled.append((i, p)))
    path = str(tmp_path / "link.sock")
    await hub.start(path)
    try:
        frames, out, link_id = await _fake_frontend(path, pid=4242)
        beat_reader, beat_writer = await asyncio.open_unix_connection(path)
        beat_out = FrameWriter(beat_writer)
        beat_out.write(
            fe_pb.FrontendMessage(hello=fe_pb.FrontendHello(index=1, pid=4242, heartbeat_of=link_id))
        )
        beats = FrameReader(beat_reader, fe_pb.CoreMessage)
        # Answered for a while (well past the timeout): alive.
        answer_until = time.monotonic() + 1.0
        while time.monotonic() < answer_until:
            ping = (await asyncio.wait_for(beats.read(), 5)).ping
            beat_out.write(fe_pb.FrontendMessage(pong=fe_pb.Pong(seq=ping.seq, loop_silent_s=0.01)))
        assert stalled == [] and link_id in hub.links
        if loop_silent_s is not None:  # the process answers, its loop does not run
            while not stalled:
                ping = (await asyncio.wait_for(beats.read(), 5)).ping
                beat_out.write(
                    fe_pb.FrontendMessage(pong=fe_pb.Pong(seq=ping.seq, loop_silent_s=loop_silent_s))
                )
        started = time.monotonic()
        # Killed, and its link closed by the core (so its requests are aborted).
        with pytest.raises(LinkClosed):
            while True:
                await asyncio.wait_for(frames.read(), 5)
        assert stalled == [(1, 4242)]
        assert time.monotonic() - started < 3.0
        while link_id in hub.links:
            await asyncio.sleep(0.01)
        out.close()
        beat_out.close()
    finally:
        await hub.stop()
