"""The editable install `./dev` makes is quiet: setuptools finds the flat layout it is told about.

Without `package-dir` setuptools installs an import hook for the root's packages and warns in a box
("folders ... with the same name as your package ... may take precedence"), which reads like a failure
at the top of `./dev demo`. The build runs on a copy of the project's layout (links to the packages),
so nothing is written into the checkout.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.cli.runner import ROOT

BUILD = "import setuptools.build_meta as b, sys; print(b.build_editable(sys.argv[1]))"


@pytest.mark.timeout(120)
def test_the_editable_install_is_a_plain_path_entry_without_a_warning(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md"):
        (project / name).write_bytes((ROOT / name).read_bytes())
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    for package in (p.rstrip("*") for p in packages["find"]["include"]):
        (project / package).symlink_to(ROOT / package)
    out = tmp_path / "wheel"
    out.mkdir()
    built = subprocess.run(
        [sys.executable, "-W", "always", "-c", BUILD, str(out)],
        cwd=project, capture_output=True, text=True, timeout=100, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    output = built.stdout + built.stderr
    assert "Warning" not in output and "!!" not in output, output
    wheel = zipfile.ZipFile(out / built.stdout.split()[-1])
    pth = [name for name in wheel.namelist() if name.endswith(".pth")]
    assert [wheel.read(name).decode().strip() for name in pth] == [str(project.resolve())]
