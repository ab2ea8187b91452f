"""One owner per piece of scheduler state (read from the source with `ast`; nothing is run).

The scheduler is composed of small objects (the running batch, the books of handles, the waiting
queue, the chunk in progress, ...), each the only writer of its own attributes: the others change
that state by calling the owner's methods, so every rule about a piece of state sits next to it.
The rule checked here, for every class defined under `control_plane/scheduler/`:

    an attribute of a class is written only in the file that defines the class.

A write is an assignment target rooted at `self` (`=`, `+=` and friends, an annotated assignment,
a `for` or `with` target):

- `self.a = ...`, `self.a += ...`, `self.a[k] = ...` write `a` of the class the method belongs to;
- `self.a.b = ...`, `self.a.b[k] += ...` write `b` of the object in `self.a`, whose class is read
  from how the class sets `self.a` (a constructor call, an annotation, an annotated `__init__`
  parameter, a dataclass field); a chain it cannot follow is an error, so nothing slips through,
  and one that ends in an object of another package (a Request, the radix tree) is out of scope;
- a class that inherits from another class defined here shares its base's attributes: they belong
  to the topmost such base, so a chain of partial classes that splits one object's state over
  several files fails.

Out of scope: writes through a local name or a parameter (`req.extend_range = ...`,
`stats.decode_bs = ...`). `Request` is the data model of control_plane/request.py, written by the
rules that act on it, as SGLang's `Req`; a StepStats is a record each step fills in as it goes.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCHEDULER = ROOT / "control_plane" / "scheduler"


@dataclass
class ClassInfo:
    name: str
    file: str
    node: ast.ClassDef
    bases: list[str]
    # attribute -> the class of the object it holds (by name), where the source says
    attr_types: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Write:
    owner: str  # the class whose attribute is written (the topmost scheduler base)
    attr: str
    file: str
    line: int


def _names_in(annotation: ast.expr | None) -> list[str]:
    if annotation is None:
        return []
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    return [n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)]


def _constructed_class(value: ast.expr | None) -> str | None:
    """`T(...)` or `T.factory(...)` -> "T"."""
    if not isinstance(value, ast.Call):
        return None
    func = value.func
    if isinstance(func, ast.Attribute):
        func = func.value
    return func.id if isinstance(func, ast.Name) else None


def _methods(cls: ast.ClassDef) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for item in cls.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            yield item


def _self_attr(target: ast.expr) -> str | None:
    """ "a" for the target `self.a`."""
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
        return target.attr
    return None


def _classes(sources: dict[str, str]) -> dict[str, ClassInfo]:
    classes: dict[str, ClassInfo] = {}
    for rel, source in sources.items():
        for node in ast.parse(source, rel).body:
            if isinstance(node, ast.ClassDef):
                assert node.name not in classes, f"two scheduler classes named {node.name}"
                bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
                classes[node.name] = ClassInfo(node.name, rel, node, bases)
    for info in classes.values():
        _learn_attr_types(info, classes)
    return classes


def _learn_attr_types(info: ClassInfo, classes: dict[str, ClassInfo]) -> None:
    def known(names: list[str]) -> str | None:
        """A scheduler class if one is named, else the first other class (e.g. Request)."""
        named = [n for n in names if n not in ("None", "Optional")]
        return next((n for n in named if n in classes), named[0] if named else None)

    types = info.attr_types
    for item in info.node.body:  # dataclass fields
        if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
            continue
        if (t := known(_names_in(item.annotation))) is not None:
            types[item.target.id] = t
    for method in _methods(info.node):
        params = {a.arg: a.annotation for a in [*method.args.args, *method.args.kwonlyargs]}
        for node in ast.walk(method):
            if isinstance(node, ast.AnnAssign) and (attr := _self_attr(node.target)) is not None:
                if (t := known(_names_in(node.annotation))) is not None:
                    types[attr] = t
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if (attr := _self_attr(target)) is None or attr in types:
                        continue
                    t = known([c] if (c := _constructed_class(node.value)) else [])
                    if t is None and isinstance(node.value, ast.Name) and node.value.id in params:
                        t = known(_names_in(params[node.value.id]))
                    if t is not None:
                        types[attr] = t


def _root(name: str, classes: dict[str, ClassInfo]) -> str:
    """The topmost base of `name` defined under scheduler/: the class whose object it is."""
    info = classes[name]
    for base in info.bases:
        if base in classes:
            return _root(base, classes)
    return name


def _attr_type(name: str, attr: str, classes: dict[str, ClassInfo]) -> str | None:
    info = classes[name]
    if attr in info.attr_types:
        return info.attr_types[attr]
    for base in info.bases:
        if base in classes and (t := _attr_type(base, attr, classes)) is not None:
            return t
    return None


def _targets(node: ast.AST) -> Iterator[ast.expr]:
    if isinstance(node, ast.Assign):
        roots: list[ast.expr] = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign | ast.For | ast.AsyncFor):
        roots = [node.target]
    elif isinstance(node, ast.withitem) and node.optional_vars is not None:
        roots = [node.optional_vars]
    else:
        return
    while roots:
        target = roots.pop()
        if isinstance(target, ast.Tuple | ast.List):
            roots.extend(target.elts)
        elif isinstance(target, ast.Starred):
            roots.append(target.value)
        else:
            yield target


def _chain(target: ast.expr) -> list[str] | None:
    """The attribute names from `self` to the attribute written (`self.a.b[k]` -> [a, b]); None
    when the target is not rooted at `self`; [] when the chain goes through an item (`self.a[i].b`)."""
    node = target
    while isinstance(node, ast.Subscript):  # item assignment writes the attribute that holds it
        node = node.value
    chain: list[str] = []
    through_item = False
    while isinstance(node, ast.Attribute | ast.Subscript):
        if isinstance(node, ast.Subscript):
            through_item = True
        else:
            chain.append(node.attr)
        node = node.value
    if not (isinstance(node, ast.Name) and node.id == "self") or not chain:
        return None
    return [] if through_item else chain[::-1]


def scan(sources: dict[str, str]) -> tuple[list[Write], list[str]]:
    """Every write rooted at `self`, and the targets whose owner cannot be told."""
    classes = _classes(sources)
    writes: list[Write] = []
    unknown: list[str] = []
    for info in classes.values():
        for method in _methods(info.node):
            for node in ast.walk(method):
                for target in _targets(node):
                    chain = _chain(target)
                    if chain is None:
                        continue
                    where = f"{info.file}:{target.lineno} ({info.name}.{method.name})"
                    owner: str | None = info.name
                    for attr in chain[:-1]:
                        owner = _attr_type(owner, attr, classes) if owner is not None else None
                    if not chain or owner is None:
                        unknown.append(f"{where}: {ast.unparse(target)}")
                        continue
                    if owner not in classes:
                        continue  # an object of another package (a Request, the radix tree)
                    writes.append(Write(_root(owner, classes), chain[-1], info.file, target.lineno))
    return writes, unknown


def violations(sources: dict[str, str]) -> list[str]:
    """Attributes written outside the file that defines their class, and unresolvable targets."""
    classes = _classes(sources)
    writes, unknown = scan(sources)
    by_attr: dict[tuple[str, str], list[Write]] = defaultdict(list)
    for w in writes:
        by_attr[(w.owner, w.attr)].append(w)
    out = [f"cannot tell whose attribute is written (annotate it): {u}" for u in unknown]
    for (owner, attr), ws in sorted(by_attr.items()):
        home = classes[owner].file
        files = sorted({w.file for w in ws})
        if files != [home]:
            sites = ", ".join(f"{w.file}:{w.line}" for w in ws if w.file != home)
            out.append(f"{owner}.{attr} (class in {home}) is written from {len(files)} files: {sites}")
    return out


def _scheduler_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(SCHEDULER.glob("*.py"))}


def test_every_attribute_of_the_scheduler_has_one_owner() -> None:
    sources = _scheduler_sources()
    writes, _ = scan(sources)
    assert len(writes) > 100, "the scan found too few writes to be looking at the scheduler"
    problems = violations(sources)
    assert not problems, "\n".join(problems)


# --- the checker itself --------------------------------------------------------------------------


BATCH = """
class Batch:
    def __init__(self) -> None:
        self.full = False
        self.rows = []

    def mark_full(self) -> None:
        self.full = True
"""


@pytest.mark.parametrize(
    ("other", "flagged"),
    [
        # A partial class in another file writing its host's flag.
        ("class Admission(Batch):\n    def f(self):\n        self.full = True\n", "Batch.full"),
        # A partial class adding its own attribute to the host object: still the host's state.
        ("class Admission(Batch):\n    def f(self):\n        self.seen = 1\n", "Batch.seen"),
        # Reaching into a composed object (its class from the constructor call).
        (
            "class Admission:\n    def __init__(self):\n        self.batch = Batch()\n"
            "    def f(self):\n        self.batch.full = True\n",
            "Batch.full",
        ),
        # ... or from the annotated parameter it was given; augmented and item writes count.
        (
            "class Admission:\n    def __init__(self, batch: Batch | None):\n        self.batch = batch\n"
            "    def f(self):\n        self.batch.rows[0] += 1\n",
            "Batch.rows",
        ),
        # ... or from an annotation, inside a tuple target.
        (
            "class Admission:\n    def __init__(self):\n        self.batch: Batch = make()\n"
            "    def f(self):\n        self.batch.full, x = True, 1\n",
            "Batch.full",
        ),
    ],
)
def test_the_checker_flags_a_write_from_another_file(other: str, flagged: str) -> None:
    problems = violations({"batch.py": BATCH, "admission.py": other})
    assert len(problems) == 1 and problems[0].startswith(f"{flagged} (class in batch.py)")


def test_the_checker_accepts_own_writes_and_method_calls() -> None:
    other = (
        "class Admission:\n    def __init__(self, batch: Batch):\n        self.batch = batch\n"
        "        self.count = 0\n"
        "    def f(self, req):\n        self.batch.mark_full()\n        self.count += 1\n"
        "        req.extend_range = (0, 1)\n"
        "        self.req: Request | None = None\n        self.req.handle = 1\n"
    )
    assert violations({"batch.py": BATCH, "admission.py": other}) == []


def test_the_checker_reports_what_it_cannot_follow() -> None:
    other = (
        "class Admission:\n    def __init__(self, thing):\n        self.thing = thing\n"
        "        self.batches = [Batch()]\n"
        "    def f(self):\n        self.thing.full = True\n        self.batches[0].full = True\n"
    )
    problems = violations({"batch.py": BATCH, "admission.py": other})
    assert len(problems) == 2 and all(p.startswith("cannot tell") for p in problems)
