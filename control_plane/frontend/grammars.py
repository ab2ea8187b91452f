"""Compiling a request's constraint before it is queued: a bad grammar is refused with
INVALID_ARGUMENT naming its field, and only a grammar known to compile reaches the core.

This is the control plane's grammar queue (SGLang keeps a request in one until its grammar
compiles). It sits in front of the core, not in the scheduler: a compile takes wall-clock time
that differs from run to run, and the scheduler must decide alike when a recording is replayed;
here a call simply waits for its own compile, so it never holds up the calls behind it, and the
core (one process for every stream) never compiles anything.

Compiles run on a small thread pool, off the event loop (llguidance releases the GIL while it
builds a grammar; GBNF is translated in linear time, grammars/gbnf.py). Results are kept in an LRU
keyed by (kind, text), errors too, so a client repeating a schema pays once; a compile already
running for the same key is shared. Each compile has --grammar-compile-timeout from the moment a
thread starts it, not from when it was queued: a call whose compile takes longer is refused
(INVALID_ARGUMENT: too complex a grammar is the input's fault), and that refusal is what is kept,
so a retry is refused at once and the grammar never reaches a worker. COMPILE_THREADS compiles run,
taken from the callers (API keys, or connections) in turn, so one caller's many grammars cannot
hold every thread while another's wait; at most MAX_QUEUED wait in all and MAX_PER_CALLER for one
caller, and past either the call is refused with GrammarBusy (RESOURCE_EXHAUSTED: retry), never
blamed on its grammar. The worker compiles the grammar again,
before the core plans it (control_plane/core/grammar_gate.py); the backend is the same, so what
compiled here compiles there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from control_plane import metrics
from control_plane.frontend.client_codec import InvalidArgument
from grammars import backend as grammar_backend
from grammars.spec import GrammarError, GrammarSpec
from protos.worker import Grammar

# Distinct constraints whose compile outcome is remembered.
CACHE_ENTRIES = 1024
COMPILE_THREADS = 2
# Compiles that may wait for a thread, in all and of one caller (a grammar's text is at most
# --max-grammar-bytes, 256 KiB by default).
MAX_QUEUED = 256
MAX_PER_CALLER = 64


@dataclass(frozen=True, slots=True)
class _Job:
    key: tuple[str, str]
    result: asyncio.Future[str]
    # When a thread took it (time.monotonic()): its deadline runs from here.
    started: asyncio.Future[float]


class GrammarBusy(Exception):
    """Too many compiles running or waiting (in all, or for this caller): retry later."""


class GrammarCompiler:
    """Checks constraints with one backend, built on first use from the control plane's tokenizer."""

    def __init__(
        self,
        backend: str,
        tokenizer_json: Callable[[], str],
        vocab_size: int,
        eos_ids: Collection[int],
        timeout_s: float,
    ) -> None:
        self.backend_name = backend
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = tuple(sorted(eos_ids))
        self.timeout_s = timeout_s
        self._backend: grammar_backend.Backend | None = None
        self._backend_lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        # (kind, text) -> "" (compiles) or the error message.
        self._outcomes: OrderedDict[tuple[str, str], str] = OrderedDict()
        # Compiles queued or running: their result, and when a thread started them.
        self._running: dict[tuple[str, str], tuple[asyncio.Future[str], asyncio.Future[float]]] = {}
        # Compiles whose calls were refused for their time: their refusal is their outcome.
        self._refused: set[tuple[str, str]] = set()
        # Compiles waiting for a thread, by caller, and the callers in turn; compiles running.
        self._queues: dict[str, deque[_Job]] = {}
        self._turns: deque[str] = deque()
        self._waiting = 0
        self._busy = 0

    async def check(self, grammar: Grammar, field: str, caller: str = "") -> Grammar:
        """The grammar with its backend named; InvalidArgument naming `field` when it does not
        compile in time, cannot be compiled, or is a kind the backend does not read; GrammarBusy
        when it would have to wait past the bounds (in all, or for `caller`)."""
        if self.backend_name == grammar_backend.NONE:
            raise InvalidArgument(
                f"{field}: constrained decoding is off on this server (--grammar-backend none)"
            )
        key = (grammar.kind, grammar.spec)
        outcome = self._outcomes.get(key)
        if outcome is None:
            outcome = await self._compile(key, field, caller)
        else:
            metrics.GRAMMAR_CACHE_HITS.inc()
            self._outcomes.move_to_end(key)
        if outcome:
            raise InvalidArgument(f"{field}: {outcome}")
        return Grammar(self.backend_name, grammar.kind, grammar.spec)

    async def _compile(self, key: tuple[str, str], field: str, caller: str) -> str:
        running = self._running.get(key)
        if running is None:
            running = self._start(key, caller)
        future, started = running
        # The deadline runs from the compile's start: a call does not pay for the queue before it.
        either: set[asyncio.Future[Any]] = {started, future}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if future.done():
            return future.result()
        left = self.timeout_s - (time.monotonic() - started.result())
        try:
            return await asyncio.wait_for(asyncio.shield(future), max(left, 0.0))
        except TimeoutError:
            metrics.GRAMMAR_COMPILES.labels("timeout").inc()
            return self._timed_out(key)

    def _start(self, key: tuple[str, str], caller: str) -> tuple[asyncio.Future[str], asyncio.Future[float]]:
        """Queue a compile of `key` for `caller`, or GrammarBusy past the bounds."""
        if self._waiting >= MAX_QUEUED:
            raise GrammarBusy(f"{MAX_QUEUED} grammars wait to compile on this frontend already; retry")
        queue = self._queues.setdefault(caller, deque())
        if len(queue) >= MAX_PER_CALLER:
            raise GrammarBusy(f"this caller has {MAX_PER_CALLER} grammars waiting to compile already; retry")
        loop = asyncio.get_running_loop()
        job = _Job(key, loop.create_future(), loop.create_future())
        queue.append(job)
        if caller not in self._turns:
            self._turns.append(caller)
        self._waiting += 1
        self._running[key] = (job.result, job.started)
        job.result.add_done_callback(lambda done: self._finished(key, done))
        self._dispatch()
        return job.result, job.started

    def _dispatch(self) -> None:
        """Start waiting compiles while a thread is free, taking callers in turn: one caller's
        many grammars do not hold every thread while another's wait."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, "grammar-compile")
        loop = asyncio.get_running_loop()
        while self._busy < COMPILE_THREADS and self._turns:
            caller = self._turns.popleft()
            queue = self._queues[caller]
            job = queue.popleft()
            if queue:
                self._turns.append(caller)
            else:
                del self._queues[caller]
            self._waiting -= 1
            self._busy += 1
            job.started.set_result(time.monotonic())
            done = self._pool.submit(self._outcome, job.key)
            done.add_done_callback(functools.partial(self._on_thread_end, loop, job))

    def _on_thread_end(
        self, loop: asyncio.AbstractEventLoop, job: _Job, done: concurrent.futures.Future[str]
    ) -> None:
        loop.call_soon_threadsafe(self._ended, job, done)

    def _ended(self, job: _Job, done: concurrent.futures.Future[str]) -> None:
        self._busy -= 1
        if done.exception() is not None:
            job.result.set_exception(done.exception())  # type: ignore[arg-type]
        else:
            job.result.set_result(done.result())
        self._dispatch()

    def _timed_out(self, key: tuple[str, str]) -> str:
        """The refusal of a compile past its deadline, kept as its outcome (also once the compile
        ends): a grammar refused here must not be accepted by the next try."""
        message = f"did not compile within {self.timeout_s:g} s (--grammar-compile-timeout)"
        self._refused.add(key)
        self._remember(key, message)
        return message

    def _finished(self, key: tuple[str, str], done: asyncio.Future[str]) -> None:
        self._running.pop(key, None)
        if key in self._refused:
            self._refused.discard(key)
            return
        if done.cancelled() or done.exception() is not None:
            return
        self._remember(key, done.result())
        metrics.GRAMMAR_COMPILES.labels("invalid" if done.result() else "ok").inc()

    def _remember(self, key: tuple[str, str], outcome: str) -> None:
        self._outcomes[key] = outcome
        self._outcomes.move_to_end(key)
        if len(self._outcomes) > CACHE_ENTRIES:
            self._outcomes.popitem(last=False)

    def _outcome(self, key: tuple[str, str]) -> str:
        """Runs on a compile thread: "" when the grammar compiles, else why not."""
        try:
            backend = self._get_backend()
        except ValueError as exc:  # not installed here: the operator's to fix, said to the caller
            return str(exc)
        kind, text = key
        if kind not in backend.kinds:
            return f"the {backend.name} grammar backend does not read {kind} grammars (--grammar-backend)"
        started = time.perf_counter()
        try:
            backend.compile(GrammarSpec(kind, text))
        except GrammarError as exc:
            return str(exc)
        except RecursionError:  # a backend's own reader recursing on nesting nesting.py did not bound
            return "nested too deeply"
        finally:
            metrics.GRAMMAR_COMPILE_TIME.observe(time.perf_counter() - started)
        return ""

    def _get_backend(self) -> grammar_backend.Backend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = grammar_backend.create(
                    self.backend_name, self._tokenizer_json(), self._vocab_size, self._eos
                )
            return self._backend

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
