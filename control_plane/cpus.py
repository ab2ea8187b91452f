"""How many CPUs this process may use, and how many frontends `--frontends auto` runs on them.

The count is the smallest of the CPUs the process may run on (its affinity mask, which `taskset`
and Kubernetes' static CPU manager set) and its cgroup's CPU quota (cgroup v2 `cpu.max` or v1
`cpu.cfs_quota_us` / `cpu.cfs_period_us`, which a Kubernetes CPU limit sets), rounded up.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

# `--frontends auto` runs one frontend per spare CPU (one is left to the core), at least one and at
# most this many: past it the core's own loop, which every frontend's traffic crosses, is the limit.
AUTO_FRONTENDS_CAP = 8
_CGROUP = Path("/sys/fs/cgroup")


def available_cpus(cgroup: Path = _CGROUP) -> int:
    """CPUs this process may use: its affinity mask, bounded by its cgroup's CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_quota(cgroup)
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def _cgroup_quota(root: Path) -> float | None:
    """The cgroup's CPU limit in CPUs, or None when it has none (or none can be read)."""
    try:
        limit, every = (root / "cpu.max").read_text().split()[:2]
        return None if limit == "max" else int(limit) / int(every)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def auto_frontends(cpus: int) -> int:
    """One frontend per CPU beyond the core's own, from 1 to AUTO_FRONTENDS_CAP."""
    return max(1, min(AUTO_FRONTENDS_CAP, cpus - 1))
