"""What grpc.aio itself costs, with none of Stepwise in the way: the floor under two of issue 24's goals.

    python bench/bench_grpc_floor.py [--turn-ms 0 2 5 10] [--calls 300] [--exchanges 5000]

- accept: a bare grpc.aio server whose loop also runs a task that spins `--turn-ms` per turn (a
  stand-in for the streaming work a loaded frontend does each turn), and a client process that sends
  `--calls` unary calls, 64 at a time, over 4 connections. Prints calls answered per second and loop
  turns per call (1000 / (turn ms x calls/s)). grpc.aio's server keeps one request for a new call
  outstanding with the gRPC core and asks for the next only after its task has run on the loop, so a
  new call costs several turns however short its handler, and a loop whose turns are long accepts
  few calls a second.
- exchange: one bidirectional stream, the server writes a 60-byte message and reads the client's
  40-byte answer, `--exchanges` times (the shape of the core's step: a plan out, a result back).
  Prints the server process's CPU (every thread, `time.process_time`) per exchange.

Both servers read gRPC's wake-ups in bulk (`clients/wakeups.py`), as Stepwise's servers do. The bench
stops every process it starts.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from clients.wakeups import read_in_bulk
from control_plane import acceptor

SERVICE = "floor.Floor"


async def _answer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return b"ok"


async def _exchange(requests: object, context: grpc.aio.ServicerContext) -> None:
    answers = requests.__aiter__()  # type: ignore[attr-defined]
    count = int(dict(context.invocation_metadata())["count"])
    started = time.process_time()
    for _ in range(count):
        await context.write(b"p" * 60)
        await answers.__anext__()
    print(f"{(time.process_time() - started) / count * 1e6:.1f}", flush=True)


async def _spin(turn_ms: float) -> None:
    while True:
        end = time.perf_counter() + turn_ms / 1000
        while time.perf_counter() < end:
            pass
        await asyncio.sleep(0)


async def serve(port_file: Path, turn_ms: float, depth: int) -> None:
    server = acceptor.server(depth=depth)
    handlers = {
        "Answer": grpc.unary_unary_rpc_method_handler(_answer),
        "Exchange": grpc.stream_stream_rpc_method_handler(_exchange),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    read_in_bulk(asyncio.get_running_loop())
    if turn_ms > 0:
        spinner = asyncio.get_running_loop().create_task(_spin(turn_ms))  # noqa: F841 (kept alive)
    port_file.write_text(str(port))
    await server.wait_for_termination()


async def send_calls(port: int, calls: int) -> float:
    options = [("grpc.use_local_subchannel_pool", 1)]  # 4 channels, 4 connections
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) for _ in range(4)]
    stubs = [c.unary_unary(f"/{SERVICE}/Answer") for c in channels]
    for stub in stubs:
        await stub(b"warm")
    gate = asyncio.Semaphore(64)

    async def one(i: int) -> None:
        async with gate:
            await stubs[i % len(stubs)](b"x")

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(calls)))
    elapsed = time.perf_counter() - started
    for channel in channels:
        await channel.close()
    return calls / elapsed


async def exchange(port: int, count: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(f"/{SERVICE}/Exchange")(metadata=(("count", str(count)),))
        seen = 0
        async for _ in call:
            seen += 1
            await call.write(b"r" * 40)
            if seen == count:
                break


class Server:
    """The server in a process of its own, stopped when the block ends."""

    def __init__(self, turn_ms: float, depth: int = 1) -> None:
        self.turn_ms, self.depth = turn_ms, depth
        self.tmp = tempfile.TemporaryDirectory(prefix="grpc-floor-")
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> tuple[int, subprocess.Popen[str]]:
        port_file = Path(self.tmp.name) / "port"
        args = [sys.executable, __file__, "--serve", str(port_file), "--turn-ms", str(self.turn_ms)]
        args += ["--accept-depth", str(self.depth)]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        return int(port_file.read_text()), self.proc

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        self.tmp.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turn-ms", type=float, nargs="+", default=[0, 2, 5, 10], help="spin per loop turn")
    parser.add_argument("--calls", type=int, default=300, help="unary calls per accept measurement")
    parser.add_argument("--exchanges", type=int, default=5000, help="plan/result-shaped exchanges")
    parser.add_argument(
        "--accept-depth",
        type=int,
        nargs="+",
        default=[1, acceptor.ACCEPT_DEPTH],
        help="requests for new calls outstanding per method (control_plane/acceptor.py); one row each",
    )
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.serve is not None:
        asyncio.run(serve(ns.serve, ns.turn_ms[0], ns.accept_depth[0]))
        return
    print("depth  turn ms  calls/s  turns/call")
    for depth in ns.accept_depth:
        for turn_ms in ns.turn_ms:
            with Server(turn_ms, depth) as (port, _):
                rate = asyncio.run(send_calls(port, ns.calls))
            turns = f"{1000 / (turn_ms * rate):.1f}" if turn_ms > 0 else "-"
            print(f"{depth:5}  {turn_ms:7g}  {rate:7.0f}  {turns:>10}")
    with Server(0) as (port, proc):
        asyncio.run(exchange(port, ns.exchanges))
        assert proc.stdout is not None
        print(f"exchange: server CPU {proc.stdout.readline().strip()} µs per plan-shaped write + read")


if __name__ == "__main__":
    main()
