"""Suite-wide test configuration: what counts as slow.

Every test that starts real processes on loopback (tests/e2e/, tests/deploy/) is `slow`, so the
quick loop (`./dev test -m "not slow"`) is the unit, property and in-process tests alone; CI runs
everything. A test elsewhere marks itself slow with `@pytest.mark.slow`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_SLOW_FOLDERS = ("e2e", "deploy")
_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.path)).resolve().relative_to(_TESTS).parts
        if parts and parts[0] in _SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)
