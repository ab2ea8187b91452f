"""A frontend's grammar compiler (control_plane/frontend/grammars.py) and the constraint fields'
checks in client_codec: what is refused, with which field named, and that compiles run off the
event loop, are cached, shared while running, and bounded in time."""

from __future__ import annotations

import asyncio
import threading

import pytest

from control_plane.config import Limits
from control_plane.frontend import client_codec
from control_plane.frontend import grammars as compiler_module
from control_plane.frontend.grammars import GrammarCompiler
from grammars.spec import GrammarError, GrammarSpec
from protos.stepwise.v1 import frontend_pb2 as fe_pb
from protos.stepwise.v1 import generation_pb2 as gen_pb
from protos.worker import Grammar
from stepwise.models import resolve_model

TOKENIZER = (resolve_model("embedded") / "tokenizer.json").read_text(encoding="utf-8")


def _compiler(backend: str = "llguidance", timeout_s: float = 10.0) -> GrammarCompiler:
    return GrammarCompiler(backend, lambda: TOKENIZER, 1024, {0}, timeout_s)


async def test_a_valid_grammar_comes_back_with_its_backend_named() -> None:
    checked = await _compiler().check(Grammar("", "regex", "[a-z]+"), "sampling.regex")
    assert checked == Grammar("llguidance", "regex", "[a-z]+")


@pytest.mark.parametrize(
    ("kind", "text", "words"),
    [
        ("regex", "a(b", "unclosed group"),
        ("json_schema", '{"type": "objectx"}', "objectx"),
        ("lark", "start: missing_rule", "missing_rule"),
    ],
)
async def test_a_grammar_that_does_not_compile_is_refused_naming_the_field(
    kind: str, text: str, words: str
) -> None:
    with pytest.raises(client_codec.InvalidArgument) as info:
        await _compiler().check(Grammar("", kind, text), f"sampling.{kind}")
    assert str(info.value).startswith(f"sampling.{kind}: ")
    assert words in str(info.value)


async def test_grammar_backend_none_refuses_every_constraint() -> None:
    with pytest.raises(client_codec.InvalidArgument, match=r"sampling.regex: .*--grammar-backend none"):
        await _compiler("none").check(Grammar("", "regex", "a"), "sampling.regex")


class _SlowBackend:
    """A backend whose compiles wait for `release`, counting them."""

    name = "slow"
    kinds = frozenset({"regex"})

    def __init__(self) -> None:
        self.release = threading.Event()
        self.compiles = 0
        self.order: list[str] = []
        self.threads: set[str] = set()

    def compile(self, spec: GrammarSpec) -> object:
        self.compiles += 1
        self.order.append(spec.text)
        self.threads.add(threading.current_thread().name)
        self.release.wait(10)
        if spec.text == "bad":
            raise GrammarError("bad grammar")
        return object()

    def matcher(self, compiled: object) -> object:
        raise NotImplementedError


@pytest.fixture
def slow(monkeypatch: pytest.MonkeyPatch) -> _SlowBackend:
    backend = _SlowBackend()
    monkeypatch.setattr(compiler_module.grammar_backend, "create", lambda *args: backend)
    return backend


async def test_compiles_run_off_the_loop_and_one_compile_serves_every_call_waiting_for_it(
    slow: _SlowBackend,
) -> None:
    compiler = _compiler("slow")
    calls = [
        asyncio.create_task(compiler.check(Grammar("", "regex", "x"), "sampling.regex")) for _ in range(5)
    ]
    await asyncio.sleep(0.05)
    # The loop is free while they compile: this coroutine runs.
    assert not any(call.done() for call in calls)
    slow.release.set()
    assert all(g.backend == "slow" for g in await asyncio.gather(*calls))
    assert slow.compiles == 1
    assert threading.current_thread().name not in slow.threads
    # Cached: no compile for the next call, errors included.
    await compiler.check(Grammar("", "regex", "x"), "sampling.regex")
    for _ in range(2):
        with pytest.raises(client_codec.InvalidArgument, match="bad grammar"):
            await compiler.check(Grammar("", "regex", "bad"), "sampling.regex")
    assert slow.compiles == 2


async def test_a_compile_past_the_timeout_refuses_its_call_and_the_refusal_is_kept(
    slow: _SlowBackend,
) -> None:
    """Issue 37: the refused compile finished and was cached, so a retry was accepted and the
    grammar reached the worker."""
    compiler = _compiler("slow", timeout_s=0.1)
    other = asyncio.create_task(asyncio.sleep(0.3, result="served"))
    with pytest.raises(client_codec.InvalidArgument, match=r"sampling.regex: did not compile within 0.1 s"):
        await compiler.check(Grammar("", "regex", "x"), "sampling.regex")
    assert await other == "served"
    slow.release.set()
    for _ in range(100):
        if slow.compiles and not compiler._running:
            break
        await asyncio.sleep(0.02)
    with pytest.raises(client_codec.InvalidArgument, match=r"did not compile within 0.1 s"):
        await compiler.check(Grammar("", "regex", "x"), "sampling.regex")
    assert slow.compiles == 1


async def test_the_deadline_runs_from_the_compiles_start_not_from_the_queue(slow: _SlowBackend) -> None:
    """Two slow grammars held both threads; a third waited behind them and was refused for their
    time, blaming its own grammar."""
    compiler = _compiler("slow", timeout_s=0.3)
    hogs = [asyncio.create_task(compiler.check(Grammar("", "regex", t), "sampling.regex", t)) for t in "ab"]
    await asyncio.sleep(0.05)
    victim = asyncio.create_task(compiler.check(Grammar("", "regex", "c"), "sampling.regex", "victim"))
    await asyncio.sleep(0.5)  # the hogs are refused; the victim has not started yet
    for hog in hogs:
        with pytest.raises(client_codec.InvalidArgument, match="did not compile"):
            await hog
    assert not victim.done()
    slow.release.set()
    assert (await victim).spec == "c"


async def test_callers_take_the_threads_in_turn(slow: _SlowBackend) -> None:
    """One caller's many grammars do not hold every thread while another's wait."""
    compiler = _compiler("slow")
    mine = [asyncio.create_task(compiler.check(Grammar("", "regex", t), "f", "me")) for t in "abcd"]
    await asyncio.sleep(0.01)
    theirs = asyncio.create_task(compiler.check(Grammar("", "regex", "z"), "f", "them"))
    await asyncio.sleep(0.05)
    started = [key[1] for key, (_, begun) in compiler._running.items() if begun.done()]
    assert started == ["a", "b"]
    slow.release.set()
    await asyncio.gather(*mine, theirs)
    assert slow.order.index("z") < slow.order.index("d"), slow.order


async def test_compiles_waiting_are_bounded_per_caller_and_in_all(
    slow: _SlowBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compiler_module, "MAX_QUEUED", 4)
    monkeypatch.setattr(compiler_module, "MAX_PER_CALLER", 2)
    compiler = _compiler("slow")
    mine = [asyncio.create_task(compiler.check(Grammar("", "regex", t), "f", "me")) for t in "abcd"]
    await asyncio.sleep(0.01)  # a and b run, c and d wait
    with pytest.raises(compiler_module.GrammarBusy, match="this caller"):
        await compiler.check(Grammar("", "regex", "e"), "f", "me")
    others = [
        asyncio.create_task(compiler.check(Grammar("", "regex", f"o{i}"), "f", f"c{i}")) for i in range(2)
    ]
    await asyncio.sleep(0.01)
    with pytest.raises(compiler_module.GrammarBusy, match="wait to compile"):
        await compiler.check(Grammar("", "regex", "late"), "f", "another")
    slow.release.set()
    await asyncio.gather(*mine, *others)
    await compiler.check(Grammar("", "regex", "e"), "f", "me")  # room again


async def test_a_kind_the_backend_does_not_read_is_refused(slow: _SlowBackend) -> None:
    slow.release.set()
    with pytest.raises(
        client_codec.InvalidArgument, match=r"sampling.lark: the slow grammar backend does not read lark"
    ):
        await _compiler("slow").check(Grammar("", "lark", "start: x"), "sampling.lark")


# --- client_codec: what needs no compile -----------------------------------------------------------


def _sampling(**fields: object) -> gen_pb.SamplingParams:
    choices = fields.pop("choice", None)
    msg = gen_pb.SamplingParams(**fields)  # type: ignore[arg-type]
    if choices is not None:
        msg.choice.choices.extend(choices)  # type: ignore[arg-type]
    return msg


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"choice": []}, "sampling.choice: must list at least one choice"),
        ({"choice": ["a", ""]}, "sampling.choice: choice 1 is empty"),
        ({"choice": ["a", "a"]}, "sampling.choice: lists a choice twice"),
        ({"regex": "a", "ignore_eos": True}, "sampling.ignore_eos: cannot be combined with sampling.regex"),
        (
            {"regex": "a", "min_new_tokens": 3},
            "sampling.min_new_tokens: cannot be combined with sampling.regex",
        ),
        ({"regex": "a" * 101}, "sampling.regex: 101 bytes; at most 100 are allowed (--max-grammar-bytes)"),
    ],
)
def test_constraint_fields_are_checked_before_any_compile(fields: dict[str, object], message: str) -> None:
    with pytest.raises(client_codec.InvalidArgument) as info:
        client_codec.sampling_from_proto(_sampling(**fields), Limits(max_grammar_bytes=100))
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"json_schema": "{"}, "sampling.json_schema: is not valid JSON"),
        ({"json_schema": "[1]"}, "sampling.json_schema: must be a JSON object"),
        ({"structural_tag": "3"}, "sampling.structural_tag: must be a JSON object"),
    ],
)
async def test_json_that_is_no_json_object_is_refused_by_its_compile(
    fields: dict[str, object], message: str
) -> None:
    """The frontend reads a schema's JSON once, in its compile (a text sent again is not read
    again): the refusal is the one the request's check gave before, naming the field."""
    params = client_codec.sampling_from_proto(_sampling(**fields))
    assert params.sampler.grammar is not None
    field = next(iter(fields))
    with pytest.raises(client_codec.InvalidArgument) as info:
        await _compiler().check(params.sampler.grammar, f"sampling.{field}")
    assert str(info.value).startswith(message)


def test_a_choice_list_becomes_a_regex_matching_exactly_its_strings() -> None:
    import re

    choices = ["a.b-c (x)?", "1+1", "x/y", "[z]", "plain"]
    params = client_codec.sampling_from_proto(_sampling(choice=choices))
    grammar = params.sampler.grammar
    assert grammar is not None and grammar.kind == "regex"
    assert all(re.fullmatch(grammar.spec, c) for c in choices)
    assert not re.fullmatch(grammar.spec, "a.b-c (x)")


def test_an_unconstrained_request_has_no_grammar() -> None:
    assert client_codec.sampling_from_proto(_sampling()).sampler.grammar is None


async def test_compiles_and_cache_hits_are_counted() -> None:
    from control_plane import metrics

    def value(name: str, labels: dict[str, str] | None = None) -> float:
        return metrics.REGISTRY.get_sample_value(name, labels or {}) or 0.0

    ok, hits = (
        value("stepwise:grammar_compiles_total", {"outcome": "ok"}),
        value("stepwise:grammar_cache_hits_total"),
    )
    compiler = _compiler()
    for _ in range(3):
        await compiler.check(Grammar("", "regex", "[0-9]{2}"), "sampling.regex")
    assert value("stepwise:grammar_compiles_total", {"outcome": "ok"}) == ok + 1
    assert value("stepwise:grammar_cache_hits_total") == hits + 2


@pytest.mark.parametrize(
    ("kind", "text"),
    [
        ("json_schema", '{"a":' * 2000 + "1" + "}" * 2000),
        ("json_schema", '{"type": "object", "x": ' + "[" * 300 + "]" * 300 + "}"),
        ("structural_tag", '{"structures": ' + "[" * 2000 + "]" * 2000 + "}"),
        ("ebnf", "root ::= " + "(" * 3000 + '"a"' + ")" * 3000),
        ("regex", "(" * 3000 + "a" + ")" * 3000),
    ],
)
async def test_a_grammar_nested_too_deep_is_refused_naming_the_field(kind: str, text: str) -> None:
    """Issue 37: a schema 2,000 deep was gRPC UNKNOWN (`Unexpected <class 'RecursionError'>`)."""
    with pytest.raises(client_codec.InvalidArgument) as info:
        await _compiler().check(Grammar("", kind, text), f"sampling.{kind}")
    assert str(info.value).startswith(f"sampling.{kind}: ")


@pytest.mark.parametrize(
    ("kind", "text", "words"),
    [
        ("ebnf", 'root ::= "a" root', "can never be satisfied"),
        ("ebnf", 'root ::= x\nx ::= "a" x | "b" x', "can never be satisfied"),
        ("regex", "[^\\s\\S]", "can never be satisfied"),
        ("lark", "start: /[^\\s\\S]/", "can never be satisfied"),
        ("ebnf", 'root ::= ""', "only the empty output"),
        ("regex", "a{0}", "only the empty output"),
    ],
)
async def test_a_grammar_that_can_never_be_satisfied_is_refused(kind: str, text: str, words: str) -> None:
    """Issue 37: these were accepted, and ended with `stop` after 0-1 tokens not matching them."""
    with pytest.raises(client_codec.InvalidArgument) as info:
        await _compiler().check(Grammar("", kind, text), f"sampling.{kind}")
    assert str(info.value).startswith(f"sampling.{kind}: ") and words in str(info.value)


@pytest.mark.parametrize(
    ("kind", "text"), [("ebnf", 'root ::= "a" | "b" root'), ("ebnf", 'root ::= x "." \nx ::= [a-z]+ x?')]
)
async def test_a_recursive_grammar_that_can_finish_compiles(kind: str, text: str) -> None:
    await _compiler().check(Grammar("", kind, text), f"sampling.{kind}")


# --- a schema is parsed once per process ----------------------------------------------------------


async def test_a_schema_sent_again_and_again_is_parsed_once_compiled_once_and_the_core_parses_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The frontend's path for each call (check the request, compile its grammar, send the checked
    value) and the core's reading of it: the schema's JSON is read once, by its one compile, and the
    core reads none of it (it had been read per call by the frontend and again by the core)."""
    from control_plane import link_params, metrics
    from control_plane.frontend.generation import as_run
    from grammars import nesting

    reads: list[int] = []
    real_loads = nesting.loads

    def counting_loads(text: str, *args: object) -> object:
        reads.append(len(text))
        return real_loads(text, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(nesting, "loads", counting_loads)
    compiles = metrics.REGISTRY.get_sample_value("stepwise:grammar_compiles_total", {"outcome": "ok"}) or 0.0
    schema = '{"type": "object", "properties": {"name": {"type": "string"}}}'
    compiler = _compiler()
    for _ in range(3):
        request = gen_pb.GenerateRequest(text="hi", sampling=gen_pb.SamplingParams(json_schema=schema))
        inp = client_codec.generate_input_from_proto(request)
        assert inp.params.sampler.grammar is not None
        grammar = await compiler.check(inp.params.sampler.grammar, "sampling.json_schema")
        sent = link_params.to_proto(as_run(inp.params, grammar, "raw"))
        got = link_params.from_arrival(fe_pb.Arrival(params=sent))
        assert got.sampler.grammar == Grammar("llguidance", "json_schema", schema)
    assert reads == [len(schema)]
    assert (
        metrics.REGISTRY.get_sample_value("stepwise:grammar_compiles_total", {"outcome": "ok"})
        == compiles + 1
    )
