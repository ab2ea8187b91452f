"""End-to-end fixtures: real processes on 127.0.0.1 with ephemeral ports, always stopped."""

from __future__ import annotations

import asyncio
import functools
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import pytest

from stepwise.models import resolve_model
from stepwise.up import Stack, stop_processes
from tests.processes import ready_file

# --strict-invariants: the KV pool invariants are checked after every step; a violation ends the run.
CONTROL_BASE = [
    "--host",
    "127.0.0.1",
    "--port",
    "0",
    "--worker-port",
    "0",
    "--log-level",
    "warning",
    "--strict-invariants",
]
WORKER_BASE = ["--log-level", "warning"]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return resolve_model("embedded")


@functools.cache
def reference_model(model_dir: Path):  # type: ignore[no-untyped-def]
    """transformers' own model on the same checkpoint (float32, CPU), loaded once per session."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_greedy(
    model_dir: Path, prompt_ids: Sequence[int], max_new_tokens: int, eos: set[int], ignore_eos: bool = False
) -> list[int]:
    """Greedy tokens transformers' generate() produces for this prompt alone, EOS not included."""
    import copy

    import torch

    model = reference_model(model_dir)
    config = copy.deepcopy(model.generation_config)
    config.do_sample, config.max_new_tokens = False, max_new_tokens
    config.pad_token_id = min(eos) if eos else 0
    if ignore_eos:
        # None falls back to the model's EOS; an id no token has never stops (transformers warns).
        config.eos_token_id = -1
    with torch.no_grad():
        out = model.generate(
            torch.tensor([list(prompt_ids)]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            generation_config=config,
        )
    tokens = out[0, len(prompt_ids) :].tolist()
    if ignore_eos:
        return tokens
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[:i]
    return tokens


StackFactory = Callable[..., "AsyncIterator[Stack]"]


@pytest.fixture
async def start_stack() -> AsyncIterator[Callable[..., object]]:
    """`stack = await start_stack(control_flags, worker_flags, workers=1)`; all stopped at teardown."""
    stacks: list[Stack] = []

    async def start(control: Sequence[str] = (), worker: Sequence[str] = (), workers: int = 1) -> Stack:
        stack = Stack([*CONTROL_BASE, *control], [*WORKER_BASE, *worker], workers)
        stacks.append(stack)
        await stack.start(timeout=120)
        return stack

    try:
        yield start
    finally:
        for stack in stacks:
            stack.stop()


class ControlProcess:
    """One `stepwise control` child plus any workers a test adds; `stop()` ends them all."""

    def __init__(self, flags: Sequence[str], tmp: Path, env: dict[str, str] | None = None) -> None:
        self.flags = list(flags)
        self.tmp = tmp
        self.env = env  # the control plane's environment, beyond this process's
        self.procs: list[subprocess.Popen[bytes]] = []
        self.address = ""
        self.worker_address = ""
        # What the control plane wrote to its ready file (ports, its pid, its frontends' pids).
        self.ready: dict[str, object] = {}

    def spawn(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stepwise.cli", *args], env={**os.environ, **(env or {})}
        )
        self.procs.append(proc)
        return proc

    async def start(self, timeout: float = 60.0) -> ControlProcess:
        ready = self.tmp / f"ready-{len(self.procs)}.json"
        control = self.spawn("control", *CONTROL_BASE, *self.flags, "--ready-file", str(ready), env=self.env)
        self.ready = await ready_file(ready, control, timeout, "control plane")
        self.address = f"127.0.0.1:{self.ready['port']}"
        self.worker_address = f"127.0.0.1:{self.ready['worker_port']}"
        return self

    @property
    def control(self) -> subprocess.Popen[bytes]:
        return self.procs[0]

    def add_worker(self, worker_id: str, *flags: str, sim: bool = True) -> subprocess.Popen[bytes]:
        backend = ["--backend", "sim", "--sim-cost", "0.002,0,0"] if sim else []
        return self.spawn(
            "worker",
            *WORKER_BASE,
            *backend,
            "--control",
            self.worker_address,
            "--worker-id",
            worker_id,
            *flags,
        )

    async def wait_workers(self, n: int, timeout: float = 60.0, **client: object) -> None:
        from clients.client import StepwiseClient

        deadline = time.monotonic() + timeout
        async with StepwiseClient(self.address, **client) as c:  # type: ignore[arg-type]
            while len((await c.server_info()).workers) != n:
                assert self.control.poll() is None, "control plane exited"
                assert time.monotonic() < deadline, f"{n} workers did not attach"
                await asyncio.sleep(0.05)

    def stop(self, timeout: float = 10.0) -> None:
        stop_processes(self.procs, timeout)


@pytest.fixture
async def start_control(tmp_path: Path) -> AsyncIterator[Callable[..., object]]:
    """`plane = await start_control(*flags)`: a control plane alone; workers via `plane.add_worker`."""
    planes: list[ControlProcess] = []

    async def start(*flags: str) -> ControlProcess:
        plane = ControlProcess(flags, tmp_path)
        planes.append(plane)
        return await plane.start()

    try:
        yield start
    finally:
        for plane in planes:
            plane.stop()
