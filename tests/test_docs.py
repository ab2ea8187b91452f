"""The project explains itself: what the code cites exists, and the README's map matches the tree.

- Every `docs/<name>.md` or `docs/<name>.md#anchor` cited anywhere in the code (tests included) names
  a file in docs/ and, with an anchor, a section of it (an explicit `<a id="...">` or a heading's
  GitHub slug). A bare `#anchor` right after a citation (`docs/scheduler.md#a, #b`) is checked
  against the same file.
- Nothing mentions a Markdown document the project does not hold, a path out of the repository, or
  section signs (the code, README and docs stand alone).
- The README stays short, and its folder map lists every package and sub-package of the tree and
  nothing that is not there.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CITATION = re.compile(r"docs/([\w-]+\.md)((?:#[\w-]+)?)((?:(?:, | and |/)#[\w-]+)*)")
# Every Markdown file name the text mentions (`<name>.md`, with or without a path); each must be a
# document of the project, matched by file name.
MENTIONED_DOC = re.compile(r"(?<![\w/.-])(?:[\w./-]*/)?([\w-]+\.md)\b")
# A path out of the repository, or section-sign citations of a document that is not here.
OUTSIDE = re.compile(r"\.\./shared|§")
README_MAX_LINES = 250
# Top-level folders that are not Python packages but belong in the map.
OTHER_FOLDERS = ("bench/", "docs/", "k8s/", "tests/")


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / line for line in out.stdout.splitlines() if (ROOT / line).exists()]


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    text = doc.read_text()
    found = set(re.findall(r'<a id="([\w-]+)"></a>', text))
    found |= {_slug(h) for h in re.findall(r"^#+\s+(.+)$", text, flags=re.M)}
    return found


def citations(text: str) -> list[tuple[str, str]]:
    """(doc file, anchor or "") for every citation in `text`."""
    out = []
    for match in CITATION.finditer(text):
        doc, first, more = match.group(1), match.group(2), match.group(3)
        out.append((doc, first[1:]))
        out += [(doc, extra) for extra in re.findall(r"#([\w-]+)", more)]
    return out


def test_mentioned_documents_are_found_with_or_without_a_path() -> None:
    doc = "md"  # the examples are assembled so that this file mentions no document it lacks
    text = f"see ../notes/Plan.{doc}, docs/scheduler.{doc}#intake and README.{doc}; not a.{doc}x"
    assert MENTIONED_DOC.findall(text) == [f"Plan.{doc}", f"scheduler.{doc}", f"README.{doc}"]
    assert OUTSIDE.search("../shared/x") and OUTSIDE.search("\u00a7 3") and not OUTSIDE.search("docs/")


def test_citations_are_parsed() -> None:
    text = "docs/scheduler.md#intake, #retraction and docs/deploy.md (docs/protocols.md#the-worker-protocol)"
    assert citations(text) == [
        ("scheduler.md", "intake"),
        ("scheduler.md", "retraction"),
        ("deploy.md", ""),
        ("protocols.md", "the-worker-protocol"),
    ]


def test_every_cited_doc_and_anchor_exists() -> None:
    missing = []
    known: dict[str, set[str] | None] = {}
    this = Path(__file__).resolve()
    for path in _tracked("*.py", "*.sh", "*.md", "*.toml", "*.yaml", "Dockerfile", "dev"):
        if path.resolve() == this:
            continue  # its docstring and examples cite made-up names on purpose
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for doc, anchor in citations(line):
                if doc not in known:
                    file = ROOT / "docs" / doc
                    known[doc] = anchors(file) if file.exists() else None
                where = f"{path.relative_to(ROOT)}:{i}"
                if known[doc] is None:
                    missing.append(f"{where}: docs/{doc} does not exist")
                elif anchor and anchor not in (known[doc] or set()):
                    missing.append(f"{where}: docs/{doc} has no section #{anchor}")
    assert missing == []


def test_nothing_cites_a_document_outside_the_project() -> None:
    this = Path(__file__).resolve()
    own = {path.name for path in _tracked("*.md")}
    found = []
    for path in _tracked("*.py", "*.sh", "*.md", "*.toml", "*.yaml", "Dockerfile", "dev"):
        if path.resolve() == this:
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            strangers = [name for name in MENTIONED_DOC.findall(line) if name not in own]
            if strangers or OUTSIDE.search(line):
                found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:80]}")
    assert found == []


def _packages() -> set[str]:
    """Every Python package and sub-package of the tree (tests' own aside), as `path/`."""
    out = set()
    for init in _tracked("*__init__.py"):
        folder = init.parent.relative_to(ROOT)
        if folder.parts[0] in ("tests", "protos") and len(folder.parts) > 1:
            continue  # test helpers and generated stubs are not rooms of their own
        out.add(f"{folder.as_posix()}/")
    return out


def readme_map() -> set[str]:
    """The paths that start the lines of the README's folder map (the fenced block that lists them)."""
    text = (ROOT / "README.md").read_text()
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S):
        paths = set(re.findall(r"^([\w./-]+/)\s", block, flags=re.M))
        if "control_plane/" in paths and "data_plane/" in paths:
            return paths
    pytest.fail("README.md has no folder map (a fenced block listing control_plane/ and data_plane/)")


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; keep it to {README_MAX_LINES}"


def test_readme_folder_map_matches_the_tree() -> None:
    listed = readme_map()
    wanted = _packages() | set(OTHER_FOLDERS)
    assert sorted(wanted - listed) == [], "folders missing from the README's map"
    absent = [p for p in listed if not (ROOT / p).is_dir()]
    assert absent == [], "the README's map lists folders that do not exist"
