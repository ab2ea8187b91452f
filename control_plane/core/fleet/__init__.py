"""Decisions that span workers, as plain synchronous objects (no asyncio, gRPC or torch), driven by
the live core (core/engine.py, server.py) and by a simulator alike: the router (where a new request
runs, who inherits a lost worker's requests), placement (after each step, which running calls move
and where), the KV balance rules, the back-off of failing destinations, and the rules of the census
and of rebalancing across control planes. This module is the public entry the engine imports."""

from control_plane.core.fleet.balance import REASONS as BALANCE_REASONS
from control_plane.core.fleet.balance import Room
from control_plane.core.fleet.fleet import Fleet
from control_plane.core.fleet.member import Member
from control_plane.core.fleet.placement import Call, Move, Plan, Rules, Spill, unreachable
from control_plane.core.fleet.router import Router

__all__ = [
    "BALANCE_REASONS",
    "Call",
    "Fleet",
    "Member",
    "Move",
    "Plan",
    "Room",
    "Router",
    "Rules",
    "Spill",
    "unreachable",
]
