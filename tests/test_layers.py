"""The import graph keeps the processes apart (read from the source with `ast`; nothing is run).

A file's folder says which process runs it and what it may import:

- `control_plane/core/` (the core process) and `control_plane/frontend/` (a frontend process)
  never import each other; both may use the shared root of `control_plane/`;
- the core imports nothing of the client protocol (generation.proto's stubs, client_codec.py): its
  frontends check a client's request and send the checked value over the link;
- the pure parts, `control_plane/scheduler/`, `cache/` and `record/`, import neither;
- the shared root of `control_plane/` imports neither core nor frontend;
- the two planes never import each other: they meet only in `protos/`;
- `protos/` imports neither plane; no library package imports `stepwise/` (the command line and
  what composes both planes sits above them all);
- `grammars/` (constrained decoding's grammars and backends, which both planes use) imports
  nothing of the project but itself;
- `flagtypes/` (the flag table's range-checked types, which every command line uses) imports
  nothing of the project.
- the rooms that decide in plain values, `control_plane/core/fleet/` and `control_plane/scheduler/`,
  import no grpc, asyncio or torch (directly or through each other), and the engine and its mover
  reach the fleet only through its public entry (`control_plane.core.fleet`), never a module inside it.

Imports inside functions and under TYPE_CHECKING count like any other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARIES = ("protos", "control_plane", "data_plane", "clients", "gateway", "flagtypes", "grammars")

# (files under this prefix, may not import modules under any of these prefixes)
# The client protocol: the core reads none of it.
CLIENT_PROTOCOL = (
    "protos.stepwise.v1.generation_pb2",
    "protos.stepwise.v1.generation_pb2_grpc",
    # Where client_codec.py lived before it became the frontends' own (frontend/client_codec.py).
    "control_plane.client_codec",
)
RULES: list[tuple[str, tuple[str, ...]]] = [
    ("control_plane.core", ("control_plane.frontend", *CLIENT_PROTOCOL)),
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
        ("control_plane/core/x.py", "from protos.stepwise.v1 import generation_pb2 as gen_pb"),
        ("control_plane/core/x.py", "from control_plane import client_codec"),
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
        ("control_plane/frontend/x.py", "from control_plane.frontend.client_codec import InvalidArgument"),
        ("control_plane/core/x.py", "from control_plane.scheduler.scheduler import Scheduler"),
        ("control_plane/record/x.py", "from control_plane.scheduler.scheduler import Scheduler"),
        ("data_plane/x.py", "from protos import decode_set"),
        ("control_plane/x.py", "import flagtypes"),
        ("data_plane/x.py", "from flagtypes import PORT"),
        ("stepwise/x.py", "from control_plane.core import server\nfrom data_plane import sim"),
    ]
    assert violations(allowed) == []


# --- the pure rooms and the fleet's entry --------------------------------------------------------

# Rooms that decide in plain values: no module of theirs imports these, directly or through another
# module of these rooms (the live core and a simulator drive them alike). The shared root's modules
# they use are not followed (control_plane.config reaches asyncio through protos.targets).
PURE_ROOMS = ("control_plane.core.fleet", "control_plane.scheduler")
EDGE_LIBRARIES = ("grpc", "asyncio", "torch")
# The engine drives one worker, and its mover starts the moves the fleet decides; what spans
# workers they reach through the fleet's public entry only.
FLEET = "control_plane.core.fleet"
FLEET_USERS = ("control_plane.core.engine", "control_plane.core.mover")


def _pure(module: str) -> bool:
    return any(_under(module, room) for room in PURE_ROOMS)


def edge_reaches(files: list[tuple[str, str]]) -> list[str]:
    """For each module of a pure room that reaches an edge library: the chain of imports."""
    sources = {_module_of(rel): (rel, source) for rel, source in files}
    graph = {module: [m for _, m in _imports(rel, source)] for module, (rel, source) in sources.items()}
    chains = (_path_to_edge(module, graph) for module in sorted(filter(_pure, sources)))
    return [" -> ".join(chain) for chain in chains if chain]


def _path_to_edge(start: str, graph: dict[str, list[str]]) -> list[str]:
    seen = {start}
    stack = [[start]]
    while stack:
        path = stack.pop()
        for imported in graph.get(path[-1], []):
            if any(_under(imported, lib) for lib in EDGE_LIBRARIES):
                return [*path, imported]
            if _pure(imported) and imported in graph and imported not in seen:
                seen.add(imported)
                stack.append([*path, imported])
    return []


def fleet_internals(files: list[tuple[str, str]]) -> list[str]:
    """Imports of a module inside the fleet's package by the modules that may use only its entry."""
    out = []
    for rel, source in files:
        if _module_of(rel) in FLEET_USERS:
            out += [
                f"{rel}:{line}: imports {imported} (only {FLEET} itself)"
                for line, imported in _imports(rel, source)
                if _under(imported, FLEET) and imported != FLEET and _module_of_fleet(imported)
            ]
    return out


def _module_of_fleet(imported: str) -> bool:
    """`control_plane.core.fleet.X...` names a module of the package (not a name its entry exports)."""
    name = imported.removeprefix(FLEET + ".").partition(".")[0]
    return (ROOT / "control_plane" / "core" / "fleet" / f"{name}.py").exists()


def test_the_pure_rooms_reach_no_grpc_asyncio_or_torch() -> None:
    assert edge_reaches(_tree()) == []


def test_the_engine_uses_only_the_fleets_public_entry() -> None:
    assert fleet_internals(_tree()) == []


@pytest.mark.parametrize("statement", ["import asyncio", "import grpc", "from torch import nn"])
def test_the_edge_check_catches_a_reach_through_another_module(statement: str) -> None:
    """Planted in a function of a scheduler module the fleet imports, and the fleet is caught."""
    files = [
        ("control_plane/core/fleet/x.py", "from control_plane.scheduler import helper\n"),
        ("control_plane/scheduler/helper.py", f"def f():\n    {statement}\n"),
    ]
    lib = statement.split()[1]
    assert f"control_plane.core.fleet.x -> control_plane.scheduler.helper -> {lib}" in edge_reaches(files)
    assert edge_reaches([files[0], ("control_plane/scheduler/helper.py", "import json\n")]) == []


def test_the_fleet_entry_check_catches_an_internal_import() -> None:
    engine = "control_plane/core/engine.py"
    assert fleet_internals([(engine, "from control_plane.core.fleet.placement import Plan\n")]) != []
    assert fleet_internals([(engine, "from control_plane.core.fleet import placement\n")]) != []
    assert fleet_internals([(engine, "from control_plane.core.fleet import Fleet, Plan\n")]) == []
    server = ("control_plane/core/server.py", "from control_plane.core.fleet.census import take\n")
    assert fleet_internals([server]) == []
