"""Is the control plane ever the bottleneck, and do new callers get their first token in milliseconds
while it streams? One `stepwise control` with sim workers, a streaming load from several client
processes, and probes beside it.

Each sim worker takes a fixed time per step (10 ms by default), so its ideal step rate is known: a
control plane that keeps it fed reaches it. The load keeps `--running` streams per worker open (long
greedy generations with ignore_eos, a new one as soon as one ends), spread over `--client-procs`
processes with `--connections` channels each. Every channel has its own TCP connection (a local
subchannel pool), so SO_REUSEPORT spreads the connections, and with them the streams, over all the
frontends (one connection, as one channel in one process would be, would load one frontend only).

After the streams have started and a warm-up, over a measured window of `--seconds`:

- per worker: the achieved fraction of the ideal step rate, and its idle gap between finishing a
  step and receiving the next plan (p50, p99; from GetServerInfo, when the server reports it);
- tokens/s and client messages/s as the load processes received them, and tokens per message;
- core CPU µs per generated token and per worker step (all workers' steps), frontend CPU µs per
  client message (with `--gateway-streams`, the tokens and messages of the gateway's streams too)
  and each frontend's CPU fraction (/proc, Linux; the frontends' pids come from the ready file,
  when the server writes them), and the load processes' own CPU fraction (a client at 100 % of a
  core is the limit);
- time to first token of new calls: `--probe-rate` short Generate calls per second, sent open-loop
  (on schedule, whether or not earlier ones answered), each timed from sending it to its first
  chunk. By default every probe opens a fresh channel, so a probe is a new caller and its time
  includes the TCP connect and HTTP/2 handshake; `--probe-channels N` sends them over N channels
  connected before the window instead (a known caller). p50/p99/max over the probes that got a
  first chunk; a probe without one within `--probe-timeout` counts as a timeout, not in the
  percentiles. Probes sent in the window are waited for, up to `--probe-timeout`, after it;
- GetServerInfo latency: `--info-rate` calls per second, open-loop, on one channel: p50/p99/max;
- after the window, with the load still streaming: Generate calls accepted per second, a burst of
  `--burst-calls` short calls `--burst-concurrency` at a time over `--connections` channels from a
  process of its own (so this process's loop is not the limit), each timed to its first message
  (a call is accepted once the control plane has queued it and it streams).

`--gateway-streams N` adds the OpenAI gateway: once the control plane is up, one `stepwise gateway`
(`--gateway-workers` processes) in front of it, and a client process of its own that keeps N
`/v1/completions` streams open through it on top of the gRPC load (the same long greedy generations
of `--output-len` tokens with ignore_eos, a text prompt, a new one as soon as one ends, each on a
connection of its own read by a minimal HTTP/1.1 chunked reader). Each asks `logprobs: 0`, so every
SSE event names its tokens (`logprobs.tokens`) and they are counted exactly as they arrive, not
guessed from text (a byte-level BPE token can end inside a character, and its text is then empty);
each stream's usage event must agree with its count, else it is an error. In the window:

- the gateway's events/s and tokens/s as that client read them (an event is a `data:` line, the
  usage event and `[DONE]` included), its CPU (user + system, its process and every descendant,
  from /proc) per event and per token, and the ratio of its tokens/s per stream to the gRPC load's
  (1: a stream through the gateway keeps the pace of one straight to the control plane; short
  `--output-len` streams lower it, since a new stream's setup is in the gateway's share).

`--stream-interval` takes several values: the stack is started once per value, one JSON object is
printed per value as it finishes, and a compact table of all of them at the end. `--busy-fraction F`
runs a process that spins F of every 10 ms on one core for the whole run ("another process takes
half a core"). The bench stops every process it started when it ends, also on Ctrl-C or SIGTERM.

Run from the repository root (or `--root` another checkout, e.g. a worktree of an older commit, to
compare in one run; the load and probes always use this checkout's client). Every server flag the
checkout does not know is left out (`--frontends auto` too, where it does not take `auto`):

    python bench/bench_control.py --workers 4 --running 128 --stream-interval 1 8 16
    python bench/bench_control.py --workers 8 --running 32 --frontends 2 --busy-fraction 0.5
    python bench/bench_control.py --workers 4 --running 32 --gateway-streams 64 --gateway-workers 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent.parent
THIS = Path(__file__).resolve()
sys.path.insert(0, str(ROOT))  # this checkout's client, also when run as `python bench/bench_control.py`

from clients.client import StepwiseClient, generate_request, sampling_params  # noqa: E402
from clients.wakeups import read_in_bulk  # noqa: E402
from protos.stepwise.v1 import generation_pb2 as gen_pb  # noqa: E402
from protos.stepwise.v1 import generation_pb2_grpc as gen_grpc  # noqa: E402
from stepwise.up import stop_processes  # noqa: E402
from tests.processes import DidNotStart, ready_file  # noqa: E402

PROBE_PROMPT = [11, 12, 13]
PROBE_TOKENS = 4  # a probe is a short call: read to its end, not aborted
# Channel arguments for a channel with a TCP connection of its own: by default channels to one
# target in one process share their subchannels, and so one connection.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def _channel(address: str) -> grpc.aio.Channel:
    channel = grpc.aio.insecure_channel(address, options=OWN_CONNECTION)
    read_in_bulk(asyncio.get_running_loop())  # as the project's own client does (clients/wakeups.py)
    return channel


def _stub(channel: grpc.aio.Channel) -> gen_grpc.GenerationStub:
    return gen_grpc.GenerationStub(channel)


def _error_name(exc: BaseException) -> str:
    return exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__


def _emit(message: dict[str, object]) -> None:
    """A child's report to the bench: one JSON line on stdout."""
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, from /proc (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tree_cpu_seconds(root: int) -> float:
    """User + system CPU of `root` and every live descendant (a gateway's worker processes), from
    /proc (0 when it is gone)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parent = int(Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
    pids, todo = [root], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        pids += kids
        todo += kids
    return sum(_cpu_seconds(pid) for pid in pids)


def _quantiles_ms(seconds: Sequence[float]) -> dict[str, float | None]:
    """p50, p99 (nearest rank) and max, in ms; None when there is no sample."""
    if not seconds:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None}
    ordered = sorted(seconds)

    def rank(q: float) -> float:
        return round(ordered[max(0, math.ceil(q * len(ordered)) - 1)] * 1e3, 2)

    return {"p50_ms": rank(0.50), "p99_ms": rank(0.99), "max_ms": round(ordered[-1] * 1e3, 2)}


# --- what the server under test knows ---------------------------------------------------------


def _control(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stepwise.cli", "control", *args],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        check=False,
    )


@functools.cache
def _control_help(root: Path) -> str:
    return _control(root, "--help").stdout


def _supports(root: Path, flag: str) -> bool:
    return flag in _control_help(root)


@functools.cache
def _accepts(root: Path, flag: str, value: str) -> bool:
    """Whether `control FLAG VALUE` parses: argparse checks the value before it reaches --help."""
    return _supports(root, flag) and _control(root, flag, value, "--help").returncode == 0


# --- child processes: this file run with --load-client, --sse-client, --burst-client, --busy-loop


@dataclass(slots=True)
class Counts:
    tokens: int = 0
    messages: int = 0  # gRPC: chunk messages; SSE: `data:` events, usage and `[DONE]` included
    finished: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    token_events: int = 0  # SSE: the events that carried tokens (a chunk the gateway was sent each)

    def error(self, name: str) -> None:
        self.errors[name] = self.errors.get(name, 0) + 1

    def __add__(self, other: Counts) -> Counts:
        errors = dict(self.errors)
        for name, n in other.errors.items():
            errors[name] = errors.get(name, 0) + n
        return Counts(
            self.tokens + other.tokens,
            self.messages + other.messages,
            self.finished + other.finished,
            errors,
            self.token_events + other.token_events,
        )

    def __sub__(self, other: Counts) -> Counts:
        errors = {k: n - other.errors.get(k, 0) for k, n in self.errors.items()}
        return Counts(
            self.tokens - other.tokens,
            self.messages - other.messages,
            self.finished - other.finished,
            {k: n for k, n in errors.items() if n},
            self.token_events - other.token_events,
        )


async def _stream_forever(
    stub: gen_grpc.GenerationStub, counts: Counts, first: asyncio.Event, ns: argparse.Namespace
) -> None:
    sampling = sampling_params(max_new_tokens=ns.output_len, ignore_eos=True, temperature=0.0)
    request = generate_request(list(range(10, 10 + ns.prompt_len)), sampling)
    while True:
        try:
            async for response in stub.Generate(request):
                if response.WhichOneof("event") == "chunk":
                    counts.tokens += len(response.chunk.token_ids)
                    counts.messages += 1
                    first.set()
                elif response.WhichOneof("event") == "finished":
                    counts.finished += 1
        except grpc.aio.AioRpcError as exc:  # counted, the stream starts over
            counts.error(_error_name(exc))
            await asyncio.sleep(0.05)


async def _stdin_reader() -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


async def _announce_ready(firsts: list[asyncio.Event]) -> None:
    await asyncio.gather(*(first.wait() for first in firsts))
    _emit({"event": "ready"})


async def _serve_counts(counts: Counts, firsts: list[asyncio.Event], tasks: list[asyncio.Task[None]]) -> None:
    """Say `ready` once every stream had its first tokens; answer `counts` (cumulative) on stdin
    until `stop` or the end of stdin (the bench is gone); then cancel the streams."""
    tasks.append(asyncio.create_task(_announce_ready(firsts)))
    commands = await _stdin_reader()
    while (line := (await commands.readline()).strip()) not in (b"", b"stop"):
        if line == b"counts":
            _emit({"event": "counts", **asdict(counts)})
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def load_client(ns: argparse.Namespace) -> None:
    """`--streams` streams over `--connections` channels; says `ready` once each had a chunk, and
    answers `counts` (cumulative) on stdin until `stop` or the end of stdin (the bench is gone)."""
    counts = Counts()
    channels = [_channel(ns.load_client) for _ in range(max(1, min(ns.connections, ns.streams)))]
    firsts = [asyncio.Event() for _ in range(ns.streams)]
    tasks = [
        asyncio.create_task(_stream_forever(_stub(channels[i % len(channels)]), counts, first, ns))
        for i, first in enumerate(firsts)
    ]
    await _serve_counts(counts, firsts, tasks)
    await asyncio.gather(*(channel.close(None) for channel in channels))


def completion_body(prompt: str, output_len: int) -> dict[str, object]:
    """The SSE client's `/v1/completions` request: a long greedy stream, every chunk one event.

    `logprobs: 0` (the sampled token only, no alternatives) makes each event carry its tokens
    (`logprobs.tokens`, one entry per token), so they can be counted exactly as they arrive, and a
    chunk whose text is still empty (a token that ends inside a UTF-8 character) is an event too.
    The usage event at the end (`include_usage`) is the check: its `completion_tokens` must equal
    the stream's count."""
    return {
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 0,
        "stream_options": {"include_usage": True},
    }


async def sse_stream(
    host: str, port: int, body: dict[str, object], on_event: Callable[[bytes], None]
) -> None:
    """POST `body` to `/v1/completions` on a connection of its own (HTTP/1.1, `connection: close`)
    and call `on_event` with each SSE event's `data:` payload (`[DONE]` included), read off the
    socket chunk by chunk (the chunked transfer coding) with no HTTP library, so the client's own
    cost stays small. An event split over chunks is put together first."""
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\nconnection: close\r\n\r\n"
    )
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(head.encode() + data)
        reply = await reader.readuntil(b"\r\n\r\n")
        if not reply.startswith(b"HTTP/1.1 200") or b"transfer-encoding: chunked" not in reply.lower():
            raise RuntimeError(f"the gateway answered {reply[:200]!r}")
        pending = b""
        while size := int((await reader.readline()).split(b";")[0], 16):
            pending += (await reader.readexactly(size + 2))[:-2]
            *events, pending = pending.split(b"\n\n")
            for event in events:
                for line in event.splitlines():
                    if line.startswith(b"data:"):
                        on_event(line[5:].strip())
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


class SseCount:
    """One completion stream's events, added to `counts` as they come: every `data:` event is a
    message, `[DONE]` and the usage event included; tokens are the entries of each choice's
    `logprobs.tokens`; a `finish_reason` finishes the stream. A usage event whose
    `completion_tokens` differs from the stream's count is an error (`usage mismatch`), and so is an
    `error` event."""

    def __init__(self, counts: Counts, first: asyncio.Event) -> None:
        self.counts, self.first, self.tokens = counts, first, 0

    def __call__(self, data: bytes) -> None:
        self.counts.messages += 1
        if data == b"[DONE]":
            return
        event = json.loads(data)
        if "error" in event:  # the gateway ends a failed stream with one
            self.counts.error(f"stream error {event['error'].get('code') or event['error'].get('type')}")
        for choice in event.get("choices", []):
            if choice.get("logprobs"):
                n = len(choice["logprobs"]["tokens"])
                self.tokens += n
                self.counts.tokens += n
                self.counts.token_events += 1
                self.first.set()
            if choice.get("finish_reason"):
                self.counts.finished += 1
        usage = event.get("usage")
        if usage and usage["completion_tokens"] != self.tokens:
            self.counts.error("usage mismatch")


async def _sse_forever(
    host: str, port: int, prompt: str, counts: Counts, first: asyncio.Event, ns: argparse.Namespace
) -> None:
    body = completion_body(prompt, ns.output_len)
    while True:
        try:
            await sse_stream(host, port, body, SseCount(counts, first))
        except (OSError, EOFError, RuntimeError, ValueError) as exc:  # counted, the stream starts over
            counts.error(type(exc).__name__)
            await asyncio.sleep(0.05)


async def sse_client(ns: argparse.Namespace) -> None:
    """`--streams` completion streams through the gateway at `--sse-client`, each on a connection
    of its own; `ready` and `counts` as the gRPC load client's (messages are SSE events)."""
    host, port = ns.sse_client.rsplit(":", 1)
    counts = Counts()
    firsts = [asyncio.Event() for _ in range(ns.streams)]
    tasks = [
        asyncio.create_task(
            _sse_forever(host, int(port), f"Once upon a time, stream {i},", counts, first, ns)
        )
        for i, first in enumerate(firsts)
    ]
    await _serve_counts(counts, firsts, tasks)


async def burst_client(ns: argparse.Namespace) -> None:
    """`--burst-calls` short Generate calls, `--burst-concurrency` at a time over `--connections`
    channels, each timed to its first message; reports calls accepted per second."""
    request = generate_request(PROBE_PROMPT, sampling_params(max_new_tokens=1, ignore_eos=True))
    channels = [_channel(ns.burst_client) for _ in range(max(1, ns.connections))]
    await asyncio.gather(*(channel.channel_ready() for channel in channels))
    stubs = [_stub(channel) for channel in channels]
    left = iter(range(ns.burst_calls))
    counts = Counts()

    async def caller() -> None:
        for i in left:
            call = stubs[i % len(stubs)].Generate(request)
            try:
                async for _ in call:
                    counts.messages += 1
                    break
            except grpc.aio.AioRpcError as exc:
                counts.error(_error_name(exc))
            call.cancel()

    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(ns.burst_concurrency)))
    elapsed = time.perf_counter() - started
    await asyncio.gather(*(channel.close(None) for channel in channels))
    _emit({"event": "burst", "seconds": elapsed, "accepted": counts.messages, "errors": counts.errors})


def busy_loop(fraction: float, period: float = 0.01) -> None:
    """Spin `fraction` of every `period` on one core until the bench is gone."""
    parent = os.getppid()
    while os.getppid() == parent:
        started = time.perf_counter()
        while time.perf_counter() - started < fraction * period:
            pass
        time.sleep(max(0.0, period - (time.perf_counter() - started)))


# --- the bench's side ---------------------------------------------------------------------------


class Child:
    """This file run in a child mode; JSON lines on its stdout, commands on its stdin."""

    def __init__(self, proc: asyncio.subprocess.Process, name: str) -> None:
        self.proc, self.name = proc, name

    @classmethod
    async def start(cls, name: str, *args: str) -> Child:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(THIS), *args, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        return cls(proc, name)

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command.encode() + b"\n")
        await self.proc.stdin.drain()

    async def read(self, event: str, timeout: float) -> dict[str, Any]:
        """The next message of kind `event` (others are skipped)."""
        assert self.proc.stdout is not None
        async with asyncio.timeout(timeout):
            while line := await self.proc.stdout.readline():
                message: dict[str, Any] = json.loads(line)
                if message.get("event") == event:
                    return message
        raise RuntimeError(f"{self.name} exited (status {await self.proc.wait()})")

    async def counts(self) -> Counts:
        await self.send("counts")
        message = await self.read("counts", 30)
        return Counts(**{name: message[name] for name in Counts.__dataclass_fields__})

    async def stop(self) -> None:
        if self.proc.returncode is None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):  # it is gone already
                await self.send("stop")
                self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 5)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()


async def _ready(path: Path, proc: subprocess.Popen[bytes], what: str) -> dict[str, Any]:
    try:
        return await ready_file(path, proc, 60, what)
    except DidNotStart as exc:
        raise DidNotStart(f"{exc} (--verbose shows its log)") from None


class Stack:
    """A `stepwise control` of the checkout at --root, its sim workers, and with --gateway-streams
    a `stepwise gateway` in front of it."""

    def __init__(self, ns: argparse.Namespace, stream_interval: int) -> None:
        self.ns = ns
        self.stream_interval = stream_interval
        self.root = Path(ns.root).resolve()
        self.tmp = tempfile.TemporaryDirectory(prefix="bench-control-")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.ready: dict[str, Any] = {}
        self.frontends_flag: str | None = None
        self.gateway_proc: subprocess.Popen[bytes] | None = None

    def _spawn(self, *args: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stepwise.cli", *args],
            cwd=self.root,
            env={**os.environ, "PYTHONPATH": str(self.root)},
            stderr=None if self.ns.verbose else subprocess.DEVNULL,
        )
        self.procs.append(proc)
        return proc

    def _control_flags(self) -> list[str]:
        ns, root = self.ns, self.root
        flags = ["--port", "0", "--worker-port", "0", "--log-level", "warning"]
        flags += ["--chunked-prefill-size", "-1"]
        if _supports(root, "--stream-interval"):
            flags += ["--stream-interval", str(self.stream_interval)]
        if _accepts(root, "--frontends", ns.frontends):
            flags += ["--frontends", ns.frontends]
            self.frontends_flag = ns.frontends
        elif _supports(root, "--frontends"):
            print(f"{root}: --frontends does not take {ns.frontends!r}; left out", file=sys.stderr)
        if ns.disable_overlap and _supports(root, "--disable-overlap-schedule"):
            flags.append("--disable-overlap-schedule")
        return flags

    def _spawn_worker(self, i: int) -> None:
        self._spawn(
            "worker",
            "--backend",
            "sim",
            "--sim-cost",
            f"{self.ns.step_ms / 1000},0,0",
            "--kv-tokens",
            str(self.ns.kv_tokens),
            "--control",
            f"127.0.0.1:{self.ready['worker_port']}",
            "--worker-id",
            f"sim-{i}",
            "--log-level",
            "warning",
        )

    async def start(self) -> str:
        """Start the control plane and its workers; the client address."""
        ready = Path(self.tmp.name) / "ready.json"
        control = self._spawn("control", *self._control_flags(), "--ready-file", str(ready))
        self.ready = await _ready(ready, control, "control plane")
        for i in range(self.ns.workers):
            self._spawn_worker(i)
        return f"127.0.0.1:{self.ready['port']}"

    async def start_gateway(self, address: str) -> str:
        """Start `stepwise gateway --workers --gateway-workers` in front of the control plane at
        `address` (the model is both sides' default, the embedded one); its HTTP address, once it
        accepts."""
        ready = Path(self.tmp.name) / "gateway.json"
        gateway = self._spawn(
            "gateway",
            *("--control", address, "--host", "127.0.0.1", "--port", "0"),
            *("--workers", str(self.ns.gateway_workers), "--log-level", "warning"),
            *("--ready-file", str(ready)),
        )
        self.gateway_proc = gateway
        return f"127.0.0.1:{(await _ready(ready, gateway, 'the gateway'))['port']}"

    @property
    def core_pid(self) -> int:
        return int(self.ready.get("pid", self.procs[0].pid))

    @property
    def frontend_pids(self) -> list[int]:
        return [int(p) for p in self.ready.get("frontend_pids", [])]

    def stop(self) -> None:
        stop_processes(self.procs, 10, signal.SIGTERM)
        self.tmp.cleanup()


@dataclass(slots=True)
class ProbeStats:
    seconds: list[float] = field(default_factory=list)
    sent: int = 0
    timeouts: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def fail(self, exc: BaseException) -> None:
        if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            self.timeouts += 1
        else:
            self.errors[_error_name(exc)] = self.errors.get(_error_name(exc), 0) + 1

    def summary(self) -> dict[str, object]:
        return {"sent": self.sent, "answered": len(self.seconds), **_quantiles_ms(self.seconds)} | {
            "timeouts": self.timeouts,
            "errors": self.errors,
        }


class ProbeChannels:
    """size 0: a fresh channel (a connection of its own) per probe, closed after it; size N: N
    channels connected up front, used in turn."""

    def __init__(self, address: str, size: int) -> None:
        self.address = address
        self.pool = [_channel(address) for _ in range(size)]
        self.turn = 0

    async def connect(self) -> None:
        await asyncio.gather(*(channel.channel_ready() for channel in self.pool))

    def take(self) -> grpc.aio.Channel:
        if not self.pool:
            return _channel(self.address)
        self.turn += 1
        return self.pool[self.turn % len(self.pool)]

    async def give_back(self, channel: grpc.aio.Channel) -> None:
        if not self.pool:
            await channel.close(None)

    async def close(self) -> None:
        await asyncio.gather(*(channel.close(None) for channel in self.pool))


async def _ttft_probe(channels: ProbeChannels, ns: argparse.Namespace, stats: ProbeStats) -> None:
    """One short call, timed from sending it to its first chunk; read to its end."""
    request = generate_request(PROBE_PROMPT, sampling_params(max_new_tokens=PROBE_TOKENS, ignore_eos=True))
    stats.sent += 1
    channel = channels.take()
    first = False
    try:
        started = time.perf_counter()
        async for response in _stub(channel).Generate(request, timeout=ns.probe_timeout):
            if not first and response.WhichOneof("event") == "chunk":
                stats.seconds.append(time.perf_counter() - started)
                first = True
        if not first:
            stats.errors["no chunk"] = stats.errors.get("no chunk", 0) + 1
    except grpc.aio.AioRpcError as exc:
        if not first:
            stats.fail(exc)
    finally:
        await channels.give_back(channel)


async def _info_probe(client: StepwiseClient, ns: argparse.Namespace, stats: ProbeStats) -> None:
    stats.sent += 1
    try:
        started = time.perf_counter()
        await client.stub.GetServerInfo(gen_pb.GetServerInfoRequest(), timeout=ns.probe_timeout)
        stats.seconds.append(time.perf_counter() - started)
    except grpc.aio.AioRpcError as exc:
        stats.fail(exc)


async def _open_loop(
    rate: float,
    stop: asyncio.Event,
    probe: Callable[[], Coroutine[Any, Any, None]],
    tasks: list[asyncio.Task[None]],
) -> None:
    """Start `probe` `rate` times a second, on schedule whether or not earlier ones answered."""
    if rate <= 0:
        return
    due = time.monotonic()
    while not stop.is_set():
        tasks.append(asyncio.create_task(probe()))
        due += 1.0 / rate
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, due - time.monotonic()))


def load_plan(ns: argparse.Namespace) -> list[tuple[int, int]]:
    """(streams, connections) for each load process: the streams split evenly over --client-procs,
    at most one connection per stream."""
    total, parts = ns.workers * ns.running, ns.client_procs
    streams = [total // parts + (1 if i < total % parts else 0) for i in range(parts)]
    return [(n, min(n, ns.connections)) for n in streams if n]


async def _start_load(ns: argparse.Namespace, address: str, children: list[Child]) -> list[Child]:
    started = await asyncio.gather(
        *(
            Child.start(
                f"load client {i}",
                *("--load-client", address, "--streams", str(n), "--connections", str(c)),
                *("--prompt-len", str(ns.prompt_len), "--output-len", str(ns.output_len)),
            )
            for i, (n, c) in enumerate(load_plan(ns))
        )
    )
    children += started
    try:
        await asyncio.gather(*(child.read("ready", ns.ready_timeout) for child in started))
    except TimeoutError:
        print(
            f"not every stream had a chunk within {ns.ready_timeout:g} s; measuring anyway", file=sys.stderr
        )
    return list(started)


async def _start_sse(ns: argparse.Namespace, gateway: str, children: list[Child]) -> Child:
    child = await Child.start(
        "SSE client",
        *("--sse-client", gateway, "--streams", str(ns.gateway_streams)),
        *("--output-len", str(ns.output_len)),
    )
    children.append(child)
    try:
        await child.read("ready", ns.ready_timeout)
    except TimeoutError:
        print(
            f"not every SSE stream had a token within {ns.ready_timeout:g} s; measuring anyway",
            file=sys.stderr,
        )
    return child


async def _burst(ns: argparse.Namespace, address: str, children: list[Child]) -> dict[str, object]:
    child = await Child.start(
        "burst client",
        *("--burst-client", address, "--connections", str(ns.connections)),
        *("--burst-calls", str(ns.burst_calls), "--burst-concurrency", str(ns.burst_concurrency)),
    )
    children.append(child)
    report = await child.read("burst", 300)
    return {
        "calls": ns.burst_calls,
        "accepted": report["accepted"],
        "accepted_per_s": round(report["accepted"] / report["seconds"], 1),
        "errors": report["errors"],
    }


@dataclass(slots=True)
class Window:
    """What the measured window saw."""

    elapsed: float
    counts: Counts
    core_cpu: float
    frontend_cpu: list[float]
    client_cpu: float
    busy_cpu: float
    steps: dict[str, int]
    after: gen_pb.ServerInfo
    ttft: ProbeStats
    info: ProbeStats
    # With --gateway-streams: what the SSE client read (messages are SSE events), the gateway's CPU
    # (its process tree) and the SSE client's.
    sse: Counts | None = None
    gateway_cpu: float = 0.0
    sse_client_cpu: float = 0.0


def _cpu(pids: Sequence[int]) -> list[float]:
    return [_cpu_seconds(pid) for pid in pids]


async def _measure(
    ns: argparse.Namespace,
    stack: Stack,
    client: StepwiseClient,
    load: list[Child],
    busy: int | None,
    sse: Child | None = None,
) -> Window:
    ttft, info, stop = ProbeStats(), ProbeStats(), asyncio.Event()
    channels = ProbeChannels(client.address, ns.probe_channels)
    probes: list[asyncio.Task[None]] = []
    drivers: list[asyncio.Task[None]] = []
    try:
        await channels.connect()
        before = await client.server_info()
        readers = [*load, *([sse] if sse else [])]  # the SSE client's counts last
        counts0 = await asyncio.gather(*(child.counts() for child in readers))
        pids = [
            stack.core_pid,
            busy or 0,
            sse.pid if sse else 0,
            *(c.pid for c in load),
            *stack.frontend_pids,
        ]
        gateway = stack.gateway_proc.pid if stack.gateway_proc else 0
        gateway0 = _tree_cpu_seconds(gateway) if gateway else 0.0
        cpu0, t0 = _cpu(pids), time.perf_counter()
        drivers = [
            asyncio.create_task(
                _open_loop(ns.probe_rate, stop, lambda: _ttft_probe(channels, ns, ttft), probes)
            ),
            asyncio.create_task(
                _open_loop(ns.info_rate, stop, lambda: _info_probe(client, ns, info), probes)
            ),
        ]
        await asyncio.sleep(ns.seconds)
        stop.set()
        await asyncio.gather(*drivers)
        counts1 = await asyncio.gather(*(child.counts() for child in readers))
        gateway1 = _tree_cpu_seconds(gateway) if gateway else 0.0
        cpu1, elapsed = _cpu(pids), time.perf_counter() - t0
        after = await client.server_info()
        if probes:  # the last ones sent have up to their timeout to answer
            await asyncio.wait(probes, timeout=ns.probe_timeout + 1)
    finally:  # also when cancelled (Ctrl-C): no probe may outlive the channels
        stop.set()
        for tasks in (drivers, probes):
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await channels.close()
    cpu = [b - a for a, b in zip(cpu0, cpu1, strict=True)]
    return Window(
        elapsed=elapsed,
        counts=sum(
            (b - a for a, b in zip(counts0[: len(load)], counts1[: len(load)], strict=True)), Counts()
        ),
        core_cpu=cpu[0],
        busy_cpu=cpu[1],
        client_cpu=sum(cpu[3 : 3 + len(load)]),
        frontend_cpu=cpu[3 + len(load) :],
        steps={w.worker_id: w.steps for w in before.workers},
        after=after,
        ttft=ttft,
        info=info,
        sse=counts1[-1] - counts0[-1] if sse else None,
        gateway_cpu=gateway1 - gateway0,
        sse_client_cpu=cpu[2],
    )


def _per_worker(ns: argparse.Namespace, window: Window) -> dict[str, dict[str, float]]:
    ideal = 1000.0 / ns.step_ms
    workers: dict[str, dict[str, float]] = {}
    for w in window.after.workers:
        achieved = (w.steps - window.steps.get(w.worker_id, 0)) / window.elapsed
        workers[w.worker_id] = {
            "step_rate_fraction": round(achieved / ideal, 3),
            "running": w.running,
            "idle_gap_p50_ms": round(getattr(w, "wait_p50_s", 0.0) * 1e3, 3),
            "idle_gap_p99_ms": round(getattr(w, "wait_p99_s", 0.0) * 1e3, 3),
        }
    return workers


def _steps(window: Window) -> int:
    """Steps every worker made in the window, together."""
    return sum(w.steps - window.steps.get(w.worker_id, 0) for w in window.after.workers)


def _gateway_report(ns: argparse.Namespace, w: Window) -> dict[str, object]:
    """The gateway's figures in the window (None without --gateway-streams). The per-stream ratio is
    the SSE streams' tokens/s per stream over the gRPC load's: 1 when a stream through the gateway
    keeps the pace of one straight to the control plane."""
    keys = ("events_per_s", "tokens_per_s", "cpu_us_per_event", "cpu_us_per_token", "cpu_fraction")
    keys += ("per_stream_ratio", "sse_client_cpu_fraction", "finished", "errors")
    if w.sse is None:
        return {"gateway_streams": 0, "gateway_workers": None} | {f"gateway_{k}": None for k in keys}
    s, events, tokens = w.elapsed, w.sse.messages, w.sse.tokens
    grpc_per_stream = w.counts.tokens / s / max(ns.workers * ns.running, 1)
    figures = {
        "events_per_s": round(events / s, 1),
        "tokens_per_s": round(tokens / s, 1),
        "cpu_us_per_event": round(w.gateway_cpu / max(events, 1) * 1e6, 1),
        "cpu_us_per_token": round(w.gateway_cpu / max(tokens, 1) * 1e6, 1),
        "cpu_fraction": round(w.gateway_cpu / s, 3),
        "per_stream_ratio": round(tokens / s / ns.gateway_streams / grpc_per_stream, 3)
        if grpc_per_stream
        else None,
        "sse_client_cpu_fraction": round(w.sse_client_cpu / s, 3),
        "finished": w.sse.finished,
        "errors": w.sse.errors,
    }
    return {"gateway_streams": ns.gateway_streams, "gateway_workers": ns.gateway_workers} | {
        f"gateway_{k}": v for k, v in figures.items()
    }


def _report(ns: argparse.Namespace, stack: Stack, w: Window, burst: dict[str, object]) -> dict[str, object]:
    tokens, messages, s = w.counts.tokens, w.counts.messages, w.elapsed
    # What the control plane streamed in all: the gateway's streams too (its token events are the
    # chunk messages the frontends sent it); the core's and the frontends' CPU is over these.
    served = w.counts + w.sse if w.sse else w.counts
    served_tokens, served_messages = served.tokens, w.counts.messages + served.token_events
    workers = _per_worker(ns, w)
    return {
        "root": str(stack.root),
        "stream_interval": stack.stream_interval,
        "workers": ns.workers,
        "running_per_worker": ns.running,
        "client_procs": len(load_plan(ns)),
        "connections": sum(c for _, c in load_plan(ns)),
        "frontends_flag": stack.frontends_flag,
        "frontend_processes": len(stack.frontend_pids),
        "overlap": not ns.disable_overlap,
        "step_ms": ns.step_ms,
        "busy_fraction": ns.busy_fraction,
        "seconds": round(s, 2),
        "tokens_per_s": round(tokens / s, 1),
        "client_messages_per_s": round(messages / s, 1),
        "tokens_per_message": round(tokens / max(messages, 1), 2),
        "finished": w.counts.finished,
        "core_cpu_us_per_token": round(w.core_cpu / max(served_tokens, 1) * 1e6, 2),
        "core_cpu_us_per_step": round(w.core_cpu / max(_steps(w), 1) * 1e6, 1),
        "core_cpu_fraction": round(w.core_cpu / s, 3),
        "frontend_cpu_us_per_message": round(sum(w.frontend_cpu) / max(served_messages, 1) * 1e6, 2)
        if w.frontend_cpu
        else None,
        "frontend_cpu_fraction": [round(c / s, 3) for c in w.frontend_cpu],
        "client_cpu_fraction": round(w.client_cpu / s, 3),
        "busy_cpu_fraction": round(w.busy_cpu / s, 3),
        "ttft": w.ttft.summary(),
        "ttft_channels": f"a pool of {ns.probe_channels}" if ns.probe_channels else "fresh per probe",
        "server_info": w.info.summary(),
        "calls_accepted_per_s": burst["accepted_per_s"],
        "burst": burst,
        "min_step_rate_fraction": min((v["step_rate_fraction"] for v in workers.values()), default=0.0),
        "errors": w.counts.errors,
        **_gateway_report(ns, w),
        "per_worker": workers,
    }


async def run_once(ns: argparse.Namespace, stream_interval: int, busy: int | None) -> dict[str, object]:
    """Start the stack with this stream interval, load it, measure, stop everything."""
    stack = Stack(ns, stream_interval)
    children: list[Child] = []
    try:
        address = await stack.start()
        async with StepwiseClient(address) as client:
            await client.wait_ready(60)
            while len((await client.server_info()).workers) < ns.workers:
                await asyncio.sleep(0.1)
            load = await _start_load(ns, address, children)
            sse = None
            if ns.gateway_streams > 0:
                sse = await _start_sse(ns, await stack.start_gateway(address), children)
            await asyncio.sleep(ns.warmup)
            window = await _measure(ns, stack, client, load, busy, sse)
            burst = await _burst(ns, address, children)
    finally:
        await asyncio.gather(*(child.stop() for child in children), return_exceptions=True)
        stack.stop()
    return _report(ns, stack, window, burst)


COLUMNS: list[tuple[str, Callable[[dict[str, Any]], object]]] = [
    ("interval", lambda r: r["stream_interval"]),
    ("tok/s", lambda r: r["tokens_per_s"]),
    ("tok/msg", lambda r: r["tokens_per_message"]),
    ("core µs/tok", lambda r: r["core_cpu_us_per_token"]),
    ("core µs/step", lambda r: r["core_cpu_us_per_step"]),
    ("fe µs/msg", lambda r: r["frontend_cpu_us_per_message"]),
    (
        "gw µs/event",
        lambda r: "-" if r["gateway_cpu_us_per_event"] is None else r["gateway_cpu_us_per_event"],
    ),
    ("min step", lambda r: r["min_step_rate_fraction"]),
    ("ttft p50/p99/max ms", lambda r: "{p50_ms}/{p99_ms}/{max_ms}".format(**r["ttft"])),
    ("ttft t/o", lambda r: f"{r['ttft']['timeouts']}/{r['ttft']['sent']}"),
    ("info p99 ms", lambda r: r["server_info"]["p99_ms"]),
    ("calls/s", lambda r: r["calls_accepted_per_s"]),
]


def table(results: Sequence[dict[str, Any]]) -> str:
    rows = [[name for name, _ in COLUMNS]] + [[str(cell(r)) for _, cell in COLUMNS] for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows)


async def bench(ns: argparse.Namespace) -> None:
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    busy: subprocess.Popen[bytes] | None = None
    results = []
    try:
        if ns.busy_fraction > 0:
            busy = subprocess.Popen([sys.executable, str(THIS), "--busy-loop", str(ns.busy_fraction)])
        for interval in ns.stream_interval:
            results.append(await run_once(ns, interval, busy.pid if busy else None))
            print(json.dumps(results[-1], indent=2), flush=True)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    print(table(results))


def _frontends(text: str) -> str:
    if text != "auto" and not text.isdigit():
        raise argparse.ArgumentTypeError("an integer or auto")
    return text


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--root", default=str(ROOT), help="the checkout whose `stepwise` to run")
    add("--workers", type=int, default=4)
    add("--running", type=int, default=32, help="streams per worker")
    add("--stream-interval", type=int, nargs="+", default=[1], help="one run per value")
    add("--frontends", type=_frontends, default="1", help="an integer, or auto where the server takes it")
    add("--disable-overlap", action="store_true")
    add("--step-ms", type=float, default=10.0, help="the sim worker's time per step")
    add("--prompt-len", type=int, default=16)
    add("--output-len", type=int, default=4000)
    add("--kv-tokens", type=int, default=1 << 20)
    add("--client-procs", type=int, default=4, help="processes the streaming load is spread over")
    add("--connections", type=int, help="channels (TCP connections) per client process (default: 32 in all)")
    add("--probe-rate", type=float, default=20.0, help="new short calls per second, timed to first chunk")
    add("--probe-channels", type=int, default=0, help="0: a fresh channel per probe; N: a pool of N")
    add("--probe-timeout", type=float, default=5.0, help="a probe without a first chunk by then times out")
    add("--info-rate", type=float, default=5.0, help="GetServerInfo calls per second")
    add("--warmup", type=float, default=5.0, help="seconds between the streams' start and the window")
    add("--seconds", type=float, default=15.0, help="the measured window")
    add("--ready-timeout", type=float, default=60.0, help="the longest wait for every stream's first chunk")
    add("--burst-calls", type=int, default=2000)
    add("--burst-concurrency", type=int, default=200)
    add("--busy-fraction", type=float, default=0.0, help="a competing process spins this much of a core")
    add(
        "--gateway-streams",
        type=int,
        default=0,
        metavar="N",
        help="also start a `stepwise gateway` and keep N /v1/completions SSE streams open through it, on "
        "top of the gRPC load (default 0: no gateway)",
    )
    add("--gateway-workers", type=int, default=1, help="the gateway's --workers (with --gateway-streams)")
    add("--verbose", action="store_true", help="show the servers' logs")
    # The child modes: this file run by the bench itself.
    add("--load-client", metavar="ADDRESS", help=argparse.SUPPRESS)
    add("--burst-client", metavar="ADDRESS", help=argparse.SUPPRESS)
    add("--sse-client", metavar="HOST:PORT", help=argparse.SUPPRESS)
    add("--busy-loop", type=float, metavar="FRACTION", help=argparse.SUPPRESS)
    add("--streams", type=int, default=1, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if not 0 <= ns.busy_fraction <= 1:
        parser.error("--busy-fraction: between 0 and 1")
    if ns.client_procs < 1:
        parser.error("--client-procs: at least 1")
    if ns.gateway_streams < 0:
        parser.error("--gateway-streams: 0 or more")
    if ns.gateway_workers < 1:
        parser.error("--gateway-workers: at least 1")
    if ns.connections is None:
        ns.connections = max(1, math.ceil(32 / ns.client_procs))
    return ns


def main() -> None:
    ns = parse_args()
    if ns.busy_loop is not None or ns.load_client or ns.burst_client or ns.sse_client:
        # A child: Ctrl-C reaches the bench, which stops it; it must not die half-way on its own.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if ns.busy_loop is not None:
        busy_loop(ns.busy_loop)
    elif ns.load_client:
        asyncio.run(load_client(ns))
    elif ns.burst_client:
        asyncio.run(burst_client(ns))
    elif ns.sse_client:
        asyncio.run(sse_client(ns))
    else:
        try:
            asyncio.run(bench(ns))
        except (KeyboardInterrupt, asyncio.CancelledError):
            sys.exit(130)


if __name__ == "__main__":
    main()
