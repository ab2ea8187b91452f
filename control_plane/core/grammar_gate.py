"""One worker's grammar gate: a call held to a grammar reaches the worker's engine (its scheduler)
only once the worker has compiled that grammar, so no step ever waits on a compile.

The frontend compiled the grammar already (control_plane/frontend/grammars.py) and so knows it is
valid, but a compile on the frontend warms nothing on the worker: a worker that met a new grammar in
a plan compiled it, and built its first matcher, inside that step, and every stream on the worker
waited (12 distinct 5,000-property schemas stalled one for 37 s, 18 large GBNF grammars got one
dropped). Here the core asks the worker to compile a grammar it has not said it holds (Prepare)
and keeps the calls held to it back; the worker compiles on a thread of its own and answers
GrammarReady, and the calls go on to the engine then. The scheduler sees them arrive at that step
(the recorder stamps it), so a replay is exact without knowing about the gate.

A sequence handed over from another worker (a hand-over or a retraction's continuation, which
the engine adopts) waits here too (`after`), and goes on however the wait ends: it is a running
stream, not a call that may be refused. Calls with no grammar, and every call to a worker that
does not prepare grammars (an older one), pass at once. A call held longer than the deadline is
refused UNAVAILABLE (the worker is busy compiling: retry); one whose grammar fails on the worker is
refused INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Coroutine

import structlog

from control_plane.core.inbox import Arrival, Verdict
from protos.worker import Grammar, GrammarReady

log = structlog.get_logger("stepwise.grammar_gate")

# Grammars the gate takes as compiled on the worker, most recently used last. The worker keeps as
# many compiled (data_plane/constraints.py, COMPILED_CACHE): one forgotten here is asked for again,
# and a worker that still holds it answers at once.
READY_ENTRIES = 256

Key = tuple[str, str, str]


def _key(grammar: Grammar) -> Key:
    return (grammar.backend, grammar.kind, grammar.spec)


class GrammarGate:
    """Holds one worker's calls until their grammar is compiled there."""

    def __init__(
        self,
        worker: str,
        submit: Callable[[Arrival], None],
        refuse: Callable[[Arrival, Verdict, str], None],
        prepare: Callable[[Grammar], Coroutine[object, object, None]],
        enabled: bool,
        deadline_s: float,
    ) -> None:
        """`submit`: the engine's; `refuse` answers a call that will not run; `prepare` asks the
        worker to compile; `enabled`: whether the worker prepares grammars (its hello)."""
        self.worker = worker
        self._submit = submit
        self._refuse = refuse
        self._prepare = prepare
        self.enabled = enabled
        self.deadline_s = deadline_s
        self._ready: OrderedDict[Key, None] = OrderedDict()
        # Calls held, by the grammar they wait for; a key here has a Prepare out.
        self._held: dict[Key, list[Arrival]] = {}
        self._timers: dict[Key, asyncio.TimerHandle] = {}
        # Grammars asked for and not yet answered (a worker compiles each once).
        self._asked: set[Key] = set()
        # Sequences handed over to this worker (`after`), by the grammar they wait for: they go on
        # however the wait ends (a compile that failed or timed out is left to the step, as before).
        self._waiters: dict[Key, list[Callable[[], None]]] = {}
        self._closed = False

    @property
    def held(self) -> int:
        return sum(len(calls) for calls in self._held.values())

    def submit(self, arrival: Arrival) -> None:
        """The call to the engine now, or once its grammar is compiled on the worker."""
        grammar = arrival.params.sampler.grammar
        if grammar is None or not self.enabled or self._closed:
            self._submit(arrival)
            return
        key = _key(grammar)
        if key in self._ready:
            self._ready.move_to_end(key)
            self._submit(arrival)
            return
        self._held.setdefault(key, []).append(arrival)
        self._wait_for(key, grammar)

    def after(self, grammar: Grammar, proceed: Callable[[], None]) -> None:
        """Call `proceed` once the worker holds `grammar` compiled (now, when it says it does or
        does not prepare grammars), or when the wait ends otherwise: a sequence handed over here
        from another worker, which must not make the worker compile in a step, nor be lost."""
        key = _key(grammar)
        if key in self._ready:
            self._ready.move_to_end(key)
        if not self.enabled or self._closed or key in self._ready:
            proceed()
            return
        self._waiters.setdefault(key, []).append(proceed)
        self._wait_for(key, grammar)

    def compiled(self, grammar: Grammar) -> bool:
        """Whether the worker holds `grammar` compiled (or prepares no grammars); when it does not,
        it is asked to compile it, once. A live migration toward this worker asks before it starts
        and waits for a later decision when the answer is no: the migrated sequence is admitted as
        soon as its KV is here, so it cannot wait at the gate (the copy's hold has a deadline), and
        its grammar would be compiled inside that step."""
        key = _key(grammar)
        if not self.enabled or self._closed or key in self._ready:
            return True
        self._wait_for(key, grammar)
        return False

    def _wait_for(self, key: Key, grammar: Grammar) -> None:
        if key not in self._asked:
            self._asked.add(key)
            self._ask(grammar)
        if key not in self._timers:
            loop = asyncio.get_running_loop()
            self._timers[key] = loop.call_later(self.deadline_s, self._expire, key)

    def ready(self, answer: GrammarReady) -> None:
        """The worker's answer to a Prepare: the calls held for it go on (or are refused)."""
        key = _key(answer.grammar)
        self._asked.discard(key)
        waiting = self._held.pop(key, [])
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        _proceed(self._waiters.pop(key, []))
        if answer.error:
            for arrival in waiting:
                self._refuse(arrival, Verdict.INVALID, f"sampling: {answer.error}")
            return
        self._ready[key] = None
        self._ready.move_to_end(key)
        while len(self._ready) > READY_ENTRIES:
            self._ready.popitem(last=False)
        for arrival in waiting:
            self._submit(arrival)

    def holds(self, rid: str, owner: str) -> bool:
        """Whether a held call of `owner` is `rid` (a call's id, or one sample's)."""
        return any(
            arrival.samples[0].owner == owner and _names(arrival, rid)
            for waiting in self._held.values()
            for arrival in waiting
        )

    def abort(self, rid: str) -> bool:
        """Drop a held call by its id (or one sample's): True when one was held."""
        for key, waiting in self._held.items():
            for arrival in waiting:
                if _names(arrival, rid):
                    waiting.remove(arrival)
                    if not waiting:
                        self._forget(key)
                    return True
        return False

    def abort_link(self, link_id: int, link_of: Callable[[int], int]) -> int:
        """Drop the held calls of a frontend that went away."""
        dropped = 0
        for key in list(self._held):
            kept = [a for a in self._held[key] if link_of(a.samples[0].uid) != link_id]
            dropped += len(self._held[key]) - len(kept)
            self._held[key] = kept
            if not kept:
                self._forget(key)
        return dropped

    def close(self) -> None:
        """The worker is gone: every held call is refused (the client may retry elsewhere)."""
        self._closed = True
        for key in list(self._held):
            for arrival in self._held.pop(key):
                self._refuse(arrival, Verdict.UNAVAILABLE, f"worker {self.worker} is gone")
            self._forget(key)
        for key in list(self._waiters):
            _proceed(self._waiters.pop(key))

    def _forget(self, key: Key) -> None:
        """No call waits for `key` any more; its Prepare is still out, and its answer is taken."""
        self._held.pop(key, None)
        if key in self._waiters:
            return  # handed-over sequences still wait, under the same deadline
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()

    def _expire(self, key: Key) -> None:
        self._timers.pop(key, None)
        waiting = self._held.pop(key, [])
        if waiting:
            log.warning("grammar not compiled in time", worker=self.worker, calls=len(waiting))
        message = f"worker {self.worker} did not compile the grammar within {self.deadline_s:g} s; retry"
        for arrival in waiting:
            self._refuse(arrival, Verdict.UNAVAILABLE, message)
        _proceed(self._waiters.pop(key, []))

    def _ask(self, grammar: Grammar) -> None:
        task = asyncio.get_running_loop().create_task(self._prepare(grammar))
        task.add_done_callback(_log_failure)


def _proceed(waiters: list[Callable[[], None]]) -> None:
    for proceed in waiters:
        proceed()


def _names(arrival: Arrival, rid: str) -> bool:
    return arrival.samples[0].call == rid or any(s.rid == rid for s in arrival.samples)


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        # The stream broke: the session ends, and close() answers the calls held.
        log.warning("prepare not sent", error=str(task.exception()))
