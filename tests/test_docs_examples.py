"""The example outputs in docs/debugging.md are what their commands print today
(`docs/examples.py --check`; `.venv/bin/python docs/examples.py` rewrites them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_debugging_examples_are_up_to_date() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "examples.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
