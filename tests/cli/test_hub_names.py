"""`--model ORG/NAME[@REV]`: a Hub id found in the local Hugging Face cache by huggingface_hub's own
lookup (HF_HUB_CACHE, HF_HOME), never downloaded; served under its id. The cache here is built by
hand in huggingface_hub's layout (refs/, snapshots/) around the embedded checkpoint. Each lookup runs
in a subprocess, since huggingface_hub reads its cache location when first imported."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stepwise.models import is_hub_id, resolve_model, served_name
from tests.cli.runner import ROOT, run_cli
from tests.cli.test_errors import assert_one_line

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub(tmp_path: Path) -> Path:
    """A Hugging Face cache holding `acme/tiny` at `main` (= COMMIT)."""
    repo = tmp_path / "hub" / "models--acme--tiny"
    shutil.copytree(resolve_model("embedded"), repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return tmp_path / "hub"


def _resolve(spec: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = "import sys; from stepwise.models import resolve_model; print(resolve_model(sys.argv[1]))"
    return subprocess.run(
        [sys.executable, "-c", code, spec],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("spec", ["acme/tiny", "acme/tiny@main", f"acme/tiny@{COMMIT}"])
def test_a_hub_id_resolves_to_its_cached_snapshot(hub: Path, spec: str) -> None:
    for env in ({"HF_HUB_CACHE": str(hub)}, {"HF_HOME": str(hub.parent), "HF_HUB_CACHE": str(hub)}):
        done = _resolve(spec, {**env, "HF_HUB_OFFLINE": "0"})
        assert done.returncode == 0, done.stderr
        assert Path(done.stdout.strip()) == hub / "models--acme--tiny" / "snapshots" / COMMIT


def test_hf_home_alone_locates_the_cache(hub: Path) -> None:
    home = hub.parent / "home"
    shutil.move(str(hub), str(home / "hub"))
    done = _resolve("acme/tiny", {"HF_HOME": str(home)})
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).parent.parent.parent == home / "hub"


@pytest.mark.parametrize("spec", ["acme/absent", "acme/tiny@v9"])
def test_a_miss_is_one_line_saying_where_it_looked(hub: Path, spec: str) -> None:
    result = run_cli(["control", "--model", spec], env={"HF_HUB_CACHE": str(hub)})
    line = assert_one_line(result.returncode, result.stderr, "--model", spec, str(hub), "never downloads")
    assert "pass the checkpoint's directory" in line


def test_served_under_the_hub_id_and_directories_win(tmp_path: Path) -> None:
    snapshot = tmp_path / "models--acme--tiny" / "snapshots" / COMMIT
    assert served_name("acme/tiny@main", snapshot) == "acme/tiny"
    assert served_name(str(snapshot), snapshot) == "acme/tiny"  # a snapshot directory: its repo
    assert served_name(str(tmp_path / "ckpt"), tmp_path / "ckpt") == "ckpt"  # another: its own name
    assert is_hub_id("acme/tiny") and is_hub_id("acme/tiny@v1")
    assert not any(map(is_hub_id, ["tiny", "./acme/tiny", "/abs/path", "a/b/c", "~/x", "acme/"]))
