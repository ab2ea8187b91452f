"""Constrained decoding end to end (docs/protocols.md#constrained-decoding): real processes, real
gRPC, the embedded model, whose free text is nonsense, so the grammar does all the work.

A battery of JSON schemas, regexes, a choice list and a GBNF grammar, each greedy and sampled with
seeds: every output validates (jsonschema, re.fullmatch, the grammar's own recognizer below) and ends
with finish reason stop, and greedy output equals transformers' generate on the same weights under
the same grammar mask (a LogitsProcessor driving a grammars matcher). The same under chunked
prefill, forced retraction, overlap on and off, two frontends, n = 3, and a worker killed mid-stream.
Then the refusals, a grammar that cannot finish in time, and 200 distinct schemas at once beside an
unconstrained stream that must keep flowing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import jsonschema
import jsonschema.exceptions
import numpy as np
import pytest

from clients.client import Generation, apply_response, generate_request, sampling_params
from control_plane.tokenizer import Tokenizer
from grammars import backend as grammar_backend
from grammars.spec import GrammarSpec, from_choices
from protos.stepwise.v1 import generation_pb2 as gen_pb
from protos.stepwise.v1 import generation_pb2_grpc as gen_grpc
from stepwise.models import resolve_model
from stepwise.up import Stack
from tests.e2e.conftest import CONTROL_BASE, WORKER_BASE, reference_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# Short and long prompts: the long ones are cut by chunked prefill (8 and 16 tokens below).
PROMPTS = [
    "Once upon a time",
    "In the morning the old man walked slowly down to the river, and there he",
    "The king said",
    "It was a dark and stormy night; the rain fell in torrents, except at occasional intervals, when it",
]
MAX_GRAMMAR_BYTES = 4096

# ---- the battery ------------------------------------------------------------------------------

_INT_0_9 = {"type": "integer", "minimum": 0, "maximum": 9}
_POINT = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9},
        "y": {"type": "integer", "minimum": -9, "maximum": 9},
    },
    "required": ["x", "y"],
    "additionalProperties": False,
}


def _object(properties: dict[str, object], required: Sequence[str] | None = None) -> dict[str, object]:
    """A closed object (no other keys): an open one lets a weak model add keys until max_new_tokens."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties if required is None else required),
        "additionalProperties": False,
    }


SCHEMAS: dict[str, dict[str, object]] = {
    "person": _object(
        {
            "name": {"type": "string", "minLength": 1, "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        }
    ),
    "enum": {"enum": ["red", "green", "blue"]},
    "bool-array": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4},
    "number-range": {"type": "number", "minimum": 1.5, "maximum": 3},
    "integer-range": {"type": "integer", "minimum": -50, "maximum": 50},
    "nested": _object(
        {
            "user": _object(
                {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                }
            ),
            "active": {"type": "boolean"},
        }
    ),
    "anyof-scalar": {"anyOf": [_INT_0_9, {"type": "string", "maxLength": 4}]},
    "optional-fields": _object(
        {
            "a": {"type": "integer", "minimum": 0, "maximum": 5},
            "b": {"type": "string", "maxLength": 3},
            "c": {"type": "boolean"},
        },
        required=["a"],
    ),
    "null": {"type": "null"},
    "string-length": {"type": "string", "minLength": 3, "maxLength": 6},
    "const": {"const": "fixed"},
    "object-array": {
        "type": "array",
        "items": _object({"x": _INT_0_9, "y": _INT_0_9}),
        "minItems": 1,
        "maxItems": 3,
    },
    "anyof-objects": {
        "anyOf": [
            _object({"cat": {"type": "string", "maxLength": 5}}),
            _object({"dog": {"type": "integer", "minimum": 0, "maximum": 20}}),
        ]
    },
    "string-pattern": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
    "enum-mixed": {"enum": [1, "two", None, True]},
    "string-or-null": {"type": ["string", "null"], "maxLength": 5},
    "three-levels": _object(
        {"l1": _object({"l2": _object({"l3": {"type": "integer", "minimum": 0, "maximum": 3}})})}
    ),
    "bool-null-int": _object(
        {
            "ok": {"type": "boolean"},
            "none": {"type": "null"},
            "count": {"type": "integer", "minimum": 0, "maximum": 100},
        }
    ),
    "date-format": {"type": "string", "format": "date"},
    "tuple": {
        "type": "array",
        "prefixItems": [
            {"type": "integer", "minimum": 0, "maximum": 99},
            {"type": "string", "maxLength": 4},
            {"type": "boolean"},
        ],
        "items": False,
        "minItems": 3,
    },
    "refs": {
        "$defs": {"point": _POINT},
        **_object({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}),
    },
    "exclusive-bounds": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    "fixed-array": {"type": "array", "items": _INT_0_9, "minItems": 3, "maxItems": 3},
}

# Rust regex syntax (the backend's): [0-9] rather than \d, which there is any Unicode digit.
REGEXES: dict[str, str] = {
    "date": r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "phone": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
    "email": r"[a-z]{1,8}(\.[a-z]{1,6})?@[a-z]{2,8}\.(com|org|net)",
    "alternation": r"(yes|no|maybe)",
    "animals": r"(cat|dog|bird)s?( and (cat|dog|bird)s?)?",
    "clock": r"([01][0-9]|2[0-3]):[0-5][0-9]",
    "sentence": r"[A-Z][a-z]{1,6}( [a-z]{1,6}){2}\.",
}
# Thirty-one two-digit numbers: about 90 tokens, long enough to kill a worker in the middle.
LONG_REGEX = r"([0-9]{2} ){30}[0-9]{2}"
CHOICES = ("alpha", "beta", "gamma delta", "x+y?")

# Settings: up to three pairs `key=value`, a value a number, a boolean or a list of up to three
# values (lists nest: a context-free language, not a regular one).
GBNF = r"""root   ::= pair ("; " pair){0,2}
pair   ::= key "=" value
key    ::= [a-z] [a-z0-9_]{0,5}
value  ::= number | bool | list
number ::= "-"? [0-9]{1,3}
bool   ::= "true" | "false"
list   ::= "[" value ("," value){0,2} "]"
"""


class _Settings:
    """A recursive-descent recognizer of GBNF's language."""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    @classmethod
    def accepts(cls, text: str) -> bool:
        parser = cls(text)
        try:
            parser.root()
        except ValueError:
            return False
        return parser.pos == len(text)

    def _eat(self, literal: str) -> bool:
        if self.text.startswith(literal, self.pos):
            self.pos += len(literal)
            return True
        return False

    def _chars(self, allowed: str, low: int, high: int) -> None:
        n = 0
        while n < high and self.pos < len(self.text) and self.text[self.pos] in allowed:
            self.pos, n = self.pos + 1, n + 1
        if n < low:
            raise ValueError(f"expected one of {allowed!r} at {self.pos}")

    def root(self) -> None:
        self.pair()
        for _ in range(2):
            if not self._eat("; "):
                return
            self.pair()

    def pair(self) -> None:
        self._chars("abcdefghijklmnopqrstuvwxyz", 1, 1)
        self._chars("abcdefghijklmnopqrstuvwxyz0123456789_", 0, 5)
        if not self._eat("="):
            raise ValueError(f"expected '=' at {self.pos}")
        self.value()

    def value(self) -> None:
        if self._eat("true") or self._eat("false"):
            return
        if self._eat("["):
            self.value()
            for _ in range(2):
                if not self._eat(","):
                    break
                self.value()
            if not self._eat("]"):
                raise ValueError(f"expected ']' at {self.pos}")
            return
        self._eat("-")
        self._chars("0123456789", 1, 3)


def test_the_recognizer_itself() -> None:
    good = ["a=1", "key_1=-42; b=true", "x=[1,[false,2],-3]; y=false; z=[[7]]", "k=999"]
    bad = [
        "",
        "a=",
        "1=1",
        "a=1;b=2",
        "a=1; b=2; c=3; d=4",
        "a=[1,2,3,4]",
        "a=1000",
        "a=[1",
        "toolongk=1",
        "a=tru",
    ]
    assert all(_Settings.accepts(t) for t in good)
    assert not any(_Settings.accepts(t) for t in bad)


@dataclass(frozen=True, slots=True)
class Case:
    """One constraint: `kind` a SamplingParams field, `value` what is sent in it."""

    name: str
    kind: str  # json_schema, regex, choice or ebnf
    value: str | tuple[str, ...]
    max_new: int = 64

    def params(self, **kw: object) -> gen_pb.SamplingParams:
        value = list(self.value) if isinstance(self.value, tuple) else self.value
        return sampling_params(max_new_tokens=self.max_new, **{self.kind: value}, **kw)  # type: ignore[arg-type]

    def spec(self) -> GrammarSpec:
        """What the backend compiles (a choice list arrives as a regex)."""
        if isinstance(self.value, tuple):
            return from_choices(self.value)
        return GrammarSpec(self.kind, self.value)

    def violation(self, text: str) -> str | None:
        """Why `text` is not a sentence of this constraint, or None when it is."""
        if self.kind == "json_schema":
            try:
                value = json.loads(text)
            except ValueError as exc:
                return f"not JSON: {exc}"
            error = jsonschema.exceptions.best_match(
                jsonschema.Draft202012Validator(
                    json.loads(self.value), format_checker=jsonschema.FormatChecker()
                ).iter_errors(value)
            )
            return None if error is None else error.message
        if self.kind == "regex":
            return None if re.fullmatch(str(self.value), text) else "no full match"
        if self.kind == "choice":
            return None if text in self.value else "not one of the choices"
        return None if _Settings.accepts(text) else "not a sentence of the GBNF grammar"


CASES: list[Case] = [
    *(Case(f"schema:{name}", "json_schema", json.dumps(schema)) for name, schema in SCHEMAS.items()),
    *(Case(f"regex:{name}", "regex", pattern, max_new=32) for name, pattern in REGEXES.items()),
    Case("choice", "choice", CHOICES, max_new=16),
    Case("gbnf", "ebnf", GBNF, max_new=64),
]
LONG = Case("regex:long", "regex", LONG_REGEX, max_new=128)


def check(case: Case, gen: Generation, where: str) -> None:
    """`gen` ended with EOS (finish reason stop) and its text is a sentence of `case`'s constraint."""
    label = f"{case.name} ({where})"
    assert gen.finish_reason == "stop", (
        f"{label}: finish reason {gen.finish_reason!r} ({gen.finish_message}) after "
        f"{gen.completion_tokens} tokens: {gen.text!r}"
    )
    assert gen.finish_message == "eos", (label, gen.finish_message)
    assert len(gen.token_ids) == gen.completion_tokens > 0, label
    problem = case.violation(gen.text)
    assert problem is None, f"{label}: {gen.text!r}: {problem}"


# ---- transformers under the same mask -----------------------------------------------------------


@functools.cache
def _tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model("embedded"))


@functools.cache
def _backend(model_dir: Path) -> grammar_backend.Backend:
    tok = _tokenizer()
    text = (model_dir / "tokenizer.json").read_text(encoding="utf-8")
    vocab = reference_model(model_dir).config.vocab_size
    return grammar_backend.create(grammar_backend.DEFAULT, text, vocab, sorted(tok.eos_token_ids))


def _grammar_processor(matcher: grammar_backend.Matcher, prompt_len: int, vocab: int):  # type: ignore[no-untyped-def]
    """A transformers LogitsProcessor: the matcher accepts the token chosen last, then every token
    its bitmask does not allow gets -inf."""
    import torch
    from transformers import LogitsProcessor

    class GrammarMask(LogitsProcessor):
        def __init__(self) -> None:
            self.words = np.zeros(grammar_backend.mask_words(vocab), dtype=np.int32)
            self.accepted = 0

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            assert input_ids.shape[0] == 1
            generated = input_ids.shape[1] - prompt_len
            if generated > self.accepted:
                assert generated == self.accepted + 1
                assert matcher.accept(int(input_ids[0, -1])), "greedy under the mask broke the grammar"
                self.accepted = generated
            matcher.fill(self.words)
            bits = np.unpackbits(self.words.view(np.uint8), bitorder="little")[: scores.shape[1]]
            banned = torch.from_numpy(bits == 0)
            return scores.masked_fill(banned.unsqueeze(0), float("-inf"))

    return GrammarMask()


@functools.cache
def reference_constrained(model_dir: Path, prompt: tuple[int, ...], case: Case) -> list[int]:
    """transformers' greedy generate() for `prompt` alone under `case`'s grammar, EOS not included."""
    import copy

    import torch
    from transformers import LogitsProcessorList

    model = reference_model(model_dir)
    backend = _backend(model_dir)
    matcher = backend.matcher(backend.compile(case.spec()))
    eos = sorted(_tokenizer().eos_token_ids)
    config = copy.deepcopy(model.generation_config)
    config.do_sample, config.max_new_tokens = False, case.max_new
    config.eos_token_id, config.pad_token_id = eos, eos[0]
    processor = _grammar_processor(matcher, len(prompt), model.config.vocab_size)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([list(prompt)]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            generation_config=config,
            logits_processor=LogitsProcessorList([processor]),
        )
    tokens = out[0, len(prompt) :].tolist()
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[:i]
    return tokens


def _prompt(i: int) -> tuple[int, ...]:
    return tuple(_tokenizer().encode(PROMPTS[i % len(PROMPTS)]))


def test_the_reference_masks_what_it_should(model_dir: Path) -> None:
    """The reference itself: a choice's greedy output is one of the choices, and a regex's matches."""
    for case in (CASES[-2], next(c for c in CASES if c.name == "regex:date")):
        tokens = reference_constrained(model_dir, _prompt(0), case)
        assert case.violation(_tokenizer().decode(tokens)) is None, case.name


# ---- stacks and connections ---------------------------------------------------------------------


@contextlib.contextmanager
def _stack(
    control: Sequence[str] = (),
    worker: Sequence[str] = (),
    workers: int = 1,
    env: dict[str, str] | None = None,
) -> Iterator[Stack]:
    """A control plane and `workers` workers for a whole module; stopped however the tests end."""
    with pytest.MonkeyPatch.context() as patch:
        for key, value in (env or {}).items():
            patch.setenv(key, value)
        stack = Stack([*CONTROL_BASE, *control], [*WORKER_BASE, *worker], workers)
        try:
            asyncio.run(asyncio.wait_for(stack.start(timeout=120), 150))
            yield stack
        finally:
            stack.stop()


class Connections:
    """`k` separate connections to one address (several frontends each take some); calls go
    round robin over them."""

    def __init__(self, address: str, k: int = 1) -> None:
        options = [("grpc.use_local_subchannel_pool", 1)]
        self.channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(k)]
        self.stubs = [gen_grpc.GenerationStub(ch) for ch in self.channels]
        self.calls = 0

    async def __aenter__(self) -> Connections:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for channel in self.channels:
            await channel.close(None)

    def stream(self, request: gen_pb.GenerateRequest):  # type: ignore[no-untyped-def]
        self.calls += 1
        return self.stubs[self.calls % len(self.stubs)].Generate(request, timeout=120)

    async def samples(self, prompt: Sequence[int], params: gen_pb.SamplingParams) -> list[Generation]:
        """Every sample of one call, in index order."""
        gens = [Generation() for _ in range(max(1, params.n))]
        async for response in self.stream(generate_request(list(prompt), params)):
            apply_response(gens[getattr(response, response.WhichOneof("event")).index], response)
        return gens

    async def generate(self, prompt: Sequence[int], params: gen_pb.SamplingParams) -> Generation:
        (gen,) = await self.samples(prompt, params)
        return gen

    async def server_info(self) -> gen_pb.ServerInfo:
        return await self.stubs[0].GetServerInfo(gen_pb.GetServerInfoRequest(), timeout=30)


async def _settled(connections: Connections, timeout: float = 15.0) -> None:
    """Every worker's books and report agree at zero: nothing leaked."""
    deadline = time.monotonic() + timeout
    while True:
        info = await connections.server_info()
        states = [(w.book_live_seqs, w.reported_live_seqs, w.book_seq_slots, w.running) for w in info.workers]
        if all(s == (0, 0, 0, 0) for s in states):
            assert all(w.kv_mismatches == 0 for w in info.workers)
            return
        assert time.monotonic() < deadline, f"books did not settle: {states}"
        await asyncio.sleep(0.05)


SEEDS = (1, 2, 3)


async def _battery(address: str, model_dir: Path, where: str, connections: int = 1, seeds=SEEDS) -> None:  # type: ignore[no-untyped-def]
    """Every case at once: greedy (equal to the reference, and valid), sampled at temperature 1 with
    each seed (some with top-k/top-p too), and n = 3 with a seed (each sample valid)."""
    async with Connections(address, connections) as conns:
        greedy = [conns.generate(_prompt(i), c.params(temperature=0.0)) for i, c in enumerate(CASES)]
        sampled = [
            conns.generate(
                _prompt(i + s),
                c.params(temperature=1.0, seed=s, **({"top_k": 40, "top_p": 0.9} if s == 3 else {})),
            )
            for s in seeds
            for i, c in enumerate(CASES)
        ]
        parallel = [
            conns.samples(_prompt(i), c.params(temperature=1.0, seed=100 + i, n=3))
            for i, c in enumerate(CASES)
        ]
        results = await asyncio.gather(*greedy, *sampled, *parallel)
        await _settled(conns)
    got_greedy = results[: len(CASES)]
    got_sampled = results[len(CASES) : len(CASES) * (1 + len(seeds))]
    got_parallel = results[len(CASES) * (1 + len(seeds)) :]
    for i, (case, gen) in enumerate(zip(CASES, got_greedy, strict=True)):
        check(case, gen, f"{where}, greedy")
        want = reference_constrained(model_dir, _prompt(i), case)
        assert gen.token_ids == want, (
            f"{case.name} ({where}, greedy): {gen.text!r} but transformers {_tokenizer().decode(want)!r}"
        )
    for k, gen in enumerate(got_sampled):
        seed, case = seeds[k // len(CASES)], CASES[k % len(CASES)]
        check(case, gen, f"{where}, temperature 1, seed {seed}")
    for i, (case, gens) in enumerate(zip(CASES, got_parallel, strict=True)):
        assert len(gens) == 3
        for index, gen in enumerate(gens):
            check(case, gen, f"{where}, n = 3, seed {100 + i}, sample {index}")


# ---- one stack per configuration ----------------------------------------------------------------


@pytest.fixture(scope="module")
def plain() -> Iterator[Stack]:
    """Overlap on (the default), one frontend, a small grammar limit."""
    with _stack(["--max-grammar-bytes", str(MAX_GRAMMAR_BYTES)]) as stack:
        yield stack


VARIANTS = {
    "chunk8-no-overlap": (
        ["--chunked-prefill-size", "8", "--disable-overlap-schedule"],
        ["--page-size", "4"],
        {},
    ),
    "chunk16-two-frontends-retract": (
        ["--chunked-prefill-size", "16", "--frontends", "2"],
        [],
        {"STEPWISE_TEST_RETRACT": "1"},
    ),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request: pytest.FixtureRequest) -> Iterator[tuple[str, Stack]]:
    control, worker, env = VARIANTS[request.param]
    with _stack(control, worker, env=env) as stack:
        yield request.param, stack


async def test_battery_validates_and_greedy_equals_transformers(plain: Stack, model_dir: Path) -> None:
    await _battery(plain.address, model_dir, "overlap")


async def test_battery_under_chunks_retraction_overlap_off_and_two_frontends(
    variant: tuple[str, Stack], model_dir: Path
) -> None:
    name, stack = variant
    await _battery(stack.address, model_dir, name, connections=6, seeds=SEEDS[:2])
    if "retract" in name:
        async with Connections(stack.address) as conns:
            info = await conns.server_info()
        assert info.workers[0].retractions > 0, "STEPWISE_TEST_RETRACT was meant to force retractions"


async def test_parallel_samples_equal_single_calls_with_their_seeds(plain: Stack) -> None:
    """n = 3 under a grammar: sample i equals a single call with seed + i (each its own matcher)."""
    picks = [c for c in CASES if c.name in ("schema:person", "regex:email", "gbnf", "schema:object-array")]
    async with Connections(plain.address) as conns:
        for case in picks:
            samples = await conns.samples(_prompt(1), case.params(temperature=1.0, seed=40, n=3))
            singles = [
                await conns.generate(_prompt(1), case.params(temperature=1.0, seed=40 + i)) for i in range(3)
            ]
            assert [g.token_ids for g in samples] == [g.token_ids for g in singles], case.name
            for index, gen in enumerate(samples):
                check(case, gen, f"n = 3, sample {index}")


# ---- refusals and a grammar that cannot finish ----------------------------------------------------

# (fields, the field the refusal names); the last two are over --max-grammar-bytes.
BAD = [
    ({"json_schema": '{"type": "object",'}, "sampling.json_schema"),
    ({"json_schema": '{"type": "objectx"}'}, "sampling.json_schema"),
    ({"json_schema": "[1, 2]"}, "sampling.json_schema"),
    ({"regex": "a(b"}, "sampling.regex"),
    ({"regex": "[0-9"}, "sampling.regex"),
    ({"ebnf": 'root ::= "a" missing'}, "sampling.ebnf"),
    ({"ebnf": 'root ::= ("a" | "b"'}, "sampling.ebnf"),
    ({"choice": ["a", "a"]}, "sampling.choice"),
    ({"regex": "[0-9]+", "ignore_eos": True}, "sampling.ignore_eos"),
    ({"json_schema": '{"type": "integer"}', "min_new_tokens": 3}, "sampling.min_new_tokens"),
    ({"regex": "a" * (MAX_GRAMMAR_BYTES + 1)}, "sampling.regex"),
    ({"json_schema": json.dumps({"enum": ["x" * MAX_GRAMMAR_BYTES]})}, "sampling.json_schema"),
]


async def test_bad_constraints_are_invalid_argument_naming_the_field(plain: Stack) -> None:
    async with Connections(plain.address) as conns:
        bystander = asyncio.create_task(
            conns.generate(_prompt(0), sampling_params(max_new_tokens=40, ignore_eos=True, temperature=0.0))
        )
        for k, (fields, name) in enumerate(BAD):
            params = sampling_params(max_new_tokens=8, **fields)  # type: ignore[arg-type]
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await conns.generate(_prompt(0), params)
            details = caught.value.details() or ""
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (fields, details)
            assert details.startswith(name + ":"), (fields, details)
            if k >= len(BAD) - 2:
                assert "--max-grammar-bytes" in details, details
        free = await bystander
        assert free.finish_reason == "length" and free.completion_tokens == 40
        # Constrained requests are still served.
        case = next(c for c in CASES if c.name == "regex:date")
        check(case, await conns.generate(_prompt(2), case.params(temperature=0.0)), "after the refusals")


async def test_a_grammar_that_cannot_finish_ends_with_length(plain: Stack) -> None:
    """200 digits, or an array of at least 50 items, cannot fit in 6 tokens: finish reason length,
    the text a prefix of a valid output; then the server goes on serving constrained and free
    requests alike."""
    tok = _tokenizer()
    longest = max(len(tok.decode([t])) for t in range(tok.vocab_size) if t not in tok.eos_token_ids)
    assert 6 * longest < 150, longest  # the shortest valid output of each is 150 characters or more
    digits = "[0-9]{200}"
    array = {"type": "array", "items": _INT_0_9, "minItems": 50}
    started = r"\[([0-9], )*([0-9](, ?)?)?"  # an array's start, cut anywhere
    requests = [
        (sampling_params(max_new_tokens=6, regex=digits, temperature=0.0), r"[0-9]+"),
        (sampling_params(max_new_tokens=6, regex=digits, temperature=1.0, seed=5), r"[0-9]+"),
        (sampling_params(max_new_tokens=6, json_schema=array, temperature=0.0), started),
        (sampling_params(max_new_tokens=6, json_schema=array, temperature=1.0, seed=6), started),
    ]
    async with Connections(plain.address) as conns:
        gens = await asyncio.gather(*(conns.generate(_prompt(i), p) for i, (p, _) in enumerate(requests)))
        for (_, prefix), gen in zip(requests, gens, strict=True):
            assert (gen.finish_reason, gen.completion_tokens) == ("length", 6), gen
            assert re.fullmatch(prefix, gen.text), gen.text
        case = next(c for c in CASES if c.name == "schema:person")
        check(case, await conns.generate(_prompt(3), case.params(temperature=0.0)), "after a length")
        free = await conns.generate(_prompt(3), sampling_params(max_new_tokens=7, ignore_eos=True))
        assert (free.finish_reason, free.completion_tokens) == ("length", 7)
        await _settled(conns)


async def test_a_grammar_that_dead_ends_after_a_token_ends_grammar_unsatisfiable(plain: Stack) -> None:
    """Issue 37 item 7: `start: "a" x`, `x: "b" x` passes the compile checks (its first token may
    be "a"), then its matcher fails: the output ends there with finish reason
    grammar_unsatisfiable, not stop (it matches no sentence of the grammar)."""
    params = sampling_params(max_new_tokens=8, lark='start: "a" x\nx: "b" x', temperature=0.0)
    async with Connections(plain.address) as conns:
        gen = await conns.generate(_prompt(1), params)
        assert gen.finish_reason == "grammar_unsatisfiable", gen
        assert "could not be satisfied" in gen.finish_message
        assert re.fullmatch(r"ab*", gen.text) and len(gen.token_ids) < 8, gen
        case = next(c for c in CASES if c.name == "regex:date")
        check(case, await conns.generate(_prompt(2), case.params(temperature=0.0)), "after a dead end")


# ---- load -------------------------------------------------------------------------------------------

BURST = 200
MAX_GAP_S = 2.0


def _burst_schema(i: int) -> dict[str, object]:
    """Schema i of the burst: distinct by its key's name and its bounds."""
    return _object(
        {
            f"field_{i}": {"type": "integer", "minimum": i, "maximum": i + 1 + i % 7},
            "note": {"type": "string", "maxLength": 1 + i % 5},
            "flag": {"enum": [True, False, f"v{i % 3}"]},
        },
        required=[f"field_{i}", "note"] if i % 2 else None,
    )


class _Watcher:
    """An unconstrained stream read on a thread of its own (a blocking gRPC channel), so the arrival
    times it records are the server's pace, not how busy the test's event loop is."""

    def __init__(self, address: str, prompt: Sequence[int]) -> None:
        self.channel = grpc.insecure_channel(address)
        sampling = sampling_params(max_new_tokens=100_000, ignore_eos=True)
        stub = gen_grpc.GenerationStub(self.channel)
        self.call = stub.Generate(generate_request(list(prompt), sampling), timeout=240)
        self.arrivals: list[float] = []
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for response in self.call:
                if response.WhichOneof("event") == "chunk" and response.chunk.token_ids:
                    self.arrivals.append(time.monotonic())
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.CANCELLED:  # type: ignore[attr-defined]
                self.error = exc

    def stop(self) -> None:
        self.call.cancel()
        self.thread.join(10)
        self.channel.close()


async def test_two_hundred_schemas_at_once_beside_a_flowing_stream(plain: Stack) -> None:
    """200 distinct schemas submitted together all complete and validate, while an unconstrained
    stream beside them never waits long between tokens."""
    cases = [Case(f"burst:{i}", "json_schema", json.dumps(_burst_schema(i))) for i in range(BURST)]
    assert len({c.value for c in cases}) == BURST
    watcher = _Watcher(plain.address, _prompt(1))
    try:
        deadline = time.monotonic() + 60
        while len(watcher.arrivals) < 5:
            assert watcher.thread.is_alive() and time.monotonic() < deadline, watcher.error
            await asyncio.sleep(0.01)
        async with Connections(plain.address, 4) as conns:
            began = time.monotonic()
            gens = await asyncio.gather(
                *(conns.generate(_prompt(i), c.params(temperature=1.0, seed=i)) for i, c in enumerate(cases))
            )
            ended = time.monotonic()
            assert watcher.thread.is_alive(), watcher.error
    finally:
        watcher.stop()
    assert watcher.error is None, watcher.error
    async with Connections(plain.address) as conns:
        await _settled(conns)
    for case, gen in zip(cases, gens, strict=True):
        check(case, gen, "burst of 200")
    during = [t for t in watcher.arrivals if began <= t <= ended]
    assert len(during) >= 10, f"the free stream sent {len(during)} chunks in the {ended - began:.1f} s burst"
    gaps = np.diff([began, *during, ended])
    assert gaps.max() < MAX_GAP_S, f"longest gap {gaps.max():.2f} s (p50 {np.median(gaps) * 1000:.1f} ms)"


# ---- a worker killed mid-stream ------------------------------------------------------------------


async def test_streams_continue_on_the_other_worker_when_one_is_killed(start_stack, model_dir: Path) -> None:
    """Two workers, long constrained streams on both; one worker killed: every stream finishes on
    the other, valid, and the greedy ones equal transformers' (the rebuilt matcher is exact)."""
    stack = await start_stack(workers=2)
    greedy = [(i, LONG.params(temperature=0.0)) for i in range(4)]
    sampled = [(i, LONG.params(temperature=1.0, seed=9 + i)) for i in range(4)]
    requests = greedy + sampled
    progress = [0] * len(requests)

    async def stream(k: int) -> Generation:
        i, params = requests[k]
        gen = Generation()
        async for response in conns.stream(generate_request(list(_prompt(i)), params)):
            apply_response(gen, response)
            progress[k] = len(gen.token_ids)
        return gen

    async with Connections(stack.address) as conns:
        tasks = [asyncio.create_task(stream(k)) for k in range(len(requests))]
        deadline = time.monotonic() + 60
        while min(progress) < 5:
            assert time.monotonic() < deadline and not any(t.done() for t in tasks), progress
            await asyncio.sleep(0.005)
        info = await conns.server_info()
        before = list(progress)
        stack.procs[1].send_signal(signal.SIGKILL)  # procs: the control plane, worker-0, worker-1
        gens = await asyncio.gather(*tasks)
    victim = next(w for w in info.workers if w.worker_id == "worker-0")
    assert victim.running > 0, "the killed worker was meant to be running some of the streams"
    assert all(len(g.token_ids) > b for g, b in zip(gens, before, strict=True)), "a stream had ended"
    for k, ((i, params), gen) in enumerate(zip(requests, gens, strict=True)):
        check(LONG, gen, f"worker killed, request {k}, temperature {params.temperature:g}")
        if params.temperature == 0.0:
            assert gen.token_ids == reference_constrained(model_dir, _prompt(i), LONG), f"request {k}"
