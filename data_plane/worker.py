"""The worker process: load the model, dial the control plane, run plans until told to stop.

Loop, as the design reads: dial (with backoff) -> Hello -> Welcome -> for each StepPlan:
execute, answer with a StepResult carrying the same step_id -> Shutdown ends it.

The session is a pipeline: a reader task reads and decodes plans into a bounded queue as they
arrive, while the executor loop runs the plans in order (in a thread: the forward releases the
GIL) and writes their results in order. With two plans in flight the next one is decoded and
waiting when a step ends, so the worker starts it at once; each result says how long the worker
waited for its plan (`wait_s`).

Exit codes: 0 on Shutdown, SIGTERM or SIGINT; 1 when the stream breaks; 2 when the control plane
refuses the worker; 3 when the control plane cannot be reached within --connect-timeout; 4 when
the model cannot be loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import signal
import sys
import time
from dataclasses import dataclass
from typing import Protocol

import grpc
import structlog
import torch

from data_plane import codec
from data_plane.config import CUDA_KV_MEMORY_FRACTION, DEFAULT_CPU_KV_BYTES, WorkerConfig
from data_plane.config import add_arguments as add_arguments
from data_plane.config import config_from_args as config_from_args
from data_plane.executor import Executor
from data_plane.kv_pool import KvPool, capacity_tokens
from data_plane.messages import Hello, Shutdown, StepPlan, StepResult, Welcome
from data_plane.models.llama import LlamaModel
from data_plane.models.loader import ModelLoadError, model_fingerprint
from data_plane.sim import CostModel, SimExecutor
from protos.stepwise.v1 import worker_pb2_grpc

EXIT_OK = 0
EXIT_STREAM_BROKEN = 1
EXIT_REFUSED = 2
EXIT_CONNECT_FAILED = 3
EXIT_BAD_MODEL = 4

# A control plane keeps a few plans in flight at most; past this many waiting, the reader stops
# reading (gRPC's flow control then holds the control plane back) rather than queue without bound.
MAX_QUEUED_PLANS = 8

_CHANNEL_OPTIONS = [
    # Keep redialing quickly while the control plane starts, instead of grpc's default backoff to 120 s.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
]

log = structlog.get_logger("data_plane.worker")


class StepExecutor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult: ...


@dataclass(frozen=True, slots=True)
class LoadedWorker:
    executor: StepExecutor
    hello: Hello


class StreamBroken(Exception):
    """The control plane went away or broke the protocol."""


@dataclass(frozen=True, slots=True)
class _Arrived:
    """A decoded plan, and when it was ready (time.perf_counter())."""

    plan: StepPlan
    at: float


# What the reader hands the executor loop, in stream order: plans, then a Shutdown or the error
# that ended reading.
_Inbox = asyncio.Queue[_Arrived | Shutdown | Exception]


# ---- start-up ----------------------------------------------------------------------------------


def configure_logging() -> None:
    """structlog to stderr: JSON lines when stderr is not a terminal, readable text when it is."""
    renderer = structlog.dev.ConsoleRenderer() if sys.stderr.isatty() else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"--device {name} requested but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: float32 on CPU, bfloat16 on CUDA."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_worker(config: WorkerConfig) -> LoadedWorker:
    """Load weights, size and allocate the KV pool, and describe the worker; ModelLoadError on failure."""
    if config.backend == "sim":
        return load_sim_worker(config)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    model = LlamaModel.from_dir(config.model, device, dtype)
    capacity = capacity_tokens(
        model.config, dtype, config.kv_tokens, _kv_budget_bytes(config, device), config.page_size
    )
    pool = KvPool(model.config, capacity, dtype, device)
    executor = Executor(model, pool, host_pool_tokens=config.host_pool_tokens)
    hello = Hello(
        worker_id=config.worker_id,
        model_fingerprint=model_fingerprint(config.model),
        kv_capacity_tokens=capacity,
        page_size=config.page_size,
        max_context=model.config.max_position_embeddings,
        vocab_size=model.config.vocab_size,
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        eos_token_ids=model.config.eos_token_ids,
        host_pool_capacity_tokens=config.host_pool_tokens,
    )
    return LoadedWorker(executor, hello)


SIM_DEFAULT_KV_TOKENS = 1 << 18


def load_sim_worker(config: WorkerConfig) -> LoadedWorker:
    """The simulator: vocabulary, EOS and context from config.json, no weights, no pool."""
    try:
        raw = json.loads((config.model / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"sim backend needs {config.model / 'config.json'}: {exc}") from exc
    eos = raw.get("eos_token_id", 0)
    eos_ids = tuple(eos) if isinstance(eos, list) else (int(eos),)
    capacity = (config.kv_tokens or SIM_DEFAULT_KV_TOKENS) // config.page_size * config.page_size
    cost = CostModel.parse(config.sim_cost)
    executor = SimExecutor(capacity, int(raw["vocab_size"]), eos_ids[0], cost, sleep=True)
    hello = Hello(
        worker_id=config.worker_id,
        model_fingerprint=model_fingerprint(config.model),
        kv_capacity_tokens=capacity,
        page_size=config.page_size,
        max_context=int(raw.get("max_position_embeddings", 4096)),
        vocab_size=int(raw["vocab_size"]),
        dtype="sim",
        device="sim",
        eos_token_ids=eos_ids,
        host_pool_capacity_tokens=config.host_pool_tokens,
    )
    return LoadedWorker(executor, hello)


def _kv_budget_bytes(config: WorkerConfig, device: torch.device) -> int:
    if config.kv_bytes is not None:
        return config.kv_bytes
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * CUDA_KV_MEMORY_FRACTION)
    return DEFAULT_CPU_KV_BYTES


# ---- the link ----------------------------------------------------------------------------------


async def _dial(config: WorkerConfig) -> grpc.aio.Channel:
    """A ready channel to the control plane; TimeoutError after connect_timeout_s."""
    channel = _channel(config)
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout=config.connect_timeout_s)
    except BaseException:
        await channel.close(grace=None)
        raise
    return channel


async def _read(call: grpc.aio.StreamStreamCall, decoder: codec.PlanDecoder) -> Welcome | StepPlan | Shutdown:
    msg = await call.read()
    if msg is grpc.aio.EOF:  # type: ignore[attr-defined]
        raise StreamBroken("control plane closed the stream")
    try:
        return decoder.control(msg)  # type: ignore[arg-type]
    except ValueError as exc:
        raise StreamBroken(f"control plane sent a message the worker cannot read: {exc}") from None


async def _session(worker: LoadedWorker, channel: grpc.aio.Channel) -> int:
    """Hello, Welcome, then plans until Shutdown. Returns the exit code."""
    call = worker_pb2_grpc.WorkerLinkStub(channel).Connect()
    await call.write(codec.hello_to_proto(worker.hello))
    decoder = codec.PlanDecoder()
    welcome = await _read(call, decoder)
    if not isinstance(welcome, Welcome):
        raise StreamBroken(f"expected Welcome, got {type(welcome).__name__}")
    if not welcome.accepted:
        log.error("refused", reason=welcome.reason)
        return EXIT_REFUSED
    log.info("welcomed")
    inbox: _Inbox = asyncio.Queue(maxsize=MAX_QUEUED_PLANS)
    reader = asyncio.create_task(_read_plans(call, decoder, inbox))
    try:
        return await _run_plans(worker, call, inbox)
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


async def _read_plans(call: grpc.aio.StreamStreamCall, decoder: codec.PlanDecoder, inbox: _Inbox) -> None:
    """Read and decode every message as it arrives, while the executor loop runs earlier plans.
    Ends at a Shutdown or at the first error, which is queued after the plans read before it."""
    try:
        while True:
            event = await _read(call, decoder)
            if isinstance(event, StepPlan):
                await inbox.put(_Arrived(event, time.perf_counter()))
            elif isinstance(event, Shutdown):
                await inbox.put(event)
                return
    except Exception as exc:
        await inbox.put(exc)


async def _run_plans(worker: LoadedWorker, call: grpc.aio.StreamStreamCall, inbox: _Inbox) -> int:
    """Execute the queued plans in order and answer each; the exit code once a Shutdown comes.

    A result is written by a task of its own while the next plan already executes: the device never
    waits for the network (SGLang copies results back on a stream of their own for the same reason).
    """
    outbox: asyncio.Queue[StepResult | None] = asyncio.Queue()
    writer = asyncio.create_task(_write_results(call, outbox))
    finished: float | None = None  # when the previous step ended
    try:
        while True:
            item = await _next(inbox, writer)
            if isinstance(item, Exception):
                raise item
            if isinstance(item, Shutdown):
                log.info("shutdown", reason=item.reason)
                outbox.put_nowait(None)
                await writer
                await call.done_writing()
                return EXIT_OK
            wait_s = 0.0 if finished is None else max(0.0, item.at - finished)
            result = await asyncio.to_thread(worker.executor.execute, item.plan)
            finished = time.perf_counter()
            if result.error:
                log.error("step_error", step_id=result.step_id, error=result.error)
            outbox.put_nowait(dataclasses.replace(result, wait_s=wait_s))
    finally:
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError, StreamBroken, grpc.aio.AioRpcError):
            await writer


async def _next(inbox: _Inbox, writer: asyncio.Task[None]) -> _Arrived | Shutdown | Exception:
    """The next queued item; a failed result writer ends the session as a broken stream would."""
    if writer.done():
        writer.result()  # raises what ended it
    getter = asyncio.ensure_future(inbox.get())
    await asyncio.wait({getter, writer}, return_when=asyncio.FIRST_COMPLETED)
    if not getter.done():
        getter.cancel()
        writer.result()
        raise StreamBroken("the result writer stopped")
    return getter.result()


async def _write_results(call: grpc.aio.StreamStreamCall, outbox: asyncio.Queue[StepResult | None]) -> None:
    """Write results in order until told to stop (None)."""
    while (result := await outbox.get()) is not None:
        await _write(call, result)


async def _write(call: grpc.aio.StreamStreamCall, result: StepResult) -> None:
    try:
        await call.write(codec.result_to_proto(result))
    except asyncio.InvalidStateError:  # the call ended while the step ran
        raise StreamBroken("control plane closed the stream") from None


async def serve(worker: LoadedWorker, config: WorkerConfig) -> int:
    """Dial, run the session, and map every way it can end to an exit code."""
    try:
        channel = await _dial(config)
    except TimeoutError:
        log.error("connect_failed", control=config.control, timeout_s=config.connect_timeout_s)
        return EXIT_CONNECT_FAILED
    log.info("connected", control=config.control)
    try:
        return await _session(worker, channel)
    except (grpc.aio.AioRpcError, StreamBroken) as exc:
        log.error("stream_broken", error=_describe(exc))
        return EXIT_STREAM_BROKEN
    finally:
        await channel.close(grace=None)


def _channel(config: WorkerConfig) -> grpc.aio.Channel:
    """Plaintext, or TLS verifying the control plane against --tls-ca, with this worker's own
    certificate when --tls-cert/--tls-key are given (mutual TLS)."""
    if config.tls_ca is None:
        return grpc.aio.insecure_channel(config.control, options=_CHANNEL_OPTIONS)
    creds = grpc.ssl_channel_credentials(
        root_certificates=config.tls_ca.read_bytes(),
        private_key=config.tls_key.read_bytes() if config.tls_key else None,
        certificate_chain=config.tls_cert.read_bytes() if config.tls_cert else None,
    )
    options: list[tuple[str, int | str]] = list(_CHANNEL_OPTIONS)
    if config.tls_server_name:
        options.append(("grpc.ssl_target_name_override", config.tls_server_name))
    return grpc.aio.secure_channel(config.control, creds, options=options)


def _describe(exc: Exception) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)


async def serve_until_signal(worker: LoadedWorker, config: WorkerConfig) -> int:
    """`serve`, but SIGTERM/SIGINT cancel it and exit 0 (Kubernetes stops pods with SIGTERM)."""
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(serve(worker, config))
    signalled = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signalled.set)
    waiter = asyncio.create_task(signalled.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        log.info("signalled")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return EXIT_OK
    finally:
        waiter.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


# ---- entry points ------------------------------------------------------------------------------


def run(config: WorkerConfig) -> int:
    """Blocking entry point for `stepwise worker`: load, connect, serve; returns the exit code.

    Logging is the caller's to configure; if nobody did, JSON/console defaults are set here.
    """
    if not structlog.is_configured():
        configure_logging()
    structlog.contextvars.bind_contextvars(worker_id=config.worker_id)
    try:
        worker = load_worker(config)
    except (ModelLoadError, ValueError) as exc:
        log.error("model_load_failed", model=str(config.model), error=str(exc))
        return EXIT_BAD_MODEL
    hello = worker.hello
    log.info(
        "hello",
        model=str(config.model),
        fingerprint=hello.model_fingerprint[:16],
        kv_capacity_tokens=hello.kv_capacity_tokens,
        device=hello.device,
        dtype=hello.dtype,
    )
    return asyncio.run(serve_until_signal(worker, config))


def main(argv: list[str] | None = None) -> int:
    """`python -m data_plane.worker --model DIR [...]` (the same flags as `stepwise worker`)."""
    parser = argparse.ArgumentParser(prog="python -m data_plane.worker", description=__doc__)
    add_arguments(parser)
    return run(config_from_args(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
