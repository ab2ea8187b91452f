"""GBNF to Lark (grammars/gbnf.py): the same text as llguidance's own translation, with its
terminal fixpoint taken rule by rule (a chain of rules once cost seconds of pure Python)."""

from __future__ import annotations

import random

import llguidance.gbnf_to_lark as llguidance
import pytest

from grammars import gbnf
from grammars.spec import GrammarError


def _chain(seed: int, rules: int) -> str:
    r = random.Random(seed)
    lines = ["root ::= r0"]
    for i in range(rules - 1):
        other = r.randint(i + 1, rules - 1)
        lines.append(f'r{i} ::= "w{i}" r{i + 1} | [a-z]{{1,3}} "{r.randint(0, 9)}" | r{other} "y"')
    lines.append(f'r{rules - 1} ::= "end"')
    return "\n".join(lines)


GRAMMARS = [
    'root ::= "a"',
    'root ::= a b\na ::= "x" | b\nb ::= [0-9]+ "y"',
    'root ::= fooBar\nfooBar ::= "a" foo-baz\nfoo-baz ::= "b"*',
    'root ::= x x\nx ::= ("a" | "b")? y\ny ::= [c-d]{2,3}',
    'root ::= "(" root ")" | "x"',
    _chain(1, 200),
    _chain(2, 50),
]


@pytest.mark.parametrize("text", GRAMMARS, ids=range(len(GRAMMARS)))
def test_the_translation_is_llguidances(text: str) -> None:
    assert gbnf.to_lark(text) == llguidance.gbnf_to_lark(text)


@pytest.mark.parametrize(("text", "words"), [('x ::= "a"', "root"), ("root ::= y", "not found")])
def test_bad_gbnf_is_refused(text: str, words: str) -> None:
    with pytest.raises(GrammarError, match=words):
        gbnf.to_lark(text)
