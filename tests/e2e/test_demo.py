"""The README's demo command works and prints generated text."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_readme_demo_command_prints_generated_text() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "./dev demo" in readme
    out = subprocess.run(
        ["./dev", "demo", "Once upon a time", "--max-new-tokens", "24"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    generated = next(line for line in lines if line.startswith("Once upon a time"))
    assert len(generated) > len("Once upon a time") + 5, out.stdout
    assert any(line.startswith("[finish: ") for line in lines), out.stdout
