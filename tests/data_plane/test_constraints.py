"""The worker's grammar matchers (data_plane/constraints.py) and the mask in the sampler.

Greedy constrained decoding through the executor is compared with transformers' logits under the
same mask, token by token; a sequence retracted mid-output and prefilled again (its output among
the extend inputs, or among the history before a cached prefix) continues with exactly the tokens
it would have produced; sampled tokens always obey the grammar.
"""

from __future__ import annotations

import json
import pathlib
import re

import numpy as np
import pytest
import torch

from data_plane.constraints import Constraints, GrammarMasks
from data_plane.executor import Executor
from data_plane.kv_pool import KvPool
from data_plane.models.llama import LlamaModel
from data_plane.sampler import apply_grammar_masks
from grammars import backend as grammar_backend
from grammars.spec import GrammarSpec
from protos.worker import Grammar, NewSeq, SamplerParams, sampled_handles
from tests.data_plane.factories import Extend, SlotAllocator, hf_next_logits, make_plan

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
JSON_GRAMMAR = Grammar("llguidance", "json_schema", json.dumps(SCHEMA))
REGEX_GRAMMAR = Grammar("llguidance", "regex", r"[0-9]{3}-[a-z]{2,4}")
PROMPT = [5, 77, 300, 12, 9, 41]


def _tokenizer_json(model_dir: pathlib.Path) -> str:
    return (model_dir / "tokenizer.json").read_text(encoding="utf-8")


@pytest.fixture
def executor(our_model: LlamaModel, model_dir: pathlib.Path) -> Executor:
    config = our_model.config
    constraints = Constraints(_tokenizer_json(model_dir), config.vocab_size, config.eos_token_ids)
    pool = KvPool(config, 4096, torch.float32, torch.device("cpu"))
    return Executor(our_model, pool, constraints=constraints, seed=0)


def _seq(
    handle: int, grammar: Grammar, prompt_len: int, sampler: SamplerParams | None = None, **kw
) -> NewSeq:  # type: ignore[no-untyped-def]
    sampler = sampler or SamplerParams()
    return NewSeq(
        handle=handle,
        sampler=SamplerParams(
            temperature=sampler.temperature, seed=sampler.seed, top_k=sampler.top_k, grammar=grammar
        ),
        prompt_len=prompt_len,
        **kw,
    )


class Run:
    """Drives one executor: prefill a sequence, decode it, keep its tokens and slots."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.slots = SlotAllocator(4096, 1, seed=1)
        self.step = 0

    def execute(self, plan):  # type: ignore[no-untyped-def]
        result = self.executor.execute(plan)
        assert result.error == "", result.error
        return dict(zip(sampled_handles(plan).tolist(), result.token_ids.tolist(), strict=True))

    def prefill(self, seq: NewSeq, tokens: list[int], start: int = 0) -> int:
        self.step += 1
        ext = Extend(seq.handle, start, tokens, self.slots.alloc(seq.handle, len(tokens)))
        return self.execute(make_plan(self.step, extends=[ext], new_seqs=[seq]))[seq.handle]

    def decode(self, handle: int) -> int:
        self.step += 1
        slot = int(self.slots.alloc(handle, 1)[0])
        return self.execute(make_plan(self.step, decodes=[(handle, slot)]))[handle]

    def release(self, handle: int) -> None:
        self.step += 1
        self.execute(make_plan(self.step, releases=[handle]))


def _generate(run: Run, handle: int, grammar: Grammar, steps: int, eos: int) -> list[int]:
    out = [run.prefill(_seq(handle, grammar, len(PROMPT)), list(PROMPT))]
    while out[-1] != eos and len(out) < steps:
        out.append(run.decode(handle))
    return out


def _allowed(words: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(words.view(np.uint8), count=vocab, bitorder="little").astype(bool)


@pytest.mark.parametrize("grammar", [JSON_GRAMMAR, REGEX_GRAMMAR], ids=["json_schema", "regex"])
def test_greedy_constrained_output_equals_transformers_under_the_same_mask(  # type: ignore[no-untyped-def]
    executor: Executor, hf_model, model_dir: pathlib.Path, grammar: Grammar
) -> None:
    config = executor.model.config
    eos = min(config.eos_token_ids)
    out = _generate(Run(executor), 1, grammar, 60, eos)
    assert out[-1] == eos, "the grammar did not finish within 60 tokens"

    backend = grammar_backend.create("llguidance", _tokenizer_json(model_dir), config.vocab_size, [eos])
    matcher = backend.matcher(backend.compile(GrammarSpec(grammar.kind, grammar.spec)))
    words = np.zeros(grammar_backend.mask_words(config.vocab_size), dtype=np.int32)
    expected: list[int] = []
    while not expected or expected[-1] != eos:
        logits = hf_next_logits(hf_model, PROMPT + expected)
        matcher.fill(words)
        logits[~torch.from_numpy(_allowed(words, config.vocab_size))] = float("-inf")
        expected.append(int(logits.argmax()))
        assert matcher.accept(expected[-1])
    assert out == expected

    import tokenizers

    text = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(out[:-1])
    if grammar.kind == "json_schema":
        value = json.loads(text)
        assert set(value) == {"name", "age", "tags"} and 0 <= value["age"] <= 99
    else:
        assert re.fullmatch(grammar.spec, text), text


@pytest.mark.parametrize("cached_output", [0, 3], ids=["output-in-extend", "output-in-history"])
def test_a_re_prefilled_sequence_rebuilds_its_matcher_and_continues_alike(
    executor: Executor, our_model: LlamaModel, model_dir: pathlib.Path, cached_output: int
) -> None:
    """Retraction's shape: the sequence is released after some output, comes back under a new
    handle with prompt + output as its input (part of it a cached prefix whose tokens arrive as
    history), and must finish exactly as the uninterrupted run did."""
    eos = min(our_model.config.eos_token_ids)
    whole = _generate(Run(executor), 1, JSON_GRAMMAR, 60, eos)
    assert len(whole) > 8

    run = Run(executor)
    done = _generate(run, 2, JSON_GRAMMAR, 6, eos)
    assert done == whole[:6]
    table = executor.table.slot_table(2)
    run.release(2)
    inputs = PROMPT + done
    cached = len(PROMPT) + cached_output
    seq = _seq(
        3,
        JSON_GRAMMAR,
        len(PROMPT),
        prefix_slots=table[:cached].copy(),
        history_ids=np.asarray(inputs[:cached], dtype=np.int32),
    )
    again = [run.prefill(seq, inputs[cached:], start=cached)]
    while again[-1] != eos and len(again) < 60:
        again.append(run.decode(3))
    assert done + again == whole


def test_sampled_tokens_obey_the_grammar_at_temperature_one(
    executor: Executor, model_dir: pathlib.Path
) -> None:
    eos = min(executor.model.config.eos_token_ids)
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for seed in range(4):
        run = Run(executor)
        seq = _seq(10 + seed, REGEX_GRAMMAR, len(PROMPT), SamplerParams(temperature=1.0, seed=seed))
        out = [run.prefill(seq, list(PROMPT))]
        while out[-1] != eos and len(out) < 40:
            out.append(run.decode(10 + seed))
        assert out[-1] == eos
        assert re.fullmatch(REGEX_GRAMMAR.spec, tok.decode(out[:-1])), (seed, tok.decode(out[:-1]))
        run.release(10 + seed)


def test_a_decode_past_the_grammars_end_gives_eos_again(executor: Executor) -> None:
    """Under overlap the control plane plans one more decode before it learns of the EOS."""
    eos = min(executor.model.config.eos_token_ids)
    run = Run(executor)
    out = _generate(run, 1, REGEX_GRAMMAR, 40, eos)
    assert out[-1] == eos
    assert run.decode(1) == eos


def test_a_release_forgets_the_matcher(executor: Executor) -> None:
    run = Run(executor)
    run.prefill(_seq(1, REGEX_GRAMMAR, len(PROMPT)), list(PROMPT))
    assert executor.constraints
    run.release(1)
    assert not executor.constraints


def test_apply_grammar_masks_sets_minus_inf_exactly_where_bits_are_clear() -> None:
    vocab = 70  # not a multiple of 32: the last word's high bits are past the vocabulary
    rng = np.random.default_rng(0)
    words = rng.integers(-(2**31), 2**31, size=(2, 3), dtype=np.int64).astype(np.int32)
    logits = torch.randn(3, vocab)
    before = logits.clone()
    apply_grammar_masks(logits, GrammarMasks(np.array([0, 2]), words))
    for k, row in enumerate((0, 2)):
        allowed = torch.from_numpy(_allowed(words[k], vocab))
        assert torch.equal(logits[row][allowed], before[row][allowed])
        assert bool(torch.isneginf(logits[row][~allowed]).all())
    assert torch.equal(logits[1], before[1])


def test_a_matcher_that_allows_nothing_is_given_eos(model_dir: pathlib.Path) -> None:
    constraints = Constraints(_tokenizer_json(model_dir), 1024, [0])
    constraints.start(5, REGEX_GRAMMAR, 0, np.zeros(0, dtype=np.int32))
    constraints.accept(np.array([5]), np.array([1000]))  # a token the grammar refuses
    masks = constraints.fill(np.array([5]))
    assert masks is not None
    assert np.flatnonzero(_allowed(masks.words[0], 1024)).tolist() == [0]


def test_a_worker_without_a_tokenizer_constrains_nothing() -> None:
    assert Constraints(None, 1024, [0]).backends == ()


def test_a_prepared_grammar_is_compiled_off_the_step(model_dir: pathlib.Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Issue 37: the compile and the first matcher build ran inside the step. `prepare` runs them
    on a thread of its own; the sequence that comes later gets a copy, compiling nothing."""
    import threading

    constraints = Constraints(_tokenizer_json(model_dir), 1024, [0])
    threads: list[str] = []
    real = grammar_backend.create

    def create(*args):  # type: ignore[no-untyped-def]
        backend = real(*args)
        compile_ = backend.compile

        def counted(spec):  # type: ignore[no-untyped-def]
            threads.append(threading.current_thread().name)
            return compile_(spec)

        backend.compile = counted
        return backend

    monkeypatch.setattr(grammar_backend, "create", create)
    done = threading.Event()
    errors: list[str] = []
    constraints.prepare(JSON_GRAMMAR, lambda error: (errors.append(error), done.set()))
    assert done.wait(30) and errors == [""]
    assert len(threads) == 1 and threads[0].startswith("grammar-prepare")
    constraints.start(0, JSON_GRAMMAR, len(PROMPT), np.asarray(PROMPT, dtype=np.int32))
    assert len(threads) == 1, "the step compiled the grammar again"
    bad = threading.Event()
    constraints.prepare(Grammar("nope", "regex", "a"), lambda error: (errors.append(error), bad.set()))
    assert bad.wait(30) and "not available" in errors[-1]


def test_a_grammar_that_dead_ends_after_its_first_token_is_reported_failed(executor: Executor) -> None:
    """Issue 37 item 7: `start: "a" x`, `x: "b" x` passes the compile checks (its first mask allows
    "a"), then its matcher fails and allows only EOS. The worker still samples EOS for it (no row
    is left all -inf) and says, for that sample, that its grammar could not be satisfied, so the
    control plane does not end it as a plain `stop`."""
    grammar = Grammar("llguidance", "lark", 'start: "a" x\nx: "b" x')
    eos = min(executor.model.config.eos_token_ids)
    run = Run(executor)
    first = run.prefill(_seq(1, grammar, len(PROMPT)), list(PROMPT))
    assert first != eos
    run.step += 1
    slot = int(run.slots.alloc(1, 1)[0])
    result = executor.execute(make_plan(run.step, decodes=[(1, slot)]))
    assert result.error == ""
    assert result.token_ids.tolist() == [eos]
    assert result.grammar_failed.tolist() == [0]


def test_a_finished_grammar_is_not_reported_failed(executor: Executor) -> None:
    grammar = Grammar("llguidance", "regex", "a")
    eos = min(executor.model.config.eos_token_ids)
    run = Run(executor)
    run.prefill(_seq(1, grammar, len(PROMPT)), list(PROMPT))
    run.step += 1
    slot = int(run.slots.alloc(1, 1)[0])
    result = executor.execute(make_plan(run.step, decodes=[(1, slot)]))
    assert result.token_ids.tolist() == [eos]
    assert result.grammar_failed.tolist() == []
