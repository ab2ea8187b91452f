"""The worker's grammar matchers: one per constrained sequence, and the bitmask they fill each step.

Why here and not in the control plane: a sequence's next mask depends only on the token this worker
sampled for it last, so the worker can advance its own matcher and fill the next mask at once, with
no mask (ceil(vocab / 32) int32 words per row, ~19 KB at a 152k vocabulary) crossing the network,
and the control plane's overlapped plans need no extra round trip.

A matcher is built from the grammar the control plane compiled (SamplerParams.grammar), out of this
worker's own LRU cache of compiled grammars. It then accepts every output token the sequence
already has: those among the tokens before the first extend (NewSequence.history_ids, positions
from prompt_len on) and those among its extend inputs (a retracted or handed-over sequence prefills
its output again). Tokens are deterministic, so a rebuilt matcher is in the very state the lost one
was, and a replayed recording masks exactly as the live run did.

Each step: `feed` accepts the extend inputs that are output tokens; `fill` writes the masks of the
sampling rows that are constrained; after sampling, `accept` advances them by the sampled tokens.
A matcher whose grammar is finished allows only EOS, so the sequence ends with EOS (finish reason
stop). One that failed (its state allows nothing, or a token was refused, or its parser gave up: a
grammar that can never be completed past some point, which no compile check caught) is given EOS
too, so a row is never left with every logit at -inf, and its row is named in `GrammarMasks.failed`:
the result reports it and the control plane ends the sequence with grammar_unsatisfiable.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from data_plane.state import PlanError
from grammars import backend as grammar_backend
from grammars.spec import GrammarError, GrammarSpec
from protos.worker import Grammar

# Compiled grammars kept per worker (an LRU): a compile is about a millisecond for llguidance, but
# a request with n samples, a retraction or a hand-over builds the same grammar again.
COMPILED_CACHE = 256
# Threads that compile grammars the control plane asks to have ready (`prepare`), off the step.
PREPARE_THREADS = 2


@dataclass(frozen=True, slots=True)
class GrammarMasks:
    """The masks of one step's constrained sampling rows: `index[i]` is a row of the step's logits
    (sampling order), `words[i]` its bitmask."""

    index: np.ndarray  # int64 [R]
    words: np.ndarray  # int32 [R, ceil(vocab / 32)]
    # Rows of the step's logits (ascending) whose grammar could not be satisfied: their matcher had
    # failed, so their mask allows only EOS and the result says so (StepResult.grammar_failed).
    failed: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


@dataclass(slots=True)
class _Sequence:
    matcher: grammar_backend.Matcher
    prompt_len: int
    backend: str


class Constraints:
    """Matchers of the constrained sequences, by sequence-table row."""

    def __init__(self, tokenizer_json: str | None, vocab_size: int, eos_ids: Sequence[int]) -> None:
        """`tokenizer_json`: the model's tokenizer.json text (None: the worker cannot constrain)."""
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = sorted(eos_ids)
        self._backends: dict[str, grammar_backend.Backend] = {}
        self._compiled: OrderedDict[tuple[str, str, str], object] = OrderedDict()
        self._rows: dict[int, _Sequence] = {}
        # The compile threads and the step share the backends and the compiled cache.
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.words = grammar_backend.mask_words(vocab_size)
        self._buffer = np.zeros((0, self.words), dtype=np.int32)

    @property
    def backends(self) -> tuple[str, ...]:
        """The backends this worker can run (for its hello): none without a tokenizer."""
        return grammar_backend.installed() if self._tokenizer_json is not None else ()

    def __bool__(self) -> bool:
        return bool(self._rows)

    def __contains__(self, row: int) -> bool:
        return row in self._rows

    # ---- membership --------------------------------------------------------------------------

    def start(self, row: int, grammar: Grammar, prompt_len: int, history: np.ndarray) -> None:
        """Give `row` a fresh matcher that has accepted the output tokens among `history` (the
        tokens at positions 0..len-1, before the sequence's first extend)."""
        matcher = self._matcher(grammar)
        self._rows[row] = _Sequence(matcher, prompt_len, grammar.backend)
        for token in history[prompt_len:].tolist():
            matcher.accept(token)

    def remove(self, row: int) -> None:
        self._rows.pop(row, None)

    def clear(self) -> None:
        self._rows.clear()

    # ---- a step ------------------------------------------------------------------------------

    def feed(self, rows: np.ndarray, starts: np.ndarray, lens: np.ndarray, tokens: np.ndarray) -> None:
        """Accept the extend inputs at output positions: entry i's tokens (consecutive in `tokens`)
        sit at positions starts[i] .. starts[i] + lens[i] - 1 of row rows[i]."""
        offsets = np.concatenate(([0], np.cumsum(lens)))
        for i, row in enumerate(rows.tolist()):
            seq = self._rows.get(row)
            if seq is None:
                continue
            skip = max(0, seq.prompt_len - int(starts[i]))
            for token in tokens[offsets[i] + skip : offsets[i + 1]].tolist():
                seq.matcher.accept(token)

    def fill(self, rows: np.ndarray) -> GrammarMasks | None:
        """The masks of the constrained rows among `rows` (a step's sampling rows, in order)."""
        index = [i for i, row in enumerate(rows.tolist()) if row in self._rows]
        if not index:
            return None
        if len(self._buffer) < len(index):
            self._buffer = np.zeros((max(len(index), 2 * len(self._buffer)), self.words), dtype=np.int32)
        words = self._buffer[: len(index)]
        seqs = [self._rows[int(rows[i])] for i in index]
        backend = self._backends[seqs[0].backend]
        if isinstance(backend, grammar_backend.BatchFiller) and all(
            s.backend == seqs[0].backend for s in seqs
        ):
            backend.fill_many([s.matcher for s in seqs], words)
        else:
            for k, seq in enumerate(seqs):
                seq.matcher.fill(words[k])
        empty = np.flatnonzero(~words.any(axis=1))
        for k in empty.tolist():
            _allow(words[k], self._eos)
        failed = sorted(set(empty.tolist()) | {k for k, seq in enumerate(seqs) if seq.matcher.failed})
        for k in failed:
            # A failed matcher's own mask may allow more than EOS (xgrammar's, before its next
            # fill); the sequence ends here either way.
            words[k] = 0
            _allow(words[k], self._eos)
        index_array = np.asarray(index, dtype=np.int64)
        return GrammarMasks(index_array, words.copy(), index_array[failed])

    def accept(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Advance each constrained row's matcher by the token sampled for it."""
        for row, token in zip(rows.tolist(), tokens.tolist(), strict=True):
            seq = self._rows.get(row)
            if seq is not None:
                seq.matcher.accept(token)

    # ---- grammars ----------------------------------------------------------------------------

    def prepare(self, grammar: Grammar, done: Callable[[str], None]) -> None:
        """Compile `grammar` and build its first matcher on a thread of its own, off the step, then
        call `done` (on that thread) with "" or why it cannot be compiled. A sequence held to it
        that comes later finds it compiled: its matcher is a copy (microseconds)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(PREPARE_THREADS, "grammar-prepare")
        self._pool.submit(self._prepare, grammar, done)

    def _prepare(self, grammar: Grammar, done: Callable[[str], None]) -> None:
        try:
            self._matcher(grammar)
        except PlanError as exc:
            done(str(exc))
        except Exception as exc:  # a backend's own failure: said to the control plane, not raised here
            done(f"grammar ({grammar.kind}) failed to compile on this worker: {type(exc).__name__}: {exc}")
        else:
            done("")

    def _matcher(self, grammar: Grammar) -> grammar_backend.Matcher:
        """A fresh matcher of `grammar`, compiled now unless the cache holds it. Two threads may
        compile the same grammar at once (the second result is kept): rare, and only time lost."""
        backend = self._backend(grammar.backend)
        key = (grammar.backend, grammar.kind, grammar.spec)
        try:
            with self._lock:
                compiled = self._compiled.get(key)
                if compiled is not None:
                    self._compiled.move_to_end(key)
            if compiled is None:
                compiled = backend.compile(GrammarSpec(grammar.kind, grammar.spec))
                matcher = backend.matcher(compiled)  # the first matcher: what is slow to build
                with self._lock:
                    self._compiled[key] = compiled
                    if len(self._compiled) > COMPILED_CACHE:
                        self._compiled.popitem(last=False)
                return matcher
            return backend.matcher(compiled)
        except GrammarError as exc:
            # The control plane compiled it with the same backend, so only a version skew gets here.
            raise PlanError(f"grammar ({grammar.kind}) does not compile on this worker: {exc}") from None

    def _backend(self, name: str) -> grammar_backend.Backend:
        with self._lock:
            backend = self._backends.get(name)
            if backend is not None:
                return backend
            if self._tokenizer_json is None or name not in self.backends:
                raise PlanError(f"grammar backend {name!r} is not available on this worker")
            backend = grammar_backend.create(name, self._tokenizer_json, self._vocab_size, self._eos)
            self._backends[name] = backend
            return backend


def _allow(words: np.ndarray, tokens: Sequence[int]) -> None:
    for token in tokens:
        words[token // 32] |= np.int32(np.uint32(1 << (token % 32)).view(np.int32))
