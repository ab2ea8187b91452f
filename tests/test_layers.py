"""The import graph keeps the processes apart (read from the source with `ast`; nothing is run).

A file's folder says which process runs it and what it may import:

- `control_plane/core/` (the core process) and `control_plane/frontend/` (a frontend process)
  never import each other; both may use the shared root of `control_plane/`;
- the pure parts, `control_plane/scheduler/`, `cache/` and `record/`, import neither;
- the shared root of `control_plane/` imports neither core nor frontend;
- the two planes never import each other: they meet only in `protos/`;
- `protos/` imports neither plane; no library package imports `stepwise/` (the command line and
  what composes both planes sits above them all);
- `grammars/` (constrained decoding's grammars and backends, which both planes use) imports
  nothing of the project but itself;
- `flagtypes/` (the flag table's range-checked types, which every command line uses) imports
  nothing of the project.

Imports inside functions and under TYPE_CHECKING count like any other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARIES = ("protos", "control_plane", "data_plane", "clients", "gateway", "flagtypes", "grammars")

# (files under this prefix, may not import modules under any of these prefixes)
RULES: list[tuple[str, tuple[str, ...]]] = [
    ("control_plane.core", ("control_plane.frontend",)),
    ("control_plane.frontend", ("control_plane.core",)),
    ("control_plane.scheduler", ("control_plane.core", "control_plane.frontend")),
    ("control_plane.cache", ("control_plane.core", "control_plane.frontend", "control_plane.scheduler")),
    ("control_plane.record", ("control_plane.core", "control_plane.frontend")),
    ("control_plane", ("data_plane", "stepwise", "gateway")),
    ("data_plane", ("control_plane", "stepwise", "gateway")),
    ("protos", ("control_plane", "data_plane", "stepwise", "gateway", "clients")),
    ("clients", ("control_plane", "data_plane", "stepwise", "gateway")),
    ("gateway", ("control_plane", "data_plane", "stepwise")),
    ("flagtypes", ("protos", "control_plane", "data_plane", "clients", "gateway", "stepwise")),
    ("grammars", ("protos", "control_plane", "data_plane", "clients", "gateway", "stepwise", "flagtypes")),
]
# The shared root of control_plane: its own modules, not its sub-packages.
SHARED_ROOT_FORBIDDEN = ("control_plane.core", "control_plane.frontend")


def _module_of(rel: str) -> str:
    parts = list(Path(rel).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(rel: str, source: str) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, relative ones resolved."""
    tree = ast.parse(source, rel)
    module = _module_of(rel)
    package = module if rel.endswith("__init__.py") else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import mod` imports pkg.mod when mod is a module of pkg.
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
    return found


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _forbidden(module: str) -> set[str]:
    banned: set[str] = set()
    for prefix, targets in RULES:
        if _under(module, prefix):
            banned.update(targets)
    if module == "control_plane" or (module.startswith("control_plane.") and module.count(".") == 1):
        banned.update(SHARED_ROOT_FORBIDDEN)
    # A package may always use its own sub-packages.
    return {b for b in banned if not _under(module, b)}


def violations(files: list[tuple[str, str]]) -> list[str]:
    """Every import in `files` ((path relative to the root, source) pairs) that crosses a boundary."""
    out = []
    for rel, source in files:
        forbidden = sorted(_forbidden(_module_of(rel)))
        reported: set[int] = set()
        for line, imported in _imports(rel, source):
            hit = next((b for b in forbidden if _under(imported, b)), None)
            if hit is not None and line not in reported:
                reported.add(line)
                out.append(f"{rel}:{line}: imports {imported} ({hit} is off limits)")
    return out


def _tree() -> list[tuple[str, str]]:
    files = []
    for package in (*LIBRARIES, "stepwise"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if "_pb2" not in path.name:
                files.append((str(path.relative_to(ROOT)), path.read_text()))
    return files


def test_no_import_crosses_a_process_or_plane_boundary() -> None:
    assert violations(_tree()) == []


@pytest.mark.parametrize(
    ("rel", "statement"),
    [
        ("control_plane/core/x.py", "from control_plane.frontend import samples"),
        ("control_plane/frontend/x.py", "from control_plane.core.inbox import Verdict"),
        ("control_plane/scheduler/x.py", "import control_plane.core.engine"),
        ("control_plane/cache/x.py", "from control_plane.scheduler.kv import KvManager"),
        ("control_plane/x.py", "from control_plane.core import hub"),
        ("control_plane/record/x.py", "from ..core import engine"),
        ("data_plane/x.py", "from control_plane.request import FinishReason"),
        ("control_plane/x.py", "from data_plane import sim"),
        ("protos/x.py", "from control_plane import request"),
        ("clients/x.py", "from stepwise.cli import RoutineError"),
        ("gateway/x.py", "import stepwise"),
        ("flagtypes/x.py", "from clients.errors import RoutineError"),
    ],
)
def test_the_check_catches_a_crossing(rel: str, statement: str) -> None:
    """Each rule bites: a crossing planted inside a function (and one under TYPE_CHECKING) is
    reported, and the same file without it is clean."""
    nested = f"def f():\n    {statement}\n"
    guarded = f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    {statement}\n"
    assert len(violations([(rel, nested)])) == 1
    assert len(violations([(rel, guarded)])) == 1
    assert violations([(rel, "import json\n")]) == []


def test_allowed_imports_pass() -> None:
    allowed = [
        ("control_plane/core/x.py", "from control_plane import link, metrics"),
        ("control_plane/frontend/x.py", "from control_plane.client_codec import InvalidArgument"),
        ("control_plane/core/x.py", "from control_plane.scheduler.scheduler import Scheduler"),
        ("control_plane/record/x.py", "from control_plane.scheduler.scheduler import Scheduler"),
        ("data_plane/x.py", "from protos import decode_set"),
        ("control_plane/x.py", "import flagtypes"),
        ("data_plane/x.py", "from flagtypes import PORT"),
        ("stepwise/x.py", "from control_plane.core import server\nfrom data_plane import sim"),
    ]
    assert violations(allowed) == []
