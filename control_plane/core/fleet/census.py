"""This control plane's census (WorkerLink.Census; core/census.py asks the peers for theirs)."""

from __future__ import annotations

from collections.abc import Iterable

from control_plane.core.fleet.member import Member
from protos.worker import Census


def take(control_plane_id: str, engines: Iterable[Member], accepting: bool, fingerprint: str) -> Census:
    """This control plane's census over its attached engines (those leaving are left out)."""
    staying = [e for e in engines if e.leaving is None]
    loads = [e.load() for e in staying]
    return Census(
        control_plane_id=control_plane_id,
        workers=len(staying),
        queued=sum(q for q, _ in loads),
        running=sum(r for _, r in loads),
        accepting=accepting,
        model_fingerprint=fingerprint,
    )
