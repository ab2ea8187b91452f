"""GBNF (llama.cpp's grammar form) translated to llguidance's Lark dialect, refusing a grammar that
can never be satisfied.

The translation is llguidance's own (`llguidance.gbnf_to_lark`: parse, resolve, print), with one
check between resolving and printing: every rule the root needs must be able to finish. A rule
finishes when one of its alternatives does, and an alternative when each of its parts does;
`root ::= "a" root` never does, and llguidance would accept it, then stop the output after one
token with a parser error. Only what is certain is refused: a character class or regex counts as
finishing (an empty class at the start is caught by the matcher's first mask, backend.py).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import Any

from grammars.spec import GrammarError

try:
    from llguidance import gbnf_to_lark as _gbnf
except ImportError:  # pragma: no cover - llguidance not installed: the backend is not offered
    _gbnf = None  # type: ignore[assignment]


def to_lark(text: str) -> str:
    """The Lark text of GBNF `text`; GrammarError when it does not parse or can never finish."""
    assert _gbnf is not None, "llguidance is not installed"
    try:
        rules = _gbnf.GrammarParser().parse(text)
        _resolve(rules)
    except RecursionError:
        raise GrammarError("is not valid GBNF: nested too deeply") from None
    except Exception as exc:  # the translator raises plain exceptions on bad GBNF
        raise GrammarError(f"is not valid GBNF: {exc}") from None
    never = _never_finishing(rules)
    if never:
        raise GrammarError(
            f"can never be satisfied: rule {never} has no alternative that finishes (each one needs "
            "a rule that never finishes, itself included)"
        )
    ordered = sorted(rules.values(), key=lambda rule: rule.order)
    out = "%llguidance {}\n\n"
    previous_multiline = True
    for rule in ordered:
        line = str(rule)
        if not previous_multiline and "\n" in line:
            out += "\n"
        out += line + "\n"
        previous_multiline = "\n" in line
        if previous_multiline:
            out += "\n"
    return out


def _resolve(rules: dict[str, Any]) -> None:
    """llguidance's `resolve` (link references, `root` becomes `start`, rules made only of terminals
    become terminals, names in Lark's case), with its terminal fixpoint as a worklist: llguidance
    sweeps every rule until a sweep changes none, which for a chain of 1,200 rules took 1.8 s of
    pure Python (the GIL held all along); this takes each rule once per rule it refers to."""
    assert _gbnf is not None

    def rename(rule: Any, name: str) -> None:
        if name in rules:
            raise Exception(f"Rule '{name}' already exists")
        del rules[rule.name]
        rule.name = name
        rules[name] = rule

    for i, rule in enumerate(rules.values()):
        rule.order = i
        rule.alternatives = rule.alternatives.simplify()
    refers: dict[int, set[int]] = {}
    users: defaultdict[int, set[int]] = defaultdict(set)
    for rule in rules.values():
        refers[id(rule)] = set()
        for node in _nodes(rule.alternatives):
            if isinstance(node, _gbnf.RuleRefNode):
                if node.name not in rules:
                    raise Exception(f"Rule '{node.name}' not found")
                node.target = rules[node.name]
                refers[id(rule)].add(id(node.target))
                users[id(node.target)].add(id(rule))
    if "root" not in rules:
        raise Exception("No 'root' rule found")
    rename(rules["root"], "start")
    by_id = {id(rule): rule for rule in rules.values()}
    waiting = {rule_id: len(targets) for rule_id, targets in refers.items()}
    queue = [rule_id for rule_id, count in waiting.items() if count == 0]
    while queue:
        rule = by_id[queue.pop()]
        if rule.name == "start" or rule.rule_is_terminal:
            continue
        rule.rule_is_terminal = True
        for user in users[id(rule)]:
            waiting[user] -= 1
            if waiting[user] == 0:
                queue.append(user)
    for rule in list(rules.values()):
        name = re.sub(r"([a-z])([A-Z])", r"\1_\2", rule.name.replace("-", "_")).lower()
        name = name.upper() if rule.rule_is_terminal else name.lower()
        if rule.name != name:
            rename(rule, name)


def _never_finishing(rules: Mapping[str, Any]) -> str | None:
    """The GBNF name of the start rule when it can never finish, else None. A worklist: a rule is
    looked at again only when a rule it refers to turns out to finish."""
    assert _gbnf is not None
    by_id = {id(rule): rule for rule in rules.values()}
    users: defaultdict[int, set[int]] = defaultdict(set)
    for rule in by_id.values():
        for node in _nodes(rule.alternatives):
            if isinstance(node, _gbnf.RuleRefNode) and node.target is not None:
                users[id(node.target)].add(id(rule))
    finishing: set[int] = set()
    queue = list(by_id)
    while queue:
        rule_id = queue.pop()
        if rule_id in finishing or not _finishes(by_id[rule_id].alternatives, finishing):
            continue
        finishing.add(rule_id)
        queue.extend(users[rule_id] - finishing)
    start = rules.get("start")
    if start is None or id(start) in finishing:
        return None
    return "root"


def _nodes(node: Any) -> Iterator[Any]:
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(current.children())


def _finishes(node: Any, finishing: set[int]) -> bool:
    """Whether `node` can match some finite text, given the rules known to finish."""
    assert _gbnf is not None
    if isinstance(node, _gbnf.RuleRefNode):
        return node.target is not None and id(node.target) in finishing
    if isinstance(node, _gbnf.RepetitionNode):
        return node.min_times == 0 or _finishes(node.node, finishing)
    if isinstance(node, _gbnf.SequenceNode):
        return all(_finishes(part, finishing) for part in node.nodes)
    if isinstance(node, _gbnf.AlternativeNode):
        return any(_finishes(part, finishing) for part in node.alternatives)
    return True  # a literal, a character class or a regex
