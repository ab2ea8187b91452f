"""Is the control plane ever the bottleneck? One `stepwise control` with sim workers and a load client.

Each sim worker takes a fixed time per step (10 ms by default), so its ideal step rate is known: a
control plane that keeps it fed reaches it. The load client keeps `--running` streams per worker
open (long greedy generations with ignore_eos, a new one as soon as one ends) and reports, over a
measured window after a warm-up:

- per worker: the achieved fraction of the ideal step rate, and its idle gap between finishing a
  step and receiving the next plan (p50, p99; from GetServerInfo, when the server reports it);
- core CPU µs per generated token and frontend CPU µs per client message (/proc, Linux);
- total generated tokens/s as the client received them;
- Generate calls accepted per second while streaming (a burst of short calls beside the load).

Run from the repository root (or `--root` another checkout, e.g. a worktree of an older commit, to
compare in one run); every flag the server does not know is left out:

    python bench/bench_control.py --workers 8 --running 32 --stream-interval 8
    python bench/bench_control.py --workers 4 --running 128 --stream-interval 16
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(slots=True)
class Load:
    tokens: int = 0
    messages: int = 0
    finished: int = 0
    errors: dict[str, int] = field(default_factory=dict)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, from /proc (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _supports(root: Path, flag: str) -> bool:
    out = subprocess.run(
        [sys.executable, "-m", "stepwise.cli", "control", "--help"],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    )
    return flag in out.stdout


class Stack:
    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        self.root = Path(ns.root).resolve()
        self.tmp = tempfile.TemporaryDirectory(prefix="bench-control-")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.ready: dict[str, object] = {}

    def _spawn(self, *args: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONPATH": str(self.root)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "stepwise.cli", *args],
            cwd=self.root,
            env=env,
            stderr=subprocess.DEVNULL if not self.ns.verbose else None,
        )
        self.procs.append(proc)
        return proc

    async def start(self) -> str:
        ns = self.ns
        ready = Path(self.tmp.name) / "ready.json"
        flags = ["--port", "0", "--worker-port", "0", "--log-level", "warning"]
        flags += ["--chunked-prefill-size", "-1"]
        optional = {
            "--stream-interval": str(ns.stream_interval),
            "--frontends": str(ns.frontends),
        }
        for flag, value in optional.items():
            if _supports(self.root, flag):
                flags += [flag, value]
        if ns.disable_overlap and _supports(self.root, "--disable-overlap-schedule"):
            flags.append("--disable-overlap-schedule")
        control = self._spawn("control", *flags, "--ready-file", str(ready))
        deadline = time.monotonic() + 60
        while not ready.exists():
            if control.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("control plane did not start")
            await asyncio.sleep(0.05)
        self.ready = json.loads(ready.read_text())
        worker_port = self.ready["worker_port"]
        for i in range(ns.workers):
            self._spawn(
                "worker",
                "--backend",
                "sim",
                "--sim-cost",
                f"{ns.step_ms / 1000},0,0",
                "--kv-tokens",
                str(ns.kv_tokens),
                "--control",
                f"127.0.0.1:{worker_port}",
                "--worker-id",
                f"sim-{i}",
                "--log-level",
                "warning",
            )
        return f"127.0.0.1:{self.ready['port']}"

    @property
    def core_pid(self) -> int:
        return int(self.ready.get("pid", self.procs[0].pid))  # type: ignore[call-overload]

    @property
    def frontend_pids(self) -> list[int]:
        return [int(p) for p in self.ready.get("frontend_pids", [])]  # type: ignore[attr-defined]

    def stop(self) -> None:
        for proc in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.tmp.cleanup()


async def _stream_forever(client: object, load: Load, stop: asyncio.Event, ns: argparse.Namespace) -> None:
    from clients.client import generate_request, sampling_params

    sampling = sampling_params(max_new_tokens=ns.output_len, ignore_eos=True, temperature=0.0)
    prompt = list(range(10, 10 + ns.prompt_len))
    stub = client.stub  # type: ignore[attr-defined]
    while not stop.is_set():
        try:
            call = stub.Generate(generate_request(prompt, sampling), metadata=client.metadata)  # type: ignore[attr-defined]
            async for response in call:
                if response.WhichOneof("event") == "chunk":
                    load.tokens += len(response.chunk.token_ids)
                    load.messages += 1
                else:
                    load.finished += 1
                if stop.is_set():
                    call.cancel()
                    break
        except Exception as exc:  # counted, the stream starts over
            name = str(exc.code()) if hasattr(exc, "code") else type(exc).__name__
            load.errors[name] = load.errors.get(name, 0) + 1
            await asyncio.sleep(0.05)


async def _burst(address: str, calls: int, concurrency: int) -> tuple[float, int]:
    """Calls accepted per second: short Generate calls, `concurrency` at a time, timed to their first
    message (a call is accepted once the control plane has queued it and it streams)."""
    from clients.client import StepwiseClient, generate_request, sampling_params

    sampling = sampling_params(max_new_tokens=1, ignore_eos=True, temperature=0.0)
    done = 0
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(calls):
        queue.put_nowait(i)

    async with StepwiseClient(address) as client:

        async def one() -> None:
            nonlocal done
            while not queue.empty():
                queue.get_nowait()
                call = client.stub.Generate(
                    generate_request([11, 12, 13], sampling), metadata=client.metadata
                )
                with contextlib.suppress(Exception):
                    async for _ in call:
                        done += 1
                        call.cancel()
                        break

        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(concurrency)))
        return calls / (time.perf_counter() - started), done


async def run(ns: argparse.Namespace) -> dict[str, object]:
    from clients.client import StepwiseClient

    stack = Stack(ns)
    try:
        address = await stack.start()
        async with StepwiseClient(address) as client:
            await client.wait_ready(60)
            while len((await client.server_info()).workers) < ns.workers:
                await asyncio.sleep(0.1)
            load, stop = Load(), asyncio.Event()
            streams = [
                asyncio.create_task(_stream_forever(client, load, stop, ns))
                for _ in range(ns.workers * ns.running)
            ]
            await asyncio.sleep(ns.warmup)
            before = await client.server_info()
            cpu0 = _cpu_seconds(stack.core_pid), sum(_cpu_seconds(p) for p in stack.frontend_pids)
            tokens0, messages0, t0 = load.tokens, load.messages, time.perf_counter()
            await asyncio.sleep(ns.seconds)
            elapsed = time.perf_counter() - t0
            tokens, messages = load.tokens - tokens0, load.messages - messages0
            cpu1 = _cpu_seconds(stack.core_pid), sum(_cpu_seconds(p) for p in stack.frontend_pids)
            after = await client.server_info()
            rate, accepted = await _burst(address, ns.burst_calls, ns.burst_concurrency)
            stop.set()
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
    finally:
        stack.stop()
    ideal = 1000.0 / ns.step_ms
    steps0 = {w.worker_id: w.steps for w in before.workers}
    workers = {}
    for w in after.workers:
        achieved = (w.steps - steps0.get(w.worker_id, 0)) / elapsed
        workers[w.worker_id] = {
            "step_rate_fraction": round(achieved / ideal, 3),
            "running": w.running,
            "idle_gap_p50_ms": round(getattr(w, "wait_p50_s", 0.0) * 1e3, 3),
            "idle_gap_p99_ms": round(getattr(w, "wait_p99_s", 0.0) * 1e3, 3),
        }
    core_cpu, frontend_cpu = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
    return {
        "root": str(stack.root),
        "workers": ns.workers,
        "running_per_worker": ns.running,
        "stream_interval": ns.stream_interval,
        "overlap": not ns.disable_overlap,
        "step_ms": ns.step_ms,
        "tokens_per_s": round(tokens / elapsed, 1),
        "client_messages_per_s": round(messages / elapsed, 1),
        "core_cpu_us_per_token": round(core_cpu / max(tokens, 1) * 1e6, 2),
        "core_cpu_fraction": round(core_cpu / elapsed, 3),
        "frontend_cpu_us_per_message": round(frontend_cpu / max(messages, 1) * 1e6, 2)
        if stack.frontend_pids
        else None,
        "calls_accepted_per_s": round(rate, 1),
        "burst_calls_streamed": accepted,
        "min_step_rate_fraction": min((w["step_rate_fraction"] for w in workers.values()), default=0.0),
        "errors": load.errors,
        "per_worker": workers,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", default=str(ROOT), help="the checkout whose `stepwise` to run")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--running", type=int, default=32, help="streams per worker")
    parser.add_argument("--stream-interval", type=int, default=1)
    parser.add_argument("--frontends", type=int, default=1)
    parser.add_argument("--disable-overlap", action="store_true")
    parser.add_argument("--step-ms", type=float, default=10.0, help="the sim worker's time per step")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=4000)
    parser.add_argument("--kv-tokens", type=int, default=1 << 20)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--burst-calls", type=int, default=2000)
    parser.add_argument("--burst-concurrency", type=int, default=200)
    parser.add_argument("--verbose", action="store_true", help="show the servers' logs")
    ns = parser.parse_args()
    print(json.dumps(asyncio.run(run(ns)), indent=2))


if __name__ == "__main__":
    main()
