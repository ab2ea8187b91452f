"""Compiling a request's constraint before it is queued: a bad grammar is refused with
INVALID_ARGUMENT naming its field, and only a grammar known to compile reaches the core.

This is the control plane's grammar queue (SGLang keeps a request in one until its grammar
compiles). It sits in front of the core, not in the scheduler: a compile takes wall-clock time
that differs from run to run, and the scheduler must decide alike when a recording is replayed;
here a call simply waits for its own compile, so it never holds up the calls behind it, and the
core (one process for every stream) never compiles anything.

Compiles run on a small thread pool, off the event loop (llguidance releases the GIL while it
builds a grammar). Results are kept in an LRU keyed by (kind, text), errors too, so a client
repeating a schema pays once; a compile already running for the same key is shared. A compile
that takes longer than --grammar-compile-timeout refuses its call (INVALID_ARGUMENT: too complex
a grammar is the input's fault) and goes on in the background, so its result is cached for the
next call. The worker compiles the grammar again from its own cache (data_plane/constraints.py);
the backend is the same, so what compiled here compiles there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection

from control_plane import metrics
from control_plane.client_codec import InvalidArgument
from grammars import backend as grammar_backend
from grammars.spec import GrammarError, GrammarSpec
from protos.worker import Grammar

# Distinct constraints whose compile outcome is remembered.
CACHE_ENTRIES = 1024
COMPILE_THREADS = 2


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
        self._running: dict[tuple[str, str], asyncio.Future[str]] = {}

    async def check(self, grammar: Grammar, field: str) -> Grammar:
        """The grammar with its backend named; InvalidArgument naming `field` when it does not
        compile in time, cannot be compiled, or is a kind the backend does not read."""
        if self.backend_name == grammar_backend.NONE:
            raise InvalidArgument(
                f"{field}: constrained decoding is off on this server (--grammar-backend none)"
            )
        key = (grammar.kind, grammar.spec)
        outcome = self._outcomes.get(key)
        if outcome is None:
            outcome = await self._compile(key, field)
        else:
            metrics.GRAMMAR_CACHE_HITS.inc()
            self._outcomes.move_to_end(key)
        if outcome:
            raise InvalidArgument(f"{field}: {outcome}")
        return Grammar(self.backend_name, grammar.kind, grammar.spec)

    async def _compile(self, key: tuple[str, str], field: str) -> str:
        future = self._running.get(key)
        if future is None:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, "grammar-compile")
            future = asyncio.wrap_future(self._pool.submit(self._outcome, key))
            self._running[key] = future
            future.add_done_callback(lambda done: self._finished(key, done))
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except TimeoutError:
            metrics.GRAMMAR_COMPILES.labels("timeout").inc()
            raise InvalidArgument(
                f"{field}: did not compile within {self.timeout_s:g} s (--grammar-compile-timeout)"
            ) from None

    def _finished(self, key: tuple[str, str], done: asyncio.Future[str]) -> None:
        self._running.pop(key, None)
        if done.cancelled() or done.exception() is not None:
            return
        self._outcomes[key] = done.result()
        metrics.GRAMMAR_COMPILES.labels("invalid" if done.result() else "ok").inc()
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
