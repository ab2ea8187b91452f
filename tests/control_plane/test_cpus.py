"""`--frontends auto`: the CPUs a process may use (affinity, cgroup quota) and the count they give."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from control_plane.config import add_arguments, frontends_from_arg
from control_plane.cpus import AUTO_FRONTENDS_CAP, auto_frontends, available_cpus


def _affinity() -> int:
    return len(os.sched_getaffinity(0))


def test_a_cgroup_v2_quota_bounds_the_count_rounded_up(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert available_cpus(tmp_path) == min(_affinity(), 2)
    (tmp_path / "cpu.max").write_text("20000 100000\n")
    assert available_cpus(tmp_path) == 1


def test_no_quota_leaves_the_affinity_mask(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert available_cpus(tmp_path) == _affinity()
    assert available_cpus(tmp_path / "absent") == _affinity()


def test_a_cgroup_v1_quota_counts_too(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert available_cpus(tmp_path) == 1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert available_cpus(tmp_path) == _affinity()


@pytest.mark.parametrize(
    ("cpus", "frontends"), [(1, 1), (2, 1), (3, 2), (5, 4), (9, 8), (64, AUTO_FRONTENDS_CAP)]
)
def test_one_frontend_per_cpu_beyond_the_cores_own_within_the_cap(cpus: int, frontends: int) -> None:
    assert auto_frontends(cpus) == frontends


def test_auto_is_the_default_and_a_count_stays_a_count() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).frontends == "auto"
    assert frontends_from_arg("auto") == auto_frontends(available_cpus())
    assert frontends_from_arg(parser.parse_args(["--frontends", "3"]).frontends) == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["--frontends", "0"])
