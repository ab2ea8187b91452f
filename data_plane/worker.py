"""The worker process: load the model, find a control plane, run its plans; find another when it
goes away; drain on SIGTERM.

    search (data_plane/dialer.py) -> session (data_plane/session.py) -> search again ...

A search asks every control plane of `--control` for its census and attaches to the one with the
fewest workers. A session ends with Shutdown (exit), Move (search again at once, preferring another
control plane), Dropped (the control plane let the worker go and said why: search again after a
backoff, preferring another control plane), a refusal (final: search again at once, never choosing
that control plane again; retryable: search again after a backoff), or a broken stream (search again
after a backoff: capped, doubling, jittered, restarted by every welcomed session). Only the first
search is bounded, by --connect-timeout.

SIGTERM or SIGINT while attached drains: the worker sends Drain, turns readiness NOT_SERVING, runs
plans until the control plane sends Shutdown (or Move), then exits; after --drain-timeout + 10 s
without either it exits anyway. A second signal, or a signal while not attached, exits at once.

Exit codes:
  0  stopped: Shutdown, a finished (or timed-out) drain, a signal while not attached;
  2  every control plane of --control refused the worker for good (one line for each says why), or
     --health-port or --transfer-port cannot be had;
  3  no control plane took the worker within --connect-timeout;
  4  the model cannot be loaded.
A broken stream does not end the process: the worker searches again.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import gc
import json
import pathlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import structlog
import torch

from data_plane.backends import make_backend
from data_plane.backends.base import BackendError
from data_plane.config import CUDA_KV_MEMORY_FRACTION, DEFAULT_CPU_KV_BYTES, WorkerConfig
from data_plane.config import add_arguments as add_arguments
from data_plane.config import config_from_args as config_from_args
from data_plane.constraints import Constraints
from data_plane.dialer import Candidate, Dialer, Refusal, Retry
from data_plane.executor import Executor
from data_plane.health import WorkerHealth
from data_plane.kv_pool import KvPool, capacity_tokens
from data_plane.kv_transfer import DTYPES, TransferAgent, TransferDeadline, TransferStore
from data_plane.kv_transfer_grpc import GrpcKvTransport, TlsFiles
from data_plane.link import Link
from data_plane.models.llama import LlamaModel
from data_plane.models.loader import ModelLoadError, model_fingerprint
from data_plane.session import Ending, SessionEnd, StepExecutor, run_session
from data_plane.sim import CostModel, SimExecutor
from protos.worker import WorkerLimits

EXIT_OK = 0
EXIT_REFUSED = 2
EXIT_CONNECT_FAILED = 3
EXIT_BAD_MODEL = 4

# After --drain-timeout the control plane still needs a moment to send Shutdown.
DRAIN_GRACE_S = 10.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

log = structlog.get_logger("data_plane.worker")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class LoadedWorker:
    executor: StepExecutor
    hello: WorkerLimits
    # The KV transfer link's store of received transfers (None: the worker serves no link).
    received: TransferStore | None = None


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
    return DTYPES[name]


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
    # On CUDA the decode block is off: it is not counted in the KV budget (the pool takes most of
    # free memory) and it never shrinks, so a long context at a large batch could run the device out
    # of memory. It is the CPU path's speed-up until it has a budget of its own.
    decode_cache = config.decode_cache and device.type == "cpu"
    try:
        attention = make_backend(config.attention_backend, model, decode_cache=decode_cache)
    except BackendError as exc:
        raise ModelLoadError(str(exc)) from exc
    constraints = Constraints(
        _tokenizer_json(config.model), model.config.vocab_size, model.config.eos_token_ids
    )
    executor = Executor(
        model, pool, host_pool_tokens=config.host_pool_tokens, attention=attention, constraints=constraints
    )
    hello = WorkerLimits(
        worker_id=config.worker_id,
        model_fingerprint=model_fingerprint(config.model),
        kv_capacity_tokens=capacity,
        page_size=config.page_size,
        max_context=model.config.max_position_embeddings,
        vocab_size=model.config.vocab_size,
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        eos_token_ids=frozenset(model.config.eos_token_ids),
        host_pool_capacity_tokens=config.host_pool_tokens,
        grammar_backends=constraints.backends,
        prepares_grammars=bool(constraints.backends),
        role=config.role,
    )
    return LoadedWorker(executor, hello)


def _tokenizer_json(model_dir: pathlib.Path) -> str | None:
    """The checkpoint's tokenizer.json text, which grammar backends read; None without one (the
    worker then constrains nothing, and says so in its hello)."""
    try:
        return (model_dir / "tokenizer.json").read_text(encoding="utf-8")
    except OSError:
        return None


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
    heads = int(raw.get("num_attention_heads", 1))
    kv_shape = (
        int(raw.get("num_hidden_layers", 1)),
        int(raw.get("num_key_value_heads", heads)),
        int(raw.get("head_dim", int(raw.get("hidden_size", heads)) // heads)),
    )
    executor = SimExecutor(capacity, int(raw["vocab_size"]), eos_ids[0], cost, sleep=True, kv_shape=kv_shape)
    hello = WorkerLimits(
        worker_id=config.worker_id,
        model_fingerprint=model_fingerprint(config.model),
        kv_capacity_tokens=capacity,
        page_size=config.page_size,
        max_context=int(raw.get("max_position_embeddings", 4096)),
        vocab_size=int(raw["vocab_size"]),
        dtype="sim",
        device="sim",
        eos_token_ids=frozenset(eos_ids),
        host_pool_capacity_tokens=config.host_pool_tokens,
        role=config.role,
    )
    return LoadedWorker(executor, hello)


def _kv_budget_bytes(config: WorkerConfig, device: torch.device) -> int:
    if config.kv_bytes is not None:
        return config.kv_bytes
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * CUDA_KV_MEMORY_FRACTION)
    return DEFAULT_CPU_KV_BYTES


# ---- control planes --------------------------------------------------------------------------


async def serve(worker: LoadedWorker, config: WorkerConfig, link: Link | None = None) -> int:
    """Search, attach, run the session, and again, until a session ends the process; the exit code.

    A draining worker (see `Link.drain`) exits when its session ends, however it ends.
    """
    link = link or Link()
    dialer = Dialer(config, worker.hello)
    retry = Retry(config.reconnect_max_backoff_s, deadline=time.monotonic() + config.connect_timeout_s)
    avoid: Candidate | None = None
    while True:
        found = await dialer.search(avoid)
        if found.refused_everywhere:
            _log_refusals(found.refused_everywhere)
            return EXIT_REFUSED
        candidate = found.chosen
        end = await _attach(worker, dialer, candidate, link) if candidate else None
        ending = end.ending if end else None
        if link.draining.is_set():
            return EXIT_OK
        if ending is Ending.SHUTDOWN:
            return EXIT_OK
        if ending is Ending.REFUSED and candidate is not None and end is not None:
            # Another control plane may take the worker: search again at once (this one is never
            # chosen again). When none does, the search says so.
            dialer.refused(candidate, end.reason)
            continue
        if end and end.welcomed:
            retry.welcomed()
        # Next time prefer another control plane than one that moved us, refused us for now, or
        # never finished the handshake (it may answer censuses and nothing else).
        failed_handshake = ending is Ending.LOST and end is not None and not end.welcomed
        avoid = (
            candidate if ending in (Ending.MOVED, Ending.RETRY, Ending.DROPPED) or failed_handshake else None
        )
        if ending is Ending.MOVED:
            await retry.jitter()
        elif not await retry.wait():
            log.error("connect_failed", control=config.control, timeout_s=config.connect_timeout_s)
            return EXIT_CONNECT_FAILED


def _log_refusals(refusals: Sequence[Refusal]) -> None:
    for refusal in refusals:
        log.error("refused_everywhere", control_plane=refusal.candidate.address.target, reason=refusal.reason)


async def _attach(worker: LoadedWorker, dialer: Dialer, candidate: Candidate, link: Link) -> SessionEnd:
    address = candidate.address.target
    with structlog.contextvars.bound_contextvars(control_plane=address):
        async with dialer.channel(candidate.address) as channel:
            end = await run_session(worker.executor, worker.hello, channel, link, worker.received)
        if end.ending is Ending.LOST:
            log.warning("control_plane_lost", welcomed=end.welcomed, error=end.reason)
        elif end.ending is Ending.REFUSED:
            log.warning("refused", reason=end.reason)
        elif end.ending is Ending.RETRY:
            log.info("refused_for_now", reason=end.reason)
        elif end.ending is Ending.DROPPED:
            log.error("dropped", reason=end.reason)
    return end


# ---- signals -----------------------------------------------------------------------------------


async def serve_until_signal(
    worker: LoadedWorker, config: WorkerConfig, signals: asyncio.Queue[str], link: Link | None = None
) -> int:
    """`serve`, stopped by the signals queued in `signals` (see `stop_signals`): the first drains
    an attached worker, a second one, or one while not attached, ends it at once (exit 0)."""
    link = link or Link()
    task = asyncio.create_task(serve(worker, config, link))
    try:
        name = await _race(task, signals.get())
        if name is None:
            return task.result()
        if not link.attached:
            log.info("signalled", signal=name)
            return EXIT_OK
        log.info("draining", signal=name, drain_timeout_s=config.drain_timeout_s)
        await link.drain(name)
        name = await _race(task, signals.get(), timeout=config.drain_timeout_s + DRAIN_GRACE_S)
        if name is None:
            return task.result()
        if name == _TIMED_OUT:
            log.warning("drain_timed_out", waited_s=config.drain_timeout_s + DRAIN_GRACE_S)
        else:
            log.info("signalled_again", signal=name)
        return EXIT_OK
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


_TIMED_OUT = "timed out"


async def _race(
    task: asyncio.Future[Any], waiter: Coroutine[Any, Any, str], timeout: float | None = None
) -> str | None:
    """None once `task` is done; else what `waiter` returned first, or _TIMED_OUT."""
    other = asyncio.ensure_future(waiter)
    try:
        done, _ = await asyncio.wait({task, other}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        other.cancel()
    if task in done:
        return None
    return other.result() if other in done else _TIMED_OUT


@contextlib.contextmanager
def stop_signals() -> Iterator[asyncio.Queue[str]]:
    """SIGTERM and SIGINT, by name, queued as they arrive (instead of their default actions)."""
    loop = asyncio.get_running_loop()
    received: asyncio.Queue[str] = asyncio.Queue()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, received.put_nowait, sig.name)
    try:
        yield received
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


# ---- entry points ------------------------------------------------------------------------------


def run(config: WorkerConfig) -> int:
    """Blocking entry point for `stepwise worker`: health, load, serve; returns the exit code.

    Logging is the caller's to configure; if nobody did, JSON/console defaults are set here.
    """
    if not structlog.is_configured():
        configure_logging()
    structlog.contextvars.bind_contextvars(worker_id=config.worker_id)
    code = asyncio.run(_run(config))
    # The process exits next. Its objects (torch's above all) are garbage or live until then:
    # frozen, the interpreter's last collections skip them (0.44 s of the exit goes to 0.11 s).
    gc.freeze()
    return code


async def _run(config: WorkerConfig) -> int:
    health = WorkerHealth()
    with stop_signals() as signals:
        try:
            if config.health_port:
                await health.start(config.health_host, config.health_port)
                log.info("health_listening", host=config.health_host, port=health.port)
        except OSError as exc:
            log.error("health_port_failed", error=str(exc))
            return EXIT_REFUSED
        try:
            return await _load_and_serve(config, health, signals)
        finally:
            await health.stop()


async def _load_and_serve(config: WorkerConfig, health: WorkerHealth, signals: asyncio.Queue[str]) -> int:
    loading = asyncio.ensure_future(_in_daemon_thread(lambda: load_worker(config)))
    name = await _race(loading, signals.get())
    if name is not None:
        log.info("signalled", signal=name, loading=True)
        return EXIT_OK
    try:
        worker = loading.result()
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
    transport = make_transport(config)
    try:
        if transport is not None:
            try:
                transfer_address = await transport.start()
            except OSError as exc:
                log.error("transfer_port_failed", error=str(exc))
                return EXIT_REFUSED
            log.info("transfer_listening", address=transfer_address)
            hello = replace(hello, transfer_address=transfer_address)
            worker = replace(worker, hello=hello, received=transport.received)
            assert isinstance(worker.executor, Executor | SimExecutor)
            worker.executor.transfers = TransferAgent(transport, asyncio.get_running_loop())
        await health.set_loaded()
        return await serve_until_signal(worker, config, signals, Link(health))
    finally:
        if transport is not None:
            await transport.stop()


def make_transport(config: WorkerConfig) -> GrpcKvTransport | None:
    """The KV transfer service the flags ask for (not started): None with --transfer-port -1, or
    with TLS to the control plane but no certificate of the worker's own to serve it with."""
    if config.transfer_port < 0:
        return None
    tls = None
    if config.tls_ca is not None:
        if config.tls_cert is None or config.tls_key is None:
            log.warning("transfer_off", reason="--tls-ca without --tls-cert: no certificate to serve it with")
            return None
        tls = TlsFiles(config.tls_ca, config.tls_cert, config.tls_key)
    deadline = TransferDeadline(config.transfer_deadline_floor_s, config.transfer_deadline_bytes_per_s)
    return GrpcKvTransport(
        config.transfer_host,
        config.transfer_port,
        config.transfer_buffer_bytes,
        tls,
        deadline=deadline,
        hold_s=config.transfer_hold_timeout_s,
    )


async def _in_daemon_thread(fn: Callable[[], T]) -> T:
    """fn() in a daemon thread. asyncio.run() waits for its default executor's threads when it ends,
    and a model load can take minutes: a signal during one should not wait for it."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def target() -> None:
        try:
            done.set_result(fn())
        except BaseException as exc:
            done.set_exception(exc)

    threading.Thread(target=target, name="load-model", daemon=True).start()
    return await asyncio.wrap_future(done)


def main(argv: list[str] | None = None) -> int:
    """`python -m data_plane.worker --model DIR [...]` (the same flags as `stepwise worker`)."""
    parser = argparse.ArgumentParser(
        prog="python -m data_plane.worker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(config_from_args(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
